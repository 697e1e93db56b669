package main

import (
	"errors"
	"flag"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/stripe"
	"github.com/cuvmm/cuvmm/vmm"
)

func init() {
	register(&command{
		name:    "stripe",
		summary: "one virtual range striped over several GPUs: build, fill, verify from every GPU, read bandwidth vs plain and raw",
		run:     runStripe,
		// "all" is every device the backend has: the simulator's two in the tour, or the one GPU of a
		// one-GPU host (a plain range there, with a notice), so the tour never asks for a missing device.
		tour: []string{"--devices", "all", "--size", "64MiB", "--stripe", "8MiB"},
	})
}

type stripeDeviceResult struct {
	Device             int     `json:"device"`
	LocalReadGBps      float64 `json:"local_read_gbps"`
	WholeReadGBps      float64 `json:"whole_read_gbps"`
	PlainLocalReadGBps float64 `json:"plain_local_read_gbps"`
	RawWholeReadGBps   float64 `json:"raw_whole_read_gbps"`

	localBytes uint64
	segments   int
}

type stripeResult struct {
	Devices         []int                `json:"devices"`
	Layout          string               `json:"layout"`
	StripeBytes     uint64               `json:"stripe_bytes"`
	SizeBytes       uint64               `json:"size_bytes"`
	BuildSeconds    float64              `json:"build_seconds"`
	RawBuildSeconds float64              `json:"raw_build_seconds"`
	Verified        bool                 `json:"verified"`
	PerDevice       []stripeDeviceResult `json:"per_device"`
}

// deviceList is a flag.Value: "all" or a comma-separated list of ordinals.
type deviceList struct {
	all      bool
	ordinals []int
}

func (l *deviceList) String() string {
	if l.all {
		return "all"
	}
	parts := make([]string, len(l.ordinals))
	for i, o := range l.ordinals {
		parts[i] = strconv.Itoa(o)
	}
	return strings.Join(parts, ",")
}

func (l *deviceList) Set(v string) error {
	v = strings.TrimSpace(v)
	l.all, l.ordinals = false, nil
	if v == "all" {
		l.all = true
		return nil
	}
	if v == "" {
		return nil
	}
	seen := map[int]bool{}
	for _, f := range strings.Split(v, ",") {
		o, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || o < 0 {
			return fmt.Errorf("%q is not a device ordinal (want a list such as 0,1, or all)", f)
		}
		if seen[o] {
			return fmt.Errorf("device %d is listed twice", o)
		}
		seen[o] = true
		l.ordinals = append(l.ordinals, o)
	}
	return nil
}

// open resolves the list on the backend. A device the backend does not have is a usage error that
// says how many there are.
func (l *deviceList) open(b *backend, flagName string) ([]*vmm.Device, error) {
	if l.all {
		return b.sys.Devices()
	}
	out := make([]*vmm.Device, 0, len(l.ordinals))
	for _, o := range l.ordinals {
		d, err := b.sys.Device(o)
		if err != nil {
			hint := ""
			if b.sim != nil {
				hint = " (--sim-devices sets how many the simulator has)"
			}
			if errors.Is(err, vmm.ErrNoDevice) {
				return nil, fmt.Errorf("--%s %s: there is no device %d: the %s backend has %d%s: %w",
					flagName, l, o, b.name, b.sys.DeviceCount(), hint, errUsage)
			}
			return nil, fmt.Errorf("--%s %s: device %d: %w", flagName, l, o, err)
		}
		out = append(out, d)
	}
	return out, nil
}

