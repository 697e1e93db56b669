package measure

import (
	"errors"
	"fmt"
	"slices"
	"sort"
	"time"

	"github.com/cuvmm/cuvmm/internal/pattern"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/vmm"
)

// BandwidthOptions are Bandwidth's options.
type BandwidthOptions struct {
	Env
	// Device is the device's ordinal.
	Device int
	// MaxSize is the largest copy measured (0: 1 GiB on a GPU, 64 MiB on the simulator); it must
	// be at least the smallest size measured, 64 KiB.
	MaxSize uint64
	// Staging is the bytes moved through async staging (0: 8 GiB on a GPU, 64 MiB on the
	// simulator), in StagingBuffers (at least 2) of StagingChunk bytes (0: 32 MiB). NoStaging
	// skips the staging measurement.
	Staging, StagingChunk uint64
	StagingBuffers        int
	NoStaging             bool
	// StagingSpin makes the stager's waits spin on a core instead of sleeping
	// (pinned.StagerOptions.SpinWait).
	StagingSpin bool
	// Iters is the timed iterations per size (0: 5 to 50, fewer for large sizes).
	Iters int
}

// bwSizes are the copy sizes measured (those up to --max-size).
var bwSizes = []uint64{64 << 10, 1 << 20, 16 << 20, 256 << 20, 1 << 30}

// The kinds of host memory Bandwidth measures, in table order (BandwidthRow.Kind). host-alloc with
// the raw driver call is the baseline.
const (
	HostPageable     = "pageable"
	HostAlloc        = "host-alloc"
	HostRegistered   = "registered"
	HostNUMA         = "host-numa"
	HostSharedMemory = "shared-memory"
)

// BandwidthRow is one kind, direction and size.
type BandwidthRow struct {
	Kind      string  `json:"kind"`
	Direction string  `json:"direction"` // "h2d" or "d2h"
	SizeBytes uint64  `json:"size_bytes"`
	Iters     int     `json:"iterations"`
	MedianGBs float64 `json:"median_gbps"`
	BestGBs   float64 `json:"best_gbps"`
	// VsHostAlloc is this row's median over the raw cuMemcpy on cuMemHostAlloc memory at the same
	// size and direction, measured in the same run.
	VsHostAlloc float64 `json:"vs_host_alloc"`
}

// BandwidthSetup is the time to make one kind of host memory ready.
type BandwidthSetup struct {
	Kind    string  `json:"kind"`
	Seconds float64 `json:"seconds"` // time to make max-size bytes of this kind ready
	Note    string  `json:"note,omitempty"`
}

// BandwidthStaging is async staging through pinned buffers against raw copies.
type BandwidthStaging struct {
	SizeBytes   uint64  `json:"size_bytes"`
	ChunkBytes  uint64  `json:"chunk_bytes"`
	Buffers     int     `json:"buffers"`
	SpinWait    bool    `json:"spin_wait"`      // the stager's waits spun on a core (else they slept)
	D2HGBs      float64 `json:"d2h_gbps"`       // device → discarding io.Writer, wall clock
	H2DGBs      float64 `json:"h2d_gbps"`       // non-copying io.Reader → device, wall clock
	RawD2HGBs   float64 `json:"raw_d2h_gbps"`   // baseline: host-alloc D2H at the largest size
	RawH2DGBs   float64 `json:"raw_h2d_gbps"`   // baseline: host-alloc H2D at the largest size
	D2HVsRaw    float64 `json:"d2h_vs_raw"`     // target on the GPU host: ≥ 0.9
	H2DVsRaw    float64 `json:"h2d_vs_raw"`     //
	BaselineLen uint64  `json:"baseline_bytes"` // the size the baseline was measured at
}

