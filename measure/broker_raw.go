package measure

import (
	"errors"
	"fmt"
	"io"
	"sync"
	"time"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/vmm"
)

// brokerRaw measures the raw pinned copy bandwidth at request size s: this process copies, on every
// device in use at once, as many bytes as that device's workers move through the broker, in pieces of
// s queued back to back on one stream, from (or into) the region: each device over its own part of
// the region, as the workers use their own windows (two devices writing the same host pages at
// once reached 13-58 GB/s together in some runs on the two-GPU host, against 102-110 apart). It
// returns the aggregate and the per-device rates in GB/s.
func brokerRaw(region *pinned.Region, devs []*vmm.Device, workerDevs []int, s uint64, dir string, perWorker, bufSize uint64) (float64, []float64, error) {
	results := make([]rawCopyRun, len(devs))
	var wg sync.WaitGroup
	for i, d := range devs {
		n := 0
		for _, o := range workerDevs {
			if o == d.Ordinal() {
				n++
			}
		}
		if n == 0 {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i] = rawCopiesOn(region, rawPart(region.Len(), len(devs), i, s), d, s, dir, perWorker/s*uint64(n), bufSize)
		}()
	}
	wg.Wait()
	var first, last time.Time
	var total uint64
	var per []float64
	for _, r := range results {
		if r.err != nil {
			return 0, nil, r.err
		}
		if r.bytes == 0 {
			per = append(per, 0)
			continue
		}
		per = append(per, float64(r.bytes)/float64(max(r.end.Sub(r.start).Nanoseconds(), 1)))
		if first.IsZero() || r.start.Before(first) {
			first = r.start
		}
		if r.end.After(last) {
			last = r.end
		}
		total += r.bytes
	}
	return float64(total) / float64(max(last.Sub(first).Nanoseconds(), 1)), per, nil
}

// rawPart is device i's part of a region of regionLen bytes (at least s) for copies of s bytes: an
// equal share of whole copies where each of the n devices gets one, else one copy's bytes each,
// as far apart as the region allows (devices then share pages only where the region is smaller than
// n copies).
func rawPart(regionLen uint64, n, i int, s uint64) hostRange {
	if part := regionLen / uint64(n) / s * s; part > 0 {
		return hostRange{uint64(i) * part, part}
	}
	slots := regionLen / s
	return hostRange{uint64(i) % slots * s, s}
}

// rawCopyRun is what one device's raw copies did.
type rawCopyRun struct {
	start, end time.Time
	bytes      uint64
	err        error
}

// hostRange is a part of the region: off and length in bytes.
type hostRange struct{ off, n uint64 }

// rawCopiesOn queues count copies of s bytes between the part hr of the region and device memory
// made like the workers' buffers (one VMM allocation, mapped) on one stream, after one untimed pass
// over the buffer (so that first-touch costs are not timed).
func rawCopiesOn(region *pinned.Region, hr hostRange, d *vmm.Device, s uint64, dir string, count, bufSize uint64) (r rawCopyRun) {
	res, err := d.System().Reserve(bufSize, vmm.ReserveOptions{})
	if err != nil {
		return rawCopyRun{err: err}
	}
	defer func() { r.err = errors.Join(r.err, res.Close()) }()
	buf, err := res.MapNew(0, bufSize, d, vmm.AllocOptions{}, vmm.ReadWrite(d))
	if err != nil {
		return rawCopyRun{err: err}
	}
	defer func() { r.err = errors.Join(r.err, buf.Close()) }()
	st, err := d.NewStream(true)
	if err != nil {
		return rawCopyRun{err: err}
	}
	defer func() { r.err = errors.Join(r.err, st.Close()) }()
	hostSlots, bufSlots := max(hr.n/s, 1), bufSize/s
	queue := func(from, to uint64) error {
		for k := from; k < to; k++ {
			host, dev := hr.off+(k%hostSlots)*s, buf.Ptr()+driver.DevicePtr((k%bufSlots)*s)
			var err error
			if dir == brokerDirH2D {
				err = region.CopyToDevice(st, dev, host, s)
			} else {
				err = region.CopyFromDevice(st, dev, host, s)
			}
			if err != nil {
				return err
			}
		}
		return st.Synchronize()
	}
	if err := queue(0, bufSlots); err != nil {
		return rawCopyRun{err: err}
	}
	r.start = time.Now()
	r.err = queue(0, count)
	r.end, r.bytes = time.Now(), count*s
	return r
}

// brokerRawCopyUS is the copy alone: a 4 KiB copy from the region into device memory and its
// stream's completion, in this process, median of samples.
func brokerRawCopyUS(region *pinned.Region, d *vmm.Device, samples int) (us float64, err error) {
	buf, err := d.AllocPlain(brokerRTTBytes)
	if err != nil {
		return 0, err
	}
	defer func() { err = errors.Join(err, buf.Close()) }()
	st, err := d.NewStream(true)
	if err != nil {
		return 0, err
	}
	defer func() { err = errors.Join(err, st.Close()) }()
	times := make([]float64, 0, samples)
	for i := 0; i < samples+10; i++ {
		t0 := time.Now()
		if err := region.CopyToDevice(st, buf.Ptr(), 0, brokerRTTBytes); err != nil {
			return 0, err
		}
		if err := st.Synchronize(); err != nil {
			return 0, err
		}
		if i >= 10 {
			times = append(times, float64(time.Since(t0).Nanoseconds())/1e3)
		}
	}
	return median(times), nil
}