func runStripe(e *env, args []string) error {
	var c common
	fs := newFlags(e, "stripe")
	c.register(fs, 2)
	devs := deviceList{all: true}
	var accessOnly deviceList
	size := sizeFlag{1 << 30}
	stripeSize := sizeFlag{128 << 20}
	fs.Var(&devs, "devices", "devices that hold the range, in layout order: a list such as 0,1, or all")
	fs.Var(&accessOnly, "access-only", "devices that access the range without holding any of it (a list)")
	fs.Var(&size, "size", "size of the range (rounded up to the granularity)")
	fs.Var(&stripeSize, "stripe", "stripe size for --layout interleaved (a multiple of the granularity)")
	layoutName := fs.String("layout", "interleaved", "interleaved (round-robin stripes) or blocked (one slab per device)")
	readOnly := fs.Bool("read-only-peers", false, "devices get read-only access to the stripes they do not hold")
	builds := fs.Int("builds", 5, "timed builds of the range and of the raw baseline; the fastest of each is reported")
	reads := fs.Int("reads", 10, "timed passes of each bandwidth measurement, after one untimed; the best is reported (1 on the simulator)")
	if err := parse(fs, args); err != nil {
		return err
	}
	var layout stripe.Layout
	switch *layoutName {
	case "interleaved":
		layout = stripe.Interleaved{Stripe: stripeSize.v}
	case "blocked":
		layout = stripe.Blocked{}
	default:
		return fmt.Errorf("--layout %q: want interleaved or blocked: %w", *layoutName, errUsage)
	}
	if *builds < 1 || *reads < 1 {
		return fmt.Errorf("--builds and --reads must be at least 1: %w", errUsage)
	}
	if !devs.all && len(devs.ordinals) == 0 {
		return fmt.Errorf("--devices: no devices: %w", errUsage)
	}

	b, err := c.openLegacy(e)
	if err != nil {
		return err
	}
	res, runErr := runStripeOn(e, b, &c, &devs, &accessOnly, size.v, layout, *readOnly, *builds, *reads)
	if cerr := b.Close(); runErr == nil && cerr != nil {
		runErr = cerr
	}
	if res != nil {
		if c.json {
			if err := writeJSON(e.stdout, res); err != nil && runErr == nil {
				runErr = err
			}
		}
		if !res.Verified && runErr == nil {
			runErr = errors.New("verification failed: some device read bytes that differ from what the owners wrote")
		}
	}
	return runErr
}

// stripeRun holds what one run made, so that everything is freed on every path.
type stripeRun struct {
	r       *stripe.Range
	raw     *rawRange
	readers map[*vmm.Device]*reader
}

func (s *stripeRun) close() error {
	var errs []error
	for _, rd := range s.readers {
		errs = append(errs, rd.close())
	}
	if s.raw != nil {
		errs = append(errs, s.raw.free())
	}
	errs = append(errs, s.r.Close())
	return errors.Join(errs...)
}

