// Package pinned provides page-locked (pinned) host memory that is fast to create, shareable between
// processes, and cheap in GPU page tables; pools of fixed-size pinned buffers; and asynchronous
// staging between device memory and an io.Writer or io.Reader through double buffers.
//
// # What pinned memory costs
//
// Measured on the project's H200 host (docs/driver-facts.md, sections 3 and 5): every GiB of host
// memory a GPU can reach costs 2 MiB of that GPU's memory for page tables, per process and per GPU,
// whatever the host page size. cuMemHostRegister (and cuMemHostAlloc) make memory reachable by every
// GPU on which the process holds a context; a host-NUMA VMM allocation is reachable only by the
// devices granted access with cuMemSetAccess, and a mapping granted to the CPU alone costs no GPU
// memory. Making memory pinned also takes time: cuMemHostAlloc takes 380-550 ms per GiB, registering
// transparent-huge-page memory 26-36 ms per GiB.
//
// # Region kinds
//
// A Region is one of three kinds (see Kind):
//
//   - HostNUMA: a host-NUMA VMM allocation (cuMemCreate at CU_MEM_LOCATION_TYPE_HOST_NUMA, CUDA 12.2+),
//     mapped at one virtual address that the CPU and the granted devices share. The default where the
//     driver supports it. Exportable as file descriptors; an opener chooses which devices, if any, to
//     grant.
//   - SharedMemory: a memfd mapped MAP_SHARED and registered with cuMemHostRegister. The fallback for
//     drivers without host-NUMA VMM; shareable by passing the memfd; visible to every GPU the process
//     holds a context on.
//   - Registered: memory the caller owns, registered with cuMemHostRegister (page-aligned). Visible to
//     every GPU the process holds a context on. Read-only registration is an option.
//
// Every region reports its estimated page-table cost per device (PageTableCost), and every Close
// frees everything the region made. Closing a region that pools still use fails with an error
// wrapping ErrInUse and frees nothing.
//
// # Threads and errors
//
// All driver calls go through package vmm, which binds the device's primary context on a locked OS
// thread for each call. Errors name the operation and wrap a sentinel: ErrInvalidValue, ErrInUse,
// ErrClosed, ErrNotSupported, ErrAlreadyRegistered, ErrNotRegistered, or a driver sentinel such as
// driver.ErrOutOfMemory.
package pinned

import (
	"errors"
	"fmt"
	"os"
	"unsafe"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/vmm"
)

// Sentinel errors. ErrInvalidValue, ErrInUse, ErrClosed and ErrNotSupported are the vmm and driver
// sentinels, so one errors.Is covers errors from every layer.
var (
	// ErrInvalidValue: a bad argument (zero or unaligned length, a buffer of another pool, ...).
	ErrInvalidValue = vmm.ErrInvalidValue
	// ErrInUse: Close of a region or pool whose buffers or pools are still in use; nothing was freed.
	ErrInUse = vmm.ErrInUse
	// ErrClosed: use after Close.
	ErrClosed = vmm.ErrClosed
	// ErrNotSupported: the driver or device lacks the feature (host-NUMA VMM, read-only registration).
	ErrNotSupported = driver.ErrNotSupported
	// ErrAlreadyRegistered: part or all of the memory is already registered with the driver in this
	// process (CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, 712).
	ErrAlreadyRegistered = errors.New("pinned: host memory already registered")
	// ErrNotRegistered: the memory is not (or no longer) registered with the driver
	// (CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, 713).
	ErrNotRegistered = errors.New("pinned: host memory not registered")
	// ErrStreamNotDrained: a Stager's copy stream could not be synchronized after a transfer, so a
	// copy may still be queued into or out of its buffers; it keeps them out of the pool until a
	// later synchronization succeeds (the next transfer, or Close).
	ErrStreamNotDrained = errors.New("pinned: the copy stream could not be drained")
)

// PageTableDivisor turns bytes of host memory visible to a GPU into the GPU memory its page tables
// take: 2 MiB per GiB (measured on the H200 host, the same for 4 KiB pages, transparent huge pages,
// hugetlbfs, registration and host-NUMA mappings), that is 1/512.
const PageTableDivisor = 512

// PageTableCost is the estimated GPU memory that page tables for n bytes of host memory take on one
// device, in one process: n/512 (2 MiB per GiB).
func PageTableCost(n uint64) uint64 { return n / PageTableDivisor }

// Kind is how a Region's memory is made pinned.
type Kind int

// Region kinds.
const (
	// Auto chooses HostNUMA where the device supports it (vmm.FeatureHostNUMA and posix-fd handles),
	// SharedMemory where the device reports no support or the driver is too old to report it
	// (before CUDA 12.9); New fails when a query fails otherwise.
	Auto Kind = iota
	// HostNUMA is a host-NUMA VMM allocation: visible to the granted devices only.
	HostNUMA
	// SharedMemory is a memfd registered with cuMemHostRegister: visible to every opened device.
	SharedMemory
	// Registered is caller-owned memory registered with cuMemHostRegister: visible to every opened
	// device.
	Registered
)

