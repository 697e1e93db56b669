package measure

import (
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/vmm"
)

// growSeed varies the pattern Grow writes.
const growSeed = 0x67726f77 // "grow"

// GrowOptions are Grow's options.
type GrowOptions struct {
	Env
	// Device is the device's ordinal.
	Device int
	// To is the final size and Step the bytes added per step (both multiples of 8 bytes).
	To, Step uint64
	// Chunk is growbuf's chunk size, a multiple of the granularity; 0 uses Step when it is one
	// (so that the capacity follows the length exactly), else growbuf's geometric policy.
	Chunk uint64
}

// GrowResult compares growing a growbuf in place with realloc-and-copy.
type GrowResult struct {
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

// Check reports a failed verification as an error.
func (r *GrowResult) Check() error {
	if !r.Verified {
		return fmt.Errorf("verification failed: %s", r.Failure)
	}
	return nil
}

func (o *GrowOptions) check() error {
	if err := o.Env.check(); err != nil {
		return err
	}
	if err := firstErr(nonZeroSize("to", o.To), nonZeroSize("step", o.Step)); err != nil {
		return err
	}
	if o.To%8 != 0 || o.Step%8 != 0 {
		return fmt.Errorf("--to %d and --step %d must be multiples of 8 bytes (the pattern's word): %w", o.To, o.Step, ErrInvalidOption)
	}
	return nil
}

// Grow grows a growbuf from 0 to To in steps of Step, filling each new part and verifying all
// content after every step, then does the same with realloc-and-copy (cuMemAlloc the new size, copy,
// free the old): times and peak memory of both.
func Grow(opts GrowOptions) (*GrowResult, error) {
	if err := opts.check(); err != nil {
		return nil, err
	}
	dev, err := device(opts.Backend, opts.Device, "device")
	if err != nil {
		return nil, err
	}
	if opts.To > dev.TotalMemory() { // also keeps growbuf's rounding of To from overflowing
		return nil, fmt.Errorf("--to %s: more than device %d's memory (%s): %w",
			units.FormatSize(opts.To), opts.Device, units.FormatSize(dev.TotalMemory()), ErrInvalidOption)
	}
	policy, err := growPolicy(dev, opts.Chunk, opts.Step)
	if err != nil {
		return nil, err
	}
	res := &GrowResult{Backend: opts.Backend.Name, Device: opts.Device, ToBytes: opts.To, StepBytes: opts.Step, Verified: true}
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
	g := &grower{opts: &opts, dev: dev, res: res}
	if err := g.growbuf(policy); err != nil {
		return nil, fmt.Errorf("growbuf: %w", err)
	}
	if err := g.realloc(); err != nil {
		return nil, fmt.Errorf("realloc baseline: %w", err)
	}
	if res.GrowbufSeconds > 0 {
		res.Speedup = res.ReallocSeconds / res.GrowbufSeconds
	}
	return res, nil
}

// device opens the device of ordinal o; a missing one is an option error naming the flag.
func device(b *Backend, o int, flagName string) (*vmm.Device, error) {
	dev, err := b.Sys.Device(o)
	if err != nil {
		if errors.Is(err, vmm.ErrNoDevice) {
			return nil, fmt.Errorf("--%s %d: the %s backend has %d devices: %w", flagName, o, b.Name, b.Sys.DeviceCount(), ErrInvalidOption)
		}
		return nil, err
	}
	return dev, nil
}

// growPolicy is the chunk policy: chunk, else step when it is a whole number of granules, else
// the package's geometric default.
func growPolicy(dev *vmm.Device, chunk, step uint64) (growbuf.ChunkPolicy, error) {
	var policy growbuf.ChunkPolicy
	gran, err := dev.DeviceGranularity()
	if err != nil {
		return policy, err
	}
	switch {
	case chunk != 0:
		if chunk%gran != 0 {
			return policy, fmt.Errorf("--chunk %s is not a multiple of the granularity %s: %w", units.FormatSize(chunk), units.FormatSize(gran), ErrInvalidOption)
		}
		policy = growbuf.FixedChunks(chunk)
	case step%gran == 0:
		policy = growbuf.FixedChunks(step)
	}
	return policy, nil
}

// grower runs the two sides of Grow.
type grower struct {
	opts *GrowOptions
	dev  *vmm.Device
	res  *GrowResult
}

// steps calls fn for each step [pos, next) from 0 to To.
func (g *grower) steps(fn func(pos, next uint64) error) error {
	to, step := g.opts.To, g.opts.Step
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

// verify checks the first n bytes at ptr and records the first failure.
func (g *grower) verify(what string, ptr driver.DevicePtr, n uint64) error {
	bad, err := g.dev.Verify(ptr, n, 0, growSeed)
	if err != nil || bad == 0 || !g.res.Verified {
		return err
	}
	g.res.Verified = false
	g.res.Failure = fmt.Sprintf("%s: after growing to %s, %d words of the first %s differ", what, units.FormatSize(n), bad, units.FormatSize(n))
	return nil
}

// growbuf maps new chunks at the end and fills the new part, step by step.
func (g *grower) growbuf(policy growbuf.ChunkPolicy) error {
	peak, err := newPeak(g.dev)
	if err != nil {
		return err
	}
	buf, err := growbuf.New(g.dev, growbuf.Options{MaxSize: g.opts.To, Chunk: policy})
	if err != nil {
		return err
	}
	g.res.ChunkPolicy = buf.Policy().String()
	bar := begin(g.opts.Progress, "growbuf", g.opts.To)
	var elapsed time.Duration
	err = g.steps(func(pos, next uint64) error {
		t0 := time.Now()
		if err := buf.Grow(next); err != nil {
			return err
		}
		if err := g.dev.Fill(buf.Ptr()+driver.DevicePtr(pos), next-pos, pos, growSeed); err != nil {
			return err
		}
		elapsed += time.Since(t0)
		if err := peak.sample(); err != nil {
			return err
		}
		g.res.Steps++
		bar.Update(next)
		return g.verify("growbuf", buf.Ptr(), next)
	})
	bar.Done()
	g.res.GrowbufSeconds = elapsed.Seconds()
	g.res.GrowbufPeakBytes = peak.peak
	g.res.GrowbufCapBytes = buf.Cap()
	g.res.GrowbufChunks = len(buf.Chunks())
	return errors.Join(err, buf.Close())
}

// realloc is the baseline: cuMemAlloc the new size, copy the old content, free the old, fill the
// new part.
func (g *grower) realloc() error {
	peak, err := newPeak(g.dev)
	if err != nil {
		return err
	}
	bar := begin(g.opts.Progress, "realloc", g.opts.To)
	var elapsed time.Duration
	var cur *vmm.PlainBuffer
	err = g.steps(func(pos, next uint64) error {
		t0 := time.Now()
		nb, err := g.reallocStep(cur, pos, next, peak)
		if err != nil {
			return err
		}
		cur = nb
		if err := g.dev.Fill(cur.Ptr()+driver.DevicePtr(pos), next-pos, pos, growSeed); err != nil {
			return err
		}
		elapsed += time.Since(t0) - peak.spent
		peak.spent = 0
		if err := peak.sample(); err != nil {
			return err
		}
		bar.Update(next)
		return g.verify("realloc", cur.Ptr(), next)
	})
	bar.Done()
	g.res.ReallocSeconds = elapsed.Seconds()
	g.res.ReallocPeakBytes = peak.peak
	return errors.Join(err, cur.Close())
}

// reallocStep allocates next bytes, copies pos bytes from cur and frees cur. The worst moment for
// memory, when both buffers exist, is sampled (and its time kept out of the timing).
func (g *grower) reallocStep(cur *vmm.PlainBuffer, pos, next uint64, peak *peakTracker) (*vmm.PlainBuffer, error) {
	nb, err := g.dev.AllocPlain(next)
	if err != nil {
		return nil, err
	}
	if cur != nil {
		// cuMemcpy between device buffers may return before the copy is done: wait for it.
		if err := errors.Join(g.dev.Copy(nb.Ptr(), cur.Ptr(), pos), g.dev.Synchronize()); err != nil {
			return nil, errors.Join(err, nb.Close())
		}
	}
	t0 := time.Now()
	err = peak.sample()
	peak.spent += time.Since(t0)
	if err == nil {
		err = cur.Close()
	}
	if err != nil {
		return nil, errors.Join(err, nb.Close())
	}
	return nb, nil
}

// peakTracker tracks the peak of used memory (total - free, cuMemGetInfo) above a starting point.
type peakTracker struct {
	d     *vmm.Device
	start uint64
	peak  uint64
	spent time.Duration // time spent sampling inside a timed section
}

func used(d *vmm.Device) (uint64, error) {
	free, total, err := d.MemInfo()
	return total - free, err
}

func newPeak(d *vmm.Device) (*peakTracker, error) {
	u, err := used(d)
	return &peakTracker{d: d, start: u}, err
}

func (p *peakTracker) sample() error {
	u, err := used(p.d)
	if err != nil {
		return err
	}
	if u > p.start {
		p.peak = max(p.peak, u-p.start)
	}
	return nil
}

func growWarmUp(dev *vmm.Device, policy growbuf.ChunkPolicy) error {
	buf, err := growbuf.New(dev, growbuf.Options{Chunk: policy})
	if err != nil {
		return err
	}
	if err := errors.Join(buf.Grow(1), buf.Close()); err != nil {
		return fmt.Errorf("warm-up: %w", err)
	}
	pb, err := dev.AllocPlain(1 << 20)
	if err != nil {
		return fmt.Errorf("warm-up: %w", err)
	}
	return pb.Close()
}

// Text writes the result for people.
func (r *GrowResult) Text(w io.Writer) {
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
