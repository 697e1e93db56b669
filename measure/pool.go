package measure

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"time"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/pool"
	"github.com/cuvmm/cuvmm/vmm"
)

// The allocators Pool replays a trace on.
const (
	PoolCuvmm         = "cuvmm"           // package pool
	PoolCuvmmNoStitch = "cuvmm-nostitch"  // package pool with stitching and the automatic release off
	PoolMemAlloc      = "cuMemAlloc"      // cuMemAlloc/cuMemFree, no caching
	PoolMemAllocAsync = "cuMemAllocAsync" // the driver's stream-ordered default pool
	PoolPeerTorch     = "torch-expandable"
)

// PoolAllocators is every allocator Pool replays on by default, in order.
var PoolAllocators = []string{PoolCuvmm, PoolCuvmmNoStitch, PoolMemAlloc, PoolMemAllocAsync}

// PoolOptions configures Pool.
type PoolOptions struct {
	Env
	// Device is the device's ordinal.
	Device int
	// Trace is the allocation trace to replay (required).
	Trace *pool.Trace
	// Streams is how many streams the trace's stream indexes map onto; 0 means the trace's count.
	Streams int
	// Memory is the memory the trace is sized against and the cuvmm pools' limit; 0 means the
	// device's free memory when the measurement starts (on the simulator, at most PoolSimMemory).
	// It must be at least PoolMinMemory, and with FillFraction 0 at least the trace's largest
	// request.
	Memory uint64
	// FillFraction scales the trace so that its peak in use is this fraction of Memory; 0 keeps the
	// trace's sizes. A value outside 0 to 1, NaN included, is refused.
	FillFraction float64
	// VerifyEvery fills every Nth block with a pattern when it is allocated and verifies it before it
	// is freed; 0 means 16.
	VerifyEvery int
	// Allocators to replay on; nil means PoolAllocators.
	Allocators []string
	// Peer "torch" also replays the trace in PyTorch's caching allocator with expandable segments
	// (PeerScript with Python), after cuvmm's allocators.
	Peer string
	// PeerScript is the peer's script (default PoolPeerScript, looked up from the working directory
	// and from the executable's directory upwards); Python runs it (default python3). It is run with
	// --trace FILE --streams N --verify-every K --cache-iters N and
	// PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in its environment; it replays the same
	// (scaled) trace and prints a PoolAllocatorResult as JSON on its last line.
	PeerScript, Python string
	// CacheIters is the number of alloc+free pairs timed from each allocator's cache; 0 means 20000.
	CacheIters int
	// TrimBytes is how much the trim measurement maps and then trims; 0 means min(16 GiB, Memory/4).
	TrimBytes uint64
}

// PoolSimMemory caps the default Memory on the simulator, whose devices are backed by files: the
// replay there checks behaviour, not scale.
const PoolSimMemory = 2 << 30

// PoolResult is the outcome of Pool: per allocator, what the same trace cost.
type PoolResult struct {
	Backend          string                          `json:"backend"`
	Device           string                          `json:"device"`
	MemoryBytes      uint64                          `json:"memory_bytes"`
	FillFraction     float64                         `json:"fill_fraction"`
	Streams          int                             `json:"streams"`
	TraceAllocations int                             `json:"trace_allocations"`
	TracePeakInUse   uint64                          `json:"trace_peak_in_use_bytes"`
	TraceLargest     uint64                          `json:"trace_largest_request_bytes"`
	Order            []string                        `json:"order"`
	Allocators       map[string]*PoolAllocatorResult `json:"allocators"`
	Trim             PoolTrimResult                  `json:"trim"`
}

