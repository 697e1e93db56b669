// Package pool is a stream-ordered caching allocator of device memory on expandable segments.
//
// A Pool reserves one large range of virtual addresses and maps physical memory into it, one page (the
// allocation granularity, 2 MiB on the H200) at a time, as blocks need it. Requests of at most
// Options.SmallSize bytes are carved from small pages at 512-byte granularity; larger ones take whole
// pages, so the two kinds never fragment each other. Freed blocks stay mapped (cached) for the next
// request; Trim, and a high-water mark checked on every free, unmap and release idle pages so that other
// processes can have the memory.
//
// Frees are stream-ordered: a block freed on stream S can be handed out again at once to a request on
// S, and to a request on another stream only once an event recorded on S after the free has completed
// (cuEventQuery). The pool records those events lazily, only when a request finds nothing else, and
// never synchronizes the device on the allocation path.
//
// When a large request finds no contiguous free range but idle pages exist elsewhere, the pool
// stitches: it unmaps idle pages and maps the same physical memory under a fresh contiguous range of
// its reservation (no copy). Only when that and mapping new memory up to the limit are not enough does
// Alloc fail, with an error wrapping driver.ErrOutOfMemory that says how much is allocated, cached and
// free.
//
// A Pool is safe for concurrent use by many goroutines.
package pool

import (
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/lifetime"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/vmm"
)

// Errors, beside vmm.ErrInvalidValue, vmm.ErrClosed, vmm.ErrInUse and driver.ErrOutOfMemory.
var (
	// ErrAsleep is returned by Alloc and Free while the pool is asleep (Sleep).
	ErrAsleep = errors.New("pool: asleep")
	// ErrReleaseFailed is wrapped by a Free that freed its block but whose release of idle pages
	// after it (the high-water release) failed: the block is free (do not free it again), and Trim
	// and Close retry the release.
	ErrReleaseFailed = errors.New("pool: the block is freed, but releasing idle pages failed")
)

// MinBlock is the granularity of small blocks: every size is rounded up to a multiple of it.
const MinBlock = 512

// Options tunes New. The zero value suits one pool using most of one GPU.
type Options struct {
	// Limit is the most memory the pool maps at once; 0 means the device's free memory when the pool
	// is made. Alloc never maps beyond it.
	Limit uint64
	// Reserve is the size of the pool's virtual address range; 0 means three times Limit (one third
	// for small pages, the rest for large blocks and stitching into fresh ranges, which must hold
	// Limit: a smaller Reserve is refused). Address space costs
	// no memory.
	Reserve uint64
	// SmallSize is the largest request served from small pages; 0 means 1 MiB.
	SmallSize uint64
	// HighWater is how many bytes of idle, unmappable cache (mapped pages no block uses) the pool keeps:
	// a Free that leaves more releases idle pages down to it. 0 means Limit/8; use ^uint64(0) to never
	// release except through Trim.
	HighWater uint64
	// NoStitch turns stitching off: idle pages stay where they were mapped until Trim, so a request
	// that finds no contiguous free range must map new memory or fail. It exists to measure what
	// stitching buys.
	NoStitch bool
	// Access lists who may access the pool's memory; empty means read-write for the pool's device.
	Access []vmm.Access
	// ReleaseWorkers is how many goroutines release the pages of one run (cuMemRelease) when many are
	// released at once (Trim, Close); 0 means 4, 1 releases them one after the other.
	ReleaseWorkers int
}

// Block is memory handed out by Alloc. Its fields are read-only; Ptr stays valid until Free.
type Block struct {
	Ptr  driver.DevicePtr
	Size uint64 // the bytes asked for; the block may span a little more (Span)
	Tag  string // the accounting tag given to AllocTag, or ""

	pool  *Pool
	id    uint64 // the pool's serial number of the allocation: copies share it, a stale block's is gone
	off   uint64
	span  uint64
	small bool
}

// Span is the bytes the block occupies: Size rounded up to 512 bytes (small blocks) or to the page.
func (b *Block) Span() uint64 { return b.span }

func (b *Block) String() string {
	return fmt.Sprintf("block of %s at %#x", units.FormatSize(b.Size), uint64(b.Ptr))
}

