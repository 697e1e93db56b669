package pool

import (
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
)

// bestWindow picks, among ranges of adjacent pieces long enough, the one covering the fewest cached
// bytes.
func TestBestWindowCoversTheFewestCachedBytes(t *testing.T) {
	u := func(off, n uint64) piece { return piece{off: off, n: n} }
	c := func(off, n uint64) piece { return piece{off: off, n: n, cached: true} }
	for _, tc := range []struct {
		name string
		ps   []piece
		span uint64
		want int // the range's start; -1: none
	}{
		{"nothing", nil, 4, -1},
		{"too short", []piece{u(0, 2), c(2, 1)}, 4, -1},
		{"a gap breaks the range", []piece{u(0, 2), u(3, 2)}, 4, -1},
		{"one cached piece is enough", []piece{c(0, 8)}, 4, 0},
		{"exact fit", []piece{u(0, 2), c(2, 2)}, 4, 0},
		{"ends inside an unmapped piece", []piece{c(0, 1), u(1, 3), c(4, 5), u(9, 3)}, 4, 0},
		{"skips the costly start", []piece{c(0, 3), u(3, 3), c(6, 1), u(7, 2)}, 6, 3},
		{"after a gap", []piece{c(0, 4), u(5, 3), c(8, 1)}, 4, 5},
		{"the later range is cheaper", []piece{u(0, 1), c(1, 3), u(10, 3), c(13, 1)}, 4, 10},
		{"ends at an unmapped piece's end", []piece{u(6, 1), c(7, 5), u(12, 5)}, 9, 8},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := bestWindow(tc.ps, tc.span)
			if tc.want < 0 {
				require.False(t, ok)
				return
			}
			require.True(t, ok)
			require.Equal(t, uint64(tc.want), got)
		})
	}
}

// bestWindow finds a range as cheap as the cheapest of all starts, on random pieces.
func TestBestWindowIsTheCheapestOfAllStarts(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for range 2000 {
		var ps []piece
		off := uint64(rng.IntN(3))
		for range 1 + rng.IntN(8) {
			n := uint64(1 + rng.IntN(6))
			ps = append(ps, piece{off: off, n: n, cached: rng.IntN(2) == 0})
			off += n + uint64(rng.IntN(3)/2) // a gap now and then
		}
		span := uint64(1 + rng.IntN(12))
		want, any := uint64(0), false
		for start := uint64(0); start <= off; start++ {
			if c, ok := naiveCost(ps, start, span); ok && (!any || c < want) {
				want, any = c, true
			}
		}
		got, ok := bestWindow(ps, span)
		require.Equal(t, any, ok, "%v span %d", ps, span)
		if ok {
			c, covered := naiveCost(ps, got, span)
			require.True(t, covered)
			require.Equal(t, want, c, "%v span %d: start %d", ps, span, got)
		}
	}
}

// naiveCost is windowCost byte by byte: every byte of the range must lie in a piece.
func naiveCost(ps []piece, start, span uint64) (uint64, bool) {
	var cost uint64
	for x := start; x < start+span; x++ {
		i := slices.IndexFunc(ps, func(p piece) bool { return p.off <= x && x < p.end() })
		if i < 0 {
			return 0, false
		}
		if ps[i].cached {
			cost++
		}
	}
	return cost, true
}
