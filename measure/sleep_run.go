package measure

import (
	"context"
	"encoding/binary"
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

// measureOffload sleeps and wakes the set: cold (pinning on the way), then warm; with several
// devices also the first device alone, cold and warm.
func (r *sleepRun) measureOffload() error {
	total := r.res.TotalBytes
	before, err := r.freeAll()
	if err != nil {
		return err
	}
	if r.res.FirstSleepSeconds, err = r.timed("first sleep", total, r.set.Sleep); err != nil {
		return err
	}
	after, err := r.freeAll()
	if err != nil {
		return err
	}
	for i, d := range r.opts.Devices {
		pd := SleepDevice{Device: d, Bytes: r.opts.Size}
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
	if err := r.syncFile(); err != nil {
		return err
	}
	if r.res.SleepSeconds, err = r.timed("sleep", total, r.set.Sleep); err != nil {
		return err
	}
	if r.res.WakeSeconds, err = r.timedAfterPause("wake", total); err != nil {
		return err
	}
	if err := r.verify("after the warm wake"); err != nil {
		return err
	}
	if err := r.measureWakeAtOnce(); err != nil {
		return err
	}
	if err := r.measureRepin(); err != nil {
		return err
	}
	r.res.FirstSleepOneSeconds = r.res.FirstSleepSeconds
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

// timedAfterPause waits asleepPause, then times a wake of tags.
func (r *sleepRun) timedAfterPause(label string, total uint64, tags ...string) (float64, error) {
	time.Sleep(asleepPause)
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
	if err := errors.Join(r.set.TrimPool(), r.syncFile()); err != nil {
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

// syncFile flushes the file mode's dirty pages, so that every timed write starts alike.
func (r *sleepRun) syncFile() error {
	if r.file == nil {
		return nil
	}
	return r.file.Sync()
}

// measureOneDevice sleeps the first device's buffer alone: cold (the pool emptied), then warm.
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
	if _, err := r.timed("first wake, one device", size, r.set.Wake, tag); err != nil {
		return err
	}
	s, err := r.timed("sleep, one device", size, r.set.Sleep, tag)
	if err != nil {
		return err
	}
	w, err := r.timedAfterPause("wake, one device", size, tag)
	if err != nil {
		return err
	}
	r.res.OneDeviceSleepGBps, r.res.OneDeviceWakeGBps = sleepGBps(size, s), sleepGBps(size, w)
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

// verify checks every buffer through the address saved before the first sleep, with a kernel and
// with the graph captured then. A failure is recorded in the result, not returned.
func (r *sleepRun) verify(when string) error {
	for i, d := range r.devs {
		pd := &r.res.PerDevice[i]
		pd.PtrUnchanged = r.bufs[i].Ptr() == r.ptrs[i]
		bad, err := d.Verify(r.ptrs[i], r.opts.Size, 0, sleepSeed+uint64(i))
		if err != nil {
			return err
		}
		viaGraph, err := r.graphs[i].run()
		if err != nil {
			return err
		}
		ok := bad == 0
		if r.policy == offload.Discard {
			zero, err := sampleZero(d, r.ptrs[i], r.opts.Size)
			if err != nil {
				return err
			}
			ok = zero
		}
		pd.Verified, pd.GraphOK = ok, viaGraph == bad
		if !pd.PtrUnchanged || !pd.Verified || !pd.GraphOK {
			r.res.Verified = r.res.Verified && pd.Verified && pd.GraphOK
			r.res.PtrUnchanged = r.res.PtrUnchanged && pd.PtrUnchanged
			if r.res.Failure == "" {
				r.res.Failure = fmt.Sprintf("device %d %s: ptr unchanged %v, %d words differ, the graph counted %d", pd.Device, when, pd.PtrUnchanged, bad, viaGraph)
			}
		}
	}
	return nil
}

// sampleZero reads the first and last MiB of a discarded buffer, which must be zeros.
func sampleZero(d *vmm.Device, ptr driver.DevicePtr, size uint64) (bool, error) {
	n := min(size, 1<<20)
	b := make([]byte, n)
	for _, off := range []uint64{0, size - n} {
		if err := d.CopyDtoH(b, ptr+driver.DevicePtr(off)); err != nil {
			return false, err
		}
		for _, v := range b {
			if v != 0 {
				return false, nil
			}
		}
	}
	return true, nil
}

// sleepGraph is a verify kernel captured into a graph while the buffer is awake, before any sleep.
type sleepGraph struct {
	d       *vmm.Device
	st      *vmm.Stream
	counter *vmm.PlainBuffer
	exec    *vmm.GraphExec
}

func captureSleepGraph(d *vmm.Device, ptr driver.DevicePtr, size, seed uint64) (g *sleepGraph, err error) {
	g = &sleepGraph{d: d}
	defer func() {
		if err != nil {
			err = errors.Join(err, g.close())
		}
	}()
	if g.st, err = d.CreateStream(vmm.StreamOptions{NonBlocking: true}); err != nil {
		return nil, err
	}
	if g.counter, err = d.AllocPlain(8); err != nil {
		return nil, err
	}
	if err = g.st.BeginCapture(); err != nil {
		return nil, err
	}
	lerr := d.LaunchVerify(ptr, size, 0, seed, g.counter.Ptr(), g.st)
	graph, err := g.st.EndCapture()
	if err = errors.Join(lerr, err); err != nil {
		return nil, errors.Join(err, graph.Close())
	}
	g.exec, err = graph.Instantiate()
	return g, errors.Join(err, graph.Close())
}

// run launches the graph and returns the words it counted as differing.
func (g *sleepGraph) run() (uint64, error) {
	if err := g.d.Memset(g.counter.Ptr(), 0, 8); err != nil {
		return 0, err
	}
	if err := errors.Join(g.exec.Launch(g.st), g.st.Synchronize()); err != nil {
		return 0, err
	}
	var c [8]byte
	if err := g.d.CopyDtoH(c[:], g.counter.Ptr()); err != nil {
		return 0, err
	}
	return binary.LittleEndian.Uint64(c[:]), nil
}

func (g *sleepGraph) close() error {
	if g == nil {
		return nil
	}
	return errors.Join(g.exec.Close(), g.counter.Close(), g.st.Close())
}

// measureBaselines measures, after the offload runs: in file mode the rounds of raw file speed
// against the set's, then (they overwrite the buffers) raw pinned copies on every device at once
// and the usual backup on the first device.
func (r *sleepRun) measureBaselines() error {
	if r.file != nil {
		if err := r.measureFileRounds(); err != nil {
			return fmt.Errorf("raw file: %w", err)
		}
	}
	if err := r.measureRaw(); err != nil {
		return fmt.Errorf("raw copies: %w", err)
	}
	if err := r.measureUsual(); err != nil {
		return fmt.Errorf("cuMemHostAlloc baseline: %w", err)
	}
	return nil
}

// sleepPiece is the size of the raw copies: the slot size offload copies in.
func (r *sleepRun) sleepPiece() uint64 { return min(r.opts.SlotSize, r.opts.Size) }

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

// measureRaw copies every buffer out and back in pieces, every device at once.
func (r *sleepRun) measureRaw() error {
	piece := r.sleepPiece()
	hostSize := min(r.opts.Size, 2<<30)
	hostSize -= hostSize % piece
	d2h := make([]float64, len(r.devs))
	h2d := make([]float64, len(r.devs))
	errs := make([]error, len(r.devs))
	var wg sync.WaitGroup
	var mu sync.Mutex
	var slowD2H, slowH2D, slowPin, slowRepin float64
	for i, d := range r.devs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			pin, repin, h, err := pinTwice(d, hostSize)
			if err != nil {
				errs[i] = err
				return
			}
			d2h[i], h2d[i], errs[i] = sleepRawCopies(d, r.ptrs[i], r.opts.Size, piece, h.mem)
			errs[i] = errors.Join(errs[i], h.close())
			mu.Lock()
			slowD2H, slowH2D = max(slowD2H, d2h[i]), max(slowH2D, h2d[i])
			slowPin, slowRepin = max(slowPin, pin), max(slowRepin, repin)
			mu.Unlock()
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return err
	}
	for i := range r.devs {
		r.res.PerDevice[i].RawD2HGBps = sleepGBps(r.opts.Size, d2h[i])
		r.res.PerDevice[i].RawH2DGBps = sleepGBps(r.opts.Size, h2d[i])
	}
	r.res.RawD2HGBps = sleepGBps(r.res.TotalBytes, slowD2H)
	r.res.RawH2DGBps = sleepGBps(r.res.TotalBytes, slowH2D)
	r.res.RawPinGBps = sleepGBps(hostSize*uint64(len(r.devs)), slowPin)
	r.res.RawRepinGBps = sleepGBps(hostSize*uint64(len(r.devs)), slowRepin)
	return nil
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

// sleepRawCopies times cuMemcpyDtoH then cuMemcpyHtoD of size bytes at ptr in pieces, cycling through
// host.
func sleepRawCopies(d *vmm.Device, ptr driver.DevicePtr, size, piece uint64, host []byte) (d2h, h2d float64, err error) {
	run := func(toHost bool) (float64, error) {
		start := time.Now()
		for off := uint64(0); off < size; off += piece {
			n := min(piece, size-off)
			h := host[off%uint64(len(host)):][:n]
			var err error
			if toHost {
				err = d.CopyDtoH(h, ptr+driver.DevicePtr(off))
			} else {
				err = d.CopyHtoD(ptr+driver.DevicePtr(off), h)
			}
			if err != nil {
				return 0, err
			}
		}
		return time.Since(start).Seconds(), nil
	}
	if d2h, err = run(true); err != nil {
		return 0, 0, err
	}
	h2d, err = run(false)
	return d2h, h2d, err
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

// fileRounds is how many times file mode times the raw write and read and the set's warm sleep and
// wake, alternately: file speed on the measured host moved by 15% between runs (the page cache, and
// memory the host provides as it is touched), so medians of interleaved rounds compare like with
// like.
const fileRounds = 3

// measureFileRounds runs fileRounds rounds of a raw write and read of the same bytes over the same
// file as the set, the way the set does them (parts of FilePart bytes, IOWorkers at once), then
// a sleep and a wake of the set (which rewrites the file), each timed phase after an fsync. The
// raw figures and the set's sleep and wake times are the medians of the rounds.
func (r *sleepRun) measureFileRounds() error {
	var writes, reads, sleeps, wakes []float64
	for i := 0; i < fileRounds; i++ {
		w, rd, err := r.rawFileOnce()
		if err != nil {
			return err
		}
		writes, reads = append(writes, w), append(reads, rd)
		for _, ph := range []struct {
			label string
			fn    func(context.Context, ...string) error
			out   *[]float64
		}{{"sleep", r.set.Sleep, &sleeps}, {"wake", r.set.Wake, &wakes}} {
			if err := r.syncFile(); err != nil {
				return err
			}
			t, err := r.timed(ph.label, r.res.TotalBytes, ph.fn)
			if err != nil {
				return err
			}
			*ph.out = append(*ph.out, t)
		}
	}
	total := r.res.TotalBytes
	r.res.FileRounds = fileRounds
	r.res.RawFileWriteGBps, r.res.RawFileReadGBps = sleepGBps(total, median(writes)), sleepGBps(total, median(reads))
	r.res.SleepSeconds, r.res.WakeSeconds = median(sleeps), median(wakes)
	return r.verify("after the file rounds")
}

// rawFileOnce times one raw write and one raw read of the set's bytes over its file, each after an
// fsync. Each goroutine moves parts of FilePart bytes through FileBuffers buffers of its own in
// turn, as package offload does with its staging buffers; the set runs IOWorkers goroutines
// for each device, and so does the raw figure.
func (r *sleepRun) rawFileOnce() (write, read float64, err error) {
	total, workers := r.res.TotalBytes, r.opts.IOWorkers*len(r.devs)
	r.res.IOWorkers, r.res.FilePart, r.res.FileBuffers = r.opts.IOWorkers, r.opts.FilePart, r.opts.FileBuffers
	part, nbuf := r.opts.FilePart, r.opts.FileBuffers
	buf := make([]byte, part*uint64(nbuf*workers))
	for i := range buf {
		buf[i] = byte(i * 7)
	}
	mem := func(w, i int, n uint64) []byte { return buf[uint64(w*nbuf+i%nbuf)*part:][:n] }
	phase := func(fn func(w, i int, off, n uint64) error) (float64, error) {
		if err := r.file.Sync(); err != nil {
			return 0, err
		}
		start := time.Now()
		err := rawFileIO(total, part, workers, fn)
		return time.Since(start).Seconds(), err
	}
	if write, err = phase(func(w, i int, off, n uint64) error {
		_, err := r.file.WriteAt(mem(w, i, n), int64(off))
		return err
	}); err != nil {
		return 0, 0, err
	}
	read, err = phase(func(w, i int, off, n uint64) error {
		_, err := r.file.ReadAt(mem(w, i, n), int64(off))
		return err
	})
	return write, read, err
}

// median is the middle of xs (the mean of the two middle ones for an even count).
func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s) == 0 {
		return 0
	}
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
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