// liveBlock is the pool's record of a block it handed out, by offset. Free trusts it, not the
// caller's Block, whose exported fields could have been changed and which may be a copy.
type liveBlock struct {
	id         uint64
	size, span uint64
	tag        string
}

// page is one physical page mapped in the reservation.
type page struct {
	alloc *vmm.Allocation
	m     *vmm.Mapping
}

// Pool is a stream-ordered caching allocator for one device. Make one with New and Close it.
type Pool struct {
	dev      *vmm.Device
	opts     Options
	res      *vmm.Reservation
	access   []vmm.Access
	pageSize uint64
	smallEnd uint64 // offsets [0, smallEnd) are small pages, [smallEnd, res.Size()) large blocks

	own        lifetime.Owner // its lock serializes the methods and guards the fields below; closed once Close freed everything
	asleep     bool
	pages      map[uint64]*page // mapped pages by offset
	smallFree  *rangeSet        // ready free bytes of mapped small pages (never across a page)
	smallUse   map[uint64]uint64
	smallIdle  map[uint64]bool // mapped small pages with no block and no pending free
	smallVA    *rangeSet       // unmapped small pages
	cached     *rangeSet       // ready free mapped large pages
	unmapped   *rangeSet       // unmapped large address space
	streams    map[*vmm.Stream]*streamState
	sealed     []*batch // oldest first
	spare      []*vmm.Event
	blocks     map[uint64]liveBlock // live blocks by offset
	serial     uint64               // the id of the last block handed out
	stranded   *rangeSet            // mapped pages without access that could not be unmapped: Trim, Close and Sleep retry
	slept      []uint64             // page offsets released by Sleep
	unreleased []*vmm.Allocation    // unmapped pages whose release failed: Trim and Close retry them
	none       *rangeSet            // always empty: the open frees of a stream that has none
	tags       map[string]uint64
	stats      Stats
	inUseBytes uint64 // sum of Size of live blocks
}

// New makes a pool on dev: it reserves the address range (cuMemAddressReserve) and maps nothing yet.
func New(dev *vmm.Device, opts Options) (*Pool, error) {
	if dev == nil {
		return nil, fmt.Errorf("pool: new: nil device: %w", vmm.ErrInvalidValue)
	}
	g, err := dev.DeviceGranularity()
	if err != nil {
		return nil, fmt.Errorf("pool: new: %w", err)
	}
	if err := opts.fill(dev, g); err != nil {
		return nil, err
	}
	res, err := dev.System().Reserve(opts.Reserve, vmm.ReserveOptions{})
	if err != nil {
		return nil, fmt.Errorf("pool: new: %w", err)
	}
	res.SetKind("pool") // vmm.Stats and package metrics report the pool's mapped memory as kind "pool"
	access := opts.Access
	if len(access) == 0 {
		access = []vmm.Access{vmm.ReadWrite(dev)}
	}
	smallEnd := smallEnd(opts.Reserve, g)
	p := &Pool{
		dev: dev, opts: opts, res: res, access: access, pageSize: g, smallEnd: smallEnd,
		pages: map[uint64]*page{}, smallFree: newRangeSet(g), smallUse: map[uint64]uint64{}, smallIdle: map[uint64]bool{},
		smallVA: newRangeSet(0), cached: newRangeSet(0), unmapped: newRangeSet(0), stranded: newRangeSet(0),
		streams: map[*vmm.Stream]*streamState{}, none: newRangeSet(0), tags: map[string]uint64{},
		blocks: map[uint64]liveBlock{},
	}
	p.smallVA.add(0, smallEnd)
	p.unmapped.add(smallEnd, res.Size()-smallEnd)
	p.stats.Limit = opts.Limit
	p.own.Init(nil, "pool")
	lifetime.Track(p, &p.own)
	return p, nil
}

// smallEnd is where the small blocks' part of a reservation of reserve bytes ends: a third of it,
// in whole pages of g.
func smallEnd(reserve, g uint64) uint64 { return reserve / 3 / g * g }

