package ncclsim

import (
	"math"
	"sort"
)

// float8 is one of NCCL's 8-bit float formats: a sign bit, exp exponent bits with bias, man
// mantissa bits. e4m3 has no infinity (S.1111.111 is NaN, 448 the largest value); e5m2 is IEEE-like
// (S.11111.00 is infinity, the largest value 57344).
type float8 struct {
	man    uint
	bias   int
	inf    bool // the all-ones exponent holds infinity and NaNs (e5m2), not numbers (e4m3)
	maxFin uint8
	values [128]float64 // the magnitudes of codes 0..127, increasing up to maxFin
}

var e4m3, e5m2 = newFloat8(3, 7, false, 0x7e), newFloat8(2, 15, true, 0x7b)

func newFloat8(man uint, bias int, inf bool, maxFin uint8) *float8 {
	f := &float8{man: man, bias: bias, inf: inf, maxFin: maxFin}
	for c := range f.values {
		f.values[c] = f.magnitude(uint8(c))
	}
	return f
}

// magnitude is the value of a code without its sign bit, for codes up to maxFin.
func (f *float8) magnitude(c uint8) float64 {
	e, m := int(c>>f.man), float64(c&(1<<f.man-1))
	if e == 0 { // subnormal
		return math.Ldexp(m, 1-f.bias-int(f.man))
	}
	return math.Ldexp(1+m/float64(int(1)<<f.man), e-f.bias)
}

func (f *float8) format() narrow {
	return narrow{1, func(h uint16) float32 { return f.to32(uint8(h)) }, func(v float32) uint16 { return uint16(f.from32(v)) }}
}

func (f *float8) to32(c uint8) float32 {
	sign, mag := float32(1), c&0x7f
	if c&0x80 != 0 {
		sign = -1
	}
	switch {
	case mag <= f.maxFin:
		return sign * float32(f.values[mag])
	case f.inf && mag == f.maxFin+1:
		return sign * float32(math.Inf(1))
	}
	return float32(math.NaN())
}

// from32 rounds v to the nearest code, ties to an even mantissa, and saturates what is beyond the
// largest finite value (infinities included) to it, as CUDA's conversion with __NV_SATFINITE does.
func (f *float8) from32(v float32) uint8 {
	var sign uint8
	if math.Signbit(float64(v)) {
		sign = 0x80
	}
	a := math.Abs(float64(v))
	switch {
	case a != a:
		return sign | 0x7f
	case a >= f.values[f.maxFin]:
		return sign | f.maxFin
	}
	// c is the largest code whose magnitude is at most a; a lies below c+1's.
	c := sort.Search(int(f.maxFin)+1, func(i int) bool { return f.values[i] > a }) - 1
	lo, hi := a-f.values[c], f.values[c+1]-a
	if hi < lo || (hi == lo && c&1 == 1) {
		c++
	}
	return sign | uint8(c)
}
