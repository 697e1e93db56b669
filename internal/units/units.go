// Package units parses and formats byte sizes ("256MiB", "16GiB", "1.5 GiB") for the command and
// error messages.
package units

import (
	"errors"
	"fmt"
	"math"
	"math/bits"
	"strconv"
	"strings"
)

// Binary size units.
const (
	KiB uint64 = 1 << 10
	MiB uint64 = 1 << 20
	GiB uint64 = 1 << 30
	TiB uint64 = 1 << 40
)

// ErrBadSize is wrapped by every ParseSize error.
var ErrBadSize = errors.New("bad size")

var suffixes = []struct {
	s string
	m uint64
}{
	{"kib", KiB}, {"mib", MiB}, {"gib", GiB}, {"tib", TiB},
	{"kb", 1000}, {"mb", 1000 * 1000}, {"gb", 1000 * 1000 * 1000}, {"tb", 1000 * 1000 * 1000 * 1000},
	{"k", KiB}, {"m", MiB}, {"g", GiB}, {"t", TiB},
	{"b", 1},
}

// ParseSize reads a size such as "4096", "64KiB", "256MiB", "1.5GiB" or "16G" (single letters are
// binary units). Fractions must come to a whole number of bytes.
func ParseSize(s string) (uint64, error) {
	in := strings.TrimSpace(s)
	low := strings.ToLower(in)
	mult := uint64(1)
	for _, suf := range suffixes {
		if strings.HasSuffix(low, suf.s) {
			mult = suf.m
			low = strings.TrimSpace(strings.TrimSuffix(low, suf.s))
			break
		}
	}
	if low == "" {
		return 0, fmt.Errorf("size %q: no number: %w", s, ErrBadSize)
	}
	if n, err := strconv.ParseUint(low, 10, 64); err == nil {
		hi, v := bits.Mul64(n, mult)
		if hi != 0 {
			return 0, fmt.Errorf("size %q overflows 64 bits: %w", s, ErrBadSize)
		}
		return v, nil
	}
	f, err := strconv.ParseFloat(low, 64)
	if err != nil || f < 0 || math.IsNaN(f) || math.IsInf(f, 0) {
		if unit, ok := unknownUnit(in); ok {
			return 0, fmt.Errorf("size %q: unknown unit %q (want %s): %w", s, unit, unitNames, ErrBadSize)
		}
		return 0, fmt.Errorf("size %q: not a non-negative number: %w", s, ErrBadSize)
	}
	v := f * float64(mult)
	if v >= math.Ldexp(1, 64) {
		return 0, fmt.Errorf("size %q overflows 64 bits: %w", s, ErrBadSize)
	}
	if v != math.Trunc(v) {
		return 0, fmt.Errorf("size %q is not a whole number of bytes: %w", s, ErrBadSize)
	}
	return uint64(v), nil
}

// unitNames lists the units ParseSize reads, for its errors.
const unitNames = "B, KiB, MiB, GiB, TiB, KB, MB, GB, TB, or K, M, G, T for the binary units"

// unknownUnit returns the unit of a size whose number reads but whose unit is not one that
// ParseSize knows ("1EiB": "EiB"); ok is false when the size does not have that shape.
func unknownUnit(in string) (unit string, ok bool) {
	i := strings.IndexFunc(in, func(r rune) bool { return (r < '0' || r > '9') && r != '.' })
	if i <= 0 {
		return "", false
	}
	if _, err := strconv.ParseFloat(in[:i], 64); err != nil {
		return "", false
	}
	unit = strings.TrimSpace(in[i:])
	return unit, unit != ""
}

// FormatSize writes n in the largest binary unit it reaches: whole when exact ("2 MiB", "16 GiB"),
// else with two decimals ("1.50 MiB", "139.80 GiB").
func FormatSize(n uint64) string {
	units := []struct {
		s string
		m uint64
	}{{"TiB", TiB}, {"GiB", GiB}, {"MiB", MiB}, {"KiB", KiB}}
	for _, u := range units {
		if n >= u.m {
			if n%u.m == 0 {
				return fmt.Sprintf("%d %s", n/u.m, u.s)
			}
			return fmt.Sprintf("%.2f %s", float64(n)/float64(u.m), u.s)
		}
	}
	return fmt.Sprintf("%d B", n)
}

// RoundUp rounds n up to a multiple of g (g > 0). ok is false when the result would overflow.
func RoundUp(n, g uint64) (r uint64, ok bool) {
	if g == 0 {
		return n, true
	}
	rem := n % g
	if rem == 0 {
		return n, true
	}
	r = n + (g - rem)
	if r < n {
		return 0, false
	}
	return r, true
}