// PoolAllocatorResult is one allocator's replay of the trace.
type PoolAllocatorResult struct {
	Verified            bool    `json:"verified"`
	VerifiedBlocks      int     `json:"verified_blocks"`
	PeakMappedBytes     uint64  `json:"peak_mapped_bytes"`
	PeakInUseBytes      uint64  `json:"peak_in_use_bytes"`
	MappedOverInUse     float64 `json:"mapped_over_in_use"`
	LargestServedBytes  uint64  `json:"largest_request_served_bytes"`
	Allocs              int     `json:"allocs"`
	FailedAllocs        int     `json:"failed_allocs"`
	FirstFailure        string  `json:"first_failure,omitempty"`
	AllocP50Ns          int64   `json:"alloc_p50_ns"`
	AllocP99Ns          int64   `json:"alloc_p99_ns"`
	FreeP50Ns           int64   `json:"free_p50_ns"`
	FreeP99Ns           int64   `json:"free_p99_ns"`
	CacheAllocFreeP50Ns int64   `json:"cache_alloc_free_p50_ns"`
	CacheAllocFreeP99Ns int64   `json:"cache_alloc_free_p99_ns"`
	ReplaySeconds       float64 `json:"replay_seconds"`
	Stitches            uint64  `json:"stitches,omitempty"`
	DriverSeconds       float64 `json:"driver_seconds,omitempty"`
	Note                string  `json:"note,omitempty"`
	Error               string  `json:"error,omitempty"`
}

// PoolTrimResult is the rate at which Trim returned idle pages to the driver, with the pool's
// default release workers and, for comparison, releasing the pages one after the other.
type PoolTrimResult struct {
	Bytes             uint64  `json:"bytes"`
	Seconds           float64 `json:"seconds"`
	GBps              float64 `json:"gbps"`
	SequentialBytes   uint64  `json:"sequential_bytes"` // what the sequential run released
	SequentialSeconds float64 `json:"sequential_seconds"`
	SequentialGBps    float64 `json:"sequential_gbps"`
	Error             string  `json:"error,omitempty"`
}

// Pool replays a trace on each allocator in turn, in one run on one device: peak mapped against peak
// in use, failures, the largest request served, alloc and free latency, alloc+free from the cache,
// and the pool's Trim rate. Blocks are filled and verified (sampled) so that an allocator handing out
// overlapping memory shows as verified=false.
func Pool(o PoolOptions) (*PoolResult, error) {
	d, err := o.poolDefaults()
	if err != nil {
		return nil, err
	}
	tr := o.Trace
	if o.FillFraction > 0 {
		peak, _ := tr.PeakInUse()
		tr = tr.Scale(o.FillFraction * float64(o.Memory) / float64(peak))
	}
	peak, largest := tr.PeakInUse()
	res := &PoolResult{Backend: o.Backend.Name, Device: d.Name(), MemoryBytes: o.Memory, FillFraction: o.FillFraction,
		Streams: o.Streams, TraceAllocations: len(tr.Events), TracePeakInUse: peak, TraceLargest: largest,
		Allocators: map[string]*PoolAllocatorResult{}}
	streams, err := poolStreams(d, o.Streams)
	defer func() {
		for _, s := range streams {
			_ = s.Close()
		}
	}()
	if err != nil {
		return nil, err
	}
	for _, name := range o.Allocators {
		// An allocator that breaks (not one that runs out of memory) is reported, and the others
		// still run.
		r, err := poolRunOne(o, d, name, tr, streams)
		if r == nil {
			r = &PoolAllocatorResult{}
		}
		if err != nil {
			r.Error = err.Error()
			o.logf("pool: %s: %v\n", name, err)
		}
		res.Order = append(res.Order, name)
		res.Allocators[name] = r
	}
	if res.Trim, err = poolTrim(o, d); err != nil {
		res.Trim.Error = err.Error()
	}
	if o.Peer != "" {
		bar := beginSteps(o.Progress, "replay on "+PoolPeerTorch, 1)
		res.Order = append(res.Order, PoolPeerTorch)
		res.Allocators[PoolPeerTorch] = poolPeer(o, tr)
		bar.Done()
	}
	return res, nil
}

