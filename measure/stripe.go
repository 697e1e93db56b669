package measure

import (
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/stripe"
	"github.com/cuvmm/cuvmm/vmm"
)

// StripeOptions are Stripe's options.
type StripeOptions struct {
	Env
	// Devices hold the range, in layout order (nil: every device). AccessOnly access it without
	// holding any of it.
	Devices, AccessOnly []int
	// Size of the range (rounded up to the granularity).
	Size uint64
	// Layout is "interleaved" (round-robin stripes of Stripe bytes, a non-zero multiple of the
	// granularity) or "blocked" (one slab per device; Stripe is not used).
	Layout string
	Stripe uint64
	// ReadOnlyPeers gives devices read-only access to the stripes they do not hold.
	ReadOnlyPeers bool
	// Builds is how many timed builds of each kind run (the fastest counts); Reads how many timed
	// passes of each bandwidth measurement (the best counts; 1 on the simulator).
	Builds, Reads int
}

// StripeDeviceResult is one device's read bandwidths.
type StripeDeviceResult struct {
	Device             int     `json:"device"`
	LocalReadGBps      float64 `json:"local_read_gbps"`
	WholeReadGBps      float64 `json:"whole_read_gbps"`
	PlainLocalReadGBps float64 `json:"plain_local_read_gbps"`
	RawWholeReadGBps   float64 `json:"raw_whole_read_gbps"`

	localBytes uint64
	segments   int
}

// StripeResult is a striped range's build time against the raw driver sequence, whether every
// device reads what the owners wrote, and read bandwidths against plain and raw-built memory.
type StripeResult struct {
	Devices []int  `json:"devices"`
	Layout  string `json:"layout"`
	// StripeBytes is the stripe size (interleaved), or with the blocked layout the size of the
	// first listed device's slab (the range's first chunk; the others equal it or are one granule
	// smaller).
	StripeBytes     uint64               `json:"stripe_bytes"`
	SizeBytes       uint64               `json:"size_bytes"`
	BuildSeconds    float64              `json:"build_seconds"`
	RawBuildSeconds float64              `json:"raw_build_seconds"`
	Verified        bool                 `json:"verified"`
	PerDevice       []StripeDeviceResult `json:"per_device"`

	backend, layoutDesc string
	accessOnly          []int
	builds, reads       int
}

// Check reports a failed verification as an error.
func (r *StripeResult) Check() error {
	if !r.Verified {
		return errors.New("verification failed: some device read bytes that differ from what the owners wrote")
	}
	return nil
}

func (o *StripeOptions) layout() (stripe.Layout, error) {
	if err := o.Env.check(); err != nil {
		return nil, err
	}
	if err := atLeast(1, intOption{"builds", o.Builds}, intOption{"reads", o.Reads}); err != nil {
		return nil, err
	}
	if o.Devices != nil && len(o.Devices) == 0 {
		return nil, fmt.Errorf("--devices: no devices: %w", ErrInvalidOption)
	}
	if o.Size == 0 {
		return nil, fmt.Errorf("--size 0: want a size above 0: %w", ErrInvalidOption)
	}
	switch o.Layout {
	case "interleaved":
		if o.Stripe == 0 {
			return nil, fmt.Errorf("--stripe 0: want a non-zero multiple of the granularity: %w", ErrInvalidOption)
		}
		return stripe.Interleaved{Stripe: o.Stripe}, nil
	case "blocked":
		return stripe.Blocked{}, nil
	}
	return nil, fmt.Errorf("--layout %q: want interleaved or blocked: %w", o.Layout, ErrInvalidOption)
}

// Stripe builds one virtual range over several GPUs, times its build against the raw driver
// sequence, has each owner write its stripes and every device verify the whole range, and times
// kernel reads of the local stripes, the whole range, the raw-built range and plain memory.
func Stripe(opts StripeOptions) (res *StripeResult, err error) {
	layout, err := opts.layout()
	if err != nil {
		return nil, err
	}
	s := &striper{opts: &opts, readers: map[*vmm.Device]*reader{}}
	if err := s.openDevices(layout); err != nil {
		return nil, err
	}
	if len(s.holders) == 1 {
		opts.logf("vmmdemo stripe: one device: the range is a plain range on device %d (nothing to stripe)\n", s.holders[0].Ordinal())
	}
	s.all = append(append([]*vmm.Device(nil), s.holders...), s.accessOnly...)
	for _, d := range s.all {
		if err := d.LoadKernels(); err != nil {
			return nil, err
		}
	}
	defer func() { err = errors.Join(err, s.close()) }()
	if err := s.build(layout); err != nil {
		return nil, err
	}
	res = s.result(layout)
	if err := s.verify(res); err != nil {
		return nil, err
	}
	if err := s.bandwidths(res); err != nil {
		return nil, err
	}
	return res, nil
}

