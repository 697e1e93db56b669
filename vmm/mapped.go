package vmm

import (
	"slices"
	"sync"

	"github.com/cuvmm/cuvmm/driver"
)

// mappedAt is where an allocation's live Mappings are, with a lock of its own (taken last, around
// nothing else), so that it can be read and changed under a reservation's lock, an allocation's, or
// both.
type mappedAt struct {
	mu   sync.Mutex
	ptrs []driver.DevicePtr
}

func (m *mappedAt) add(ptr driver.DevicePtr) {
	m.mu.Lock()
	m.ptrs = append(m.ptrs, ptr)
	m.mu.Unlock()
}

func (m *mappedAt) remove(ptr driver.DevicePtr) {
	m.mu.Lock()
	if i := slices.Index(m.ptrs, ptr); i >= 0 {
		m.ptrs = slices.Delete(m.ptrs, i, i+1)
	}
	m.mu.Unlock()
}

func (m *mappedAt) snapshot() []driver.DevicePtr {
	m.mu.Lock()
	defer m.mu.Unlock()
	return slices.Clone(m.ptrs)
}

func (m *mappedAt) count() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.ptrs)
}

// onlyAt reports whether the allocation has exactly one live Mapping, at ptr.
func (m *mappedAt) onlyAt(ptr driver.DevicePtr) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.ptrs) == 1 && m.ptrs[0] == ptr
}
