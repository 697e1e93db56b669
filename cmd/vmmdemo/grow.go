package main

import (
	"errors"
	"fmt"
	"time"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/vmm"
)

func init() {
	register(&command{
		name:    "grow",
		summary: "grow a buffer in place step by step, verifying all content each step; compare with realloc-and-copy",
		run:     runGrow,
		tour:    []string{"--to", "64MiB", "--step", "8MiB"},
	})
}

// growSeed varies the pattern the demo writes.
const growSeed = 0x67726f77 // "grow"

type growResult struct {
	Backend     string `json:"backend"`
	Device      int    `json:"device"`
	ToBytes     uint64 `json:"to_bytes"`
	StepBytes   uint64 `json:"step_bytes"`
	Steps       int    `json:"steps"`
	ChunkBytes  uint64 `json:"chunk_bytes"` // 0: the geometric default policy
	ChunkPolicy string `json:"chunk_policy"`
	// Seconds spent growing and filling the new part, summed over the steps; verification and
	// memory sampling are not timed.
	GrowbufSeconds float64 `json:"growbuf_seconds"`
	ReallocSeconds float64 `json:"realloc_seconds"`
	Speedup        float64 `json:"speedup"`
	// Peak of (total - free) from cuMemGetInfo minus its value before the run.
	GrowbufPeakBytes uint64 `json:"growbuf_peak_bytes"`
	ReallocPeakBytes uint64 `json:"realloc_peak_bytes"`
	GrowbufCapBytes  uint64 `json:"growbuf_cap_bytes"`
	GrowbufChunks    int    `json:"growbuf_chunks"`
	// Verified: after every step all content written so far read back intact, for both methods.
	Verified bool `json:"verified"`
	// Failure names the first step whose verification failed (empty when verified).
	Failure string `json:"failure,omitempty"`
}

func runGrow(e *env, args []string) error {
	var c common
	fs := newFlags(e, "grow")
	c.register(fs, 1)
	to := sizeFlag{1 << 30}
	step := sizeFlag{64 << 20}
	var chunk sizeFlag
	fs.Var(&to, "to", "final size of the buffer (a multiple of 8 bytes)")
	fs.Var(&step, "step", "bytes added per step (a multiple of 8 bytes)")
	fs.Var(&chunk, "chunk", "growbuf chunk size, a multiple of the granularity (default: --step when it is one, else the package's geometric policy)")
	device := fs.Int("device", 0, "device ordinal")
	if err := parse(fs, args); err != nil {
		return err
	}
	if to.v == 0 || step.v == 0 {
		return fmt.Errorf("--to %d and --step %d must not be 0: %w", to.v, step.v, errUsage)
	}
	if to.v%8 != 0 || step.v%8 != 0 {
		return fmt.Errorf("--to %d and --step %d must be multiples of 8 bytes (the pattern's word): %w", to.v, step.v, errUsage)
	}
	b, err := c.openLegacy(e)
	if err != nil {
		return err
	}
	res, runErr := growOn(e, b, *device, to.v, step.v, chunk.v, c.json)
	if cerr := b.Close(); runErr == nil && cerr != nil {
		runErr = cerr
	}
	if res == nil {
		return runErr
	}
	if c.json {
		if err := writeJSON(e.stdout, res); err != nil && runErr == nil {
			runErr = err
		}
	} else {
		printGrow(e, res)
	}
	if !res.Verified && runErr == nil {
		runErr = fmt.Errorf("verification failed: %s", res.Failure)
	}
	return runErr
}

// growUsed is the device memory in use (total - free, cuMemGetInfo).
func growUsed(d *vmm.Device) (uint64, error) {
	free, total, err := d.MemInfo()
	if err != nil {
		return 0, err
	}
	return total - free, nil
}

// growPeak tracks the peak of used memory above a starting point.
type growPeak struct {
	d     *vmm.Device
	start uint64
	peak  uint64
}

