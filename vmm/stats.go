package vmm

import (
	"fmt"
	"sort"
	"time"
)

// Op is a kind of driver call that Stats counts and times.
type Op int

// The counted operations. Each is the driver call (or calls) named.
const (
	OpReserve        Op = iota // cuMemAddressReserve
	OpFreeAddress              // cuMemAddressFree
	OpCreate                   // cuMemCreate
	OpRelease                  // cuMemRelease
	OpMap                      // cuMemMap
	OpUnmap                    // cuMemUnmap
	OpSetAccess                // cuMemSetAccess
	OpExport                   // cuMemExportToShareableHandle (FD or fabric), cuMemGetHandleForAddressRange
	OpImport                   // cuMemImportFromShareableHandle
	OpHostRegister             // cuMemHostRegister
	OpHostUnregister           // cuMemHostUnregister
	OpHostAlloc                // cuMemHostAlloc
	OpFreeHost                 // cuMemFreeHost
	OpAlloc                    // cuMemAlloc
	OpFree                     // cuMemFree
	OpCopy                     // every cuMemcpy variant, synchronous and asynchronous
	OpMemset                   // cuMemsetD8, cuMemsetD32, cuMemsetD8Async
	numOps
)

var opNames = [numOps]string{"reserve", "free_address", "create", "release", "map", "unmap", "set_access",
	"export", "import", "host_register", "host_unregister", "host_alloc", "free_host", "alloc", "free", "copy", "memset"}

// String is the operation's name as the metrics label it: "create", "set_access", ...
func (o Op) String() string {
	if o < 0 || o >= numOps {
		return fmt.Sprintf("op(%d)", int(o))
	}
	return opNames[o]
}

// MarshalText makes an Op a readable JSON map key.
func (o Op) MarshalText() ([]byte, error) { return []byte(o.String()), nil }

// Ops lists every counted operation, in a fixed order.
func Ops() []Op {
	out := make([]Op, numOps)
	for i := range out {
		out[i] = Op(i)
	}
	return out
}

// OpStats is what one device's context spent on one operation since the System was opened.
type OpStats struct {
	// Calls counts the calls, failed ones included; Errors counts those that failed.
	Calls, Errors uint64
	// Bytes is the sum of the sizes the calls were given (reserve, create, map, set access,
	// register, host alloc, alloc, copy and memset; 0 for the others).
	Bytes uint64
	// Time is the wall time spent inside the driver calls. Asynchronous copies and memsets count the
	// time to enqueue them, not to run them.
	Time time.Duration
}

// Memory kinds in Stats' by-kind maps. A Reservation marked with SetKind gives its mappings that
// kind instead (growbuf and stripe mark theirs).
const (
	KindVMM      = "vmm"      // made by cuMemCreate in this process, in an unmarked reservation
	KindImported = "imported" // imported from a shareable handle, in an unmarked reservation
	KindUnknown  = "unknown"  // mapped from a handle this System did not see made (Raw)
)

// Stats is a snapshot of what a System holds through the driver, from the calls its devices' contexts
// made (every vmm call and every Device.Raw call is counted). It is a plain value: taking it costs
// one lock and no driver call.
type Stats struct {
	// Devices has one entry per device of the system, by ordinal; devices not opened have only
	// their ordinal and the memory of theirs that other devices' contexts mapped.
	Devices []DeviceStats
	// Host is the pinned host memory.
	Host HostStats
}

// DeviceStats is one device's part of a Stats snapshot.
type DeviceStats struct {
	Ordinal int
	Name    string // empty for a device not opened
	Opened  bool   // this System holds the device's primary context

	// ReservedBytes is the virtual address space reserved through this device's context and not
	// freed (reservations belong to the unified address space; they are counted where made).
	ReservedBytes uint64
	// CreatedBytes is physical memory on this device made by cuMemCreate and not released.
	CreatedBytes uint64
	// MappedBytes is this device's memory mapped into reservations (each mapping counted once, so
	// an allocation mapped twice counts twice); MappedByKind splits it by kind (KindVMM,
	// KindImported, or the mark of the reservation: "growbuf", "stripe", ...).
	MappedBytes  uint64
	MappedByKind map[string]uint64
	// PlainBytes is memory from cuMemAlloc on this device not freed (baselines, kernel scratch).
	PlainBytes uint64
	// HostVisibleBytes is the host memory this GPU can reach in this process: every registration
	// and cuMemHostAlloc buffer when this System holds the device's context, and the host-NUMA
	// mappings granted to this device. PageTableBytes estimates the GPU memory its page tables take:
	// 2 MiB per GiB (docs/driver-facts.md).
	HostVisibleBytes uint64
	PageTableBytes   uint64
	// LiveOwners counts the vmm owners (allocations, reservations, streams, events, buffers,
	// registrations) that belong to this device and are not closed; LiveOwnersByKind splits them
	// by kind ("allocation", "reservation", "stream", ...). System.Close refuses while any remain.
	LiveOwners       int
	LiveOwnersByKind map[string]int
	// Live counts the driver objects made through this device's context and not yet freed.
	Live LiveObjects
	// Ops counts and times the driver calls made through this device's context, by operation.
	Ops map[Op]OpStats
}

