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

type sleepResult struct {
	Backend                    string  `json:"backend"`
	Devices                    []int   `json:"devices"`
	SizeBytes                  float64 `json:"size_bytes"`
	FirstSleepGBps             float64 `json:"first_sleep_gbps"`
	SleepGBps                  float64 `json:"sleep_gbps"`
	WakeGBps                   float64 `json:"wake_gbps"`
	RawD2HGBps                 float64 `json:"raw_d2h_gbps"`
	RawH2DGBps                 float64 `json:"raw_h2d_gbps"`
	FirstSleepSeconds          float64 `json:"first_sleep_seconds"`
	FirstSleepOneDeviceSeconds float64 `json:"first_sleep_one_device_seconds"`
	BaselineSleepSeconds       float64 `json:"baseline_sleep_seconds"`
}

// drawSleep: warm sleep and wake GB/s, and the first sleep's (which pins its backup on the way),
// against raw pinned copies of the same run; and the first sleep of one device against the usual
// approach, cuMemHostAlloc of a backup then a copy.
func drawSleep(data []byte) ([]*plot.Plot, error) {
	var r sleepResult
	if err := json.Unmarshal(data, &r); err != nil {
		return nil, err
	}
	if r.SleepGBps <= 0 && r.WakeGBps <= 0 {
		return nil, fmt.Errorf("no sleep_gbps or wake_gbps figures")
	}
	what := fmt.Sprintf("%s on %d device(s)", sizeLabel(r.SizeBytes), max(len(r.Devices), 1))
	bw := newPlot("sleep and wake"+onSim(r.Backend), what, "bandwidth, all devices (GB/s)")
	err := bars(bw, []string{"sleep / wake", "first sleep", "raw pinned copy"}, [][]float64{
		{r.SleepGBps, r.WakeGBps}, {r.FirstSleepGBps, 0}, {r.RawD2HGBps, r.RawH2DGBps}})
	if err != nil {
		return nil, err
	}
	bw.NominalX("device to host", "host to device")
	out := []*plot.Plot{bw}
	first := r.FirstSleepOneDeviceSeconds
	if first <= 0 {
		first = r.FirstSleepSeconds
	}
	if first > 0 && r.BaselineSleepSeconds > 0 {
		t := newPlot("first sleep"+onSim(r.Backend), fmt.Sprintf("%s of one device", sizeLabel(r.SizeBytes)), "time (s)")
		if err := bars(t, []string{"first sleep", "cuMemHostAlloc + copy"}, [][]float64{{first}, {r.BaselineSleepSeconds}}); err != nil {
			return nil, err
		}
		t.NominalX("back up and release")
		out = append(out, t)
	}
	return out, nil
}