func newGrowPeak(d *vmm.Device) (*growPeak, error) {
	u, err := growUsed(d)
	return &growPeak{d: d, start: u}, err
}

func (p *growPeak) sample() error {
	u, err := growUsed(p.d)
	if err != nil {
		return err
	}
	if u > p.start {
		p.peak = max(p.peak, u-p.start)
	}
	return nil
}

// growSteps calls fn for each step [pos, next) from 0 to to.
func growSteps(to, step uint64, fn func(pos, next uint64) error) error {
	for pos := uint64(0); pos < to; {
		next := to
		if step < to-pos {
			next = pos + step
		}
		if err := fn(pos, next); err != nil {
			return err
		}
		pos = next
	}
	return nil
}

func growOn(e *env, b *backend, ordinal int, to, step, chunkFlag uint64, jsonOut bool) (*growResult, error) {
	dev, err := b.sys.Device(ordinal)
	if err != nil {
		if errors.Is(err, vmm.ErrNoDevice) {
			return nil, fmt.Errorf("--device %d: the %s backend has %d devices: %w", ordinal, b.name, b.sys.DeviceCount(), errUsage)
		}
		return nil, err
	}
	gran, err := dev.DeviceGranularity()
	if err != nil {
		return nil, err
	}
	// The chunk: --chunk, else the step when it is a whole number of granules (so that Cap follows
	// Len exactly and the peak is the final size), else the package's geometric default.
	var policy growbuf.ChunkPolicy
	switch {
	case chunkFlag != 0:
		if chunkFlag%gran != 0 {
			return nil, fmt.Errorf("--chunk %s is not a multiple of the granularity %s: %w", units.FormatSize(chunkFlag), units.FormatSize(gran), errUsage)
		}
		policy = growbuf.FixedChunks(chunkFlag)
	case step%gran == 0:
		policy = growbuf.FixedChunks(step)
	}
	res := &growResult{Backend: b.name, Device: ordinal, ToBytes: to, StepBytes: step, Verified: true}
	if policy.Fixed {
		res.ChunkBytes = policy.Size
	}

	// Load the kernels and touch both allocators once, so that neither side pays one-time costs.
	if err := dev.LoadKernels(); err != nil {
		return nil, err
	}
	if err := growWarmUp(dev, policy); err != nil {
		return nil, err
	}

	fail := func(what string, pos, bad uint64) {
		if res.Verified {
			res.Verified = false
			res.Failure = fmt.Sprintf("%s: after growing to %s, %d words of the first %s differ", what, units.FormatSize(pos), bad, units.FormatSize(pos))
		}
	}

	// growbuf: map new chunks at the end, fill the new part.
	peak, err := newGrowPeak(dev)
	if err != nil {
		return nil, err
	}
	buf, err := growbuf.New(dev, growbuf.Options{MaxSize: to, Chunk: policy})
	if err != nil {
		return nil, err
	}
	res.ChunkPolicy = buf.Policy().String()
	prog := newProgress(e, "growbuf", to, jsonOut)
	var elapsed time.Duration
	err = growSteps(to, step, func(pos, next uint64) error {
		t0 := time.Now()
		if err := buf.Grow(next); err != nil {
			return err
		}
		if err := dev.Fill(buf.Ptr()+driver.DevicePtr(pos), next-pos, pos, growSeed); err != nil {
			return err
		}
		elapsed += time.Since(t0)
		if err := peak.sample(); err != nil {
			return err
		}
		bad, err := dev.Verify(buf.Ptr(), next, 0, growSeed)
		if err != nil {
			return err
		}
		if bad != 0 {
			fail("growbuf", next, bad)
		}
		res.Steps++
		prog.Update(next)
		return nil
	})
	prog.Done()
	res.GrowbufSeconds = elapsed.Seconds()
	res.GrowbufPeakBytes = peak.peak
	res.GrowbufCapBytes = buf.Cap()
	res.GrowbufChunks = len(buf.Chunks())
	if cerr := buf.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return nil, fmt.Errorf("growbuf: %w", err)
	}

	// The baseline: cuMemAlloc the new size, copy the old content, free the old, fill the new part.
	if peak, err = newGrowPeak(dev); err != nil {
		return nil, err
	}
	prog = newProgress(e, "realloc", to, jsonOut)
	elapsed = 0
	var cur *vmm.PlainBuffer
	err = growSteps(to, step, func(pos, next uint64) error {
		t0 := time.Now()
		nb, err := dev.AllocPlain(next)
		if err != nil {
			return err
		}
		if cur != nil {
			// cuMemcpy between device buffers may return before the copy is done: wait for it.
			if err := errors.Join(dev.Copy(nb.Ptr(), cur.Ptr(), pos), dev.Synchronize()); err != nil {
				return errors.Join(err, nb.Close())
			}
		}
		elapsed += time.Since(t0)
		// The worst moment: the old and the new buffer both exist.
		if err := peak.sample(); err != nil {
			return errors.Join(err, nb.Close())
		}
		t0 = time.Now()
		if err := cur.Close(); err != nil {
			return errors.Join(err, nb.Close())
		}
		cur = nb
		if err := dev.Fill(cur.Ptr()+driver.DevicePtr(pos), next-pos, pos, growSeed); err != nil {
			return err
		}
		elapsed += time.Since(t0)
		if err := peak.sample(); err != nil {
			return err
		}
		bad, err := dev.Verify(cur.Ptr(), next, 0, growSeed)
		if err != nil {
			return err
		}
		if bad != 0 {
			fail("realloc", next, bad)
		}
		prog.Update(next)
		return nil
	})
	prog.Done()
	if cerr := cur.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return nil, fmt.Errorf("realloc baseline: %w", err)
	}
	res.ReallocSeconds = elapsed.Seconds()
	res.ReallocPeakBytes = peak.peak
	if res.GrowbufSeconds > 0 {
		res.Speedup = res.ReallocSeconds / res.GrowbufSeconds
	}
	return res, nil
}