// LiveObjects counts driver objects alive by type.
type LiveObjects struct {
	Allocations   int // cuMemCreate and imported handles not released
	Reservations  int
	Mappings      int
	Streams       int
	Events        int
	PlainBuffers  int // cuMemAlloc
	HostBuffers   int // cuMemHostAlloc
	Registrations int // cuMemHostRegister
}

// HostStats is the pinned host memory of a Stats snapshot.
type HostStats struct {
	// RegisteredBytes is memory page-locked with cuMemHostRegister; HostAllocBytes with
	// cuMemHostAlloc; NUMACreatedBytes is host-NUMA memory made by cuMemCreate, not released.
	RegisteredBytes  uint64
	HostAllocBytes   uint64
	NUMACreatedBytes uint64
	// PinnedBytes is the sum of the three: the page-locked host memory this process made.
	PinnedBytes uint64
	// NUMAMappedBytes is host-NUMA memory mapped into reservations (made here or imported), each
	// mapping counted once; NUMAMappedByKind splits it by kind as DeviceStats.MappedByKind does.
	NUMAMappedBytes  uint64
	NUMAMappedByKind map[string]uint64
}

// PageTableDivisor is the ratio of host memory visible to a GPU to the GPU memory its page tables
// take, as measured: 2 MiB per GiB.
const PageTableDivisor = 512

// Total sums a per-device field over the devices, for example
// st.Total(func(d DeviceStats) uint64 { return d.MappedBytes }).
func (st Stats) Total(field func(DeviceStats) uint64) uint64 {
	var n uint64
	for _, d := range st.Devices {
		n += field(d)
	}
	return n
}

// Stats takes a snapshot of what the system holds. It is safe to call concurrently with anything,
// and on a closed System (which then reports what was left).
func (s *System) Stats() Stats {
	if s == nil {
		return Stats{}
	}
	s.mu.Lock()
	opened := make([]*Device, s.count)
	copy(opened, s.devices)
	s.mu.Unlock()
	ids := make(map[int32]int, s.count) // CUdevice to ordinal
	for i := 0; i < s.count; i++ {
		if d := opened[i]; d != nil {
			ids[int32(d.dev)] = i
		} else if dev, err := s.api.DeviceGet(i); err == nil {
			ids[int32(dev)] = i
		}
	}
	st := Stats{Devices: make([]DeviceStats, s.count)}
	for i := range st.Devices {
		ds := &st.Devices[i]
		ds.Ordinal, ds.MappedByKind, ds.Ops = i, map[string]uint64{}, map[Op]OpStats{}
		if d := opened[i]; d != nil {
			ds.Name, ds.Opened = d.name, true
			ds.LiveOwners, ds.LiveOwnersByKind = d.own.Children(), d.own.ChildrenByKind()
			d.counted.ops.read(ds.Ops)
		}
	}
	s.stats.fill(&st, ids)
	for i := range st.Devices {
		st.Devices[i].PageTableBytes = st.Devices[i].HostVisibleBytes / PageTableDivisor
	}
	return st
}

// SetKind marks the reservation as holding memory of kind (for example "growbuf" or "stripe"):
// Stats reports the memory mapped in it, now and later, under that kind. An empty kind removes the
// mark. It makes no driver call.
func (r *Reservation) SetKind(kind string) {
	if r == nil {
		return
	}
	r.dev.sys.stats.setKind(r.ptr, r.size, kind)
}

// sortedKinds lists a by-kind map's keys in order (for stable output).
func sortedKinds(m map[string]uint64) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// String summarises the device's memory in one line.
func (d DeviceStats) String() string {
	s := fmt.Sprintf("device %d: reserved %d, created %d, mapped %d", d.Ordinal, d.ReservedBytes, d.CreatedBytes, d.MappedBytes)
	for _, k := range sortedKinds(d.MappedByKind) {
		s += fmt.Sprintf(" (%s %d)", k, d.MappedByKind[k])
	}
	return s + fmt.Sprintf(", plain %d, host visible %d, page tables %d", d.PlainBytes, d.HostVisibleBytes, d.PageTableBytes)
}
