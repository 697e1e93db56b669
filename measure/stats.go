package measure

import "slices"

// percentile is the q-quantile (0 <= q <= 1) of xs, interpolated linearly between the two nearest
// ranks of the sorted values (R's type 7, numpy's default): q = 0 is the smallest value, q = 1 the
// largest, and q = 0.5 the median, the mean of the two middle values for an even count. Without
// values it is 0. The package's medians are this function too, so a p50 and a median agree.
func percentile[T int64 | float64](xs []T, q float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	pos := q * float64(len(s)-1)
	lo := int(pos)
	frac := pos - float64(lo)
	if frac == 0 || lo+1 >= len(s) {
		return float64(s[min(lo, len(s)-1)])
	}
	// Weighted, not s[lo] + frac*(s[lo+1]-s[lo]): for frac 0.5 this is exactly (s[lo]+s[lo+1])/2.
	return float64(s[lo])*(1-frac) + float64(s[lo+1])*frac
}

// median is the middle of xs: the mean of the two middle values for an even count, 0 for none.
func median(xs []float64) float64 { return percentile(xs, 0.5) }