// BandwidthResult is host↔device copy bandwidth by host memory kind against cuMemHostAlloc.
type BandwidthResult struct {
	Backend  string            `json:"backend"`
	Device   int               `json:"device"`
	Name     string            `json:"device_name"`
	Timing   string            `json:"timing"`
	Setup    []BandwidthSetup  `json:"setup"`
	Rows     []BandwidthRow    `json:"rows"`
	Verified bool              `json:"verified"`
	Staging  *BandwidthStaging `json:"staging,omitempty"`
	// MinPinnedVsHostAlloc is the lowest VsHostAlloc of the pinned kinds at 16 MiB and above
	// (target on the GPU host: ≥ 0.97); -1 when none was measured (--max-size below 16 MiB, or no
	// host-alloc baseline).
	MinPinnedVsHostAlloc float64 `json:"min_pinned_vs_host_alloc"`

	sizes []uint64
}

// defaults fills in the sizes left 0 and checks the options; it returns the copy sizes measured.
func (o *BandwidthOptions) defaults() ([]uint64, error) {
	if err := o.Env.check(); err != nil {
		return nil, err
	}
	if err := firstErr(atLeast(0, intOption{"iters", o.Iters}), atLeast(2, intOption{"staging-buffers", o.StagingBuffers})); err != nil {
		return nil, err
	}
	if o.NoStaging && (o.Staging != 0 || o.StagingChunk != 0 || o.StagingSpin) {
		return nil, fmt.Errorf("--no-staging skips the staging measurement that --staging, --staging-chunk, --staging-buffers and --staging-spin set up: leave them out: %w", ErrInvalidOption)
	}
	sim := o.Backend.Sim()
	if o.MaxSize == 0 {
		o.MaxSize = pick[uint64](sim, 64<<20, 1<<30)
	}
	switch {
	case o.NoStaging:
		o.Staging = 0
	case o.Staging == 0:
		o.Staging = pick[uint64](sim, 64<<20, 8<<30)
	}
	if o.StagingChunk == 0 {
		o.StagingChunk = 32 << 20
	}
	var sizes []uint64
	for _, s := range bwSizes {
		if s <= o.MaxSize {
			sizes = append(sizes, s)
		}
	}
	if largest := bwSizes[len(bwSizes)-1]; o.MaxSize > largest {
		return nil, fmt.Errorf("--max-size %s: want at most %s (the largest size measured): %w", units.FormatSize(o.MaxSize),
			units.FormatSize(largest), ErrInvalidOption)
	}
	if len(sizes) == 0 {
		return nil, fmt.Errorf("--max-size %s is below the smallest size measured (64KiB): %w", units.FormatSize(o.MaxSize), ErrInvalidOption)
	}
	return sizes, nil
}

func pick[T any](sim bool, onSim, onGPU T) T {
	if sim {
		return onSim
	}
	return onGPU
}

// Bandwidth times host↔device copies for each kind of host memory (pageable, cuMemHostAlloc with
// raw copies as the baseline, registered, host-NUMA and shared-memory regions) at each size up to
// MaxSize, checks the data both ways, and times async staging against the raw copies.
func Bandwidth(opts BandwidthOptions) (*BandwidthResult, error) {
	sizes, err := opts.defaults()
	if err != nil {
		return nil, err
	}
	d, err := device(opts.Backend, opts.Device, "device")
	if err != nil {
		return nil, err
	}
	res, err := measureBandwidth(&opts, d, sizes)
	if err != nil {
		return nil, err
	}
	if opts.Staging > 0 {
		if res.Staging, err = measureStaging(&opts, d, res); err != nil {
			return nil, err
		}
	}
	return res, nil
}

func bwIters(size uint64, fixed int) int {
	if fixed > 0 {
		return fixed
	}
	return int(min(max((1<<30)/size, 5), 50))
}

// bwBench is the device side of the copies: a buffer of the largest size, a stream and two events.
type bwBench struct {
	d          *vmm.Device
	dev        *vmm.PlainBuffer
	s          *vmm.Stream
	start, end *vmm.Event
	hosts      []bwHost
}