func (o *PoolOptions) poolDefaults() (*vmm.Device, error) {
	if err := o.check(); err != nil {
		return nil, err
	}
	d, err := device(o.Backend, o.Device, "device")
	if err != nil {
		return nil, err
	}
	if err := o.poolMemory(d); err != nil {
		return nil, err
	}
	if o.VerifyEvery <= 0 {
		o.VerifyEvery = 16
	}
	if o.Allocators == nil {
		o.Allocators = PoolAllocators
	}
	if o.CacheIters <= 0 {
		o.CacheIters = 20000
	}
	if o.TrimBytes == 0 {
		o.TrimBytes = min(16<<30, o.Memory/4)
	}
	return d, d.LoadKernels()
}

// check refuses bad options before the device is opened, fills in Streams, and finds the peer's
// Python and script.
func (o *PoolOptions) check() error {
	if err := o.Env.check(); err != nil {
		return err
	}
	if o.Trace == nil || len(o.Trace.Events) == 0 {
		return fmt.Errorf("pool: a non-empty trace is needed: %w", ErrInvalidOption)
	}
	if peak, _ := o.Trace.PeakInUse(); peak == 0 { // nothing to replay, and no scale for --fill-fraction
		return fmt.Errorf("pool: the trace's %d allocations are all of 0 bytes: %w", len(o.Trace.Events), ErrInvalidOption)
	}
	if !(o.FillFraction >= 0 && o.FillFraction <= 1) { // NaN too
		return fmt.Errorf("--fill-fraction %v: want 0 to 1: %w", o.FillFraction, ErrInvalidOption)
	}
	if o.Streams == 0 {
		o.Streams = o.Trace.Streams()
	}
	if o.Streams < 1 || o.Streams > 64 {
		return fmt.Errorf("--streams %d: want 1 to 64: %w", o.Streams, ErrInvalidOption)
	}
	for i, a := range o.Allocators {
		if !slices.Contains(PoolAllocators, a) {
			return fmt.Errorf("allocator %q: want one of %v: %w", a, PoolAllocators, ErrInvalidOption)
		}
		if slices.Contains(o.Allocators[:i], a) {
			return fmt.Errorf("--allocators: %q is listed twice: %w", a, ErrInvalidOption)
		}
	}
	if o.CacheIters < 0 {
		return fmt.Errorf("--cache-iters %d: want at least 1: %w", o.CacheIters, ErrInvalidOption)
	}
	if o.VerifyEvery < 0 {
		return fmt.Errorf("--verify-every %d: want at least 1: %w", o.VerifyEvery, ErrInvalidOption)
	}
	var err error
	o.Python, o.PeerScript, err = findPeer(o.Peer, o.Python, o.PeerScript, PoolPeerScript)
	return err
}

// PoolMinMemory is the least Memory Pool accepts: the trim measurement maps 64 MiB blocks, and the
// cache benchmark's 32 MiB blocks must still fit beside what a replay leaves mapped in a pool that
// neither stitches nor releases (cuvmm-nostitch).
const PoolMinMemory = 128 << 20

// poolMemory fills in Memory when it is 0 (the device's free memory, capped on the simulator) and
// checks it up front, so that a replay does not run only to fail at its end: at least
// PoolMinMemory, and with FillFraction 0 (the trace's own sizes) at least the largest request.
func (o *PoolOptions) poolMemory(d *vmm.Device) error {
	given := "--memory " + units.FormatSize(o.Memory)
	if o.Memory == 0 {
		free, _, err := d.MemInfo()
		if err != nil {
			return err
		}
		if o.Backend.Sim() {
			free = min(free, PoolSimMemory)
		}
		o.Memory, given = free, "--memory (left out: "+units.FormatSize(free)+")"
	}
	if o.Memory < PoolMinMemory {
		return fmt.Errorf("%s: want at least %s (the trim maps 64 MiB blocks, the cache benchmark 32 MiB ones beside the replay's): %w",
			given, units.FormatSize(PoolMinMemory), ErrInvalidOption)
	}
	if _, largest := o.Trace.PeakInUse(); o.FillFraction == 0 && largest > o.Memory {
		return fmt.Errorf("%s: below the trace's largest request, %s (--fill-fraction scales the trace to the memory): %w",
			given, units.FormatSize(largest), ErrInvalidOption)
	}
	return nil
}

