// Package driver is the raw layer over the CUDA driver API: the C types and enum values the project
// needs (declared here, no CUDA toolkit at build time), the libcuda.so.1 loader, CUresult errors, and
// the API interface that both the real driver (Open) and the simulated driver (package sim) implement.
//
// Every method of API is named after the C entry point it calls, without the "cu" prefix and the ABI
// suffix: API.MemCreate calls cuMemCreate, API.MemHostRegister calls cuMemHostRegister_v2. The exact
// versioned symbols are listed in symbols.go.
package driver

import (
	"fmt"
	"math"
)

// Device is a CUdevice: a device handle returned by DeviceGet (on every known driver, the ordinal).
type Device int32

// Context is a CUcontext, an opaque driver pointer.
type Context uintptr

// Stream is a CUstream; 0 is the legacy default stream.
type Stream uintptr

// Event is a CUevent.
type Event uintptr

// Module is a CUmodule.
type Module uintptr

// Function is a CUfunction.
type Function uintptr

// DevicePtr is a CUdeviceptr: an address in the unified virtual address space.
type DevicePtr uint64

// MemHandle is a CUmemGenericAllocationHandle: a physical allocation made by cuMemCreate or imported.
type MemHandle uint64

// AllocationType is CUmemAllocationType.
type AllocationType int32

// AllocationTypePinned is CU_MEM_ALLOCATION_TYPE_PINNED, the only type cuMemCreate accepts.
const AllocationTypePinned AllocationType = 1

// HandleType is CUmemAllocationHandleType, a bitmask of shareable handle kinds.
type HandleType int32

// Shareable handle types (bitmask).
const (
	HandleTypeNone     HandleType = 0
	HandleTypePosixFD  HandleType = 1
	HandleTypeWin32    HandleType = 2
	HandleTypeWin32KMT HandleType = 4
	HandleTypeFabric   HandleType = 8 // CUDA 12.3+; needs an IMEX channel

	// HandleTypeKnown is every bit the driver defines; other bits are invalid.
	HandleTypeKnown = HandleTypePosixFD | HandleTypeWin32 | HandleTypeWin32KMT | HandleTypeFabric
)

func (h HandleType) String() string {
	if h == HandleTypeNone {
		return "none"
	}
	s := ""
	add := func(bit HandleType, name string) {
		if h&bit != 0 {
			if s != "" {
				s += "|"
			}
			s += name
		}
	}
	add(HandleTypePosixFD, "posix-fd")
	add(HandleTypeWin32, "win32")
	add(HandleTypeWin32KMT, "win32-kmt")
	add(HandleTypeFabric, "fabric")
	if rest := h &^ HandleTypeKnown; rest != 0 {
		if s != "" {
			s += "|"
		}
		s += fmt.Sprintf("0x%x", int32(rest))
	}
	return s
}

// LocationType is CUmemLocationType.
type LocationType int32

// Location types.
const (
	LocationInvalid         LocationType = 0
	LocationDevice          LocationType = 1
	LocationHost            LocationType = 2 // CUDA 12.2+
	LocationHostNUMA        LocationType = 3 // CUDA 12.2+
	LocationHostNUMACurrent LocationType = 4 // CUDA 12.2+
)

func (t LocationType) String() string {
	switch t {
	case LocationInvalid:
		return "invalid"
	case LocationDevice:
		return "device"
	case LocationHost:
		return "host"
	case LocationHostNUMA:
		return "host-numa"
	case LocationHostNUMACurrent:
		return "host-numa-current"
	}
	return fmt.Sprintf("location-type(%d)", int32(t))
}

// Location is CUmemLocation (8 bytes: type, id).
type Location struct {
	Type LocationType
	ID   int32
}

func (l Location) String() string {
	switch l.Type {
	case LocationDevice:
		return fmt.Sprintf("device %d", l.ID)
	case LocationHostNUMA:
		return fmt.Sprintf("host NUMA node %d", l.ID)
	case LocationHost:
		return "host"
	}
	return fmt.Sprintf("%s %d", l.Type, l.ID)
}

// DeviceLocation is the location of device dev.
func DeviceLocation(dev Device) Location { return Location{Type: LocationDevice, ID: int32(dev)} }

// HostLocation is the host (CPU) location, used for access descriptors and process-private host
// allocations.
func HostLocation() Location { return Location{Type: LocationHost} }

