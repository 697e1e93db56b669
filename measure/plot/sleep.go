package plot

import (
	"encoding/json"
	"fmt"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
)

type sleepResult struct {
	Backend                    string  `json:"backend"`
	Mode                       string  `json:"mode"`
	Devices                    []int   `json:"devices"`
	SizeBytes                  float64 `json:"size_bytes"`
	PrepareSeconds             float64 `json:"prepare_seconds"`
	FirstSleepGBps             float64 `json:"first_sleep_gbps"`
	SleepGBps                  float64 `json:"sleep_gbps"`
	WakeGBps                   float64 `json:"wake_gbps"`
	RawD2HGBps                 float64 `json:"raw_d2h_gbps"`
	RawH2DGBps                 float64 `json:"raw_h2d_gbps"`
	FirstSleepSeconds          float64 `json:"first_sleep_seconds"`
	FirstSleepOneDeviceSeconds float64 `json:"first_sleep_one_device_seconds"`
	BaselineSleepSeconds       float64 `json:"baseline_sleep_seconds"`
	// file mode
	RawFileWriteGBps float64   `json:"raw_file_write_gbps"`
	RawFileReadGBps  float64   `json:"raw_file_read_gbps"`
	SleepRounds      []float64 `json:"sleep_vs_raw_file_rounds"`
	WakeRounds       []float64 `json:"wake_vs_raw_file_rounds"`
	// keep and discard: each warm round's sleep and wake against its raw copies
	SleepCopyRounds []float64 `json:"sleep_vs_raw_rounds"`
	WakeCopyRounds  []float64 `json:"wake_vs_raw_rounds"`
}

// rounds are each round's ratios of a sleep result, and how to name them.
type rounds struct {
	sleep, wake         []float64
	sleepName, wakeName string
	yLabel              string
}

// drawSleep: warm sleep and wake GB/s, and the first sleep's (which pins its backup on the way),
// against raw pinned copies of the same run; the first sleep of one device against the usual
// approach, cuMemHostAlloc of a backup then a copy; and, where the result has them, each warm
// round's ratios. A file-mode result is drawn by drawSleepFile.
func drawSleep(data []byte) ([]*plot.Plot, error) {
	var r sleepResult
	if err := json.Unmarshal(data, &r); err != nil {
		return nil, err
	}
	if r.SleepGBps <= 0 && r.WakeGBps <= 0 {
		return nil, fmt.Errorf("no sleep_gbps or wake_gbps figures")
	}
	if r.Mode == "file" {
		return drawSleepFile(r)
	}
	what := fmt.Sprintf("%s on %d device(s)", sizeLabel(r.SizeBytes), max(len(r.Devices), 1))
	firstLabel, oneLabel := "first sleep", "first sleep"
	if r.PrepareSeconds > 0 { // Set.Prepare pinned the backup before the first sleep
		firstLabel = "first sleep, after Prepare"
		if len(r.Devices) <= 1 {
			oneLabel = "Prepare + first sleep"
		}
	}
	bw := newPlot("sleep and wake"+onSim(r.Backend), what, "bandwidth, all devices (GB/s)")
	err := bars(bw, []string{"sleep / wake", firstLabel, "raw pinned copy"}, [][]float64{
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
		if err := bars(t, []string{oneLabel, "cuMemHostAlloc + copy"}, [][]float64{{first}, {r.BaselineSleepSeconds}}); err != nil {
			return nil, err
		}
		t.NominalX("back up and release")
		out = append(out, t)
	}
	return withRounds(out, r, rounds{r.SleepCopyRounds, r.WakeCopyRounds, "sleep ÷ raw D2H", "wake ÷ raw H2D", "the set ÷ raw pinned copies"})
}

// withRounds appends the rounds' panel to out where the result lists a ratio of each kind for
// every round.
func withRounds(out []*plot.Plot, r sleepResult, rs rounds) ([]*plot.Plot, error) {
	if len(rs.wake) == 0 || len(rs.wake) != len(rs.sleep) {
		return out, nil
	}
	p, err := drawRounds(r, rs)
	if err != nil {
		return nil, err
	}
	return append(out, p), nil
}

// drawSleepFile: the sleep against the raw write and the wake against the raw read of the same
// file in the same run (medians of the rounds, each in its own panel: a disk writes far slower
// than the page cache reads), and each round's ratios in the order run.
func drawSleepFile(r sleepResult) ([]*plot.Plot, error) {
	if r.RawFileWriteGBps <= 0 || r.RawFileReadGBps <= 0 {
		return nil, fmt.Errorf("file mode without raw_file_write_gbps and raw_file_read_gbps figures")
	}
	what := fmt.Sprintf("%s on %d device(s), medians of the rounds", sizeLabel(r.SizeBytes), max(len(r.Devices), 1))
	var out []*plot.Plot
	for _, ph := range []struct {
		title, raw, group string
		set, rawGBps      float64
	}{
		{"file sleep", "raw write", "to the file", r.SleepGBps, r.RawFileWriteGBps},
		{"file wake", "raw read", "from the file", r.WakeGBps, r.RawFileReadGBps},
	} {
		p := newPlot(ph.title+onSim(r.Backend), what, "bandwidth, all devices (GB/s)")
		if err := bars(p, []string{"the set", ph.raw}, [][]float64{{ph.set}, {ph.rawGBps}}); err != nil {
			return nil, err
		}
		p.NominalX(ph.group)
		out = append(out, p)
	}
	return withRounds(out, r, rounds{r.SleepRounds, r.WakeRounds, "sleep ÷ raw write", "wake ÷ raw read", "the set ÷ raw file I/O"})
}

// drawRounds: each round's sleep and wake ratios, against the round's number.
func drawRounds(r sleepResult, rs rounds) (*plot.Plot, error) {
	p := newPlot("each round"+onSim(r.Backend), "round", rs.yLabel)
	series := map[string]plotter.XYs{}
	for name, xs := range map[string][]float64{rs.sleepName: rs.sleep, rs.wakeName: rs.wake} {
		for i, x := range xs {
			series[name] = append(series[name], plotter.XY{X: float64(i + 1), Y: x})
		}
	}
	if err := lines(p, []string{rs.sleepName, rs.wakeName}, series); err != nil {
		return nil, err
	}
	p.X.Min, p.X.Max = 0.5, float64(len(rs.wake))+0.5
	return p, nil
}
