package vmm

import (
	"unsafe"

	"github.com/cuvmm/cuvmm/driver"
)

// HostView is the CPU's view of n bytes at unified address ptr: host-NUMA memory granted to the CPU
// (HostReadWrite or HostReadOnly), registered or cuMemHostAlloc memory. The CPU reads and writes
// through the same virtual address the GPUs use. Touching memory the CPU has no access to faults the
// process, like any wild pointer; the slice must not be used after the mapping is closed.
func HostView(ptr driver.DevicePtr, n uint64) []byte {
	addr := uintptr(ptr)
	// Reinterpret the integer as a pointer without the uintptr→unsafe.Pointer conversion pattern
	// that vet rejects: the memory is not Go-managed, so the garbage collector does not care.
	p := *(*unsafe.Pointer)(unsafe.Pointer(&addr))
	return unsafe.Slice((*byte)(p), n)
}