func poolStreams(d *vmm.Device, n int) ([]*vmm.Stream, error) {
	var out []*vmm.Stream
	for i := 0; i < n; i++ {
		s, err := d.NewStream(true)
		if err != nil {
			return out, err
		}
		out = append(out, s)
	}
	return out, nil
}

// poolAllocator is one allocator under measurement.
type poolAllocator interface {
	alloc(size uint64, s *vmm.Stream) (driver.DevicePtr, any, error)
	free(h any, s *vmm.Stream) error
	sample() error // after each successful allocation, outside the timed call
	finish(r *PoolAllocatorResult) error
	close() error
}

func poolRunOne(o PoolOptions, d *vmm.Device, name string, tr *pool.Trace, streams []*vmm.Stream) (*PoolAllocatorResult, error) {
	a, err := poolNewAllocator(o, d, name)
	if err != nil {
		return nil, err
	}
	bar := beginSteps(o.Progress, "replay on "+name, uint64(len(tr.Events)))
	r, err := poolReplay(o, d, a, tr, streams, bar)
	bar.Done()
	if err == nil {
		err = a.finish(r) // the replay's peaks, before the cache benchmark adds its own blocks
	}
	if err == nil {
		var lat []int64
		lat, err = poolCacheBench(a, streams[0], o.CacheIters)
		r.CacheAllocFreeP50Ns, r.CacheAllocFreeP99Ns = poolPercentile(lat, 0.50), poolPercentile(lat, 0.99)
	}
	if r != nil && r.PeakInUseBytes > 0 {
		r.MappedOverInUse = float64(r.PeakMappedBytes) / float64(r.PeakInUseBytes)
	}
	return r, errors.Join(err, a.close())
}

func poolNewAllocator(o PoolOptions, d *vmm.Device, name string) (poolAllocator, error) {
	switch name {
	case PoolCuvmm, PoolCuvmmNoStitch:
		opts := pool.Options{Limit: o.Memory}
		if name == PoolCuvmmNoStitch {
			// Idle pages stay where they were first mapped: no stitching and no automatic release,
			// a segment cache without garbage collection.
			opts.NoStitch, opts.HighWater = true, ^uint64(0)
		}
		p, err := pool.New(d, opts)
		if err != nil {
			return nil, err
		}
		return &poolCuvmmAlloc{p: p}, nil
	case PoolMemAlloc:
		return newPoolMemAlloc(d)
	case PoolMemAllocAsync:
		return newPoolAsyncAlloc(d)
	}
	return nil, fmt.Errorf("unknown allocator %q: %w", name, vmm.ErrInvalidValue)
}

// poolLive is one allocated block of a replay.
type poolLive struct {
	ptr      driver.DevicePtr
	h        any
	size     uint64
	stream   *vmm.Stream
	verified bool
}

// poolReplayer is one replay of a trace on one allocator.
type poolReplayer struct {
	o                 PoolOptions
	d                 *vmm.Device
	a                 poolAllocator
	r                 *PoolAllocatorResult
	live              []*poolLive
	allocLat, freeLat []int64
	inUse             uint64
}

// poolReplay runs the trace on a: frees due before each allocation, then the allocation; every
// VerifyEvery-th block is filled and verified before its free.
func poolReplay(o PoolOptions, d *vmm.Device, a poolAllocator, tr *pool.Trace, streams []*vmm.Stream, bar Bar) (*PoolAllocatorResult, error) {
	p := &poolReplayer{o: o, d: d, a: a, r: &PoolAllocatorResult{Verified: true}, live: make([]*poolLive, len(tr.Events))}
	defer p.abandon()
	frees := tr.FreesBefore()
	start := time.Now()
	for i, e := range tr.Events {
		if i%256 == 0 {
			bar.Update(uint64(i))
		}
		for _, j := range frees[i] {
			if err := p.release(j); err != nil {
				return p.r, err
			}
		}
		if err := p.allocate(i, e, streams[e.Stream%len(streams)]); err != nil {
			return p.r, err
		}
	}
	for j := len(p.live) - 1; j >= 0; j-- {
		if err := p.release(j); err != nil {
			return p.r, err
		}
	}
	r := p.r
	r.ReplaySeconds = time.Since(start).Seconds()
	r.AllocP50Ns, r.AllocP99Ns = poolPercentile(p.allocLat, 0.50), poolPercentile(p.allocLat, 0.99)
	r.FreeP50Ns, r.FreeP99Ns = poolPercentile(p.freeLat, 0.50), poolPercentile(p.freeLat, 0.99)
	return r, nil
}

