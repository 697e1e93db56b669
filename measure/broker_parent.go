package measure

import (
	"errors"
	"fmt"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/internal/pattern"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/internal/worker"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/vmm"
)

// brokerProc is one worker process seen from the parent.
type brokerProc struct {
	p      *worker.Process
	device int
	offset uint64 // its window
	ready  brokerReport
	last   brokerReport
}

// startWorkers starts the workers: each brings up its context and its device buffer first, so
// that the memory measured afterwards is only the region's.
func (b *brokerRun) startWorkers() error {
	for i := 0; i < b.o.Workers; i++ {
		d := b.devs[i%len(b.devs)].Ordinal()
		setup := brokerSetup{workerSetup: newWorkerSetup(b.o.Backend), Device: d, Buffer: b.bufSize}
		p, err := startWorker(&b.o.Env, roleBroker, setup)
		if err != nil {
			return err
		}
		b.procs = append(b.procs, &brokerProc{p: p, device: d, offset: uint64(i) * b.window})
		b.res.WorkerDevices = append(b.res.WorkerDevices, d)
		b.res.WorkerPIDs = append(b.res.WorkerPIDs, p.Pid())
	}
	for _, w := range b.procs {
		if err := w.p.Conn.Receive(&w.ready); err != nil {
			return fmt.Errorf("worker %d: %w", w.p.Pid(), err)
		}
	}
	return nil
}

// stopWorkers tells the workers to exit (or, after a failure, kills them) and reaps them. It runs
// before the server closes on success, so that the workers leave on their own.
func (b *brokerRun) stopWorkers(failed bool) error {
	var errs []error
	for _, w := range b.procs {
		if failed {
			_ = w.p.Kill()
			continue
		}
		err := w.p.Conn.Send(brokerCmd{Op: brokerCmdExit})
		if err = errors.Join(err, w.p.Wait()); err != nil {
			errs = append(errs, fmt.Errorf("worker %d: %w", w.p.Pid(), err))
		}
	}
	b.procs = nil
	return errors.Join(errs...)
}

// all sends every worker its command at once and collects the reports into w.last.
func (b *brokerRun) all(cmd func(*brokerProc) brokerCmd) error {
	for _, w := range b.procs {
		if err := w.p.Conn.Send(cmd(w)); err != nil {
			return fmt.Errorf("worker %d: %w", w.p.Pid(), err)
		}
	}
	for _, w := range b.procs {
		w.last = brokerReport{}
		if err := w.p.Conn.Receive(&w.last); err != nil {
			return fmt.Errorf("worker %d: %w", w.p.Pid(), err)
		}
	}
	return nil
}

func (b *brokerRun) reports() []brokerReport {
	out := make([]brokerReport, len(b.procs))
	for i, w := range b.procs {
		out[i] = w.last
	}
	return out
}

// memory has every worker connect (map the region for its CPU, register its buffer), then map the
// region for its own GPU as it would without a broker (the baseline), and sets the GPU memory
// result from the free memory at each stage.
func (b *brokerRun) memory(free0 []uint64) error {
	free1, err := b.free()
	if err != nil {
		return err
	}
	if err := b.all(func(w *brokerProc) brokerCmd {
		return brokerCmd{Op: brokerCmdConnect, Socket: b.srv.Path(), WindowOffset: w.offset, WindowBytes: b.window}
	}); err != nil {
		return err
	}
	connected := b.reports()
	for i, w := range b.procs {
		if w.last.GrantOffset != w.offset || w.last.GrantBytes != b.window {
			return fmt.Errorf("worker %d was granted %s at %#x, want %s at %#x", i, units.FormatSize(w.last.GrantBytes), w.last.GrantOffset, units.FormatSize(b.window), w.offset)
		}
	}
	free2, err := b.free()
	if err != nil {
		return err
	}
	if err := b.all(func(*brokerProc) brokerCmd { return brokerCmd{Op: brokerCmdNaiveOpen} }); err != nil {
		return err
	}
	naive := b.reports()
	free3, err := b.free()
	if err != nil {
		return err
	}
	if err := b.all(func(*brokerProc) brokerCmd { return brokerCmd{Op: brokerCmdNaiveClose} }); err != nil {
		return err
	}
	brokerMemoryResult(b.res, b.o.Backend, b.devs, b.procs, b.region.Len(), [4][]uint64{free0, free1, free2, free3}, connected, naive)
	return nil
}

