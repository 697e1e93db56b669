package pinned

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"
	"unsafe"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/lifetime"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/vmm"
)

// Pool is a fixed set of equal pinned buffers carved from one Region when the pool is made, handed
// out with Get or TryGet and given back with Put. No memory is pinned or freed while the pool runs,
// so Get and Put cost nothing in the driver. It is safe for concurrent use.
type Pool struct {
	region     *Region
	ownsRegion bool
	off        uint64 // the pool's range in the region starts here
	bufSize    uint64
	bufs       []*Buffer
	free       chan *Buffer
	done       chan struct{} // closed by Close: wakes waiters
	multi      chan struct{} // held by getN while it collects several buffers
	closing    sync.Mutex    // held through Close, so that a second Close waits for the first

	own        lifetime.Owner // its lock guards the fields below
	out        int
	stats      PoolStats
	regionOpen bool // an owned region whose Close failed: retried by Close
}

// Buffer is one buffer of a Pool: a []byte view for the CPU (Bytes) and the address devices use
// (Ptr), valid from Get until Put.
type Buffer struct {
	pool  *Pool
	index int
	off   uint64
	size  uint64
	out   bool // guarded by pool.own
}

// PoolStats are a pool's counters.
type PoolStats struct {
	Buffers    int    // buffers in the pool
	BufferSize uint64 // bytes per buffer
	InUse      int    // buffers out now
	MaxInUse   int    // the most buffers out at once
	Gets       uint64 // buffers handed out (Get and TryGet)
	Puts       uint64 // buffers given back
	Waits      uint64 // Get calls that found the pool empty and waited
	WaitTime   time.Duration
	Misses     uint64 // TryGet calls that found the pool empty
	Cancelled  uint64 // Get calls that gave up (context done, or the pool closed)
}

// bufferAlign is what buffer sizes are rounded up to: the host page, so that buffers suit O_DIRECT
// I/O and never share a page.
var bufferAlign = pageSize

// NewPool carves count buffers of bufSize bytes (rounded up to the host page size; BufferSize
// reports it) from the part of r that no open pool holds: the lowest free range that fits. Closing
// the pool frees its range for later pools. The
// region must stay open while the pool is: closing it fails with ErrInUse until the pool is closed.
func NewPool(r *Region, bufSize uint64, count int) (*Pool, error) {
	if r == nil {
		return nil, fmt.Errorf("pinned: new pool: nil region: %w", ErrInvalidValue)
	}
	if count <= 0 {
		return nil, fmt.Errorf("pinned: new pool: %d buffers: %w", count, ErrInvalidValue)
	}
	size, err := vmm.RoundUp("pinned: new pool", bufSize, bufferAlign)
	if err != nil {
		return nil, err
	}
	r.own.Lock()
	defer r.own.Unlock()
	if r.closed { // also after a Close that failed halfway: part of the memory may be gone
		return nil, fmt.Errorf("pinned: new pool on %s: %w", r, ErrClosed)
	}
	off, ok := r.carve(size, count)
	if !ok {
		return nil, fmt.Errorf("pinned: new pool of %d × %s: no free range of %s that fits is left: %w", count, units.FormatSize(size), r, ErrInvalidValue)
	}
	p := &Pool{region: r, off: off, bufSize: size, free: make(chan *Buffer, count), done: make(chan struct{}),
		multi: make(chan struct{}, 1)}
	for i := 0; i < count; i++ {
		b := &Buffer{pool: p, index: i, off: off + uint64(i)*size, size: size}
		p.bufs = append(p.bufs, b)
		p.free <- b
	}
	p.stats.Buffers, p.stats.BufferSize = count, size
	p.own.Init(nil, "pinned pool")
	lifetime.Track(p, &p.own)
	return p, nil
}

// carve takes the lowest free range of count × size bytes for a pool, if one fits; the caller holds
// r.own's lock.
func (r *Region) carve(size uint64, count int) (uint64, bool) {
	if uint64(count) > r.size/size {
		return 0, false
	}
	n, off, i := uint64(count)*size, uint64(0), 0
	for ; i < len(r.pools) && r.pools[i].off-off < n; i++ {
		off = r.pools[i].end
	}
	if i == len(r.pools) && r.size-off < n {
		return 0, false
	}
	r.pools = slices.Insert(r.pools, i, span{off, off + n})
	return off, true
}

