package pool

import (
	"maps"
	"time"
)

// Stats is a snapshot of a pool's accounting. Byte counts are of the pool's device memory.
type Stats struct {
	Limit         uint64 // the most the pool maps
	Allocated     uint64 // bytes in live blocks (each block's Span)
	InUse         uint64 // bytes asked for by live blocks (each block's Size)
	Cached        uint64 // mapped bytes no live block uses: free, or freed on a stream not yet passed
	Pending       uint64 // of Cached, frees some stream has not yet passed
	Mapped        uint64 // physical memory mapped into the pool now
	PeakMapped    uint64 // the most Mapped has been
	PeakAllocated uint64 // the most Allocated has been
	PeakInUse     uint64 // the most InUse has been
	// LargestFree is the largest request served without a driver call from a contiguous mapped range
	// free for every stream: the largest range of the large blocks' cache (when above SmallSize,
	// which only it serves), or of the small pages' free ranges, up to SmallSize.
	LargestFree uint64
	// Fragmentation is 1 - LargestFree / (free bytes ready for every stream), 0 when none is free: how
	// scattered the cache is. Stitching makes it harmless.
	Fragmentation float64
	Blocks        int    // live blocks
	Allocs        uint64 // successful Alloc calls
	Frees         uint64 // successful Free calls
	// Failures counts Alloc calls that failed after their arguments were accepted: for lack of memory
	// (errors wrapping driver.ErrOutOfMemory) or because a driver call failed.
	Failures uint64
	// Borrows counts requests served from another stream's free that had not completed, by making
	// the requesting stream wait for its event (cuStreamWaitEvent) instead of mapping more memory.
	Borrows       uint64
	Stitches      uint64 // requests served by remapping idle pages into a fresh range (not failed ones)
	StitchedBytes uint64 // bytes of pages remapped by stitching
	NewPages      uint64 // pages created (cuMemCreate)
	Trims         uint64 // releases of idle pages (Trim, the high-water mark, Close)
	TrimmedBytes  uint64 // bytes unmapped and released by them
	// DriverTime is the time spent in driver calls (mapping, unmapping, events).
	DriverTime time.Duration
	// Tags sums Size of the live blocks per tag given to AllocTag.
	Tags map[string]uint64
}

// Stats returns the pool's statistics now.
func (p *Pool) Stats() Stats {
	if p == nil {
		return Stats{}
	}
	p.own.Lock()
	defer p.own.Unlock()
	s := p.stats
	s.Mapped = uint64(len(p.pages)) * p.pageSize
	s.InUse = p.inUseBytes
	if s.Mapped > s.Allocated { // asleep, blocks keep their bytes but nothing is mapped
		s.Cached = s.Mapped - s.Allocated
	}
	s.Pending = p.pendingBytes()
	s.Blocks = len(p.blocks)
	s.LargestFree, s.Fragmentation = p.freeShape()
	s.Tags = maps.Clone(p.tags)
	return s
}

// freeShape is the largest mapped range free for every stream and the fragmentation of such ranges.
// Asleep, nothing is mapped, so nothing is free: the free parts of the small pages under live blocks
// have no memory until Wake.
func (p *Pool) freeShape() (largest uint64, fragmentation float64) {
	if p.asleep {
		return 0, 0
	}
	// The large blocks' cache serves only requests above SmallSize, the small pages' free ranges
	// only requests up to it.
	if r := p.cached.largest(); r != nil && r.n > p.opts.SmallSize {
		largest = r.n
	}
	if r := p.smallFree.largest(); r != nil {
		largest = max(largest, min(r.n, p.opts.SmallSize))
	}
	if ready := p.cached.total + p.smallFree.total; ready > 0 {
		fragmentation = 1 - float64(largest)/float64(ready)
	}
	return largest, fragmentation
}
