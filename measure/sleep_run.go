package measure

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/offload"
)

// measureOffload sleeps and wakes the set: cold (pinning on the way, or staged: SleepOptions.FirstSleep), then warm; with several
// devices also the first device alone, cold and warm.
func (r *sleepRun) measureOffload() error {
	total := r.res.TotalBytes
	before, err := r.freeAll()
	if err != nil {
		return err
	}
	if r.opts.Prepare {
		if r.res.PrepareSeconds, err = r.timed("prepare", total, r.set.Prepare); err != nil {
			return err
		}
	}
	if r.res.FirstSleepSeconds, err = r.timed("first sleep", total, r.set.Sleep); err != nil {
		return err
	}
	r.res.FirstSleepStagedBytes = r.set.Stats().LastSleepSteps.StagedBytes
	after, err := r.freeAll()
	if err != nil {
		return err
	}
	for i, d := range r.opts.Devices {
		pd := SleepDevice{Device: d, Bytes: r.opts.Size, PtrUnchanged: true, Verified: true, GraphOK: true} // until a check fails
		if after[i] > before[i] {
			pd.FreedBytes = after[i] - before[i]
		}
		r.res.FreedBytes += pd.FreedBytes
		r.res.PerDevice = append(r.res.PerDevice, pd)
	}
	if r.res.FirstWakeSeconds, err = r.timed("first wake", total, r.set.Wake); err != nil {
		return err
	}
	if err := r.verify("after the first wake"); err != nil {
		return err
	}
	if err := r.measureWarm(); err != nil {
		return err
	}
	if err := r.measureWakeAtOnce(); err != nil {
		return err
	}
	if err := r.measureRepin(); err != nil {
		return err
	}
	r.res.FirstSleepOneSeconds = r.res.PrepareSeconds + r.res.FirstSleepSeconds
	if len(r.devs) > 1 {
		return r.measureOneDevice()
	}
	return nil
}

// asleepPause is how long the set stays asleep before the warm wake that is reported as
// WakeSeconds. The driver clears released device memory in the background for some tens of
// milliseconds, and copies into chunks created meanwhile run slower: measured in C on the H200
// host, 16 GiB copied into chunks recreated right after their release took 0.343 s, and 0.310 s
// (as fast as into chunks never released) when 50 ms passed after the release. A service stays
// asleep far longer than that; WakeAtOnceSeconds is the wake right after the sleep.
const asleepPause = 250 * time.Millisecond

// measureWarm times the warm sleeps and wakes in keep and discard mode: Rounds rounds against raw
// copies (measureWarmRounds). In file mode the file rounds, after the other offload runs, give
// the warm figures, each phase beside raw file I/O of the same bytes (measureFileRounds).
func (r *sleepRun) measureWarm() error {
	if r.file != nil {
		return nil
	}
	return r.measureWarmRounds()
}

// timedAfterPause waits asleepPause, then times a wake of tags. Not in file mode, whose wakes
// (the rounds' and the one device's) are each timed right after an fsync instead.
func (r *sleepRun) timedAfterPause(label string, total uint64, tags ...string) (float64, error) {
	if r.file == nil {
		time.Sleep(asleepPause)
	}
	return r.timed(label, total, r.set.Wake, tags...)
}

// measureWakeAtOnce sleeps the warm set again and times a wake right after it (not in file mode,
// where writing the file keeps the set asleep for seconds anyway).
func (r *sleepRun) measureWakeAtOnce() error {
	if r.file != nil {
		return nil
	}
	r.res.AsleepPauseSeconds = asleepPause.Seconds() // the warm wake's, reported beside this one
	if err := r.set.Sleep(context.Background()); err != nil {
		return fmt.Errorf("sleep before the wake at once: %w", err)
	}
	var err error
	if r.res.WakeAtOnceSeconds, err = r.timed("wake at once", r.res.TotalBytes, r.set.Wake); err != nil {
		return err
	}
	return r.verify("after the wake at once")
}

