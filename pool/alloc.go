package pool

import (
	"errors"
	"fmt"
	"time"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/vmm"
)

// errNoMemory says that neither idle pages nor room under the limit can serve a request.
var errNoMemory = errors.New("no idle pages and no room under the limit")

// Alloc returns a block of at least size bytes usable by work queued on s (nil: the legacy default
// stream) from now on. It fails with vmm.ErrInvalidValue for size 0, a size above the limit or a
// stream of another device, and with an error wrapping driver.ErrOutOfMemory when the memory cannot
// be found even by stitching and waiting for pending frees.
func (p *Pool) Alloc(size uint64, s *vmm.Stream) (*Block, error) { return p.AllocTag(size, s, "") }

// AllocTag is Alloc with an accounting tag (Stats.Tags sums the live bytes per tag).
func (p *Pool) AllocTag(size uint64, s *vmm.Stream, tag string) (*Block, error) {
	small, span, err := p.checkAlloc(size, s)
	if err != nil {
		return nil, err
	}
	p.own.Lock()
	defer p.own.Unlock()
	if err := p.usable("allocate"); err != nil {
		return nil, err
	}
	st := p.lookup(s)
	off, ok := p.fastFit(st, small, span)
	if !ok {
		if off, err = p.slowAlloc(st, small, span); err != nil {
			p.stats.Failures++
			return nil, fmt.Errorf("pool: allocate %s: %w", units.FormatSize(size), err)
		}
	}
	p.serial++
	b := &Block{Ptr: p.res.Ptr() + driver.DevicePtr(off), Size: size, Tag: tag, pool: p, id: p.serial, off: off, span: span, small: small}
	p.blocks[off] = liveBlock{id: p.serial, size: size, span: span, tag: tag}
	p.inUseBytes += size
	p.stats.Allocs++
	p.stats.Allocated += span
	p.stats.PeakAllocated = max(p.stats.PeakAllocated, p.stats.Allocated)
	p.stats.PeakInUse = max(p.stats.PeakInUse, p.inUseBytes)
	if tag != "" {
		p.tags[tag] += size
	}
	return b, nil
}

// checkAlloc validates a request and rounds it: to MinBlock for small blocks, to the page for others.
func (p *Pool) checkAlloc(size uint64, s *vmm.Stream) (small bool, span uint64, err error) {
	if p == nil {
		return false, 0, fmt.Errorf("pool: allocate on a nil pool: %w", vmm.ErrInvalidValue)
	}
	if size == 0 {
		return false, 0, fmt.Errorf("pool: allocate 0 bytes: %w", vmm.ErrInvalidValue)
	}
	if size > p.opts.Limit {
		return false, 0, fmt.Errorf("pool: allocate %s: above the pool's limit of %s: %w", units.FormatSize(size), units.FormatSize(p.opts.Limit), vmm.ErrInvalidValue)
	}
	if err := p.checkStream(s); err != nil {
		return false, 0, fmt.Errorf("pool: allocate %s %w", units.FormatSize(size), err)
	}
	small = size <= p.opts.SmallSize
	unit := p.pageSize
	if small {
		unit = MinBlock
	}
	return small, (size + unit - 1) / unit * unit, nil
}

// usable reports why the pool cannot be used now; the caller holds the pool's lock.
func (p *Pool) usable(op string) error {
	if p.own.Closed() {
		return fmt.Errorf("pool: %s: %w", op, vmm.ErrClosed)
	}
	if p.asleep {
		return fmt.Errorf("pool: %s: %w", op, ErrAsleep)
	}
	return nil
}

// fastFit serves a request from memory already mapped: free for every stream, or freed on st itself.
// It makes no driver call.
func (p *Pool) fastFit(st *streamState, small bool, span uint64) (uint64, bool) {
	ready := p.cached
	if small {
		ready = p.smallFree
	}
	bestSet, best := ready, ready.bestFit(span)
	consider := func(set *rangeSet) {
		if r := set.bestFit(span); r != nil && (best == nil || r.n < best.n) {
			bestSet, best = set, r
		}
	}
	if small {
		consider(st.small)
	} else {
		consider(st.large)
	}
	for _, b := range p.sealed {
		if b.st.s == st.s {
			if small {
				consider(b.small)
			} else {
				consider(b.large)
			}
		}
	}
	if best == nil {
		return 0, false
	}
	off := best.off
	bestSet.take(best, off, span)
	if small && bestSet == ready {
		pg := off / p.pageSize * p.pageSize
		delete(p.smallIdle, pg)
		p.smallUse[pg] += span
	}
	return off, true
}

