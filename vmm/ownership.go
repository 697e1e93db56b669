package vmm

import "fmt"

// TransferOwnership moves the ownership of an allocation from one of its mappings to another: src must
// own its allocation (it was made by MapNew, or received ownership here) and dst must be a live
// mapping of the same allocation that does not own it (Reservation.MapAccess of src.Allocation()).
// Afterwards closing or unmapping src only unmaps it, and closing or unmapping dst also releases the
// allocation. No driver call is made.
//
// growbuf uses it to move a buffer's chunks to a larger reservation without copying: map every
// allocation again in the new range, transfer ownership, unmap the old range. The caller must not use
// src and dst concurrently with this call.
func TransferOwnership(dst, src *Mapping) error {
	if dst == nil || src == nil {
		return fmt.Errorf("vmm: transfer ownership: nil mapping: %w", ErrInvalidValue)
	}
	if dst == src {
		return nil
	}
	if dst.alloc != src.alloc {
		return fmt.Errorf("vmm: transfer ownership from %s to %s: they map different allocations: %w", src, dst, ErrInvalidValue)
	}
	// Check both first, so that a refusal changes nothing. Each mapping's ownsAlloc is guarded by its
	// reservation's mutex (forget reads it there); the two are taken one after the other, never
	// nested, so that no lock order between reservations is needed.
	if err := ownershipCheck(src, true); err != nil {
		return err
	}
	if err := ownershipCheck(dst, false); err != nil {
		return err
	}
	src.res.own.Lock()
	src.ownsAlloc = false
	src.res.own.Unlock()
	dst.res.own.Lock()
	dst.ownsAlloc = true
	dst.res.own.Unlock()
	return nil
}

func ownershipCheck(m *Mapping, wantOwner bool) error {
	m.res.own.Lock()
	defer m.res.own.Unlock()
	if m.gone() {
		return fmt.Errorf("vmm: transfer ownership: %s: %w", m, ErrClosed)
	}
	if m.ownsAlloc != wantOwner {
		if wantOwner {
			return fmt.Errorf("vmm: transfer ownership from %s: it does not own its allocation: %w", m, ErrInvalidValue)
		}
		return fmt.Errorf("vmm: transfer ownership to %s: it already owns its allocation: %w", m, ErrInvalidValue)
	}
	return nil
}

// OwnsAllocation reports whether closing the mapping also releases its allocation (MapNew, or
// ownership received with TransferOwnership).
func (m *Mapping) OwnsAllocation() bool {
	m.res.own.Lock()
	defer m.res.own.Unlock()
	return m.ownsAlloc
}