// openDevices opens the holders and the access-only devices, and checks what needs them: no device
// both holds and only accesses the range, and an interleaved stripe is a multiple of their common
// granularity (stripe.New would refuse both too, naming Go fields instead of flags).
func (s *striper) openDevices(layout stripe.Layout) (err error) {
	o := s.opts
	if s.holders, err = devices(o.Backend, o.Devices, "devices"); err != nil {
		return err
	}
	if len(o.AccessOnly) > 0 {
		if s.accessOnly, err = devices(o.Backend, o.AccessOnly, "access-only"); err != nil {
			return err
		}
	}
	for _, d := range s.accessOnly {
		if slices.Contains(s.holders, d) {
			return fmt.Errorf("--access-only %s: device %d is also in --devices (a device holds part of the range or only accesses it): %w",
				ordinalList(o.AccessOnly), d.Ordinal(), ErrInvalidOption)
		}
	}
	il, ok := layout.(stripe.Interleaved)
	if !ok {
		return nil
	}
	gran, err := o.Backend.Sys.CommonGranularity(driver.Location{}, append(slices.Clone(s.holders), s.accessOnly...)...)
	if err != nil {
		return err
	}
	if il.Stripe%gran != 0 {
		return fmt.Errorf("--stripe %s: want a multiple of the granularity %s: %w", units.FormatSize(il.Stripe), units.FormatSize(gran), ErrInvalidOption)
	}
	return nil
}

// devices opens the devices of the ordinals (nil: every device). A device listed twice, or one the
// backend does not have, is an option error (the latter says how many there are).
func devices(b *Backend, ordinals []int, flagName string) ([]*vmm.Device, error) {
	if ordinals == nil {
		return b.Sys.Devices()
	}
	if len(ordinals) == 0 {
		return nil, fmt.Errorf("--%s: no devices: %w", flagName, ErrInvalidOption)
	}
	out := make([]*vmm.Device, 0, len(ordinals))
	for i, o := range ordinals {
		if slices.Contains(ordinals[:i], o) {
			return nil, fmt.Errorf("--%s %s: device %d is listed twice: %w", flagName, ordinalList(ordinals), o, ErrInvalidOption)
		}
		d, err := b.Sys.Device(o)
		if err != nil {
			hint := ""
			if b.Sim() {
				hint = " (--sim-devices sets how many the simulator has)"
			}
			if errors.Is(err, vmm.ErrNoDevice) {
				return nil, fmt.Errorf("--%s %s: there is no device %d: the %s backend has %d%s: %w",
					flagName, ordinalList(ordinals), o, b.Name, b.Sys.DeviceCount(), hint, ErrInvalidOption)
			}
			return nil, fmt.Errorf("--%s %s: device %d: %w", flagName, ordinalList(ordinals), o, err)
		}
		out = append(out, d)
	}
	return out, nil
}

func ordinalList(ordinals []int) string {
	parts := make([]string, len(ordinals))
	for i, o := range ordinals {
		parts[i] = strconv.Itoa(o)
	}
	return strings.Join(parts, ",")
}

func ordinalsOf(devs []*vmm.Device) []int {
	out := make([]int, len(devs))
	for i, d := range devs {
		out[i] = d.Ordinal()
	}
	return out
}

// striper holds what one Stripe run made, so that everything is freed on every path.
type striper struct {
	opts                     *StripeOptions
	holders, accessOnly, all []*vmm.Device
	r                        *stripe.Range
	raw                      *rawRange
	readers                  map[*vmm.Device]*reader
	best, bestRaw            time.Duration
}

func (s *striper) close() error {
	var errs []error
	for _, rd := range s.readers {
		errs = append(errs, rd.close())
	}
	errs = append(errs, s.raw.free())
	if s.r != nil {
		errs = append(errs, s.r.Close())
	}
	return errors.Join(errs...)
}

func (s *striper) pause() time.Duration {
	if s.opts.Backend.Sim() {
		return 0
	}
	return settlePause
}