// fill replaces zero options by their defaults and checks the rest.
func (o *Options) fill(dev *vmm.Device, g uint64) error {
	if o.Limit == 0 {
		free, _, err := dev.MemInfo()
		if err != nil {
			return fmt.Errorf("pool: new: %w", err)
		}
		o.Limit = free
	}
	o.Limit = o.Limit / g * g
	if o.Limit == 0 {
		return fmt.Errorf("pool: new: limit below one page (%s): %w", units.FormatSize(g), vmm.ErrInvalidValue)
	}
	if o.Reserve == 0 {
		if o.Limit > math.MaxUint64/3 {
			return fmt.Errorf("pool: new: limit %s is too large: the default reserve of three times it overflows 64 bits (set Reserve): %w", units.FormatSize(o.Limit), vmm.ErrInvalidValue)
		}
		o.Reserve = 3 * o.Limit
	}
	if o.Reserve < 3*g || o.Reserve/3 < g {
		return fmt.Errorf("pool: new: reserve %s is too small (at least %s): %w", units.FormatSize(o.Reserve), units.FormatSize(3*g), vmm.ErrInvalidValue)
	}
	// An empty pool serves its whole limit in one block, from the large blocks' part of the range.
	if large := o.Reserve - smallEnd(o.Reserve, g); large < o.Limit { // Limit is whole pages
		return fmt.Errorf("pool: new: reserve %s leaves %s for large blocks, less than the limit of %s (reserve about 1.5 times the limit or more): %w",
			units.FormatSize(o.Reserve), units.FormatSize(large), units.FormatSize(o.Limit), vmm.ErrInvalidValue)
	}
	if o.SmallSize == 0 {
		o.SmallSize = 1 << 20
	}
	if o.SmallSize > g {
		return fmt.Errorf("pool: new: small size %s exceeds the page %s: %w", units.FormatSize(o.SmallSize), units.FormatSize(g), vmm.ErrInvalidValue)
	}
	if o.HighWater == 0 {
		o.HighWater = o.Limit / 8
	}
	if o.ReleaseWorkers <= 0 {
		o.ReleaseWorkers = 4
	}
	return nil
}

// Device is the pool's device.
func (p *Pool) Device() *vmm.Device { return p.dev }

// Limit is the most memory the pool maps.
func (p *Pool) Limit() uint64 { return p.opts.Limit }

// PageSize is the size of the pool's physical pages (the granularity).
func (p *Pool) PageSize() uint64 { return p.pageSize }

// Reservation is the pool's address range. Its mappings belong to the pool.
func (p *Pool) Reservation() *vmm.Reservation { return p.res }

// Close waits for pending frees, unmaps and releases every page and frees the address range. It fails
// with an error wrapping vmm.ErrInUse, naming how many blocks are still allocated, and then frees
// nothing. When releasing a page fails (now, or again for one whose release failed earlier) the pool
// stays open, the error says so, and Close can be called again. Close is idempotent and safe on nil.
func (p *Pool) Close() error {
	if p == nil {
		return nil
	}
	p.own.Lock()
	defer p.own.Unlock()
	if p.own.Closed() {
		return nil
	}
	if len(p.blocks) > 0 {
		return fmt.Errorf("pool: close: %d blocks (%s) are still allocated: %w", len(p.blocks), units.FormatSize(p.stats.Allocated), vmm.ErrInUse)
	}
	var errs []error
	if err := p.drain(true); err != nil {
		errs = append(errs, err)
	}
	if _, err := p.releaseAll(); err != nil {
		errs = append(errs, err)
	}
	if err := p.closeSpares(); err != nil {
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("pool: close: %w", err)
	}
	if err := p.res.Close(); err != nil {
		return fmt.Errorf("pool: close: %w", err)
	}
	p.own.MarkClosed()
	return nil
}

// closeSpares destroys the spare events (Close). One whose destruction fails stays a spare, so that
// the next Close retries it rather than report success while it is alive.
func (p *Pool) closeSpares() error {
	var kept []*vmm.Event
	var errs []error
	for _, e := range p.spare {
		if err := e.Close(); err != nil {
			kept, errs = append(kept, e), append(errs, err)
		}
	}
	p.spare = kept
	return errors.Join(errs...)
}

// driverTime adds the time since t0 to the time spent in the driver.
func (p *Pool) driverTime(t0 time.Time) { p.stats.DriverTime += time.Since(t0) }
