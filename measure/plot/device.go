package plot

import (
	"encoding/json"
	"fmt"

	"gonum.org/v1/plot"
)

type growResult struct {
	Backend          string  `json:"backend"`
	ToBytes          float64 `json:"to_bytes"`
	StepBytes        float64 `json:"step_bytes"`
	Steps            int     `json:"steps"`
	GrowbufSeconds   float64 `json:"growbuf_seconds"`
	ReallocSeconds   float64 `json:"realloc_seconds"`
	Speedup          float64 `json:"speedup"`
	GrowbufPeakBytes float64 `json:"growbuf_peak_bytes"`
	ReallocPeakBytes float64 `json:"realloc_peak_bytes"`
}

// drawGrow: total time and peak memory of growing in place against realloc-and-copy. The result has
// the totals of all steps, not each step's time, so the figure shows the totals and the mean step.
func drawGrow(data []byte) ([]*plot.Plot, error) {
	var r growResult
	if err := json.Unmarshal(data, &r); err != nil {
		return nil, err
	}
	if r.Steps <= 0 {
		return nil, fmt.Errorf("steps is %d", r.Steps)
	}
	names := []string{"growbuf (map in place)", "realloc + copy"}
	t := newPlot(fmt.Sprintf("growth time%s: %.1fx faster in place", onSim(r.Backend), r.Speedup),
		fmt.Sprintf("grow to %s in %d steps of %s", sizeLabel(r.ToBytes), r.Steps, sizeLabel(r.StepBytes)), "time (ms)")
	n := float64(r.Steps)
	if err := bars(t, names, [][]float64{{r.GrowbufSeconds * 1e3, r.GrowbufSeconds * 1e3 / n}, {r.ReallocSeconds * 1e3, r.ReallocSeconds * 1e3 / n}}); err != nil {
		return nil, err
	}
	t.NominalX("all steps", "mean step")
	m := newPlot("peak device memory", "", "peak (MiB)")
	m.X.Label.Text = t.X.Label.Text
	if err := bars(m, names, [][]float64{{r.GrowbufPeakBytes / mib}, {r.ReallocPeakBytes / mib}}); err != nil {
		return nil, err
	}
	m.NominalX("peak while growing")
	return []*plot.Plot{t, m}, nil
}

type brokerResult struct {
	Backend   string `json:"backend"`
	Workers   int    `json:"workers"`
	Bandwidth []struct {
		RequestBytes  float64 `json:"request_bytes"`
		Direction     string  `json:"direction"`
		AggregateGBps float64 `json:"aggregate_gbps"`
		RawGBps       float64 `json:"raw_gbps"`
	} `json:"bandwidth"`
}

// drawBroker: the aggregate bandwidth of every worker through the broker against request size, with
// raw pinned copies of the same size in the same run; one panel per direction.
func drawBroker(data []byte) ([]*plot.Plot, error) {
	var r brokerResult
	if err := json.Unmarshal(data, &r); err != nil {
		return nil, err
	}
	var out []*plot.Plot
	for _, dir := range directions {
		var s sizeLines
		broker := fmt.Sprintf("broker, %d workers", r.Workers)
		for _, b := range r.Bandwidth {
			if b.Direction == dir.key {
				s.add(broker, b.RequestBytes, b.AggregateGBps)
				s.add("raw pinned copies", b.RequestBytes, b.RawGBps)
			}
		}
		p, err := s.draw(dir.key, fmt.Sprintf("copy broker, %s%s", dir.title, onSim(r.Backend)), "request size", "bandwidth, all workers (GB/s)")
		if err != nil {
			return nil, err
		}
		out = append(out, p)
	}
	return out, nil
}
