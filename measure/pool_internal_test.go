package measure

import "testing"

// The pool's latency percentiles interpolate between the nearest ranks, as median does: p50 of an
// even count is the mean of the two middle values (not the upper one), and p99 of 100 samples lies
// between the two largest (not the largest, which is p100).
func TestPoolPercentile(t *testing.T) {
	hundred := make([]int64, 100)
	for i := range hundred {
		hundred[i] = int64(100 - i) // 100 down to 1: unsorted
	}
	for _, c := range []struct {
		in   []int64
		q    float64
		want int64
	}{
		{nil, 0.5, 0},
		{[]int64{7}, 0.99, 7},
		{[]int64{3, 1, 2}, 0.5, 2},
		{[]int64{40, 10, 30, 20}, 0.5, 25},
		{[]int64{4, 1}, 0.5, 3}, // 2.5, rounded to a whole nanosecond
		{hundred, 0.5, 51},      // 50.5
		{hundred, 0.99, 99},     // 99.01
		{hundred, 1, 100},
		{hundred, 0, 1},
	} {
		if got := poolPercentile(c.in, c.q); got != c.want {
			t.Errorf("poolPercentile(%d values, %v) = %d, want %d", len(c.in), c.q, got, c.want)
		}
	}
}
