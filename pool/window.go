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
	i, ok := bestWindow(ps, span)
	if !ok {
		return nil, noRange
	}
	if err := p.backable(span/p.pageSize, 0); err != nil {
		return nil, err
	}
	t0 := time.Now()
	defer p.driverTime(t0)
	var out []*vmm.Allocation
	for end := ps[i].off + span; i < len(ps) && ps[i].off < end; i++ {
		if !ps[i].cached {
			continue
		}
		off, n := ps[i].off, min(ps[i].end(), end)-ps[i].off
		as, err := p.unmapPages(off, n/p.pageSize)
		if err != nil {
			_, rerr := p.release(out)
			return nil, errors.Join(fmt.Errorf("clear an address range of %s: unmap the idle pages in it: %w", units.FormatSize(span), err), rerr)
		}
		p.cached.take(p.cached.byStart[off], off, n)
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

// bestWindow returns the index of the piece at whose start a range of span bytes, made of adjacent
// pieces only, covers the fewest cached bytes; false when there is no such range. One pass: ps[i:j]
// are the adjacent pieces that end within the range starting at ps[i], full their cached bytes.
func bestWindow(ps []piece, span uint64) (int, bool) {
	best, bestCached := -1, uint64(0)
	j, full := 0, uint64(0)
	adjacent := func(k, i int) bool { return k == i || ps[k-1].end() == ps[k].off }
	for i := range ps {
		if j <= i {
			j, full = i, 0
		}
		end := ps[i].off + span
		for j < len(ps) && ps[j].end() <= end && adjacent(j, i) {
			full += ps[j].cachedBytes()
			j++
		}
		c, fits := full, j > i && ps[j-1].end() == end
		if !fits && j < len(ps) && adjacent(j, i) { // the range ends inside ps[j]
			fits = true
			if ps[j].cached {
				c += end - ps[j].off
			}
		}
		if fits && (best < 0 || c < bestCached) {
			best, bestCached = i, c
		}
		if j > i {
			full -= ps[i].cachedBytes()
		}
	}
	return best, best >= 0
}