// build times the raw driver sequence and stripe.New alternately, each freed before the next is
// built and each started from the same state: the devices idle and a short pause after the last
// free (the driver finishes freeing in the background, and a build right after a free pays for it,
// whichever builds). The fastest of each counts. A first, untimed build shows the shape the raw
// baseline copies. The last stripe.New range is kept; the raw range for the reads is built once
// more afterwards, untimed.
func (s *striper) build(layout stripe.Layout) (err error) {
	o := s.opts
	sopts := stripe.Options{ReadOnlyPeers: o.ReadOnlyPeers, AccessOnly: s.accessOnly}
	if s.r, err = stripe.New(s.holders, o.Size, layout, sopts); err != nil {
		return err
	}
	plan := rawPlan(s.r, s.holders, s.accessOnly, o.ReadOnlyPeers)
	size := s.r.Size()
	for i := 0; i < o.Builds; i++ {
		err := s.r.Close()
		s.r = nil
		if err != nil {
			return err
		}
		dt, err := s.timeRaw(size, plan)
		if err != nil {
			return err
		}
		if s.bestRaw == 0 || dt < s.bestRaw {
			s.bestRaw = dt
		}
		if err := settle(s.all, s.pause()); err != nil {
			return err
		}
		t0 := time.Now()
		r, err := stripe.New(s.holders, o.Size, layout, sopts)
		dt = time.Since(t0)
		if err != nil {
			return err
		}
		s.r = r
		if s.best == 0 || dt < s.best {
			s.best = dt
		}
	}
	if err := settle(s.all, s.pause()); err != nil {
		return err
	}
	if s.raw, _, err = buildRaw(s.holders[0], size, plan); err != nil {
		return fmt.Errorf("raw driver baseline: %w", err)
	}
	return nil
}

// timeRaw builds and frees the raw range once after the devices settled, returning the build time.
func (s *striper) timeRaw(size uint64, plan []rawPiece) (time.Duration, error) {
	if err := settle(s.all, s.pause()); err != nil {
		return 0, err
	}
	raw, dt, err := buildRaw(s.holders[0], size, plan)
	if err != nil {
		return 0, fmt.Errorf("raw driver baseline: %w", err)
	}
	return dt, raw.free()
}

func (s *striper) result(layout stripe.Layout) *StripeResult {
	r := s.r
	res := &StripeResult{Devices: ordinalsOf(s.holders), Layout: "interleaved", SizeBytes: r.Size(),
		BuildSeconds: s.best.Seconds(), RawBuildSeconds: s.bestRaw.Seconds(),
		backend: s.opts.Backend.Name, layoutDesc: layout.String(), accessOnly: ordinalsOf(s.accessOnly),
		builds: s.opts.Builds, reads: s.opts.Reads}
	if s.opts.Backend.Sim() {
		res.reads = 1
	}
	if il, ok := layout.(stripe.Interleaved); ok {
		res.StripeBytes = il.Stripe
	} else {
		res.Layout = "blocked"
		res.StripeBytes = r.Chunks()[0].Allocation.Size() // the first chunk: the first listed device's slab
	}
	for _, d := range s.all {
		res.PerDevice = append(res.PerDevice, StripeDeviceResult{Device: d.Ordinal(), localBytes: r.LocalBytes(d), segments: len(r.Segments(d))})
	}
	return res
}

// stripeSeed varies the pattern Stripe writes.
const stripeSeed = 0x5712

// verify has each owner write the pattern into its own segments and every device verify the whole
// range.
func (s *striper) verify(res *StripeResult) error {
	r := s.r
	bar := begin(s.opts.Progress, "fill and verify", r.Size()*uint64(1+len(s.all)))
	defer bar.Done()
	var done uint64
	for _, d := range s.holders {
		for _, seg := range r.Segments(d) {
			if err := d.Fill(r.Ptr()+driver.DevicePtr(seg.Offset), seg.Size, seg.Offset, stripeSeed); err != nil {
				return err
			}
			done += seg.Size
			bar.Update(done)
		}
	}
	res.Verified = true
	for _, d := range s.all {
		bad, err := d.Verify(r.Ptr(), r.Size(), 0, stripeSeed)
		if err != nil {
			return err
		}
		done += r.Size()
		bar.Update(done)
		if bad != 0 {
			res.Verified = false
			s.opts.logf("vmmdemo stripe: device %d found %d of %d words wrong\n", d.Ordinal(), bad, r.Size()/8)
		}
	}
	return nil
}

