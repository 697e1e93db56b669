package measure

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/offload"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/vmm"
)

// sleepPiece is the size of the raw copies: the slot size offload copies in.
func (r *sleepRun) sleepPiece() uint64 { return min(r.opts.SlotSize, r.opts.Size) }

// rawHostLimit bounds the pinned memory each device's raw copies cycle through. Through 2 GiB
// the raw copies of two H100s ran about 3 % faster (1-9 % run by run) than through 16 GiB, as much
// as a sleep of 16 GiB fills (docs/offload-runs.md): the smaller working set is the stricter
// baseline, and it does not pin as much again as the backups.
const rawHostLimit = 2 << 30

// rawHostSize is the raw copies' host memory on each device: the buffer, up to rawHostLimit, in
// whole pieces, and at least one piece (a piece larger than the limit is used whole).
func rawHostSize(size, piece uint64) uint64 {
	h := min(size, rawHostLimit)
	return max(h-h%piece, piece)
}

// rawHost is pinned memory made the way offload makes its slots (registered THP), up to 2 GiB, that
// the raw copies cycle through.
type rawHost struct {
	mem    []byte
	region *pinned.Region
}

func newRawHost(d *vmm.Device, size uint64) (*rawHost, error) {
	mem, err := pinned.MapAnonymous(size)
	if err != nil {
		return nil, err
	}
	reg, err := pinned.Register(d, mem, pinned.RegisterOptions{HugePages: true})
	if err != nil {
		return nil, errors.Join(err, pinned.Unmap(mem))
	}
	return &rawHost{mem: mem, region: reg}, nil
}

func (h *rawHost) close() error { return errors.Join(h.region.Close(), pinned.Unmap(h.mem)) }

// rawCopies is what the raw copies need on each device: pinned host memory made the way offload
// makes its slots (rawHost) and device memory of one piece (cuMemAlloc), which they copy out of and
// into in turn. They never touch the set's buffers, so they can run between its sleeps and wakes.
type rawCopies struct {
	r     *sleepRun
	hosts []*rawHost
	devs  []*vmm.PlainBuffer
}

// newRawCopies pins each device's host memory twice, every device at once (RawPinGBps and
// RawRepinGBps are the rates), and allocates its piece of device memory.
func (r *sleepRun) newRawCopies() (rc *rawCopies, err error) {
	piece, n := r.sleepPiece(), len(r.devs)
	hostSize := rawHostSize(r.opts.Size, piece)
	rc = &rawCopies{r: r, hosts: make([]*rawHost, n), devs: make([]*vmm.PlainBuffer, n)}
	pin, repin := make([]float64, n), make([]float64, n)
	if _, err = inStep(n, func(i int) (err error) {
		if pin[i], repin[i], rc.hosts[i], err = pinTwice(r.devs[i], hostSize); err != nil {
			return err
		}
		rc.devs[i], err = r.devs[i].AllocPlain(piece)
		return err
	}); err != nil {
		return nil, errors.Join(err, rc.close())
	}
	r.res.RawPinGBps = sleepGBps(hostSize*uint64(n), slices.Max(pin))
	r.res.RawRepinGBps = sleepGBps(hostSize*uint64(n), slices.Max(repin))
	return rc, nil
}

func (rc *rawCopies) close() error {
	var errs []error
	for i := range rc.hosts {
		if rc.hosts[i] != nil {
			errs = append(errs, rc.hosts[i].close())
		}
		errs = append(errs, rc.devs[i].Close())
	}
	return errors.Join(errs...)
}

// copyAll copies Size bytes on every device at once, out of the device (toHost) or into it: the
// window from their common start to the last device's finish, and each device's own time.
func (rc *rawCopies) copyAll(toHost bool) (window float64, each []float64, err error) {
	r := rc.r
	each = make([]float64, len(rc.hosts))
	win, err := inStep(len(rc.hosts), func(i int) (err error) {
		each[i], err = sleepRawCopy(r.devs[i], rc.devs[i].Ptr(), r.opts.Size, r.sleepPiece(), rc.hosts[i].mem, toHost)
		return err
	})
	if err != nil {
		return 0, nil, err
	}
	return win[0], each, nil
}

