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

// lines adds one line with points per series, in the order given (the size figures put log2 of a
// byte size on x).
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
	for _, dir := range directions {
		var s sizeLines
		for _, row := range r.Rows {
			if row.Direction == dir.key {
				s.add(row.Kind, row.SizeBytes, row.MedianGBps)
			}
		}
		p, err := s.draw(dir.key, dir.title+onSim(r.Backend), "transfer size ("+r.DeviceName+")", "median bandwidth (GB/s)")
		if err != nil {
			return nil, err
		}
		out = append(out, p)
	}
	return out, nil
}

// directions are the two copy directions, one panel each.
var directions = []struct{ key, title string }{{"h2d", "host to device"}, {"d2h", "device to host"}}

// sizeLines gathers lines against a log2 size axis: the series in the order they first appear, and
// the distinct sizes for the ticks.
type sizeLines struct {
	order  []string
	series map[string]plotter.XYs
	sizes  []float64
}

// add puts the point (size, y) on line name; sizes of 0 or less are left out.
func (s *sizeLines) add(name string, size, y float64) {
	if size <= 0 {
		return
	}
	if s.series == nil {
		s.series = map[string]plotter.XYs{}
	}
	if _, ok := s.series[name]; !ok {
		s.order = append(s.order, name)
	}
	s.series[name] = append(s.series[name], plotter.XY{X: math.Log2(size), Y: y})
	if !slices.Contains(s.sizes, size) {
		s.sizes = append(s.sizes, size)
	}
}

// draw makes the panel, or an error naming what (a direction) when no point was added.
func (s *sizeLines) draw(what, title, x, y string) (*plot.Plot, error) {
	if len(s.order) == 0 {
		return nil, fmt.Errorf("no %s rows", what)
	}
	p := newPlot(title, x, y)
	p.X.Tick.Marker = sizeTicks(s.sizes)
	if err := lines(p, s.order, s.series); err != nil {
		return nil, err
	}
	return p, nil
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