// uncarve frees the range of the pool at off; the caller holds r.own's lock.
func (r *Region) uncarve(off uint64) {
	r.pools = slices.DeleteFunc(r.pools, func(s span) bool { return s.off == off })
}

// CreatePool makes a region of count × bufSize bytes for dev with opts (see New) and carves a pool
// from it. The pool owns the region: Close closes both.
func CreatePool(dev *vmm.Device, bufSize uint64, count int, opts Options) (*Pool, error) {
	if count <= 0 {
		return nil, fmt.Errorf("pinned: create pool: %d buffers: %w", count, ErrInvalidValue)
	}
	size, err := vmm.RoundUp("pinned: create pool", bufSize, bufferAlign)
	if err != nil {
		return nil, err
	}
	if uint64(count) > ^uint64(0)/size {
		return nil, fmt.Errorf("pinned: create pool of %d × %s: overflows: %w", count, units.FormatSize(size), ErrInvalidValue)
	}
	r, err := New(dev, size*uint64(count), opts)
	if err != nil {
		return nil, err
	}
	p, err := NewPool(r, size, count)
	if err != nil {
		return nil, errors.Join(err, r.Close())
	}
	p.ownsRegion = true
	return p, nil
}

// Region is the region the buffers are carved from.
func (p *Pool) Region() *Region { return p.region }

// BufferSize is the size of every buffer.
func (p *Pool) BufferSize() uint64 { return p.bufSize }

// Len is the number of buffers.
func (p *Pool) Len() int { return len(p.bufs) }

// Stats returns the pool's counters.
func (p *Pool) Stats() PoolStats {
	p.own.Lock()
	defer p.own.Unlock()
	s := p.stats
	s.InUse = p.out
	return s
}

func (p *Pool) String() string {
	return fmt.Sprintf("pool of %d × %s", len(p.bufs), units.FormatSize(p.bufSize))
}

// take marks b as out; it fails (putting b back) when the pool closed meanwhile.
func (p *Pool) take(b *Buffer) (*Buffer, error) {
	p.own.Lock()
	defer p.own.Unlock()
	if p.own.Closed() {
		p.free <- b
		return nil, fmt.Errorf("pinned: get from %s: %w", p, ErrClosed)
	}
	b.out = true
	p.out++
	p.stats.Gets++
	p.stats.MaxInUse = max(p.stats.MaxInUse, p.out)
	return b, nil
}

func (p *Pool) isClosed() bool {
	p.own.Lock()
	defer p.own.Unlock()
	return p.own.Closed()
}

// Get takes a buffer, waiting while all are out until one is put back, ctx is done (an error
// wrapping ctx.Err()) or the pool is closed (ErrClosed).
func (p *Pool) Get(ctx context.Context) (*Buffer, error) {
	if p.isClosed() {
		return nil, fmt.Errorf("pinned: get from %s: %w", p, ErrClosed)
	}
	if err := ctx.Err(); err != nil {
		p.count(func(s *PoolStats) { s.Cancelled++ })
		return nil, fmt.Errorf("pinned: get from %s: %w", p, err)
	}
	select {
	case b := <-p.free:
		return p.take(b)
	default:
	}
	start := time.Now()
	p.count(func(s *PoolStats) { s.Waits++ })
	defer func() {
		d := time.Since(start)
		p.count(func(s *PoolStats) { s.WaitTime += d })
	}()
	select {
	case b := <-p.free:
		return p.take(b)
	case <-ctx.Done():
		p.count(func(s *PoolStats) { s.Cancelled++ })
		return nil, fmt.Errorf("pinned: get from %s: all %d buffers in use: %w", p, len(p.bufs), ctx.Err())
	case <-p.done:
		p.count(func(s *PoolStats) { s.Cancelled++ })
		return nil, fmt.Errorf("pinned: get from %s: %w", p, ErrClosed)
	}
}

// getN takes n buffers. Callers that need several buffers at once collect them one at a time, so two
// of them could each hold part of what the other waits for; getN lets one collector run at a time.
// On error it gives back what it took.
func (p *Pool) getN(ctx context.Context, n int) ([]*Buffer, error) {
	if n > len(p.bufs) {
		return nil, fmt.Errorf("pinned: get %d buffers from %s: %w", n, p, ErrInvalidValue)
	}
	select {
	case p.multi <- struct{}{}:
	case <-ctx.Done():
		return nil, fmt.Errorf("pinned: get %d buffers from %s: %w", n, p, ctx.Err())
	case <-p.done:
		return nil, fmt.Errorf("pinned: get %d buffers from %s: %w", n, p, ErrClosed)
	}
	defer func() { <-p.multi }()
	bufs := make([]*Buffer, 0, n)
	for len(bufs) < n {
		b, err := p.Get(ctx)
		if err != nil {
			for _, b := range bufs {
				_ = p.Put(b)
			}
			return nil, err
		}
		bufs = append(bufs, b)
	}
	return bufs, nil
}