// verify checks the copies both ways: by each worker (its device with a kernel, the region with its
// CPU) and here (the region with this process's CPU).
func (b *brokerRun) verify() error {
	if err := b.all(func(*brokerProc) brokerCmd { return brokerCmd{Op: brokerCmdVerify} }); err != nil {
		return err
	}
	for i, w := range b.procs {
		n := min(b.bufSize, b.window)
		here := pattern.CountHost(b.region.Bytes()[w.offset:w.offset+n], 0, brokerSeedH2D)
		if bad := w.last.CPUBad + w.last.GPUBad + here; bad != 0 {
			b.res.Verified = false
			b.res.MismatchedWords += bad
			b.res.Notes = append(b.res.Notes, fmt.Sprintf("worker %d: %d words wrong in the region after the device→host copies (its CPU), %d on its device after the host→device copies, %d in the region as the broker's CPU sees it",
				i, w.last.CPUBad, w.last.GPUBad, here))
		}
	}
	return nil
}

// bandwidths measures each request size and direction: the workers through the broker, then raw
// in this process (after the broker: both then find the region's pages in place).
func (b *brokerRun) bandwidths() error {
	bar := beginSteps(b.o.Progress, "bandwidth", uint64(len(b.sizes)*2))
	defer bar.Done()
	for _, s := range b.sizes {
		for _, d := range []string{brokerDirH2D, brokerDirD2H} {
			bw, err := b.bandwidth(s, d)
			if err != nil {
				return err
			}
			b.res.Bandwidth = append(b.res.Bandwidth, bw)
			bar.Update(uint64(len(b.res.Bandwidth)))
		}
	}
	return nil
}

func (b *brokerRun) bandwidth(s uint64, d string) (BrokerBandwidth, error) {
	bytes := max(b.o.BytesPerWorker/s, 4) * s
	bw := BrokerBandwidth{RequestBytes: s, Direction: d, BytesPerWorker: bytes, Target: brokerTargetLarge}
	if s < 16<<20 {
		bw.Target = brokerTargetSmall
	}
	cpu0, t0 := cpuTime(), time.Now()
	if err := b.all(func(*brokerProc) brokerCmd {
		return brokerCmd{Op: brokerCmdBandwidth, RequestBytes: s, Direction: d, Bytes: bytes, Depth: b.o.Depth}
	}); err != nil {
		return bw, err
	}
	bw.ServerCPUSeconds = (cpuTime() - cpu0).Seconds()
	bw.ServerCores = bw.ServerCPUSeconds / max(time.Since(t0).Seconds(), 1e-9)
	var err error
	if bw.RawGBs, bw.RawPerDeviceGBs, err = brokerRaw(b.region, b.devs, b.res.WorkerDevices, s, d, bytes, b.bufSize); err != nil {
		return bw, fmt.Errorf("raw %s %s: %w", units.FormatSize(s), d, err)
	}
	var first, last int64
	var total uint64
	for i, w := range b.procs {
		r := w.last
		bw.PerWorkerGBs = append(bw.PerWorkerGBs, float64(r.Bytes)/float64(max(r.EndNS-r.StartNS, 1)))
		if i == 0 || r.StartNS < first {
			first = r.StartNS
		}
		last = max(last, r.EndNS)
		total += r.Bytes
	}
	bw.AggregateGBs = float64(total) / float64(max(last-first, 1))
	if bw.RawGBs > 0 {
		bw.VsRaw = bw.AggregateGBs / bw.RawGBs
	}
	return bw, nil
}