// allocate makes block i on s (timed); running out of memory is counted, other errors end the replay.
func (p *poolReplayer) allocate(i int, e pool.TraceEvent, s *vmm.Stream) error {
	t0 := time.Now()
	ptr, h, err := p.a.alloc(e.Size, s)
	p.allocLat = append(p.allocLat, time.Since(t0).Nanoseconds())
	r := p.r
	if err != nil {
		if !errors.Is(err, driver.ErrOutOfMemory) {
			return err
		}
		r.FailedAllocs++
		if r.FirstFailure == "" {
			r.FirstFailure = fmt.Sprintf("allocation %d of %d bytes: %v", i, e.Size, err)
		}
		return nil
	}
	if err := p.a.sample(); err != nil {
		return err
	}
	b := &poolLive{ptr: ptr, h: h, size: e.Size, stream: s, verified: i%p.o.VerifyEvery == 0 && e.Size >= 8}
	p.live[i] = b
	r.Allocs++
	p.inUse += e.Size
	r.PeakInUseBytes = max(r.PeakInUseBytes, p.inUse)
	r.LargestServedBytes = max(r.LargestServedBytes, e.Size)
	if b.verified {
		r.VerifiedBlocks++
		return poolFill(p.d, b, uint64(i))
	}
	return nil
}

// release verifies block j when it was filled, then frees it (timed).
func (p *poolReplayer) release(j int) error {
	b := p.live[j]
	if b == nil {
		return nil
	}
	p.live[j] = nil
	p.inUse -= b.size
	if b.verified {
		if err := poolCheck(p.d, b, uint64(j)); err != nil {
			p.r.Verified = false
			p.r.Note = err.Error()
		}
	}
	t0 := time.Now()
	err := p.a.free(b.h, b.stream)
	p.freeLat = append(p.freeLat, time.Since(t0).Nanoseconds())
	return err
}

// abandon frees what an interrupted replay still holds, so that the next allocator has the memory.
func (p *poolReplayer) abandon() {
	for j, b := range p.live {
		if b != nil {
			_ = p.a.free(b.h, b.stream)
			p.live[j] = nil
		}
	}
}

// poolFill waits for the block's stream (the memory is ordered on it), then fills the block.
func poolFill(d *vmm.Device, b *poolLive, seed uint64) error {
	if err := b.stream.Synchronize(); err != nil {
		return err
	}
	return d.Fill(b.ptr, b.size/8*8, 0, seed)
}

func poolCheck(d *vmm.Device, b *poolLive, seed uint64) error {
	if err := b.stream.Synchronize(); err != nil {
		return err
	}
	bad, err := d.Verify(b.ptr, b.size/8*8, 0, seed)
	if err == nil && bad != 0 {
		err = fmt.Errorf("block of %d bytes at %#x: %d words changed while it was allocated", b.size, uint64(b.ptr), bad)
	}
	return err
}

// poolCacheBench times alloc+free pairs of a few sizes on one stream, after one warm-up pair each:
// what a request served from the cache costs.
func poolCacheBench(a poolAllocator, s *vmm.Stream, iters int) ([]int64, error) {
	sizes := []uint64{4 << 10, 256 << 10, 2 << 20, 32 << 20}
	for _, n := range sizes {
		_, h, err := a.alloc(n, s)
		if err == nil {
			err = a.free(h, s)
		}
		if err != nil {
			return nil, err
		}
	}
	lat := make([]int64, 0, iters)
	for i := 0; i < iters; i++ {
		n := sizes[i%len(sizes)]
		t0 := time.Now()
		_, h, err := a.alloc(n, s)
		if err == nil {
			err = a.free(h, s)
		}
		lat = append(lat, time.Since(t0).Nanoseconds())
		if err != nil {
			return nil, err
		}
	}
	return lat, s.Synchronize()
}