func runStripeOn(e *env, b *backend, c *common, devList, accessList *deviceList, size uint64, layout stripe.Layout,
	readOnly bool, builds, reads int) (res *stripeResult, err error) {
	holders, err := devList.open(b, "devices")
	if err != nil {
		return nil, err
	}
	accessOnly, err := accessList.open(b, "access-only")
	if err != nil {
		return nil, err
	}
	if len(holders) == 1 {
		fmt.Fprintf(e.stderr, "vmmdemo stripe: one device: the range is a plain range on device %d (nothing to stripe)\n", holders[0].Ordinal())
	}
	simNote := ""
	pause := settlePause
	if b.sim != nil {
		reads, pause = 1, 0
		simNote = "; the simulator's bandwidths are not meaningful"
	}
	all := append(append([]*vmm.Device(nil), holders...), accessOnly...)
	for _, d := range all {
		if err := d.LoadKernels(); err != nil {
			return nil, err
		}
	}
	opts := stripe.Options{ReadOnlyPeers: readOnly, AccessOnly: accessOnly}

	run := &stripeRun{readers: map[*vmm.Device]*reader{}}
	defer func() {
		if cerr := run.close(); err == nil {
			err = cerr
		}
	}()

	// Builds: the raw driver sequence and stripe.New, alternately, each freed before the next is built
	// and each started from the same state: the devices idle and a short pause after the last free
	// (the driver finishes freeing in the background, and a build right after a free pays for it,
	// whichever builds). The fastest of each counts. A first, untimed build shows the shape the raw
	// baseline copies. The last stripe.New range is kept; the raw range for the read measurements is
	// built once more afterwards, untimed.
	r, err := stripe.New(holders, size, layout, opts)
	if err != nil {
		return nil, err
	}
	run.r = r
	plan := rawPlan(r, holders, accessOnly, readOnly)
	var best, bestRaw time.Duration
	for i := 0; i < builds; i++ {
		if err := run.r.Close(); err != nil {
			return nil, err
		}
		run.r = nil
		if err := settle(all, pause); err != nil {
			return nil, err
		}
		raw, dt, err := buildRaw(holders[0], r.Size(), plan)
		if err != nil {
			return nil, fmt.Errorf("raw driver baseline: %w", err)
		}
		if err := raw.free(); err != nil {
			return nil, err
		}
		if bestRaw == 0 || dt < bestRaw {
			bestRaw = dt
		}
		if err := settle(all, pause); err != nil {
			return nil, err
		}
		t0 := time.Now()
		r, err = stripe.New(holders, size, layout, opts)
		dt = time.Since(t0)
		if err != nil {
			return nil, err
		}
		run.r = r
		if best == 0 || dt < best {
			best = dt
		}
	}
	if err := settle(all, pause); err != nil {
		return nil, err
	}
	raw, _, err := buildRaw(holders[0], r.Size(), plan)
	if err != nil {
		return nil, fmt.Errorf("raw driver baseline: %w", err)
	}
	run.raw = raw

	res = &stripeResult{Layout: "interleaved", SizeBytes: r.Size(), BuildSeconds: best.Seconds(), RawBuildSeconds: bestRaw.Seconds()}
	for _, d := range holders {
		res.Devices = append(res.Devices, d.Ordinal())
	}
	if il, ok := layout.(stripe.Interleaved); ok {
		res.StripeBytes = il.Stripe
	} else {
		res.Layout = "blocked"
		res.StripeBytes = r.Chunks()[0].Allocation.Size() // device 0's slab
	}
	if !c.json {
		fmt.Fprintf(e.stdout, "stripe: %s %s over devices %s (%s backend%s)\n",
			units.FormatSize(r.Size()), layout, devList.describe(holders), b.name, simNote)
		if len(accessOnly) > 0 {
			fmt.Fprintf(e.stdout, "  access only: devices %s\n", devList.describe(accessOnly))
		}
		for _, d := range holders {
			fmt.Fprintf(e.stdout, "  device %d holds %s in %d segments\n", d.Ordinal(), units.FormatSize(r.LocalBytes(d)), len(r.Segments(d)))
		}
		fmt.Fprintf(e.stdout, "build: %s (raw driver sequence: %s, %.2fx; fastest of %d)\n",
			fmtDuration(best), fmtDuration(bestRaw), best.Seconds()/bestRaw.Seconds(), builds)
	}

	// Each owner writes the pattern into its own segments; every device verifies the whole range.
	const seed = 0x5712
	prog := newProgress(e, "fill and verify", r.Size()*uint64(1+len(all)), c.json)
	var done uint64
	for _, d := range holders {
		for _, s := range r.Segments(d) {
			if err := d.Fill(r.Ptr()+driver.DevicePtr(s.Offset), s.Size, s.Offset, seed); err != nil {
				prog.Done()
				return nil, err
			}
			done += s.Size
			prog.Update(done)
		}
	}
	res.Verified = true
	for _, d := range all {
		bad, err := d.Verify(r.Ptr(), r.Size(), 0, seed)
		if err != nil {
			prog.Done()
			return nil, err
		}
		done += r.Size()
		prog.Update(done)
		if bad != 0 {
			res.Verified = false
			fmt.Fprintf(e.stderr, "vmmdemo stripe: device %d found %d of %d words wrong\n", d.Ordinal(), bad, r.Size()/8)
		}
	}
	prog.Done()
	if !c.json {
		if res.Verified {
			fmt.Fprintln(e.stdout, "verified: every device read the whole range and found what each owner wrote")
		} else {
			fmt.Fprintln(e.stdout, "verified: NO")
		}
	}

	// Read bandwidth, device by device: the local segments, the whole range, the raw-built range, and
	// a plain cuMemAlloc buffer of the device's local size.
	whole := []span{{r.Ptr(), r.Size()}}
	rawWhole := []span{{run.raw.ptr, run.raw.size}}
	for _, d := range all {
		rd, err := newReader(d)
		if err != nil {
			return nil, err
		}
		run.readers[d] = rd
		pd := stripeDeviceResult{Device: d.Ordinal(), localBytes: r.LocalBytes(d), segments: len(r.Segments(d))}
		var local []span
		for _, s := range r.Segments(d) {
			local = append(local, span{r.Ptr() + driver.DevicePtr(s.Offset), s.Size})
		}
		if pd.LocalReadGBps, err = rd.bandwidth(local, reads); err != nil {
			return nil, err
		}
		if pd.WholeReadGBps, err = rd.bandwidth(whole, reads); err != nil {
			return nil, err
		}
		if pd.RawWholeReadGBps, err = rd.bandwidth(rawWhole, reads); err != nil {
			return nil, err
		}
		res.PerDevice = append(res.PerDevice, pd)
	}
	// The raw range is no longer needed: free it before the plain buffers take memory.
	if err := run.raw.free(); err != nil {
		return nil, err
	}
	run.raw = nil
	for i := range res.PerDevice {
		pd := &res.PerDevice[i]
		if pd.localBytes == 0 {
			continue
		}
		d := all[i]
		plain, err := d.AllocPlain(pd.localBytes)
		if err != nil {
			return nil, fmt.Errorf("plain baseline: %w", err)
		}
		pd.PlainLocalReadGBps, err = run.readers[d].bandwidth([]span{{plain.Ptr(), plain.Size()}}, reads)
		if cerr := plain.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return nil, err
		}
	}
	if !c.json {
		printStripeBandwidth(e, res, reads)
	}
	return res, nil
}