// roundTrip times small synchronous copies one worker at a time, then the copy alone in this
// process.
func (b *brokerRun) roundTrip() error {
	samples := b.o.RTTSamples
	rt := BrokerRoundTrip{RequestBytes: brokerRTTBytes, Samples: samples, TargetUS: brokerTargetRTTUS}
	var pings, brokerCopies []float64
	for _, w := range b.procs {
		w.last = brokerReport{}
		if err := w.p.Conn.Call(brokerCmd{Op: brokerCmdRTT, Samples: samples}, &w.last); err != nil {
			return fmt.Errorf("worker %d: %w", w.p.Pid(), err)
		}
		rt.PerWorkerRTTUS = append(rt.PerWorkerRTTUS, w.last.RTTUS)
		pings = append(pings, w.last.PingUS)
		brokerCopies = append(brokerCopies, w.last.BrokerCopyUS)
	}
	rt.RTTUS, rt.PingUS, rt.BrokerCopyUS = median(rt.PerWorkerRTTUS), median(pings), median(brokerCopies)
	var err error
	if rt.CopyUS, err = brokerRawCopyUS(b.region, b.devs[0], samples); err != nil {
		return err
	}
	rt.OverheadUS = rt.RTTUS - rt.CopyUS
	b.res.RoundTrip = rt
	return nil
}

// brokerMemoryResult sets the GPU memory result from the free memory before the region, after the
// region and the server, with every worker connected and with every worker mapping the region.
func brokerMemoryResult(res *BrokerResult, b *Backend, devs []*vmm.Device, procs []*brokerProc, regionLen uint64, free [4][]uint64, connected, naive []brokerReport) {
	free0, free1, free2, free3 := free[0], free[1], free[2], free[3]
	cost := pinned.PageTableCost(regionLen)
	res.GPUMemory.Measure = "cuMemGetInfo free memory of each device: with every worker's context and buffer up (before the region), after the region and the server, with every worker connected (CPU-only view, buffer registered), and with every worker mapping the region for its own GPU"
	if b.Sim() {
		res.GPUMemory.Measure += " (simulator: each process counts its own devices; the workers' differences are added to the broker's)"
	}
	sum := func(reps []brokerReport, base func(i int) []uint64, o int) int64 {
		var n int64
		if !b.Sim() {
			return 0
		}
		for i, r := range reps {
			if o < len(r.Free) && o < len(base(i)) {
				n += int64(base(i)[o]) - int64(r.Free[o])
			}
		}
		return n
	}
	for _, d := range devs {
		o := d.Ordinal()
		m := BrokerDeviceMemory{Device: o, ExpectedBrokerBytes: cost}
		for _, w := range procs {
			if w.device == o {
				m.WorkersOnDevice++
			}
		}
		m.BrokerRegionBytes = int64(free0[o]) - int64(free1[o])
		m.AddedByWorkersBytes = int64(free1[o]) - int64(free2[o]) + sum(connected, func(i int) []uint64 { return procs[i].ready.Free }, o)
		m.BrokerBytes = m.BrokerRegionBytes + m.AddedByWorkersBytes
		m.NaiveBytes = int64(free2[o]) - int64(free3[o]) + sum(naive, func(i int) []uint64 { return connected[i].Free }, o)
		// A host-NUMA mapping costs the device granted; a registration every device the worker
		// holds a context on, which is its own here. Either way: one region per worker on its device.
		m.ExpectedNaiveBytes = uint64(m.WorkersOnDevice) * cost
		res.GPUMemory.PerDevice = append(res.GPUMemory.PerDevice, m)
	}
}

// cpuTime is the CPU time this process has used so far, user and system (zero where getrusage fails).
func cpuTime() time.Duration {
	var ru unix.Rusage
	if unix.Getrusage(unix.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