// poolPercentile is the q-quantile of latencies in nanoseconds (percentile), rounded to a whole
// nanosecond.
func poolPercentile(v []int64, q float64) int64 {
	return int64(math.Round(percentile(v, q)))
}

// poolTrim measures Trim twice (pages released one after the other, then by the default workers).
func poolTrim(o PoolOptions, d *vmm.Device) (PoolTrimResult, error) {
	var r PoolTrimResult
	var err error
	if r.SequentialBytes, r.SequentialSeconds, err = poolTrimOnce(o, d, 1); err != nil {
		return r, err
	}
	r.Bytes, r.Seconds, err = poolTrimOnce(o, d, 0)
	if r.Seconds > 0 {
		r.GBps = float64(r.Bytes) / 1e9 / r.Seconds
	}
	if r.SequentialSeconds > 0 {
		r.SequentialGBps = float64(r.SequentialBytes) / 1e9 / r.SequentialSeconds
	}
	return r, err
}

// poolTrimOnce maps TrimBytes in 64 MiB blocks (fewer if the device runs out of memory), frees
// them, and times the Trim that releases them; it returns the bytes Trim released.
func poolTrimOnce(o PoolOptions, d *vmm.Device, workers int) (uint64, float64, error) {
	p, err := pool.New(d, pool.Options{Limit: o.Memory, HighWater: ^uint64(0), ReleaseWorkers: workers})
	if err != nil {
		return 0, 0, err
	}
	var blocks []*pool.Block
	for n := uint64(0); n < o.TrimBytes; n += 64 << 20 {
		b, aerr := p.Alloc(64<<20, nil)
		if errors.Is(aerr, driver.ErrOutOfMemory) {
			break // trim what could be mapped
		}
		if aerr != nil {
			err = fmt.Errorf("trim: map %s in 64MiB blocks: %w", units.FormatSize(o.TrimBytes), aerr)
			break
		}
		blocks = append(blocks, b)
	}
	for _, b := range blocks {
		err = errors.Join(err, p.Free(b, nil))
	}
	if err == nil {
		err = d.Synchronize()
	}
	var n uint64
	var secs float64
	if err == nil {
		t0 := time.Now()
		n, err = p.Trim()
		secs = time.Since(t0).Seconds()
	}
	return n, secs, errors.Join(err, p.Close())
}

// ---- the allocators ----

type poolCuvmmAlloc struct{ p *pool.Pool }

func (c *poolCuvmmAlloc) alloc(size uint64, s *vmm.Stream) (driver.DevicePtr, any, error) {
	b, err := c.p.Alloc(size, s)
	if err != nil {
		return 0, nil, err
	}
	return b.Ptr, b, nil
}

func (c *poolCuvmmAlloc) free(h any, s *vmm.Stream) error { return c.p.Free(h.(*pool.Block), s) }
func (c *poolCuvmmAlloc) sample() error                   { return nil }
func (c *poolCuvmmAlloc) close() error                    { return c.p.Close() }

func (c *poolCuvmmAlloc) finish(r *PoolAllocatorResult) error {
	st := c.p.Stats()
	r.PeakMappedBytes, r.Stitches, r.DriverSeconds = st.PeakMapped, st.Stitches, st.DriverTime.Seconds()
	return nil
}

// poolMemAlloc is cuMemAlloc/cuMemFree; its footprint is read from cuMemGetInfo after each
// allocation.
type poolMemAlloc struct {
	d          *vmm.Device
	base, peak uint64
}

func newPoolMemAlloc(d *vmm.Device) (*poolMemAlloc, error) {
	if err := d.Synchronize(); err != nil {
		return nil, err
	}
	free, _, err := d.MemInfo()
	return &poolMemAlloc{d: d, base: free}, err
}