func growWarmUp(dev *vmm.Device, policy growbuf.ChunkPolicy) error {
	buf, err := growbuf.New(dev, growbuf.Options{Chunk: policy})
	if err != nil {
		return err
	}
	err = buf.Grow(1)
	if cerr := buf.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("warm-up: %w", err)
	}
	pb, err := dev.AllocPlain(1 << 20)
	if err != nil {
		return fmt.Errorf("warm-up: %w", err)
	}
	return pb.Close()
}

func printGrow(e *env, r *growResult) {
	w := e.stdout
	fmt.Fprintf(w, "grow to %s in %d steps of %s on device %d (%s backend), %s chunks\n",
		units.FormatSize(r.ToBytes), r.Steps, units.FormatSize(r.StepBytes), r.Device, r.Backend, r.ChunkPolicy)
	fmt.Fprintf(w, "  growbuf (map chunks in place): %9.4f s, peak %s (cap %s in %d chunks)\n",
		r.GrowbufSeconds, units.FormatSize(r.GrowbufPeakBytes), units.FormatSize(r.GrowbufCapBytes), r.GrowbufChunks)
	fmt.Fprintf(w, "  realloc (cuMemAlloc + copy):   %9.4f s, peak %s\n", r.ReallocSeconds, units.FormatSize(r.ReallocPeakBytes))
	fmt.Fprintf(w, "  speedup %.1fx; times are growth + fill of the new part (verification not timed)\n", r.Speedup)
	if r.Verified {
		fmt.Fprintln(w, "  verified: all content intact after every step, for both")
	} else {
		fmt.Fprintf(w, "  VERIFICATION FAILED: %s\n", r.Failure)
	}
	if r.Backend == "sim" {
		fmt.Fprintln(w, "  (simulator: times measure the Go simulation, not a GPU)")
	}
}
