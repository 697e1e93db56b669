package measure

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// TestRawPartKeepsDevicesApart: each device's raw copies use a part of the region of their own
// where the region holds a copy for each, and never run past the region's end.
func TestRawPartKeepsDevicesApart(t *testing.T) {
	const s = 1 << 20
	cases := []struct {
		name      string
		regionLen uint64
		n         int
		want      []hostRange
	}{
		{"equal shares of whole copies", 8 * s, 2, []hostRange{{0, 4 * s}, {4 * s, 4 * s}}},
		{"a share rounded down to whole copies", 5*s + 100, 2, []hostRange{{0, 2 * s}, {2 * s, 2 * s}}},
		{"one copy each, no room for more", 2*s + 100, 2, []hostRange{{0, s}, {s, s}}},
		{"fewer copies than devices: one copy's bytes each, wrapping", s + s/2, 2, []hostRange{{0, s}, {0, s}}},
		{"three devices on two copies", 2 * s, 3, []hostRange{{0, s}, {s, s}, {0, s}}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			for i, want := range c.want {
				got := rawPart(c.regionLen, c.n, i, s)
				require.Equal(t, want, got, "device %d", i)
				require.LessOrEqual(t, got.off+got.n, c.regionLen, "device %d's part ends past the region", i)
			}
		})
	}
}

// An even count's median is the mean of the two middle values (RTTUS over 2 or 4 workers, and the
// default 200 samples per worker), not the upper one.
func TestBrokerMedianEvenCount(t *testing.T) {
	for _, c := range []struct {
		in   []float64
		want float64
	}{
		{nil, 0},
		{[]float64{5}, 5},
		{[]float64{3, 1, 2}, 2},
		{[]float64{26.51, 24.365, 26.551, 26.121}, (26.121 + 26.51) / 2},
		{[]float64{4, 1}, 2.5},
	} {
		if got := median(c.in); got != c.want {
			t.Errorf("median(%v) = %v, want %v", c.in, got, c.want)
		}
	}
}