// rawTimes are the raw copies' times over one or more rounds: the windows of all devices out and in,
// and each device's own.
type rawTimes struct {
	outs, ins       []float64
	outEach, inEach [][]float64 // [round][device]
}

// add times one raw copy out (toHost) or in on every device at once.
func (t *rawTimes) add(rc *rawCopies, toHost bool) error {
	win, each, err := rc.copyAll(toHost)
	if err != nil {
		return fmt.Errorf("raw copies: %w", err)
	}
	if toHost {
		t.outs, t.outEach = append(t.outs, win), append(t.outEach, each)
	} else {
		t.ins, t.inEach = append(t.ins, win), append(t.inEach, each)
	}
	return nil
}

// figures sets the raw copy rates from the medians of the rounds' times.
func (t *rawTimes) figures(r *sleepRun) {
	for i := range r.devs {
		outs, ins := make([]float64, len(t.outEach)), make([]float64, len(t.inEach))
		for k := range t.outEach {
			outs[k] = t.outEach[k][i]
		}
		for k := range t.inEach {
			ins[k] = t.inEach[k][i]
		}
		r.res.PerDevice[i].RawD2HGBps = sleepGBps(r.opts.Size, median(outs))
		r.res.PerDevice[i].RawH2DGBps = sleepGBps(r.opts.Size, median(ins))
	}
	r.res.RawD2HGBps, r.res.RawH2DGBps = sleepGBps(r.res.TotalBytes, median(t.outs)), sleepGBps(r.res.TotalBytes, median(t.ins))
}

// withRawCopies makes the raw copies' memory on every device, runs fn with it and the times it
// adds, sets the raw copy rates from those times, and frees the memory.
func (r *sleepRun) withRawCopies(fn func(rc *rawCopies, t *rawTimes) error) (err error) {
	rc, err := r.newRawCopies()
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, rc.close()) }()
	var t rawTimes
	if err := fn(rc, &t); err != nil {
		return err
	}
	t.figures(r)
	return nil
}

// measureRaw times raw copies of Size bytes on every device at once, in pieces, between its pinned
// host memory and its piece of device memory: all devices pin, then all copy out (D2H) together,
// then all copy in (H2D) together. The aggregate rates are over each phase's window, from its
// common start to the last device's finish; the per-device rates are over each device's own copy
// time.
func (r *sleepRun) measureRaw() error {
	return r.withRawCopies(func(rc *rawCopies, t *rawTimes) error {
		if err := t.add(rc, true); err != nil {
			return err
		}
		return t.add(rc, false)
	})
}

// measureWarmRounds times Rounds warm sleeps and wakes of the set, each against raw copies of as
// many bytes in the same round, every device at once: a raw copy out, a sleep, asleepPause, a raw
// copy in, a wake. The set's times and the raw rates reported are the rounds' medians, and each
// round's ratios are listed.
func (r *sleepRun) measureWarmRounds() error {
	return r.withRawCopies(func(rc *rawCopies, t *rawTimes) error {
		var sleeps, wakes []float64
		var steps []offload.SleepSteps
		total := r.res.TotalBytes
		for range r.opts.Rounds {
			if err := t.add(rc, true); err != nil {
				return err
			}
			s, err := r.timedSleep(&steps)
			if err != nil {
				return err
			}
			time.Sleep(asleepPause)
			if err := t.add(rc, false); err != nil {
				return err
			}
			w, err := r.timed("wake", total, r.set.Wake)
			if err != nil {
				return err
			}
			sleeps, wakes = append(sleeps, s), append(wakes, w)
		}
		r.warmRoundFigures(t.outs, t.ins, sleeps, wakes)
		r.sleepStepFigures(steps)
		return r.verify("after the warm rounds")
	})
}