func (m *poolMemAlloc) alloc(size uint64, _ *vmm.Stream) (driver.DevicePtr, any, error) {
	var p driver.DevicePtr
	err := m.d.Raw(func(api driver.API) error {
		var err error
		p, err = api.MemAlloc(size)
		return err
	})
	return p, p, err
}

func (m *poolMemAlloc) free(h any, _ *vmm.Stream) error {
	return m.d.Raw(func(api driver.API) error { return api.MemFree(h.(driver.DevicePtr)) })
}

func (m *poolMemAlloc) sample() error {
	free, _, err := m.d.MemInfo()
	if free < m.base {
		m.peak = max(m.peak, m.base-free)
	}
	return err
}

func (m *poolMemAlloc) finish(r *PoolAllocatorResult) error {
	r.PeakMappedBytes = m.peak
	r.Note = "peak mapped: the drop in cuMemGetInfo's free memory"
	return nil
}

func (m *poolMemAlloc) close() error { return nil }

// poolAsyncAlloc is cuMemAllocAsync/cuMemFreeAsync on the device's default pool, with the release
// threshold at its maximum (the pool keeps what it has, as a caching allocator does); its footprint
// is the pool's RESERVED_MEM_HIGH.
type poolAsyncAlloc struct {
	d    *vmm.Device
	pool driver.MemPool
}

func newPoolAsyncAlloc(d *vmm.Device) (*poolAsyncAlloc, error) {
	a := &poolAsyncAlloc{d: d}
	err := d.Raw(func(api driver.API) error {
		var err error
		if a.pool, err = api.DeviceGetDefaultMemPool(d.Handle()); err != nil {
			return err
		}
		if err = api.MemPoolTrimTo(a.pool, 0); err != nil {
			return err
		}
		if err = api.MemPoolSetAttribute(a.pool, driver.MemPoolReservedMemHigh, 0); err != nil {
			return err
		}
		return api.MemPoolSetAttribute(a.pool, driver.MemPoolReleaseThreshold, ^uint64(0))
	})
	return a, err
}

func (a *poolAsyncAlloc) alloc(size uint64, s *vmm.Stream) (driver.DevicePtr, any, error) {
	var p driver.DevicePtr
	err := a.d.Raw(func(api driver.API) error {
		var err error
		p, err = api.MemAllocAsync(size, s.Handle())
		return err
	})
	return p, p, err
}

func (a *poolAsyncAlloc) free(h any, s *vmm.Stream) error {
	return a.d.Raw(func(api driver.API) error { return api.MemFreeAsync(h.(driver.DevicePtr), s.Handle()) })
}

func (a *poolAsyncAlloc) sample() error { return nil }

func (a *poolAsyncAlloc) finish(r *PoolAllocatorResult) error {
	r.Note = "default pool, release threshold at its maximum; peak mapped: RESERVED_MEM_HIGH"
	return a.d.Raw(func(api driver.API) error {
		var err error
		r.PeakMappedBytes, err = api.MemPoolGetAttribute(a.pool, driver.MemPoolReservedMemHigh)
		return err
	})
}

func (a *poolAsyncAlloc) close() error {
	if err := a.d.Synchronize(); err != nil {
		return err
	}
	return a.d.Raw(func(api driver.API) error {
		return errors.Join(api.MemPoolTrimTo(a.pool, 0), api.MemPoolSetAttribute(a.pool, driver.MemPoolReleaseThreshold, 0))
	})
}

