package vmm

import (
	"fmt"
	"sync"
)

// holdCount counts an allocation's holders outside this package (an NCCL registration of the
// memory, for example) that need the allocation to stay mapped.
type holdCount struct {
	mu sync.Mutex
	n  int
	by string
}

// Hold marks the allocation as used by something outside vmm (by names it, for example "an NCCL
// registration") until the returned release is called: until then, closing the allocation or any
// mapping of it, or releasing it to sleep (ReleaseAt), fails with an error wrapping ErrInUse, so the
// memory cannot vanish under the holder. Hold refuses an allocation that has no memory to hold: a
// closed one with ErrClosed, one asleep with ErrAsleep; release is then nil. Holds nest; release is
// idempotent.
func (a *Allocation) Hold(by string) (release func(), err error) {
	if err := a.check("hold for " + by); err != nil {
		return nil, err
	}
	// Under the allocation's lock, which Close and ReleaseAt hold while they check for holds: the
	// allocation is either refused here or held before they look.
	a.own.Lock()
	defer a.own.Unlock()
	switch {
	case a.own.Closed():
		return nil, fmt.Errorf("vmm: hold %s for %s: %w", a, by, ErrClosed)
	case a.sleep.asleep:
		return nil, fmt.Errorf("vmm: hold %s for %s: %w", a, by, ErrAsleep)
	}
	h := &a.hold
	h.mu.Lock()
	h.n++
	h.by = by
	h.mu.Unlock()
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
	if h.n > 0 {
		return fmt.Errorf("vmm: %s: %s is still held by %s (%d holds): %w", op, a, h.by, h.n, ErrInUse)
	}
	return nil
}