// slowAlloc runs when nothing mapped fits: it collects completed frees, then maps pages under a fresh
// range (stitching idle pages first, then new memory), then waits for pending frees and tries again.
func (p *Pool) slowAlloc(st *streamState, small bool, span uint64) (uint64, error) {
	if err := p.drain(false); err != nil {
		return 0, err
	}
	if off, ok := p.fastFit(st, small, span); ok {
		return off, nil
	}
	if off, ok, err := p.borrow(st, small, span); ok || err != nil {
		return off, err
	}
	for {
		off, err := p.grow(st, small, span)
		if err == nil {
			return off, nil
		}
		if !errors.Is(err, errNoMemory) {
			return 0, err
		}
		if len(p.sealed) == 0 {
			return 0, p.oom(span, err)
		}
		if err := p.poll(true); err != nil {
			return 0, err
		}
		if off, ok := p.fastFit(st, small, span); ok {
			return off, nil
		}
	}
}

// borrow serves a request from memory freed on another stream whose free has not completed yet: the
// requesting stream is made to wait for the event that covers the free (cuStreamWaitEvent), so work
// queued on it after this call runs after the freeing stream has passed the free. No one waits on
// the host, and no page is mapped.
func (p *Pool) borrow(st *streamState, small bool, span uint64) (uint64, bool, error) {
	for _, b := range p.sealed {
		if b.st.s == st.s {
			continue
		}
		set := b.large
		if small {
			set = b.small
		}
		r := set.bestFit(span)
		if r == nil {
			continue
		}
		t0 := time.Now()
		err := st.s.WaitEvent(b.ev)
		p.driverTime(t0)
		if err != nil {
			return 0, false, fmt.Errorf("pool: order the request after a free on another stream: %w", err)
		}
		off := r.off
		set.take(r, off, span)
		p.stats.Borrows++
		return off, true, nil
	}
	return 0, false, nil
}

// grow maps pages for a request: one more small page, or a fresh range of span bytes for a large
// block.
func (p *Pool) grow(st *streamState, small bool, span uint64) (uint64, error) {
	if !small {
		return p.growLarge(span)
	}
	r := p.smallVA.bestFit(p.pageSize)
	if r == nil {
		return 0, fmt.Errorf("the small pages' address range is full: %w", errNoMemory)
	}
	off := r.off
	p.smallVA.take(r, off, p.pageSize)
	if _, err := p.mapRange(off, 1, nil); err != nil {
		p.giveBack(off, p.pageSize)
		return 0, err
	}
	p.smallFree.add(off, p.pageSize)
	p.smallIdle[off] = true
	got, _ := p.fastFit(st, true, span)
	return got, nil
}

// growLarge maps a fresh range of span bytes for a large block: an unmapped range, or else one
// cleared of the idle pages that cut the address space into shorter pieces (clearRange).
func (p *Pool) growLarge(span uint64) (uint64, error) {
	var given []*vmm.Allocation
	r := p.unmapped.bestFit(span)
	if r == nil {
		var err error
		if given, err = p.clearRange(span); err != nil {
			return 0, err
		}
		r = p.unmapped.bestFit(span)
	}
	off := r.off
	p.unmapped.take(r, off, span)
	mapped, err := p.mapRange(off, span/p.pageSize, given)
	if err != nil {
		// Pages mapped with access before the failure stay as cache; the rest of the range is free
		// address space, but for pages left mapped without access (p.stranded).
		p.cached.add(off, mapped*p.pageSize)
		p.giveBack(off+mapped*p.pageSize, span-mapped*p.pageSize)
		return 0, err
	}
	return off, nil
}

// giveBack returns the pages of [off, off+n) that are not mapped to the free address space of their
// area (small or large). Pages still mapped there (p.stranded) stay out of it until they are dropped.
func (p *Pool) giveBack(off, n uint64) {
	for o := off; o < off+n; o += p.pageSize {
		if p.pages[o] != nil {
			continue
		}
		if o < p.smallEnd {
			p.smallVA.add(o, p.pageSize)
		} else {
			p.unmapped.add(o, p.pageSize)
		}
	}
}