func newBWBench(d *vmm.Device, size uint64) (b *bwBench, err error) {
	b = &bwBench{d: d}
	if b.dev, err = d.AllocPlain(size); err != nil {
		return nil, err
	}
	if b.s, err = d.NewStream(true); err == nil {
		if b.start, err = d.NewEvent(true); err == nil {
			b.end, err = d.NewEvent(true)
		}
	}
	if err != nil {
		return nil, errors.Join(err, b.close())
	}
	return b, nil
}

func (b *bwBench) close() error {
	var errs []error
	for _, h := range b.hosts {
		errs = append(errs, h.close())
	}
	errs = append(errs, b.end.Close(), b.start.Close(), b.s.Close(), b.dev.Close())
	return errors.Join(errs...)
}

// timeIt times fn between two events on the stream.
func (b *bwBench) timeIt(fn func() error) (time.Duration, error) {
	if err := b.start.Record(b.s); err != nil {
		return 0, err
	}
	if err := fn(); err != nil {
		return 0, err
	}
	if err := b.end.Record(b.s); err != nil {
		return 0, err
	}
	if err := b.end.Synchronize(); err != nil {
		return 0, err
	}
	el, err := b.end.Elapsed(b.start)
	return max(el, time.Nanosecond), err
}

// bwSeed is the pattern the device buffer holds.
const bwSeed = 0xb4

func measureBandwidth(o *BandwidthOptions, d *vmm.Device, sizes []uint64) (res *BandwidthResult, err error) {
	top := sizes[len(sizes)-1]
	res = &BandwidthResult{Backend: o.Backend.Name, Device: d.Ordinal(), Name: d.Name(), sizes: sizes,
		Timing: "CUDA events around each copy on a non-blocking stream; GB/s = 1e9 bytes/s; median and best of the iterations"}
	if o.Backend.Sim() {
		res.Timing += " (simulator: wall time of Go copies, not GPU figures)"
	}
	b, err := newBWBench(d, top)
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, b.close()) }()
	if res.Setup, err = b.makeHosts(o, top); err != nil {
		return nil, err
	}
	bar := beginSteps(o.Progress, "bandwidth", uint64(2*len(sizes)))
	defer bar.Done()
	for _, dir := range []string{"d2h", "h2d"} {
		for _, size := range sizes {
			rows, err := b.rows(dir, size, bwIters(size, o.Iters))
			if err != nil {
				return nil, err
			}
			res.Rows = append(res.Rows, rows...)
			bar.Update(uint64(len(res.Rows) / len(b.hosts)))
		}
	}
	// Each kind copies the pattern down (checked on the CPU) and up (checked on the GPU), once at
	// the largest size, untimed.
	res.Verified = true
	for _, dir := range []string{"d2h", "h2d"} {
		ok, err := b.verify(dir, top)
		if err != nil {
			return nil, err
		}
		res.Verified = res.Verified && ok
	}
	bwRatios(res)
	return res, nil
}

// rows times n copies of size bytes in direction dir for every kind. The kinds take turns,
// iteration by iteration, so that noise that comes and goes over the run (other copies, the host's
// page handling) falls on all of them alike and the ratios compare like with like.
func (b *bwBench) rows(dir string, size uint64, n int) ([]BandwidthRow, error) {
	copyFns := make([]func() error, len(b.hosts))
	times := make([][]time.Duration, len(b.hosts))
	for k, h := range b.hosts {
		copyFns[k] = func() error { return h.d2h(b.dev.Ptr(), size, b.s) }
		if dir == "h2d" {
			copyFns[k] = func() error { return h.h2d(b.dev.Ptr(), size, b.s) }
		}
		if _, err := b.timeIt(copyFns[k]); err != nil { // warm-up
			return nil, fmt.Errorf("%s %s %s: %w", h.kind, dir, units.FormatSize(size), err)
		}
		times[k] = make([]time.Duration, n)
	}
	for i := 0; i < n; i++ {
		for k, h := range b.hosts {
			var err error
			if times[k][i], err = b.timeIt(copyFns[k]); err != nil {
				return nil, fmt.Errorf("%s %s %s: %w", h.kind, dir, units.FormatSize(size), err)
			}
		}
	}
	var rows []BandwidthRow
	for k, h := range b.hosts {
		med, best := bwMedianBest(size, times[k])
		rows = append(rows, BandwidthRow{Kind: h.kind, Direction: dir, SizeBytes: size, Iters: n, MedianGBs: med, BestGBs: best})
	}
	return rows, nil
}