// measureRepin gives the backup back (TrimPool) and sleeps again: a cold sleep on memory the host
// has provided before.
func (r *sleepRun) measureRepin() error {
	if err := r.set.TrimPool(); err != nil {
		return err
	}
	var err error
	if r.res.RepinSleepSeconds, err = r.timed("sleep after the pool was trimmed", r.res.TotalBytes, r.set.Sleep); err != nil {
		return err
	}
	if _, err := r.timed("wake", r.res.TotalBytes, r.set.Wake); err != nil {
		return err
	}
	return r.verify("after the re-pinned sleep")
}

// syncFile flushes the file mode's dirty pages, so that every timed phase starts alike (timed
// calls it before it starts the clock).
func (r *sleepRun) syncFile() error {
	if r.file == nil {
		return nil
	}
	return r.file.Sync()
}

// measureOneDevice sleeps the first device's buffer alone: cold (the pool emptied), then warm. In
// file mode, like the all-device figures it is compared with, the warm sleep and wake are the
// medians of Rounds rounds, each phase timed right after an fsync with no pause.
func (r *sleepRun) measureOneDevice() error {
	tag := fmt.Sprintf("dev%d", r.opts.Devices[0])
	size := r.opts.Size
	if err := r.set.TrimPool(); err != nil {
		return err
	}
	var err error
	if r.res.FirstSleepOneSeconds, err = r.timed("first sleep, one device", size, r.set.Sleep, tag); err != nil {
		return err
	}
	r.res.FirstSleepOneStagedBytes = r.set.Stats().LastSleepSteps.StagedBytes
	if _, err := r.timed("first wake, one device", size, r.set.Wake, tag); err != nil {
		return err
	}
	var sleeps, wakes []float64
	for range r.opts.Rounds { // at least 1: SleepOptions.check set it
		s, err := r.timed("sleep, one device", size, r.set.Sleep, tag)
		if err != nil {
			return err
		}
		w, err := r.timedAfterPause("wake, one device", size, tag)
		if err != nil {
			return err
		}
		sleeps, wakes = append(sleeps, s), append(wakes, w)
	}
	r.res.OneDeviceSleepGBps, r.res.OneDeviceWakeGBps = sleepGBps(size, median(sleeps)), sleepGBps(size, median(wakes))
	return r.verify("after the one-device wake")
}

func (r *sleepRun) freeAll() ([]uint64, error) {
	out := make([]uint64, len(r.devs))
	for i, d := range r.devs {
		if err := d.Synchronize(); err != nil {
			return nil, err
		}
		f, _, err := d.MemInfo()
		if err != nil {
			return nil, err
		}
		out[i] = f
	}
	return out, nil
}

// measureBaselines measures, after the offload runs: in file mode the rounds of raw file speed
// against the set's, then raw pinned copies on every device at once (the other modes timed them in
// their warm rounds); and the usual backup on the first device.
func (r *sleepRun) measureBaselines() error {
	if r.file != nil {
		if err := r.measureFileRounds(); err != nil {
			return fmt.Errorf("raw file: %w", err)
		}
		if err := r.measureRaw(); err != nil {
			return fmt.Errorf("raw copies: %w", err)
		}
	}
	if err := r.measureUsual(); err != nil {
		return fmt.Errorf("cuMemHostAlloc baseline: %w", err)
	}
	return nil
}

// measureUsual times the usual backup on the first device: cuMemHostAlloc of the buffer's size,
// then a copy of each chunk into it.
func (r *sleepRun) measureUsual() error {
	d := r.devs[0]
	start := time.Now()
	hb, err := d.HostAlloc(r.opts.Size, 0)
	if err != nil {
		return err
	}
	r.res.BaselineAllocSeconds = time.Since(start).Seconds()
	host := hb.Bytes()
	for _, c := range r.bufs[0].Chunks() {
		n := c.Allocation.Size()
		if err := d.CopyDtoH(host[c.Offset:c.Offset+n], r.ptrs[0]+driver.DevicePtr(c.Offset)); err != nil {
			return errors.Join(err, hb.Close())
		}
	}
	r.res.BaselineSleepSeconds = time.Since(start).Seconds()
	return hb.Close()
}

