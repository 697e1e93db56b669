package vmm

import (
	"fmt"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/units"
)

// RoundUp rounds size up to a multiple of g: the one place sizes are rounded (decision 6 of the
// design), used by every package of the module. Size 0, g 0 and a size that overflows when rounded
// are errors wrapping ErrInvalidValue; what names the operation (with its package prefix) in them.
func RoundUp(what string, size, g uint64) (uint64, error) {
	if size == 0 {
		return 0, fmt.Errorf("%s: size 0: %w", what, ErrInvalidValue)
	}
	if g == 0 {
		return 0, fmt.Errorf("%s: granularity 0: %w", what, ErrInvalidValue)
	}
	r, ok := units.RoundUp(size, g)
	if !ok {
		return 0, fmt.Errorf("%s: size %d overflows when rounded to the granularity %s: %w", what, size, units.FormatSize(g), ErrInvalidValue)
	}
	return r, nil
}

// roundUp is RoundUp with this package's prefix.
func roundUp(what string, size, g uint64) (uint64, error) { return RoundUp("vmm: "+what, size, g) }

// lcm is the least common multiple of a and b (both non-zero).
func lcm(a, b uint64) uint64 {
	x, y := a, b
	for y != 0 {
		x, y = y, x%y
	}
	return a / x * b
}

// CommonGranularity is the granularity of memory at loc that every device of devs uses, mapped
// into this System's reservations: the least common multiple of each device's minimum granularity
// for loc (the zero Location: each device's own memory) and of the reservation granularity
// (System.Granularity). A chunk size that is a multiple of it can be allocated through any of the
// devices and mapped at any offset that is a multiple of it. Granularities are powers of two on
// every known GPU, where the least common multiple is the largest; the least common multiple is what
// is right for any values. devs must not be empty and must belong to s.
func (s *System) CommonGranularity(loc driver.Location, devs ...*Device) (uint64, error) {
	if len(devs) == 0 {
		return 0, fmt.Errorf("vmm: common granularity for %s: no devices: %w", loc, ErrInvalidValue)
	}
	g, err := s.Granularity()
	if err != nil {
		return 0, err
	}
	for i, d := range devs {
		if d == nil || d.sys != s {
			return 0, fmt.Errorf("vmm: common granularity for %s: device %d of the list is nil or of another System: %w", loc, i, ErrInvalidValue)
		}
		l := loc
		if l.Type == driver.LocationInvalid {
			l = d.Location()
		}
		dg, err := d.Granularity(l, driver.GranularityMinimum)
		if err != nil {
			return 0, err
		}
		g = lcm(g, dg)
	}
	return g, nil
}
