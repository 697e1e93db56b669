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
// mapping of it fails with an error wrapping ErrInUse, so the memory cannot vanish under the holder.
// Holds nest; release is idempotent.
func (a *Allocation) Hold(by string) (release func()) {
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
	}
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