// measureFileRounds runs Rounds rounds over the set's file, each phase timed after an fsync:
// a raw write of the same bytes the way the set writes them (parts of FilePart bytes, IOWorkers at
// once), a sleep of the set (which writes the file again), a raw read, a wake of the set, and a
// raw read again. Each sleep is compared with the raw write just before it, and each wake with the
// mean of the raw reads on either side of it, so that a host whose speed drifts between rounds
// moves both alike. The raw figures and the set's sleep and wake times are the medians of the
// rounds.
func (r *sleepRun) measureFileRounds() error {
	raw := r.newRawFile()
	var writes, reads, sleeps, wakes, firsts []float64
	var steps []offload.SleepSteps
	for range r.opts.Rounds {
		var t [5]float64
		for j, ph := range []func() (float64, error){
			raw.write,
			func() (float64, error) { return r.timedSleep(&steps) },
			raw.read,
			func() (float64, error) {
				t, err := r.timed("wake", r.res.TotalBytes, r.set.Wake)
				firsts = append(firsts, r.firstCopy.Seconds())
				return t, err
			},
			raw.read,
		} {
			var err error
			if t[j], err = ph(); err != nil {
				return err
			}
		}
		writes, sleeps = append(writes, t[0]), append(sleeps, t[1])
		reads, wakes = append(reads, (t[2]+t[4])/2), append(wakes, t[3])
	}
	r.fileRoundFigures(writes, reads, sleeps, wakes)
	r.sleepStepFigures(steps)
	r.res.WakeFirstCopySeconds = median(firsts)
	return r.verify("after the file rounds")
}

// fileRoundFigures sets the file figures from the rounds' times.
func (r *sleepRun) fileRoundFigures(writes, reads, sleeps, wakes []float64) {
	total := r.res.TotalBytes
	r.res.Rounds = r.opts.Rounds
	for i := range writes { // a ratio of rates is the inverse ratio of times
		r.res.SleepVsRawFileRounds = append(r.res.SleepVsRawFileRounds, sleepRatio(writes[i], sleeps[i]))
		r.res.WakeVsRawFileRounds = append(r.res.WakeVsRawFileRounds, sleepRatio(reads[i], wakes[i]))
	}
	r.res.SleepVsRawFileRoundsMedian = median(r.res.SleepVsRawFileRounds)
	r.res.WakeVsRawFileRoundsMedian = median(r.res.WakeVsRawFileRounds)
	r.res.RawFileWriteGBps, r.res.RawFileReadGBps = sleepGBps(total, median(writes)), sleepGBps(total, median(reads))
	r.res.SleepSeconds, r.res.WakeSeconds = median(sleeps), median(wakes)
}

// rawFile writes and reads the set's bytes over its file the way package offload does: as many
// goroutines for each device as the set runs, each moving parts of FilePart bytes through
// staging buffers of its own in turn, with as many buffers each (fileStaging), all taking parts of
// the whole file.
type rawFile struct {
	r       *sleepRun
	workers int
	mem     func(w, i int, n uint64) []byte // goroutine w's buffer for its part i
}

func (r *sleepRun) newRawFile() *rawFile {
	g, per := r.opts.fileStaging()
	r.res.IOWorkers, r.res.FilePart, r.res.FileBuffers = r.opts.IOWorkers, r.opts.FilePart, r.opts.FileBuffers
	r.res.IOWorkersUsed, r.res.FileBuffersUsed = g, per[0]
	part, workers := r.opts.FilePart, g*len(r.devs)
	first := make([]int, workers+1) // goroutine w's buffers are first[w] to first[w+1]
	for w := range workers {
		first[w+1] = first[w] + per[w%g]
	}
	buf := make([]byte, part*uint64(first[workers]))
	for i := range buf {
		buf[i] = byte(i * 7)
	}
	return &rawFile{r: r, workers: workers, mem: func(w, i int, n uint64) []byte {
		return buf[uint64(first[w]+i%(first[w+1]-first[w]))*part:][:n]
	}}
}

