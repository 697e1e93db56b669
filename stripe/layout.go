package stripe

import (
	"fmt"

	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/vmm"
)

// Layout says which device holds which bytes of a Range: Blocked or Interleaved.
type Layout interface {
	fmt.Stringer
	// plan splits size bytes (a multiple of gran) among holders devices, in offset order.
	plan(size uint64, holders int, gran uint64) ([]piece, error)
}

// piece is one allocation of the range: [off, off+size) held by holder (an index into the devices).
type piece struct {
	off, size uint64
	holder    int
}

// Blocked gives each device one contiguous slab, in list order, as the driver's multi-device sample
// (multiDeviceAlloc) does: device 0 holds the first slab, device 1 the next, and so on.
//
// The size is cut in granules (the granularity, see New) and shared as evenly as whole granules
// allow: with U granules over n devices, the first U mod n devices hold ceil(U/n) granules and the
// others floor(U/n). So slabs are multiples of the granularity, differ by at most one granule, and the
// last device holds as much as the first or one granule less. When the range has fewer granules than
// there are devices, the last devices hold nothing (they still get access to the range).
type Blocked struct{}

// nilLayout reports a layout that is nil, also as a nil *Blocked or *Interleaved, whose methods
// would dereference it.
func nilLayout(l Layout) bool {
	switch v := l.(type) {
	case nil:
		return true
	case *Blocked:
		return v == nil
	case *Interleaved:
		return v == nil
	}
	return false
}

func (Blocked) String() string { return "blocked" }

func (Blocked) plan(size uint64, holders int, gran uint64) ([]piece, error) {
	n := uint64(holders)
	u := size / gran
	base, extra := u/n, u%n
	out := make([]piece, 0, holders)
	var off uint64
	for i := uint64(0); i < n; i++ {
		k := base
		if i < extra {
			k++
		}
		if k == 0 {
			continue
		}
		out = append(out, piece{off: off, size: k * gran, holder: int(i)})
		off += k * gran
	}
	return out, nil
}

// Interleaved deals stripes of Stripe bytes round-robin: stripe k, at offset k*Stripe, is held by
// device k mod n. Stripe must be a non-zero multiple of the granularity (see New). The size is
// rounded to the granularity, not to the stripe, so the last stripe may be shorter than Stripe
// (a multiple of the granularity all the same).
type Interleaved struct {
	// Stripe is the stripe size in bytes.
	Stripe uint64
}

func (l Interleaved) String() string {
	return fmt.Sprintf("interleaved in %s stripes", units.FormatSize(l.Stripe))
}

func (l Interleaved) check(gran uint64) error {
	if l.Stripe == 0 || l.Stripe%gran != 0 {
		return fmt.Errorf("stripe: stripe size %d (%s) is not a non-zero multiple of the granularity %s: %w",
			l.Stripe, units.FormatSize(l.Stripe), units.FormatSize(gran), vmm.ErrInvalidValue)
	}
	return nil
}

func (l Interleaved) plan(size uint64, holders int, gran uint64) ([]piece, error) {
	if err := l.check(gran); err != nil {
		return nil, err
	}
	count := size / l.Stripe
	if size%l.Stripe != 0 {
		count++
	}
	out := make([]piece, 0, count)
	for k := uint64(0); k < count; k++ {
		off := k * l.Stripe
		out = append(out, piece{off: off, size: min(l.Stripe, size-off), holder: int(k % uint64(holders))})
	}
	return out, nil
}
