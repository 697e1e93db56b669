package measure

import (
	"errors"
	"fmt"
	"time"

	"github.com/cuvmm/cuvmm/internal/pattern"
	"github.com/cuvmm/cuvmm/internal/worker"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/vmm"
)

// pinWorker is one worker process seen from the parent.
type pinWorker struct {
	p      *worker.Process
	device int
	ready  pinReport
	opened pinReport
}

// pinMode is one mode's run: its workers and the free memory seen before and after.
type pinMode struct {
	o       *PinnedOptions
	mode    string
	all     []*vmm.Device
	workers []*pinWorker
}

func pinRunMode(o *PinnedOptions, mode string, workerDevs []int, all []*vmm.Device) (res *PinnedModeResult, err error) {
	m := &pinMode{o: o, mode: mode, all: all}
	idle, err := pinFree(all)
	if err != nil {
		return nil, err
	}
	defer func() { err = m.stop(idle, err) }()
	for _, dev := range workerDevs {
		setup := pinSetup{workerSetup: newWorkerSetup(o.Backend), Device: dev, AllDevices: o.WorkerContexts == "all"}
		p, err := startWorker(&o.Env, rolePinned, setup)
		if err != nil {
			return nil, err
		}
		m.workers = append(m.workers, &pinWorker{p: p, device: dev})
	}
	for _, w := range m.workers {
		if err := w.p.Conn.Receive(&w.ready); err != nil {
			return nil, fmt.Errorf("worker on device %d: %w", w.device, err)
		}
	}
	// Every worker's context is up: this is the baseline.
	before, err := pinFree(all)
	if err != nil {
		return nil, err
	}
	res, r, err := m.share(all[workerDevs[0]])
	if r != nil {
		defer func() { err = errors.Join(err, r.Close()) }()
	}
	if err != nil {
		return nil, err
	}
	after, err := pinFree(all)
	if err != nil {
		return nil, err
	}
	m.overheads(res, r.Len(), before, after)
	for _, w := range m.workers {
		if err := w.p.Conn.Send(pinCall{Op: "release"}); err != nil {
			return nil, err
		}
	}
	return res, nil
}

// stop reaps the workers (killed after a failure). On the real driver the workers' contexts are
// freed after they exit, not always before Wait returns: it lets them go before the next mode
// takes its baseline.
func (m *pinMode) stop(idle []uint64, err error) error {
	for _, w := range m.workers {
		if werr := stopWorker(w.p, err); werr != nil && err == nil {
			err = fmt.Errorf("worker on device %d: %w", w.device, werr)
		}
	}
	if len(m.workers) > 0 && !m.o.Backend.Sim() {
		pinWaitFree(m.all, idle)
	}
	return err
}

// pinSeed is the pattern the creator writes.
const pinSeed = 0x71

// share creates the region as the mode says, fills its windows, shares it with every worker and
// waits until each has opened and checked it.
func (m *pinMode) share(dev *vmm.Device) (*PinnedModeResult, *pinned.Region, error) {
	res := &PinnedModeResult{Mode: m.mode}
	opts := pinned.Options{CPUOnly: true}
	if m.mode == pinNaive {
		opts.Kind = pinned.SharedMemory
	}
	t0 := time.Now()
	r, err := pinned.New(dev, m.o.Size, opts)
	if err != nil {
		return nil, nil, err
	}
	res.CreatorSeconds = time.Since(t0).Seconds()
	res.RegionKind = r.Kind().String()
	call := pinCall{Op: "open", Mode: m.mode, Grant: m.mode != pinCPUOnly, Seed: pinSeed, Windows: pinWindows(r.Len())}
	for _, win := range call.Windows {
		pattern.FillHost(r.Bytes()[win.Offset:win.Offset+win.Size], win.Offset, pinSeed)
	}
	for _, w := range m.workers {
		if err := w.p.Conn.Send(call); err != nil {
			return nil, r, err
		}
		if err := r.Share(w.p.Conn.Unix()); err != nil {
			return nil, r, err
		}
	}
	bar := begin(m.o.Progress, "workers opening ("+m.mode+")", uint64(len(m.workers))*m.o.Size)
	defer bar.Done()
	for i, w := range m.workers {
		if err := w.p.Conn.Receive(&w.opened); err != nil {
			return nil, r, fmt.Errorf("worker on device %d: %w", w.device, err)
		}
		bar.Update(uint64(i+1) * m.o.Size)
	}
	return res, r, nil
}

// overheads sets each device's measured and expected overhead and whether every worker read the
// pattern.
func (m *pinMode) overheads(res *PinnedModeResult, regionLen uint64, before, after []uint64) {
	res.Verified = true
	cost := pinned.PageTableCost(regionLen)
	allContexts := m.o.WorkerContexts == "all"
	for _, d := range m.all {
		o := d.Ordinal()
		// Free memory is device-wide on the real driver: the parent sees every process. Each
		// simulator counts its own process: the workers' differences are added to the parent's.
		pd := PinnedDeviceOverhead{Device: o, OverheadBytes: int64(before[o]) - int64(after[o])}
		for _, w := range m.workers {
			if m.o.Backend.Sim() {
				pd.OverheadBytes += int64(w.ready.Free[o]) - int64(w.opened.Free[o])
			}
			switch {
			case m.mode == pinNaive && (allContexts || w.device == o):
				pd.ExpectedBytes += cost // a registration is visible in every context of its process
			case m.mode == pinShared && w.device == o:
				pd.ExpectedBytes += cost
			}
		}
		res.PerDevice = append(res.PerDevice, pd)
	}
	for _, w := range m.workers {
		res.WorkerOpenSeconds = append(res.WorkerOpenSeconds, w.opened.OpenSeconds)
		if w.opened.CPUBad != 0 || w.opened.GPUBad != 0 {
			res.Verified = false
		}
	}
}