// write times one raw write of the set's bytes over its file, after an fsync.
func (f *rawFile) write() (float64, error) {
	return f.r.rawFilePhase(f.workers, func(w, i int, off, n uint64) error {
		_, err := f.r.file.WriteAt(f.mem(w, i, n), int64(off))
		return err
	})
}

// read times one raw read of the set's bytes from its file, after an fsync.
func (f *rawFile) read() (float64, error) {
	return f.r.rawFilePhase(f.workers, func(w, i int, off, n uint64) error {
		_, err := f.r.file.ReadAt(f.mem(w, i, n), int64(off))
		return err
	})
}

// rawFilePhase fsyncs the file, then times fn over the set's bytes in parts, workers at once.
func (r *sleepRun) rawFilePhase(workers int, fn func(w, i int, off, n uint64) error) (float64, error) {
	if err := r.file.Sync(); err != nil {
		return 0, err
	}
	start := time.Now()
	err := rawFileIO(r.res.TotalBytes, r.opts.FilePart, workers, fn)
	return time.Since(start).Seconds(), err
}

// rawFileIO runs fn over total bytes in parts of part bytes, workers goroutines at once, each
// taking the next part as soon as its last one is done (fn's w says which goroutine, and i how
// many parts it moved before).
func rawFileIO(total, part uint64, workers int, fn func(w, i int, off, n uint64) error) error {
	next := make(chan uint64, (total+part-1)/part)
	for off := uint64(0); off < total; off += part {
		next <- off
	}
	close(next)
	errs := make([]error, workers)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			i := 0
			for off := range next {
				if errs[w] = fn(w, i, off, min(part, total-off)); errs[w] != nil {
					return
				}
				i++
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

func (r *sleepRun) ratios() {
	res := r.res
	res.FreedRatio = sleepRatio(float64(res.FreedBytes), float64(res.TotalBytes))
	res.FirstSleepGBps = sleepGBps(res.TotalBytes, res.FirstSleepSeconds)
	res.SleepGBps = sleepGBps(res.TotalBytes, res.SleepSeconds)
	res.WakeGBps = sleepGBps(res.TotalBytes, res.WakeSeconds)
	res.SleepVsRaw = sleepRatio(res.SleepGBps, res.RawD2HGBps)
	res.WakeVsRaw = sleepRatio(res.WakeGBps, res.RawH2DGBps)
	res.WakeAtOnceGBps = sleepGBps(res.TotalBytes, res.WakeAtOnceSeconds)
	res.WakeAtOnceVsRaw = sleepRatio(res.WakeAtOnceGBps, res.RawH2DGBps)
	res.FirstSleepSpeedup = sleepRatio(res.BaselineSleepSeconds, res.FirstSleepOneSeconds)
	floor := func(pinGBps float64) float64 {
		if pinGBps <= 0 || res.RawD2HGBps <= 0 {
			return 0
		}
		return max(float64(res.TotalBytes)/1e9/pinGBps, float64(res.TotalBytes)/1e9/res.RawD2HGBps)
	}
	res.FirstSleepLimitSeconds = floor(res.RawPinGBps)
	res.RepinSleepLimitSeconds = floor(res.RawRepinGBps)
	if len(r.devs) > 1 {
		res.AggregateSleepX = sleepRatio(res.SleepGBps, res.OneDeviceSleepGBps)
		res.AggregateWakeX = sleepRatio(res.WakeGBps, res.OneDeviceWakeGBps)
	}
	if r.file != nil {
		res.SleepVsRawFile = sleepRatio(res.SleepGBps, res.RawFileWriteGBps)
		res.WakeVsRawFile = sleepRatio(res.WakeGBps, res.RawFileReadGBps)
		res.FileSleepLimitGBps = min(res.RawFileWriteGBps, res.RawD2HGBps)
		res.FileWakeLimitGBps = min(res.RawFileReadGBps, res.RawH2DGBps)
		res.SleepVsFileLimit = sleepRatio(res.SleepGBps, res.FileSleepLimitGBps)
		res.WakeVsFileLimit = sleepRatio(res.WakeGBps, res.FileWakeLimitGBps)
	}
}