func (l *deviceList) describe(devs []*vmm.Device) string {
	parts := make([]string, len(devs))
	for i, d := range devs {
		parts[i] = strconv.Itoa(d.Ordinal())
	}
	return strings.Join(parts, ",")
}

func fmtDuration(d time.Duration) string { return fmt.Sprintf("%.3f ms", d.Seconds()*1e3) }

func ratio(a, b float64) string {
	if b <= 0 {
		return "-"
	}
	return fmt.Sprintf("%.2fx", a/b)
}

func printStripeBandwidth(e *env, res *stripeResult, reads int) {
	w := e.stdout
	fmt.Fprintf(w, "kernel read bandwidth, GB/s (best of %d):\n", reads)
	fmt.Fprintf(w, "  %6s %10s %12s %7s %10s %10s %7s\n", "device", "local", "plain local", "ratio", "whole", "raw whole", "ratio")
	for _, pd := range res.PerDevice {
		fmt.Fprintf(w, "  %6d %10.1f %12.1f %7s %10.1f %10.1f %7s\n", pd.Device, pd.LocalReadGBps, pd.PlainLocalReadGBps,
			ratio(pd.LocalReadGBps, pd.PlainLocalReadGBps), pd.WholeReadGBps, pd.RawWholeReadGBps, ratio(pd.WholeReadGBps, pd.RawWholeReadGBps))
	}
	fmt.Fprintf(w, "  local: the device's own segments, one read kernel per segment over %d streams; plain local: one\n", readStreams)
	fmt.Fprintln(w, "  cuMemAlloc buffer of the same size; whole: the whole range; raw whole: the same range built with")
	fmt.Fprintln(w, "  raw driver calls")
}