func brokerSummarize(res *BrokerResult, gpu bool) {
	t := &res.Targets
	t.GPUFigures = gpu
	t.MinVsRaw16MiB, t.MinVsRaw1MiB = -1, -1
	for _, bw := range res.Bandwidth {
		if bw.RequestBytes >= 16<<20 && (t.MinVsRaw16MiB < 0 || bw.VsRaw < t.MinVsRaw16MiB) {
			t.MinVsRaw16MiB = bw.VsRaw
		}
		if bw.RequestBytes == 1<<20 && (t.MinVsRaw1MiB < 0 || bw.VsRaw < t.MinVsRaw1MiB) {
			t.MinVsRaw1MiB = bw.VsRaw
		}
	}
	t.OverheadUS = res.RoundTrip.OverheadUS
	t.BrokerSameForAnyN = true
	for _, m := range res.GPUMemory.PerDevice {
		if m.AddedByWorkersBytes > 2<<20 || m.AddedByWorkersBytes < -(2<<20) {
			t.BrokerSameForAnyN = false
		}
	}
	t.Met = res.Verified && t.BrokerSameForAnyN && t.OverheadUS <= brokerTargetRTTUS &&
		(t.MinVsRaw16MiB < 0 || t.MinVsRaw16MiB >= brokerTargetLarge) && (t.MinVsRaw1MiB < 0 || t.MinVsRaw1MiB >= brokerTargetSmall)
}

// spinText says how the broker waits for copies; the cores column is the CPU the broker's process
// used over the wall time.
func spinText(spinMax int64) string {
	if spinMax < 0 {
		return "every copy waited for sleeping"
	}
	return fmt.Sprintf("copies up to %s waited for spinning, larger ones sleeping (cores: CPU time of the broker's process / wall time)", units.FormatSize(uint64(spinMax)))
}

// Text writes the result for people.
func (r *BrokerResult) Text(w io.Writer) {
	fmt.Fprintf(w, "copy broker: %s %s region (pinned in %.1f ms), %d worker processes on devices %v, %s windows, %s device buffers (%s backend)\n",
		units.FormatSize(r.RegionBytes), r.RegionKind, r.RegionSeconds*1e3, r.Workers, r.WorkerDevices, units.FormatSize(r.WindowBytes), units.FormatSize(r.BufferBytes), r.Backend)
	fmt.Fprintf(w, "timing: %s\n", r.Timing)
	fmt.Fprintf(w, "\nbandwidth, %d requests in flight per worker, %d streams per device, %s:\n", r.Depth, r.StreamsPerDevice, spinText(r.SpinMaxBytes))
	fmt.Fprintf(w, "  %-8s %-4s %12s %12s %8s %8s %7s   per worker GB/s\n", "request", "dir", "aggregate", "raw", "× raw", "target", "cores")
	for _, bw := range r.Bandwidth {
		fmt.Fprintf(w, "  %-8s %-4s %9.1f GB/s %7.1f GB/s %8.3f %8.2f %7.2f  ", units.FormatSize(bw.RequestBytes), bw.Direction, bw.AggregateGBs, bw.RawGBs, bw.VsRaw, bw.Target, bw.ServerCores)
		for _, g := range bw.PerWorkerGBs {
			fmt.Fprintf(w, " %.1f", g)
		}
		fmt.Fprintln(w)
	}
	rt := r.RoundTrip
	fmt.Fprintf(w, "\nround trip of a %s copy (median of %d per worker): %.1f µs; the copy alone %.1f µs (the broker's own view %.1f µs); overhead %.1f µs (target ≤ %.0f); ping %.1f µs\n",
		units.FormatSize(rt.RequestBytes), rt.Samples, rt.RTTUS, rt.CopyUS, rt.BrokerCopyUS, rt.OverheadUS, rt.TargetUS, rt.PingUS)
	fmt.Fprintf(w, "\nGPU memory per device (%s):\n", r.GPUMemory.Measure)
	for _, m := range r.GPUMemory.PerDevice {
		fmt.Fprintf(w, "  device %d (%d workers): broker %s (region %s, workers added %s; expected %s)   each worker mapping the region: %s (expected %s)\n",
			m.Device, m.WorkersOnDevice, pinMiB(m.BrokerBytes), pinMiB(m.BrokerRegionBytes), pinMiB(m.AddedByWorkersBytes), pinMiB(int64(m.ExpectedBrokerBytes)),
			pinMiB(m.NaiveBytes), pinMiB(int64(m.ExpectedNaiveBytes)))
	}
	t := r.Targets
	fmt.Fprintf(w, "\ndata verified both ways: %s\n", yesNo(r.Verified))
	verdict := map[bool]string{true: "met", false: "not met"}[t.Met]
	if !t.GPUFigures {
		verdict = "the targets are for GPU figures; these are the simulator's"
	}
	fmt.Fprintf(w, "targets: ≥16 MiB × raw %.3f (≥ %.2f), 1 MiB × raw %.3f (≥ %.2f), overhead %.1f µs (≤ %.0f), broker memory independent of workers %s: %s\n",
		t.MinVsRaw16MiB, brokerTargetLarge, t.MinVsRaw1MiB, brokerTargetSmall, t.OverheadUS, brokerTargetRTTUS, yesNo(t.BrokerSameForAnyN), verdict)
	for _, n := range r.Notes {
		fmt.Fprintf(w, "note: %s\n", n)
	}
}
