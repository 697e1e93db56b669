package plot

import (
	"encoding/json"
	"fmt"
	"math"
	"slices"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
)

const mib = 1 << 20

// onSim marks figures drawn from simulator runs, whose times are not GPU figures.
func onSim(backend string) string {
	if backend == "sim" {
		return " (simulator)"
	}
	return ""
}

// lines adds one line with points per series, in the order given; x is log2 of a byte size.
func lines(p *plot.Plot, order []string, series map[string]plotter.XYs) error {
	for i, name := range order {
		xy := series[name]
		l, s, err := plotter.NewLinePoints(xy)
		if err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		l.Color, s.Color = plotutil.Color(i), plotutil.Color(i)
		l.Dashes, s.Shape = plotutil.Dashes(i), plotutil.Shape(i)
		p.Add(l, s)
		p.Legend.Add(name, l, s)
	}
	legendRoom(p, len(order))
	return nil
}

// bars adds grouped bars: one series per name, one bar per group (p.NominalX names the groups).
func bars(p *plot.Plot, names []string, values [][]float64) error {
	w := vg.Points(60 / float64(max(len(names), 1)))
	for i, name := range names {
		b, err := plotter.NewBarChart(plotter.Values(values[i]), w)
		if err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		b.Color = plotutil.Color(i)
		b.LineStyle.Width = 0
		b.Offset = w * vg.Length(2*i-len(names)+1) / 2
		p.Add(b)
		p.Legend.Add(name, b)
	}
	legendRoom(p, len(names))
	return nil
}

type bandwidthResult struct {
	Backend    string `json:"backend"`
	DeviceName string `json:"device_name"`
	Rows       []struct {
		Kind       string  `json:"kind"`
		Direction  string  `json:"direction"`
		SizeBytes  float64 `json:"size_bytes"`
		MedianGBps float64 `json:"median_gbps"`
	} `json:"rows"`
}

// drawBandwidth: median GB/s against transfer size, one line per memory kind; host to device on the
// left, device to host on the right.
func drawBandwidth(data []byte) ([]*plot.Plot, error) {
	var r bandwidthResult
	if err := json.Unmarshal(data, &r); err != nil {
		return nil, err
	}
	var out []*plot.Plot
	for _, dir := range []struct{ key, title string }{{"h2d", "host to device"}, {"d2h", "device to host"}} {
		series, order, sizes := map[string]plotter.XYs{}, []string{}, []float64{}
		for _, row := range r.Rows {
			if row.Direction != dir.key || row.SizeBytes <= 0 {
				continue
			}
			if _, ok := series[row.Kind]; !ok {
				order = append(order, row.Kind)
			}
			series[row.Kind] = append(series[row.Kind], plotter.XY{X: math.Log2(row.SizeBytes), Y: row.MedianGBps})
			if !slices.Contains(sizes, row.SizeBytes) {
				sizes = append(sizes, row.SizeBytes)
			}
		}
		if len(order) == 0 {
			return nil, fmt.Errorf("no %s rows", dir.key)
		}
		p := newPlot(dir.title+onSim(r.Backend), "transfer size ("+r.DeviceName+")", "median bandwidth (GB/s)")
		p.X.Tick.Marker = sizeTicks(sizes)
		if err := lines(p, order, series); err != nil {
			return nil, err
		}
		out = append(out, p)
	}
	return out, nil
}

type pinnedResult struct {
	Backend   string  `json:"backend"`
	SizeBytes float64 `json:"size_bytes"`
	Procs     int     `json:"procs"`
	Modes     []struct {
		Mode       string `json:"mode"`
		RegionKind string `json:"region_kind"`
		PerDevice  []struct {
			Device        int     `json:"device"`
			OverheadBytes float64 `json:"overhead_bytes"`
		} `json:"per_device"`
	} `json:"modes"`
}

// drawPinned: the GPU memory each sharing mode costs, per device (bars grouped by mode).
func drawPinned(data []byte) ([]*plot.Plot, error) {
	var r pinnedResult
	if err := json.Unmarshal(data, &r); err != nil {
		return nil, err
	}
	if len(r.Modes) == 0 {
		return nil, fmt.Errorf("no modes")
	}
	var devices []int
	for _, m := range r.Modes {
		for _, d := range m.PerDevice {
			if !slices.Contains(devices, d.Device) {
				devices = append(devices, d.Device)
			}
		}
	}
	slices.Sort(devices)
	names, groups := make([]string, len(devices)), make([]string, len(r.Modes))
	values := make([][]float64, len(devices))
	for i, dev := range devices {
		names[i] = fmt.Sprintf("device %d", dev)
		values[i] = make([]float64, len(r.Modes))
		for j, m := range r.Modes {
			groups[j] = fmt.Sprintf("%s (%s)", m.Mode, m.RegionKind)
			for _, d := range m.PerDevice {
				if d.Device == dev {
					values[i][j] = d.OverheadBytes / mib
				}
			}
		}
	}
	title := fmt.Sprintf("%d processes share %s pinned%s", r.Procs, sizeLabel(r.SizeBytes), onSim(r.Backend))
	p := newPlot(title, "sharing mode (region kind)", "GPU memory for page tables (MiB)")
	if err := bars(p, names, values); err != nil {
		return nil, err
	}
	p.NominalX(groups...)
	return []*plot.Plot{p}, nil
}