// oom is the error of a request that cannot be served.
func (p *Pool) oom(span uint64, why error) error {
	mapped := uint64(len(p.pages)) * p.pageSize
	return fmt.Errorf("%s needed: %s allocated in %d blocks, %s cached (%s of it pending frees, %s idle), %s free under the limit of %s (%v): %w",
		units.FormatSize(span), units.FormatSize(p.stats.Allocated), len(p.blocks), units.FormatSize(mapped-p.stats.Allocated),
		units.FormatSize(p.pendingBytes()), units.FormatSize(p.idleBytes()), units.FormatSize(p.opts.Limit-mapped),
		units.FormatSize(p.opts.Limit), why, driver.ErrOutOfMemory)
}

// Free returns b to the pool, ordered on stream s (nil: the legacy default stream): work queued on s
// before the call may still use the memory; requests on s may reuse it at once, requests on other
// streams once s has passed this point. Freeing a block twice (also through a copy of the Block, or
// a Block kept after its memory was handed out again), a block of another pool, or on a stream of
// another device fails with vmm.ErrInvalidValue and changes nothing. An error wrapping
// ErrReleaseFailed says the block was freed but the high-water release after it failed.
func (p *Pool) Free(b *Block, s *vmm.Stream) error {
	if p == nil || b == nil {
		return fmt.Errorf("pool: free: nil pool or block: %w", vmm.ErrInvalidValue)
	}
	if b.pool != p {
		return fmt.Errorf("pool: free %s: the block belongs to another pool: %w", b, vmm.ErrInvalidValue)
	}
	if err := p.checkStream(s); err != nil {
		return fmt.Errorf("pool: free %s %w", b, err)
	}
	p.own.Lock()
	defer p.own.Unlock()
	if err := p.usable("free"); err != nil {
		return err
	}
	lb, ok := p.blocks[b.off]
	if !ok || lb.id != b.id {
		return fmt.Errorf("pool: free %s: freed twice: it is not a live block of the pool: %w", b, vmm.ErrInvalidValue)
	}
	delete(p.blocks, b.off)
	st := p.stream(s)
	if b.small {
		st.small.add(b.off, lb.span)
	} else {
		st.large.add(b.off, lb.span)
	}
	p.inUseBytes -= lb.size
	p.stats.Frees++
	p.stats.Allocated -= lb.span
	if lb.tag != "" {
		if p.tags[lb.tag] -= lb.size; p.tags[lb.tag] == 0 {
			delete(p.tags, lb.tag)
		}
	}
	if err := p.highWater(); err != nil {
		return fmt.Errorf("pool: free %s: %w: %w", b, ErrReleaseFailed, err)
	}
	return nil
}

// checkStream refuses a stream of another device, and of another System (whose device may have the
// pool's ordinal); its error reads after the operation.
func (p *Pool) checkStream(s *vmm.Stream) error {
	switch {
	case s == nil:
		return nil
	case s.Device().System() != p.dev.System():
		return fmt.Errorf("on a stream of another System than the pool's: %w", vmm.ErrInvalidValue)
	case s.Device() != p.dev:
		return fmt.Errorf("on a stream of device %d: the pool is on device %d: %w", s.Device().Ordinal(), p.dev.Ordinal(), vmm.ErrInvalidValue)
	}
	return nil
}

// highWater applies the high-water mark after a free: when more than Options.HighWater bytes are
// cached, it records events for the frees (no waiting) and releases the idle pages above the mark.
// Below the mark a free makes no driver call.
func (p *Pool) highWater() error {
	mapped := uint64(len(p.pages)) * p.pageSize
	if mapped-p.stats.Allocated <= p.opts.HighWater {
		return nil
	}
	if err := p.drain(false); err != nil {
		return err
	}
	if p.idleBytes() > p.opts.HighWater {
		_, err := p.releaseIdle(p.opts.HighWater)
		return err
	}
	return nil
}

// idleBytes is the mapped memory no block uses and no free is pending on: what Trim can release.
func (p *Pool) idleBytes() uint64 { return p.cached.total + uint64(len(p.smallIdle))*p.pageSize }