// settlePause is how long the timed builds wait after the devices are idle: the driver finishes
// freeing the previous range in the background, and a build that starts at once pays for it (on the
// H200 host an 8 GiB build in 128 MiB stripes takes about 11 ms right after a free, 7 ms after a
// pause, whether raw or not). The simulator has nothing to wait for.
const settlePause = 50 * time.Millisecond

// settle waits until the devices are idle, then pause.
func settle(devs []*vmm.Device, pause time.Duration) error {
	for _, d := range devs {
		if err := d.Synchronize(); err != nil {
			return err
		}
	}
	time.Sleep(pause)
	return nil
}

// span is an address range to read.
type span struct {
	ptr  driver.DevicePtr
	size uint64
}

// readStreams is how many streams the read kernels are spread over. One kernel per segment on one
// stream loses a few microseconds per launch to the ramp-up and tail of each kernel (measured on the
// H200: 128 MiB segments read at 0.91x a single buffer, 32 MiB at 0.70x); kernels on several streams
// overlap those gaps (1.01x for both).
const readStreams = 4

// reader times the read kernel on one device. The kernels go to readStreams blocking streams and the
// timing events to the legacy default stream, which waits for the blocking streams' earlier work and
// makes their later work wait for it: the events bracket every kernel of a pass.
type reader struct {
	d          *vmm.Device
	streams    []*vmm.Stream
	start, end *vmm.Event
}

func newReader(d *vmm.Device) (rd *reader, err error) {
	rd = &reader{d: d}
	for i := 0; i < readStreams && err == nil; i++ {
		var s *vmm.Stream
		if s, err = d.NewStream(false); err == nil {
			rd.streams = append(rd.streams, s)
		}
	}
	if err == nil {
		if rd.start, err = d.NewEvent(true); err == nil {
			rd.end, err = d.NewEvent(true)
		}
	}
	if err != nil {
		return nil, errors.Join(err, rd.close())
	}
	return rd, nil
}

func (rd *reader) close() error {
	errs := []error{rd.end.Close(), rd.start.Close()}
	for _, s := range rd.streams {
		errs = append(errs, s.Close())
	}
	return errors.Join(errs...)
}

// bandwidth reads every span once per pass (one kernel launch per span, round-robin over the streams)
// and returns the best pass's rate in GB/s (1e9 bytes per second), after one untimed pass. No spans,
// or a pass too short for the events to see, gives 0.
func (rd *reader) bandwidth(spans []span, passes int) (float64, error) {
	var bytes uint64
	for _, s := range spans {
		bytes += s.size
	}
	if bytes == 0 {
		return 0, nil
	}
	pass := func() (time.Duration, error) {
		if err := rd.start.Record(nil); err != nil {
			return 0, err
		}
		for i, s := range spans {
			if err := rd.d.LaunchRead(s.ptr, s.size, rd.streams[i%len(rd.streams)]); err != nil {
				return 0, err
			}
		}
		if err := rd.end.Record(nil); err != nil {
			return 0, err
		}
		if err := rd.end.Synchronize(); err != nil {
			return 0, err
		}
		return rd.end.Elapsed(rd.start)
	}
	if _, err := pass(); err != nil { // untimed: first-touch and cache effects
		return 0, err
	}
	var best time.Duration
	for i := 0; i < passes; i++ {
		dt, err := pass()
		if err != nil {
			return 0, err
		}
		if dt > 0 && (best == 0 || dt < best) {
			best = dt
		}
	}
	if best <= 0 {
		return 0, nil
	}
	return float64(bytes) / best.Seconds() / 1e9, nil
}

// rawPiece is one stripe of the raw baseline: where, how big, on which device, with which access.
type rawPiece struct {
	off, size uint64
	loc       driver.Location
	access    []driver.AccessDesc
}

