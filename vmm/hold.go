package vmm

import (
	"fmt"
	"sync"
)

// holdCount counts an allocation's holders outside this package (an NCCL registration of the
// memory, for example) that need the allocation to stay mapped, and the unmaps of its mappings in
// progress, which refuse new holders until they end.
type holdCount struct {
	mu        sync.Mutex
	n         int
	by        string
	unmapping int
	remapping bool // ReleaseAt or RecreateAt is unmapping or mapping the allocation at its mapping
}

// Hold marks the allocation as used by something outside vmm (by names it, for example "an NCCL
// registration") until the returned release is called: until then, closing the allocation or any
// mapping of it, or releasing it to sleep (ReleaseAt), fails with an error wrapping ErrInUse, so the
// memory cannot vanish under the holder. Hold refuses an allocation that has no memory to hold: a
// closed one with ErrClosed, one asleep with ErrAsleep. While a mapping of it is being unmapped
// (Mapping.Close, Reservation.UnmapRange), Hold fails at once with an error wrapping ErrInUse: retry
// once the unmap ends (then the allocation may be closed, if the mapping owned it). On failure release
// is nil. Holds nest; release is idempotent.
func (a *Allocation) Hold(by string) (release func(), err error) {
	if err := a.check("hold for " + by); err != nil {
		return nil, err
	}
	// Under the allocation's lock, which Close and ReleaseAt hold while they check for holds: the
	// allocation is either refused here or held before they look. The unmap of a mapping runs under
	// its reservation's lock instead, and marks itself in h (beginUnmap).
	a.own.Lock()
	defer a.own.Unlock()
	if err := a.usable("hold for " + by); err != nil {
		return nil, err
	}
	h := &a.hold
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.unmapping > 0 {
		return nil, fmt.Errorf("vmm: hold %s for %s: a mapping of it is being unmapped; retry: %w", a, by, ErrInUse)
	}
	h.n++
	h.by = by
	var once sync.Once
	return func() {
		once.Do(func() {
			h.mu.Lock()
			h.n--
			h.mu.Unlock()
		})
	}, nil
}

// checkHeld fails when a is held.
func (a *Allocation) checkHeld(op string) error {
	h := &a.hold
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.heldError(op, a)
}

// heldError fails when a (whose holdCount h is) is held; the caller holds h.mu.
func (h *holdCount) heldError(op string, a *Allocation) error {
	if h.n > 0 {
		return fmt.Errorf("vmm: %s: %s is still held by %s (%d holds): %w", op, a, h.by, h.n, ErrInUse)
	}
	return nil
}

// beginUnmap fails when a is held, and otherwise makes Hold refuse a until endUnmap: the check for
// holds and the unmap that follows it are then one step as Hold sees them.
func (a *Allocation) beginUnmap(op string) error {
	h := &a.hold
	h.mu.Lock()
	defer h.mu.Unlock()
	if err := h.heldError(op, a); err != nil {
		return err
	}
	if h.remapping {
		return fmt.Errorf("vmm: %s: %s is being released or recreated at its mapping; retry: %w", op, a, ErrInUse)
	}
	h.unmapping++
	return nil
}

// beginRemap fails while a mapping of a is being unmapped (beginUnmap), and otherwise makes the unmap
// of a's mappings refuse until the returned end: ReleaseAt and RecreateAt, which unmap and map a at
// its mapping under a's lock, and an unmap of that mapping, under its reservation's, never run at
// once (a recreate after the unmap, before the mapping is forgotten, would map memory that no
// Mapping owns).
func (a *Allocation) beginRemap(op string) (end func(), err error) {
	h := &a.hold
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.unmapping > 0 {
		return nil, fmt.Errorf("vmm: %s: a mapping of %s is being unmapped; retry: %w", op, a, ErrInUse)
	}
	h.remapping = true
	return func() {
		h.mu.Lock()
		h.remapping = false
		h.mu.Unlock()
	}, nil
}

// endUnmap ends what beginUnmap began, whether the unmap succeeded or not.
func (a *Allocation) endUnmap() {
	h := &a.hold
	h.mu.Lock()
	h.unmapping--
	h.mu.Unlock()
}

// beginUnmaps is beginUnmap for the allocations of ms (an allocation mapped twice counts twice): all
// or none. The caller calls end once the unmap and what follows it are done.
func beginUnmaps(ms []*Mapping) (end func(), err error) {
	var begun []*Allocation
	end = func() {
		for _, a := range begun {
			a.endUnmap()
		}
	}
	for _, m := range ms {
		if err := m.alloc.beginUnmap("unmap " + m.String()); err != nil {
			end()
			return nil, err
		}
		begun = append(begun, m.alloc)
	}
	return end, nil
}
