package pool

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/vmm"
)

// piece is one range of the large blocks' area that a fresh range may be cleared over: unmapped
// address space, or idle cached pages.
type piece struct {
	off, n uint64
	cached bool
}

func (x piece) end() uint64 { return x.off + x.n }

// cachedBytes is the piece's bytes of idle pages.
func (x piece) cachedBytes() uint64 {
	if x.cached {
		return x.n
	}
	return 0
}

// clearRange makes room for a large block of span bytes when no unmapped range is long enough:
// stitching and high-water releases turn freed ranges into unmapped address space around the idle
// pages they keep, which can cut the address space into pieces all shorter than a request that the
// idle pages and the limit could back. It picks the range made of unmapped address space and idle
// pages (never pages under a pending free) with the fewest idle pages, checks that the request can
// be backed, and unmaps those pages, so that the range is unmapped address space. It returns their
// allocations for mapRange to map again. Without stitching idle pages stay where they are: it fails.
// On failure the pages it unmapped are released.
func (p *Pool) clearRange(span uint64) ([]*vmm.Allocation, error) {
	noRange := fmt.Errorf("no free address range of %s in the reservation: %w", units.FormatSize(span), errNoMemory)
	if p.opts.NoStitch {
		return nil, noRange
	}
	ps := p.pieces()
	start, ok := bestWindow(ps, span)
	if !ok {
		return nil, noRange
	}
	if err := p.backable(span/p.pageSize, 0); err != nil {
		return nil, err
	}
	t0 := time.Now()
	defer p.driverTime(t0)
	var out []*vmm.Allocation
	end := start + span
	for i := range ps {
		if !ps[i].cached || ps[i].end() <= start || ps[i].off >= end {
			continue
		}
		off := max(ps[i].off, start)
		n := min(ps[i].end(), end) - off
		as, err := p.unmapPages(off, n/p.pageSize)
		if err != nil {
			_, rerr := p.release(out)
			return nil, errors.Join(fmt.Errorf("clear an address range of %s: unmap the idle pages in it: %w", units.FormatSize(span), err), rerr)
		}
		p.cached.take(p.cached.byStart[ps[i].off], off, n)
		p.unmapped.add(off, n)
		out = append(out, as...)
	}
	return out, nil
}

// pieces lists the unmapped and the idle cached ranges of the large blocks' area in address order.
func (p *Pool) pieces() []piece {
	out := make([]piece, 0, len(p.unmapped.byStart)+len(p.cached.byStart))
	for _, r := range p.unmapped.byStart {
		out = append(out, piece{off: r.off, n: r.n})
	}
	for _, r := range p.cached.byStart {
		out = append(out, piece{off: r.off, n: r.n, cached: true})
	}
	slices.SortFunc(out, func(a, b piece) int { return cmp.Compare(a.off, b.off) })
	return out
}

// bestWindow returns the start of the range of span bytes, made of adjacent pieces only, that
// covers the fewest cached bytes; false when there is none. A range's cost changes linearly with its
// start between the points where it starts or ends at a piece's edge, so the cheapest range starts
// at a piece's start or ends at a piece's end: those are the candidates tried.
func bestWindow(ps []piece, span uint64) (uint64, bool) {
	var best, bestCost uint64
	found := false
	try := func(start uint64) {
		if cost, ok := windowCost(ps, start, span); ok && (!found || cost < bestCost) {
			best, bestCost, found = start, cost, true
		}
	}
	for _, x := range ps {
		try(x.off)
		if x.end() >= span {
			try(x.end() - span)
		}
	}
	return best, found
}

// windowCost is the cached bytes that [start, start+span) covers, and whether adjacent pieces cover
// all of it.
func windowCost(ps []piece, start, span uint64) (uint64, bool) {
	i, _ := slices.BinarySearchFunc(ps, start, func(x piece, t uint64) int { return cmp.Compare(x.end(), t+1) })
	if i == len(ps) || ps[i].off > start {
		return 0, false
	}
	end, cost := start+span, uint64(0)
	for k := i; k < len(ps) && ps[k].off < end; k++ {
		if k > i && ps[k].off != ps[k-1].end() {
			return 0, false
		}
		if ps[k].cached {
			cost += min(ps[k].end(), end) - max(ps[k].off, start)
		}
		if ps[k].end() >= end {
			return cost, true
		}
	}
	return 0, false
}
