package pool

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// bestWindow picks, among ranges of adjacent pieces long enough, the one covering the fewest cached
// bytes, starting at a piece.
func TestBestWindowCoversTheFewestCachedBytes(t *testing.T) {
	u := func(off, n uint64) piece { return piece{off: off, n: n} }
	c := func(off, n uint64) piece { return piece{off: off, n: n, cached: true} }
	for _, tc := range []struct {
		name string
		ps   []piece
		span uint64
		want int // -1: none
	}{
		{"nothing", nil, 4, -1},
		{"too short", []piece{u(0, 2), c(2, 1)}, 4, -1},
		{"a gap breaks the range", []piece{u(0, 2), u(3, 2)}, 4, -1},
		{"one cached piece is enough", []piece{c(0, 8)}, 4, 0},
		{"exact fit", []piece{u(0, 2), c(2, 2)}, 4, 0},
		{"ends inside an unmapped piece", []piece{c(0, 1), u(1, 3), c(4, 5), u(9, 3)}, 4, 0},
		{"skips the costly start", []piece{c(0, 3), u(3, 3), c(6, 1), u(7, 2)}, 6, 1},
		{"after a gap", []piece{c(0, 4), u(5, 3), c(8, 1)}, 4, 1},
		{"the later range is cheaper", []piece{u(0, 1), c(1, 3), u(10, 3), c(13, 1)}, 4, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := bestWindow(tc.ps, tc.span)
			if tc.want < 0 {
				require.False(t, ok)
				return
			}
			require.True(t, ok)
			require.Equal(t, tc.want, got)
		})
	}
}