// warmRoundFigures sets the warm figures from the rounds' times: a ratio of rates is the inverse
// ratio of times.
func (r *sleepRun) warmRoundFigures(outs, ins, sleeps, wakes []float64) {
	res := r.res
	res.Rounds = len(sleeps)
	for k := range sleeps {
		res.SleepVsRawRounds = append(res.SleepVsRawRounds, sleepRatio(outs[k], sleeps[k]))
		res.WakeVsRawRounds = append(res.WakeVsRawRounds, sleepRatio(ins[k], wakes[k]))
	}
	res.SleepVsRawRoundsMedian, res.WakeVsRawRoundsMedian = median(res.SleepVsRawRounds), median(res.WakeVsRawRounds)
	res.SleepSeconds, res.WakeSeconds = median(sleeps), median(wakes)
}

// timedSleep times a sleep of the whole set (timed) and appends its steps (Stats.LastSleepSteps)
// to steps.
func (r *sleepRun) timedSleep(steps *[]offload.SleepSteps) (float64, error) {
	t, err := r.timed("sleep", r.res.TotalBytes, r.set.Sleep)
	*steps = append(*steps, r.set.Stats().LastSleepSteps)
	return t, err
}

// sleepStepFigures sets the medians of the rounds' sleeps' steps (warm rounds, or file rounds).
func (r *sleepRun) sleepStepFigures(steps []offload.SleepSteps) {
	var prep, cp, rel []float64
	for _, s := range steps {
		prep, cp, rel = append(prep, s.Wait.Seconds()), append(cp, s.Copy.Seconds()), append(rel, s.Release.Seconds())
	}
	r.res.SleepWaitSeconds, r.res.SleepCopySeconds, r.res.SleepReleaseSeconds = median(prep), median(cp), median(rel)
}

// inStep runs each step for i in [0, n), each i on a goroutine of its own, step after step: no i
// starts step k+1 before every i finished step k (a barrier between the steps). It returns each
// step's window, from its common start to the last finish; the first failing step ends it.
func inStep(n int, steps ...func(i int) error) ([]float64, error) {
	windows := make([]float64, len(steps))
	for k, step := range steps {
		errs := make([]error, n)
		var wg sync.WaitGroup
		start := time.Now()
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs[i] = step(i)
			}()
		}
		wg.Wait()
		windows[k] = time.Since(start).Seconds()
		if err := errors.Join(errs...); err != nil {
			return nil, err
		}
	}
	return windows, nil
}

// pinTwice times pinning size bytes of fresh memory, gives it back, and times pinning as much again
// (memory the process has had); it returns the second region.
func pinTwice(d *vmm.Device, size uint64) (pin, repin float64, h *rawHost, err error) {
	start := time.Now()
	if h, err = newRawHost(d, size); err != nil {
		return 0, 0, nil, err
	}
	pin = time.Since(start).Seconds()
	if err = h.close(); err != nil {
		return 0, 0, nil, err
	}
	start = time.Now()
	if h, err = newRawHost(d, size); err != nil {
		return 0, 0, nil, err
	}
	return pin, time.Since(start).Seconds(), h, nil
}

// sleepRawCopy times cuMemcpyDtoH (toHost) or cuMemcpyHtoD of size bytes in pieces, between the
// device memory at dev (one piece) and host, cycling through host.
func sleepRawCopy(d *vmm.Device, dev driver.DevicePtr, size, piece uint64, host []byte, toHost bool) (float64, error) {
	start := time.Now()
	for off := uint64(0); off < size; off += piece {
		n := min(piece, size-off)
		h := host[off%uint64(len(host)):][:n]
		var err error
		if toHost {
			err = d.CopyDtoH(h, dev)
		} else {
			err = d.CopyHtoD(dev, h)
		}
		if err != nil {
			return 0, err
		}
	}
	return time.Since(start).Seconds(), nil
}