func (k Kind) String() string {
	switch k {
	case Auto:
		return "auto"
	case HostNUMA:
		return "host-numa"
	case SharedMemory:
		return "shared-memory"
	case Registered:
		return "registered"
	}
	return fmt.Sprintf("kind(%d)", int(k))
}

// SupportsHostNUMA reports whether dev can make HostNUMA regions: the driver reports host-NUMA VMM
// support (attribute 141, CUDA 12.9+ reports it; allocation works from 12.2), a host NUMA node for
// the device (attribute 134), and POSIX file descriptor handles for sharing.
//
// It is false also when the driver cannot be asked; New with Auto tells the two apart (a failed
// query is an error there, but on a driver before 12.9, which does not know the attribute, Auto
// makes SharedMemory), and so does dev.Check(vmm.FeatureHostNUMA).
func SupportsHostNUMA(dev *vmm.Device) bool {
	return dev != nil && dev.Check(vmm.FeatureHostNUMA) == nil && dev.Check(vmm.FeaturePosixFDHandles) == nil
}

// Options describes a Region made by New. The zero value is the Auto kind, granted read-write to the
// device passed to New and to the CPU.
type Options struct {
	// Kind chooses how the memory is pinned: Auto (the default), HostNUMA or SharedMemory. Memory the
	// caller owns is registered with Register instead.
	Kind Kind
	// Grant lists the devices that may reach the region. nil means the device passed to New. For a
	// SharedMemory region any non-empty Grant registers the memory, which makes it visible to every
	// device (a property of cuMemHostRegister); listed devices must belong to the same System.
	Grant []*vmm.Device
	// CPUOnly grants no device: a HostNUMA region is mapped for the CPU alone, a SharedMemory region is
	// not registered. Either costs no GPU memory. A HostNUMA region's devices can be granted later
	// (Region.Grant); a SharedMemory region is registered by opening it again with a grant.
	CPUOnly bool
	// ReadOnly lets devices only read the region: granted devices get read access (HostNUMA), the
	// memory is registered with CU_MEMHOSTREGISTER_READ_ONLY (SharedMemory). The CPU may always write.
	ReadOnly bool
	// ChunkSize is the size of each physical allocation of a HostNUMA region (a multiple of the
	// granularity; 0: 1 GiB, or more so that a region has at most 64 chunks). Each chunk is one file
	// descriptor when the region is shared.
	ChunkSize uint64
	// Name names the memfd of a SharedMemory region (visible in /proc/PID/fd); default "cuvmm-pinned".
	Name string
	// Progress, when set, is called as the memory is made ready, with the bytes done and the total
	// (possibly from several goroutines, never concurrently).
	Progress func(done, total uint64)
}

// grants resolves the devices to grant.
func (o Options) grants(dev *vmm.Device) ([]*vmm.Device, error) {
	if o.CPUOnly {
		return nil, nil
	}
	if o.Grant == nil {
		return []*vmm.Device{dev}, nil
	}
	return uniqueDevices(dev.System(), o.Grant)
}

// uniqueDevices checks that devs belong to sys and drops duplicates, keeping order.
func uniqueDevices(sys *vmm.System, devs []*vmm.Device) ([]*vmm.Device, error) {
	var out []*vmm.Device
	seen := map[int]bool{}
	for _, d := range devs {
		if d == nil {
			return nil, fmt.Errorf("pinned: nil device in the grant list: %w", ErrInvalidValue)
		}
		if d.System() != sys {
			return nil, fmt.Errorf("pinned: %s belongs to another System: %w", d, ErrInvalidValue)
		}
		if !seen[d.Ordinal()] {
			seen[d.Ordinal()] = true
			out = append(out, d)
		}
	}
	return out, nil
}

func (o Options) progress(done, total uint64) {
	if o.Progress != nil {
		o.Progress(done, total)
	}
}

// pageSize is the host page size.
var pageSize = uint64(os.Getpagesize())

// addrPtr turns an address of memory outside the Go heap (a mapping made by the driver or by mmap)
// into a pointer. Reading it out of a variable keeps go vet and the race detector's checkptr from
// objecting to an integer-to-pointer conversion.
func addrPtr(a uintptr) unsafe.Pointer { return *(*unsafe.Pointer)(unsafe.Pointer(&a)) }

// devicePtrOf is the address of mem's first byte as a device pointer: what a device uses for
// registered memory when it can use host pointers, and the CPU address of unregistered memory.
func devicePtrOf(mem []byte) driver.DevicePtr {
	return driver.DevicePtr(uintptr(unsafe.Pointer(&mem[0])))
}

// bytesAt is [addr, addr+n) as a byte slice.
func bytesAt(addr uintptr, n uint64) []byte { return unsafe.Slice((*byte)(addrPtr(addr)), n) }

// classify wraps the registration results 712 and 713 with this package's sentinels.
func classify(err error) error {
	var r driver.Result
	if errors.As(err, &r) {
		switch r {
		case driver.ErrorHostMemoryAlreadyRegistered:
			return fmt.Errorf("%w: %w", ErrAlreadyRegistered, err)
		case driver.ErrorHostMemoryNotRegistered:
			return fmt.Errorf("%w: %w", ErrNotRegistered, err)
		}
	}
	return err
}