// TryGet takes a buffer if one is free, without waiting.
func (p *Pool) TryGet() (*Buffer, bool) {
	if p.isClosed() {
		return nil, false
	}
	select {
	case b := <-p.free:
		if _, err := p.take(b); err != nil {
			return nil, false
		}
		return b, true
	default:
		p.count(func(s *PoolStats) { s.Misses++ })
		return nil, false
	}
}

func (p *Pool) count(f func(*PoolStats)) {
	p.own.Lock()
	f(&p.stats)
	p.own.Unlock()
}

// Put gives b back. A buffer of another pool, nil, or one already put back is an error wrapping
// ErrInvalidValue. Copies into or out of b must be complete.
func (p *Pool) Put(b *Buffer) error {
	if b == nil || b.pool != p {
		return fmt.Errorf("pinned: put to %s: the buffer is nil or belongs to another pool: %w", p, ErrInvalidValue)
	}
	p.own.Lock()
	if !b.out {
		p.own.Unlock()
		return fmt.Errorf("pinned: put buffer %d to %s: it is not out (put back twice?): %w", b.index, p, ErrInvalidValue)
	}
	b.out = false
	p.out--
	p.stats.Puts++
	p.own.Unlock()
	p.free <- b // never blocks: the channel holds every buffer
	return nil
}

// Close closes the pool, and its region when the pool owns it (CreatePool). It fails with an error
// wrapping ErrInUse, freeing nothing, while buffers are out. Waiting Get calls return ErrClosed.
// Close is idempotent and safe on nil; a Close called while another runs waits for it.
func (p *Pool) Close() error {
	if p == nil {
		return nil
	}
	p.closing.Lock()
	defer p.closing.Unlock()
	p.own.Lock()
	if p.own.Closed() {
		retry := p.regionOpen
		p.own.Unlock()
		if retry {
			return p.closeRegion()
		}
		return nil
	}
	if p.out > 0 {
		n := p.out
		p.own.Unlock()
		return fmt.Errorf("pinned: close %s: %d buffers are still out: %w", p, n, ErrInUse)
	}
	p.own.MarkClosed()
	close(p.done)
	p.own.Unlock()

	r := p.region
	r.own.Lock()
	r.uncarve(p.off)
	r.own.Unlock()
	if p.ownsRegion {
		return p.closeRegion()
	}
	return nil
}

// closeRegion closes the region the pool owns; when that fails a later Close retries it, so Close
// never reports success while the region is held.
func (p *Pool) closeRegion() error {
	err := p.region.Close()
	p.own.Lock()
	p.regionOpen = err != nil
	p.own.Unlock()
	return err
}

// Pool is the pool the buffer belongs to.
func (b *Buffer) Pool() *Pool { return b.pool }

// Index is the buffer's index in its pool, 0 to Len-1.
func (b *Buffer) Index() int { return b.index }

// Len is the buffer's size.
func (b *Buffer) Len() uint64 { return b.size }

// Offset is the buffer's offset in the pool's region.
func (b *Buffer) Offset() uint64 { return b.off }

// Bytes is the buffer's memory for the CPU.
func (b *Buffer) Bytes() []byte {
	return b.pool.region.mem[b.off : b.off+b.size : b.off+b.size]
}

// Ptr is the buffer's address for the devices the region is visible to.
func (b *Buffer) Ptr() driver.DevicePtr { return b.pool.region.ptr + driver.DevicePtr(b.off) }

// pointer is the buffer's host address, for asynchronous copies.
func (b *Buffer) pointer() unsafe.Pointer { return unsafe.Pointer(&b.pool.region.mem[b.off]) }

// Release puts the buffer back into its pool (Pool.Put).
func (b *Buffer) Release() error {
	if b == nil {
		return fmt.Errorf("pinned: release a nil buffer: %w", ErrInvalidValue)
	}
	return b.pool.Put(b)
}