// bandwidths reads, device by device, the local segments, the whole range, the raw-built range,
// and a plain cuMemAlloc buffer of the device's local size.
func (s *striper) bandwidths(res *StripeResult) error {
	r, reads := s.r, res.reads
	whole := []span{{r.Ptr(), r.Size()}}
	rawWhole := []span{{s.raw.ptr, s.raw.size}}
	for i, d := range s.all {
		rd, err := newReader(d)
		if err != nil {
			return err
		}
		s.readers[d] = rd
		pd := &res.PerDevice[i]
		var local []span
		for _, seg := range r.Segments(d) {
			local = append(local, span{r.Ptr() + driver.DevicePtr(seg.Offset), seg.Size})
		}
		if pd.LocalReadGBps, err = rd.bandwidth(local, reads); err != nil {
			return err
		}
		if pd.WholeReadGBps, err = rd.bandwidth(whole, reads); err != nil {
			return err
		}
		if pd.RawWholeReadGBps, err = rd.bandwidth(rawWhole, reads); err != nil {
			return err
		}
	}
	// The raw range is no longer needed: free it before the plain buffers take memory.
	if err := s.raw.free(); err != nil {
		return err
	}
	for i := range res.PerDevice {
		pd := &res.PerDevice[i]
		if pd.localBytes == 0 {
			continue
		}
		d := s.all[i]
		plain, err := d.AllocPlain(pd.localBytes)
		if err != nil {
			return fmt.Errorf("plain baseline: %w", err)
		}
		pd.PlainLocalReadGBps, err = s.readers[d].bandwidth([]span{{plain.Ptr(), plain.Size()}}, reads)
		if err := errors.Join(err, plain.Close()); err != nil {
			return err
		}
	}
	return nil
}

func fmtDuration(d time.Duration) string { return fmt.Sprintf("%.3f ms", d.Seconds()*1e3) }

func ratio(a, b float64) string {
	if b <= 0 {
		return "-"
	}
	return fmt.Sprintf("%.2fx", a/b)
}

// Text writes the result for people.
func (res *StripeResult) Text(w io.Writer) {
	simNote := ""
	if res.backend == "sim" {
		simNote = "; the simulator's bandwidths are not meaningful"
	}
	fmt.Fprintf(w, "stripe: %s %s over devices %s (%s backend%s)\n",
		units.FormatSize(res.SizeBytes), res.layoutDesc, ordinalList(res.Devices), res.backend, simNote)
	if len(res.accessOnly) > 0 {
		fmt.Fprintf(w, "  access only: devices %s\n", ordinalList(res.accessOnly))
	}
	for _, pd := range res.PerDevice[:len(res.Devices)] {
		fmt.Fprintf(w, "  device %d holds %s in %d segments\n", pd.Device, units.FormatSize(pd.localBytes), pd.segments)
	}
	best, bestRaw := time.Duration(res.BuildSeconds*1e9), time.Duration(res.RawBuildSeconds*1e9)
	fmt.Fprintf(w, "build: %s (raw driver sequence: %s, %s; fastest of %d)\n",
		fmtDuration(best), fmtDuration(bestRaw), ratio(res.BuildSeconds, res.RawBuildSeconds), res.builds)
	if res.Verified {
		fmt.Fprintln(w, "verified: every device read the whole range and found what each owner wrote")
	} else {
		fmt.Fprintln(w, "verified: NO")
	}
	fmt.Fprintf(w, "kernel read bandwidth, GB/s (best of %d):\n", res.reads)
	fmt.Fprintf(w, "  %6s %10s %12s %7s %10s %10s %7s\n", "device", "local", "plain local", "ratio", "whole", "raw whole", "ratio")
	for _, pd := range res.PerDevice {
		fmt.Fprintf(w, "  %6d %10.1f %12.1f %7s %10.1f %10.1f %7s\n", pd.Device, pd.LocalReadGBps, pd.PlainLocalReadGBps,
			ratio(pd.LocalReadGBps, pd.PlainLocalReadGBps), pd.WholeReadGBps, pd.RawWholeReadGBps, ratio(pd.WholeReadGBps, pd.RawWholeReadGBps))
	}
	fmt.Fprintf(w, "  local: the device's own segments, one read kernel per segment over %d streams; plain local: one\n", readStreams)
	fmt.Fprintln(w, "  cuMemAlloc buffer of the same size; whole: the whole range; raw whole: the same range built with")
	fmt.Fprintln(w, "  raw driver calls")
}