// rawPlan copies the built range's shape (the same stripes on the same devices with the same access)
// for the raw baseline.
func rawPlan(r *stripe.Range, holders, accessOnly []*vmm.Device, readOnly bool) []rawPiece {
	all := append(append([]*vmm.Device(nil), holders...), accessOnly...)
	var out []rawPiece
	for _, c := range r.Chunks() {
		owner := c.Allocation.Device()
		p := rawPiece{off: c.Offset, size: c.Allocation.Size(), loc: owner.Location()}
		for _, d := range all {
			f := driver.AccessReadWrite
			if readOnly && d != owner {
				f = driver.AccessRead
			}
			p.access = append(p.access, driver.AccessDesc{Location: d.Location(), Flags: f})
		}
		out = append(out, p)
	}
	return out
}

// rawRange is the baseline: the range built with raw driver calls in one context binding, the
// sequence of the driver's multi-device sample.
type rawRange struct {
	dev     *vmm.Device
	ptr     driver.DevicePtr
	size    uint64
	handles []driver.MemHandle
	mapped  uint64 // bytes mapped from ptr
}

// buildRaw reserves size bytes, then for every stripe creates its memory, maps it and sets access,
// and reports the time those calls took. On failure it frees what it made.
func buildRaw(d *vmm.Device, size uint64, plan []rawPiece) (*rawRange, time.Duration, error) {
	rr := &rawRange{dev: d, size: size}
	var dt time.Duration
	err := d.Raw(func(api driver.API) error {
		t0 := time.Now()
		ptr, err := api.MemAddressReserve(size, 0, 0, 0)
		if err != nil {
			return fmt.Errorf("cuMemAddressReserve %s: %w", units.FormatSize(size), err)
		}
		rr.ptr = ptr
		for _, p := range plan {
			prop := driver.AllocationProp{Type: driver.AllocationTypePinned, Location: p.loc}
			h, err := api.MemCreate(p.size, &prop, 0)
			if err != nil {
				return fmt.Errorf("cuMemCreate %s at %s: %w", units.FormatSize(p.size), p.loc, err)
			}
			rr.handles = append(rr.handles, h)
			if err := api.MemMap(ptr+driver.DevicePtr(p.off), p.size, 0, h, 0); err != nil {
				return fmt.Errorf("cuMemMap at offset %#x: %w", p.off, err)
			}
			rr.mapped = p.off + p.size
			if err := api.MemSetAccess(ptr+driver.DevicePtr(p.off), p.size, p.access); err != nil {
				return fmt.Errorf("cuMemSetAccess at offset %#x: %w", p.off, err)
			}
		}
		dt = time.Since(t0)
		return nil
	})
	if err != nil {
		return nil, 0, errors.Join(err, rr.free())
	}
	return rr, dt, nil
}

// free unmaps the raw range in one call, releases every allocation and frees the addresses.
func (rr *rawRange) free() error {
	if rr == nil || rr.ptr == 0 {
		return nil
	}
	err := rr.dev.Raw(func(api driver.API) error {
		var errs []error
		if rr.mapped > 0 {
			if err := api.MemUnmap(rr.ptr, rr.mapped); err != nil {
				return fmt.Errorf("cuMemUnmap: %w", err) // releasing or freeing now would fail too
			}
			rr.mapped = 0
		}
		for len(rr.handles) > 0 {
			h := rr.handles[len(rr.handles)-1]
			if err := api.MemRelease(h); err != nil {
				errs = append(errs, fmt.Errorf("cuMemRelease: %w", err))
			}
			rr.handles = rr.handles[:len(rr.handles)-1]
		}
		if err := api.MemAddressFree(rr.ptr, rr.size); err != nil {
			return errors.Join(append(errs, fmt.Errorf("cuMemAddressFree: %w", err))...)
		}
		rr.ptr = 0
		return errors.Join(errs...)
	})
	if err != nil {
		return fmt.Errorf("free the raw baseline range: %w", err)
	}
	return nil
}

var _ flag.Value = (*deviceList)(nil)