// poolPeer runs the peer's script on the trace written to a temporary file and reads its JSON result.
func poolPeer(o PoolOptions, tr *pool.Trace) *PoolAllocatorResult {
	r := &PoolAllocatorResult{}
	f, err := o.createTemp("cuvmm-pool-*.trace")
	if err == nil {
		defer os.Remove(f.Name())
		_, err = tr.WriteTo(f)
		err = errors.Join(err, f.Close())
	}
	if err != nil {
		r.Error = err.Error()
		return r
	}
	cmd := exec.Command(o.Python, o.PeerScript, "--trace", f.Name(), "--streams", strconv.Itoa(o.Streams),
		"--verify-every", strconv.Itoa(o.VerifyEvery), "--cache-iters", strconv.Itoa(o.CacheIters))
	cmd.Env = append(os.Environ(), "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		r.Error = fmt.Sprintf("%v: %s", err, poolTail(stderr.Bytes(), 2000))
		return r
	}
	lines := bytes.Split(bytes.TrimSpace(stdout.Bytes()), []byte("\n"))
	if err := json.Unmarshal(lines[len(lines)-1], r); err != nil {
		r.Error = fmt.Sprintf("reading the peer's JSON: %v: %s", err, poolTail(stdout.Bytes(), 2000))
	}
	return r
}

func poolTail(b []byte, n int) string {
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(bytes.TrimSpace(b))
}

// Check reports an allocator whose blocks did not read back intact, or one that could not run.
func (r *PoolResult) Check() error {
	for _, name := range r.Order {
		a := r.Allocators[name]
		if a.Error != "" {
			return fmt.Errorf("pool: %s: %s", name, a.Error)
		}
		if !a.Verified {
			return fmt.Errorf("pool: %s: verification failed: %s", name, a.Note)
		}
	}
	if r.Trim.Error != "" {
		return fmt.Errorf("pool: trim: %s", r.Trim.Error)
	}
	return nil
}

// Text writes the comparison as a table.
func (r *PoolResult) Text(w io.Writer) {
	fmt.Fprintf(w, "trace: %d allocations on %d streams, peak in use %s, largest request %s", r.TraceAllocations, r.Streams,
		units.FormatSize(r.TracePeakInUse), units.FormatSize(r.TraceLargest))
	if r.FillFraction > 0 {
		fmt.Fprintf(w, " (sized to %.0f%% of %s)", 100*r.FillFraction, units.FormatSize(r.MemoryBytes))
	}
	fmt.Fprintf(w, "\ndevice %s (%s backend)\n", r.Device, r.Backend)
	fmt.Fprintf(w, "  %-17s %-8s %12s %12s %7s %7s %11s %11s %11s %11s\n", "allocator", "verified", "peak mapped", "peak in use",
		"ratio", "failed", "alloc p50", "alloc p99", "cache p50", "cache p99")
	for _, name := range r.Order {
		a := r.Allocators[name]
		if a.Error != "" {
			fmt.Fprintf(w, "  %-17s did not run: %s\n", name, a.Error)
			continue
		}
		fmt.Fprintf(w, "  %-17s %-8s %12s %12s %7.3f %7d %11s %11s %11s %11s\n", name, yesNo(a.Verified),
			units.FormatSize(a.PeakMappedBytes), units.FormatSize(a.PeakInUseBytes), a.MappedOverInUse, a.FailedAllocs,
			time.Duration(a.AllocP50Ns), time.Duration(a.AllocP99Ns), time.Duration(a.CacheAllocFreeP50Ns), time.Duration(a.CacheAllocFreeP99Ns))
		if a.FirstFailure != "" {
			fmt.Fprintf(w, "  %-17s first failure: %s\n", "", a.FirstFailure)
		}
	}
	if r.Trim.Error != "" {
		fmt.Fprintf(w, "  trim: failed: %s\n", r.Trim.Error)
	} else {
		fmt.Fprintf(w, "  trim: %s released in %.4f s (%.1f GB/s; %.1f GB/s releasing one page after another)\n",
			units.FormatSize(r.Trim.Bytes), r.Trim.Seconds, r.Trim.GBps, r.Trim.SequentialGBps)
	}
	fmt.Fprintln(w, "  ratio = peak mapped / peak in use; cache = one alloc+free pair served from the allocator's cache")
	if r.Backend == "sim" {
		fmt.Fprintln(w, "  (simulator: times measure the Go simulation, not a GPU; only the cuvmm pools are bounded by the memory above)")
	}
}
