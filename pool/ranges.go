package pool

import "slices"

// run is one free range [off, off+n) of the reservation.
type run struct {
	off, n uint64
	idx    int // position in its set's bySize[n]
}

func (r *run) end() uint64 { return r.off + r.n }

// rangeSet is a set of disjoint free ranges that merges neighbours and answers best fit in O(log k)
// for k distinct sizes. barrier, when not 0, keeps ranges from merging across its multiples (the
// small pool's pages, so that a page that is wholly free is exactly one range).
type rangeSet struct {
	barrier uint64
	byStart map[uint64]*run
	byEnd   map[uint64]*run
	bySize  map[uint64][]*run
	sizes   []uint64 // the keys of bySize, sorted
	total   uint64
}

func newRangeSet(barrier uint64) *rangeSet {
	return &rangeSet{barrier: barrier, byStart: map[uint64]*run{}, byEnd: map[uint64]*run{}, bySize: map[uint64][]*run{}}
}

func (s *rangeSet) empty() bool { return s.total == 0 }

// crosses reports whether merging at boundary x would join two barrier-separated pieces.
func (s *rangeSet) crosses(x uint64) bool { return s.barrier != 0 && x%s.barrier == 0 }

// add inserts [off, off+n), which must not overlap the set, merging with its neighbours.
func (s *rangeSet) add(off, n uint64) {
	if n == 0 {
		return
	}
	if !s.crosses(off) {
		if l := s.byEnd[off]; l != nil {
			s.unlink(l)
			off, n = l.off, n+l.n
		}
	}
	if end := off + n; !s.crosses(end) {
		if r := s.byStart[end]; r != nil {
			s.unlink(r)
			n += r.n
		}
	}
	s.link(&run{off: off, n: n})
}

func (s *rangeSet) link(r *run) {
	s.byStart[r.off] = r
	s.byEnd[r.end()] = r
	list := s.bySize[r.n]
	if len(list) == 0 {
		i, _ := slices.BinarySearch(s.sizes, r.n)
		s.sizes = slices.Insert(s.sizes, i, r.n)
	}
	r.idx = len(list)
	s.bySize[r.n] = append(list, r)
	s.total += r.n
}

func (s *rangeSet) unlink(r *run) {
	delete(s.byStart, r.off)
	delete(s.byEnd, r.end())
	list := s.bySize[r.n]
	last := list[len(list)-1]
	list[r.idx], last.idx = last, r.idx
	list = list[:len(list)-1]
	if len(list) == 0 {
		delete(s.bySize, r.n)
		if i, ok := slices.BinarySearch(s.sizes, r.n); ok {
			s.sizes = slices.Delete(s.sizes, i, i+1)
		}
	} else {
		s.bySize[r.n] = list
	}
	s.total -= r.n
}

// bestFit is the smallest range of at least n bytes, or nil.
func (s *rangeSet) bestFit(n uint64) *run {
	i, _ := slices.BinarySearch(s.sizes, n)
	if i == len(s.sizes) {
		return nil
	}
	list := s.bySize[s.sizes[i]]
	return list[len(list)-1]
}

// largest is the largest range, or nil.
func (s *rangeSet) largest() *run {
	if len(s.sizes) == 0 {
		return nil
	}
	list := s.bySize[s.sizes[len(s.sizes)-1]]
	return list[len(list)-1]
}

// take removes [off, off+n) from the range r of the set (it must lie within r), keeping the rest.
func (s *rangeSet) take(r *run, off, n uint64) {
	s.unlink(r)
	if off > r.off {
		s.link(&run{off: r.off, n: off - r.off})
	}
	if end := off + n; end < r.end() {
		s.link(&run{off: end, n: r.end() - end})
	}
}

// each calls fn for every range, smallest first, until fn returns false. fn must not change s.
func (s *rangeSet) each(fn func(r *run) bool) {
	for _, n := range s.sizes {
		for _, r := range s.bySize[n] {
			if !fn(r) {
				return
			}
		}
	}
}

// runs lists the ranges, smallest first (a copy, safe to use while changing s).
func (s *rangeSet) runs() []run {
	out := make([]run, 0, len(s.byStart))
	s.each(func(r *run) bool { out = append(out, *r); return true })
	return out
}