// bwMedianBest is the median and the best of the iterations' rates in GB/s, each moving size bytes
// in one of times (the median of an even count is the mean of the two middle rates).
func bwMedianBest(size uint64, times []time.Duration) (med, best float64) {
	gbs := make([]float64, len(times))
	for i, t := range times {
		gbs[i] = float64(size) / t.Seconds() / 1e9
	}
	if len(gbs) == 0 {
		return 0, 0
	}
	return median(gbs), slices.Max(gbs)
}

// verify makes one untimed copy of top bytes in direction dir for every kind and checks all of it.
// d2h: the device holds the pattern, the host memory is zeroed first, and the CPU checks every
// word. h2d: the host memory holds the pattern, the device buffer is zeroed first, and the GPU
// checks every word. So a copy that moves nothing, or only part, is caught.
func (b *bwBench) verify(dir string, top uint64) (bool, error) {
	ok := true
	for _, h := range b.hosts {
		good, err := b.verifyKind(h, dir, top)
		if err != nil {
			return false, fmt.Errorf("%s %s verify %s: %w", h.kind, dir, units.FormatSize(top), err)
		}
		ok = ok && good
	}
	return ok, nil
}

func (b *bwBench) verifyKind(h bwHost, dir string, top uint64) (bool, error) {
	mem := h.mem[:top]
	if dir == "h2d" {
		pattern.FillHost(mem, 0, bwSeed)
		if err := b.zeroDevice(top); err != nil {
			return false, err
		}
		if err := h.h2d(b.dev.Ptr(), top, b.s); err != nil {
			return false, err
		}
		if err := b.s.Synchronize(); err != nil {
			return false, err
		}
		bad, err := b.d.Verify(b.dev.Ptr(), top, 0, bwSeed)
		return bad == 0, err
	}
	clear(mem)
	if err := b.d.Fill(b.dev.Ptr(), top, 0, bwSeed); err != nil {
		return false, err
	}
	if err := b.d.Synchronize(); err != nil {
		return false, err
	}
	if err := h.d2h(b.dev.Ptr(), top, b.s); err != nil {
		return false, err
	}
	if err := b.s.Synchronize(); err != nil {
		return false, err
	}
	return pattern.CountHost(mem, 0, bwSeed) == 0, nil
}

// zeroDevice zeroes the device buffer and waits for it.
func (b *bwBench) zeroDevice(n uint64) error {
	if err := b.d.Memset(b.dev.Ptr(), 0, n); err != nil {
		return err
	}
	return b.d.Synchronize()
}

// bwRatios sorts the rows by kind and sets each one's ratio to host-alloc and the lowest ratio of
// the pinned kinds at 16 MiB and above.
func bwRatios(res *BandwidthResult) {
	sort.SliceStable(res.Rows, func(i, j int) bool { return res.Rows[i].Kind < res.Rows[j].Kind })
	base := map[string]float64{}
	for _, r := range res.Rows {
		if r.Kind == HostAlloc {
			base[fmt.Sprint(r.Direction, r.SizeBytes)] = r.MedianGBs
		}
	}
	res.MinPinnedVsHostAlloc = -1
	for i := range res.Rows {
		r := &res.Rows[i]
		if b := base[fmt.Sprint(r.Direction, r.SizeBytes)]; b > 0 {
			r.VsHostAlloc = r.MedianGBs / b
		}
		if r.Kind != HostPageable && r.Kind != HostAlloc && r.SizeBytes >= 16<<20 && r.VsHostAlloc > 0 {
			if res.MinPinnedVsHostAlloc < 0 || r.VsHostAlloc < res.MinPinnedVsHostAlloc {
				res.MinPinnedVsHostAlloc = r.VsHostAlloc
			}
		}
	}
}