// HostNUMALocation is host memory on NUMA node node. A node outside int32 gives ID -1, which the
// driver refuses, rather than wrapping to another node.
func HostNUMALocation(node int) Location {
	if node < math.MinInt32 || node > math.MaxInt32 {
		node = -1
	}
	return Location{Type: LocationHostNUMA, ID: int32(node)}
}

// CompressionType is the allocFlags.compressionType byte.
type CompressionType uint8

// Compression types.
const (
	CompressionNone    CompressionType = 0
	CompressionGeneric CompressionType = 1
)

// AllocationProp is CUmemAllocationProp (32 bytes, see docs/driver-facts.md, section 1).
type AllocationProp struct {
	Type                 AllocationType
	RequestedHandleTypes HandleType
	Location             Location
	// win32HandleMetaData is always NULL on Linux and not represented.
	Compression          CompressionType
	GPUDirectRDMACapable bool
	Usage                uint16
}

// AccessFlags is CUmemAccess_flags.
type AccessFlags int32

// Access flags.
const (
	AccessNone      AccessFlags = 0
	AccessRead      AccessFlags = 1
	AccessReadWrite AccessFlags = 3
)

func (a AccessFlags) String() string {
	switch a {
	case AccessNone:
		return "none"
	case AccessRead:
		return "read"
	case AccessReadWrite:
		return "read-write"
	}
	return fmt.Sprintf("access(%d)", int32(a))
}

// AccessDesc is CUmemAccessDesc (12 bytes: location, flags).
type AccessDesc struct {
	Location Location
	Flags    AccessFlags
}

// GranularityOption is CUmemAllocationGranularity_flags.
type GranularityOption int32

// Granularity options.
const (
	GranularityMinimum     GranularityOption = 0
	GranularityRecommended GranularityOption = 1
)

// RangeHandleType is CUmemRangeHandleType.
type RangeHandleType int32

// RangeHandleTypeDMABufFD is CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD.
const RangeHandleTypeDMABufFD RangeHandleType = 1

// Host registration flags (cuMemHostRegister).
const (
	HostRegisterPortable  uint32 = 1
	HostRegisterDeviceMap uint32 = 2
	HostRegisterIOMemory  uint32 = 4
	HostRegisterReadOnly  uint32 = 8
)

// Host allocation flags (cuMemHostAlloc).
const (
	HostAllocPortable      uint32 = 1
	HostAllocDeviceMap     uint32 = 2
	HostAllocWriteCombined uint32 = 4
)

// Stream and event flags.
const (
	StreamDefault      uint32 = 0
	StreamNonBlocking  uint32 = 1
	EventDefault       uint32 = 0
	EventBlockingSync  uint32 = 1
	EventDisableTiming uint32 = 2
)

// Dim3 is a grid or block shape for LaunchKernel.
type Dim3 struct{ X, Y, Z uint32 }

// FabricHandle is CUmemFabricHandle (64 opaque bytes).
type FabricHandle [64]byte

// DeviceAttribute is CUdevice_attribute. Only the attributes the project reads are named; any value
// may be passed.
type DeviceAttribute int32

// Device attributes used by the project (values from the CUDA 13.0 header).
const (
	AttrMultiprocessorCount                      DeviceAttribute = 16
	AttrPCIBusID                                 DeviceAttribute = 33
	AttrPCIDeviceID                              DeviceAttribute = 34
	AttrUnifiedAddressing                        DeviceAttribute = 41
	AttrPCIDomainID                              DeviceAttribute = 50
	AttrComputeCapabilityMajor                   DeviceAttribute = 75
	AttrComputeCapabilityMinor                   DeviceAttribute = 76
	AttrCanUseHostPointerForRegisteredMem        DeviceAttribute = 91
	AttrHostRegisterSupported                    DeviceAttribute = 99
	AttrVirtualMemoryManagementSupported         DeviceAttribute = 102
	AttrHandleTypePosixFDSupported               DeviceAttribute = 103
	AttrGenericCompressionSupported              DeviceAttribute = 107
	AttrGPUDirectRDMAWithCUDAVMMSupported        DeviceAttribute = 110
	AttrReadOnlyHostRegisterSupported            DeviceAttribute = 113
	AttrDMABufSupported                          DeviceAttribute = 124
	AttrHandleTypeFabricSupported                DeviceAttribute = 128
	AttrNUMAConfig                               DeviceAttribute = 130
	AttrNUMAID                                   DeviceAttribute = 131
	AttrHostNUMAID                               DeviceAttribute = 134
	AttrHostNUMAVirtualMemoryManagementSupported DeviceAttribute = 141
	AttrHostVirtualMemoryManagementSupported     DeviceAttribute = 145
)
