package sim

import (
	"fmt"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
)

// allocation is physical memory: a memfd and this process's MAP_SHARED view of all of it (the
// "physical" side through which copies and kernels reach it, whatever is mapped where).
type allocation struct {
	prop     driver.AllocationProp
	size     uint64
	fd       int
	view     []byte
	ino, dev uint64 // the memfd's identity, to recognize an import of an allocation already here
	refs     int    // handles + mappings + in-flight copies and kernels
	imported bool   // made by cuMemImportFromShareableHandle: the exporter pays for the memory
	legacy   bool   // the backing of a cuMemAlloc buffer
	charged  *device
}

// hostVisible reports whether the memory lives on the host (a host-NUMA node or the process-private
// host location): the CPU may be granted access, and every device may be.
func (a *allocation) hostVisible() bool {
	return a.prop.Location.Type == driver.LocationHostNUMA || a.prop.Location.Type == driver.LocationHost
}

// owner is the device ordinal of device memory, or -1 for host memory.
func (a *allocation) owner() int {
	if a.prop.Location.Type == driver.LocationDevice {
		return int(a.prop.Location.ID)
	}
	return -1
}

func (a *allocation) free() error {
	err := unix.Munmap(a.view)
	if cerr := unix.Close(a.fd); err == nil {
		err = cerr
	}
	a.view = nil
	return err
}

// memfdName encodes what an importer needs to rebuild an allocation's properties.
func memfdName(p driver.AllocationProp, size uint64) string {
	loc := "device"
	switch p.Location.Type {
	case driver.LocationHostNUMA:
		loc = "host-numa"
	case driver.LocationHost:
		loc = "host"
	}
	rdma := 0
	if p.GPUDirectRDMACapable {
		rdma = 1
	}
	return fmt.Sprintf("%sloc=%s:%d size=%d types=%d comp=%d rdma=%d usage=%d",
		memfdPrefix, loc, p.Location.ID, size, int32(p.RequestedHandleTypes), p.Compression, rdma, p.Usage)
}

// parseMemfdName is the inverse of memfdName; ok is false for anything else.
func parseMemfdName(name string) (p driver.AllocationProp, size uint64, ok bool) {
	rest, found := strings.CutPrefix(name, memfdPrefix)
	if !found {
		return p, 0, false
	}
	rest = strings.TrimSuffix(rest, " (deleted)")
	seen := 0
	for _, f := range strings.Fields(rest) {
		k, v, found := strings.Cut(f, "=")
		if !found {
			return p, 0, false
		}
		var err error
		switch k {
		case "loc":
			typ, id, found := strings.Cut(v, ":")
			if !found {
				return p, 0, false
			}
			switch typ {
			case "device":
				p.Location.Type = driver.LocationDevice
			case "host-numa":
				p.Location.Type = driver.LocationHostNUMA
			case "host":
				p.Location.Type = driver.LocationHost
			default:
				return p, 0, false
			}
			var n int64
			n, err = strconv.ParseInt(id, 10, 32)
			p.Location.ID = int32(n)
		case "size":
			size, err = strconv.ParseUint(v, 10, 64)
		case "types":
			var n int64
			n, err = strconv.ParseInt(v, 10, 32)
			p.RequestedHandleTypes = driver.HandleType(n)
		case "comp":
			var n uint64
			n, err = strconv.ParseUint(v, 10, 8)
			p.Compression = driver.CompressionType(n)
		case "rdma":
			p.GPUDirectRDMACapable = v == "1"
		case "usage":
			var n uint64
			n, err = strconv.ParseUint(v, 10, 16)
			p.Usage = uint16(n)
		default:
			continue
		}
		if err != nil {
			return p, 0, false
		}
		seen++
	}
	p.Type = driver.AllocationTypePinned
	return p, size, seen == 6
}

// newAllocation makes an allocation over fd (which it takes over) and maps its view.
func (s *Sim) newAllocation(prop driver.AllocationProp, size uint64, fd int) (*allocation, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return nil, err
	}
	view, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	a := &allocation{prop: prop, size: size, fd: fd, view: view, ino: st.Ino, dev: st.Dev}
	s.allocs[a] = struct{}{}
	s.fds++
	return a, nil
}

// createAllocation makes fresh memory with prop (already validated) and charges device memory.
func (s *Sim) createAllocation(prop driver.AllocationProp, size uint64, name string) (*allocation, error) {
	var owner *device
	if prop.Location.Type == driver.LocationDevice {
		owner = s.devs[prop.Location.ID]
		if size > s.free(owner) {
			return nil, driver.ErrorOutOfMemory
		}
	}
	fd, err := newMemfd(name, size)
	if err != nil {
		return nil, driver.ErrorOutOfMemory
	}
	a, err := s.newAllocation(prop, size, fd)
	if err != nil {
		return nil, driver.ErrorOutOfMemory
	}
	if owner != nil {
		owner.used += size
		a.charged = owner
	}
	return a, nil
}

// unref drops one reference to a and frees it with the last one.
func (s *Sim) unref(a *allocation) {
	a.refs--
	if a.refs > 0 {
		return
	}
	if a.charged != nil {
		a.charged.used -= a.size
	}
	if _, live := s.allocs[a]; live {
		delete(s.allocs, a)
		s.fds--
		_ = a.free()
	}
}

// newMemHandle returns a new handle value for a (one more reference).
func (s *Sim) newMemHandle(a *allocation) driver.MemHandle {
	h := driver.MemHandle(newHandle())
	s.handles[h] = a
	a.refs++
	return h
}

// checkLocation validates an allocation location: a device ordinal that exists
// (CUDA_ERROR_INVALID_DEVICE otherwise), host-NUMA node 0 (the host has one node), or HOST.
func (s *Sim) checkLocation(loc driver.Location) error {
	switch loc.Type {
	case driver.LocationDevice:
		if s.device(driver.Device(loc.ID)) == nil {
			return driver.ErrorInvalidDevice
		}
	case driver.LocationHostNUMA:
		if loc.ID != 0 {
			return driver.ErrorInvalidValue
		}
	case driver.LocationHost:
	default: // INVALID, HOST_NUMA_CURRENT (measured INVALID_VALUE) and unknown types
		return driver.ErrorInvalidValue
	}
	return nil
}

// MemCreate calls cuMemCreate. prop.Type must be PINNED; size a non-zero multiple of the granularity;
// the location a device, host-NUMA node 0, or HOST (without handle types: HOST memory is process-
// private); handle types POSIX_FD, or FABRIC only with EnableFabric (CUDA_ERROR_NOT_PERMITTED
// otherwise, also combined with POSIX_FD). Device memory beyond what is free is
// CUDA_ERROR_OUT_OF_MEMORY. Compression is granted for device memory and ignored for host memory.
func (s *Sim) MemCreate(size uint64, prop *driver.AllocationProp, flags uint64) (driver.MemHandle, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.begin("cuMemCreate", ctxBound); err != nil {
		return 0, err
	}
	if prop == nil || flags != 0 || prop.Type != driver.AllocationTypePinned {
		return 0, driver.ErrorInvalidValue
	}
	if size == 0 || !s.aligned(size) {
		return 0, driver.ErrorInvalidValue
	}
	if err := s.checkLocation(prop.Location); err != nil {
		return 0, err
	}
	types := prop.RequestedHandleTypes
	if types&^driver.HandleTypeKnown != 0 || types&(driver.HandleTypeWin32|driver.HandleTypeWin32KMT) != 0 {
		return 0, driver.ErrorInvalidValue
	}
	if prop.Location.Type == driver.LocationHost && types != driver.HandleTypeNone {
		return 0, driver.ErrorInvalidValue
	}
	if types&driver.HandleTypeFabric != 0 && !s.cfg.fabric {
		return 0, driver.ErrorNotPermitted
	}
	p := *prop
	if p.Location.Type != driver.LocationDevice {
		p.Compression = driver.CompressionNone
	}
	a, err := s.createAllocation(p, size, memfdName(p, size))
	if err != nil {
		return 0, err
	}
	return s.newMemHandle(a), nil
}

// handle looks up an allocation handle; unknown and released handles are CUDA_ERROR_INVALID_VALUE.
func (s *Sim) handle(h driver.MemHandle) (*allocation, error) {
	a, ok := s.handles[h]
	if !ok {
		return nil, driver.ErrorInvalidValue
	}
	return a, nil
}

// MemRelease calls cuMemRelease. The memory stays valid while it is mapped and is freed (and its
// device memory returned) with the last unmap, as measured.
func (s *Sim) MemRelease(h driver.MemHandle) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.begin("cuMemRelease", ctxBound); err != nil {
		return err
	}
	a, err := s.handle(h)
	if err != nil {
		return err
	}
	delete(s.handles, h)
	delete(s.imported, h)
	s.unref(a)
	return nil
}

// MemGetAllocationGranularity calls cuMemGetAllocationGranularity: Granularity for every valid
// location, minimum and recommended alike.
func (s *Sim) MemGetAllocationGranularity(prop *driver.AllocationProp, option driver.GranularityOption) (uint64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.begin("cuMemGetAllocationGranularity", ctxBound); err != nil {
		return 0, err
	}
	if prop == nil || (option != driver.GranularityMinimum && option != driver.GranularityRecommended) {
		return 0, driver.ErrorInvalidValue
	}
	if err := s.checkLocation(prop.Location); err != nil {
		return 0, err
	}
	return s.gran(), nil
}

// MemGetAllocationPropertiesFromHandle calls cuMemGetAllocationPropertiesFromHandle: the properties
// the allocation was created with (for an import, the exporter's, but with no requested handle
// types, as measured).
func (s *Sim) MemGetAllocationPropertiesFromHandle(h driver.MemHandle) (driver.AllocationProp, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.begin("cuMemGetAllocationPropertiesFromHandle", ctxBound); err != nil {
		return driver.AllocationProp{}, err
	}
	a, err := s.handle(h)
	if err != nil {
		return driver.AllocationProp{}, err
	}
	p := a.prop
	if s.imported[h] {
		p.RequestedHandleTypes = driver.HandleTypeNone
	}
	return p, nil
}

// MemRetainAllocationHandle calls cuMemRetainAllocationHandle: for an address inside a mapping, a new
// handle of the mapped allocation, to be released like any other. Elsewhere (including cuMemAlloc
// memory): CUDA_ERROR_INVALID_VALUE.
func (s *Sim) MemRetainAllocationHandle(addr driver.DevicePtr) (driver.MemHandle, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.begin("cuMemRetainAllocationHandle", ctxBound); err != nil {
		return 0, err
	}
	m := s.mappingAt(uint64(addr))
	if m == nil || m.res.legacy {
		return 0, driver.ErrorInvalidValue
	}
	return s.newMemHandle(m.alloc), nil
}

// MemExportToShareableHandle calls cuMemExportToShareableHandle for POSIX_FD: a new close-on-exec
// descriptor of the allocation's memfd, owned by the caller, which another process's simulator can
// import. The allocation must have been created with POSIX_FD in its requested handle types
// (CUDA_ERROR_INVALID_VALUE otherwise, as measured; imported memory never has it); other types are
// CUDA_ERROR_INVALID_VALUE.
func (s *Sim) MemExportToShareableHandle(h driver.MemHandle, typ driver.HandleType, flags uint64) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.begin("cuMemExportToShareableHandle", ctxBound); err != nil {
		return -1, err
	}
	a, err := s.handle(h)
	if err != nil {
		return -1, err
	}
	if typ != driver.HandleTypePosixFD || flags != 0 || s.imported[h] || a.prop.RequestedHandleTypes&driver.HandleTypePosixFD == 0 {
		return -1, driver.ErrorInvalidValue
	}
	fd, err := unix.FcntlInt(uintptr(a.fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return -1, driver.ErrorOutOfMemory
	}
	return fd, nil
}

// MemExportToFabricHandle calls cuMemExportToShareableHandle for FABRIC. Without EnableFabric it is
// CUDA_ERROR_NOT_PERMITTED (no IMEX channel); with it, an allocation created with the FABRIC type gets
// a 64-byte token naming its memfd. The simulator cannot import fabric handles (the API has no call
// for it).
func (s *Sim) MemExportToFabricHandle(h driver.MemHandle, flags uint64) (driver.FabricHandle, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var fh driver.FabricHandle
	if _, err := s.begin("cuMemExportToShareableHandle", ctxBound); err != nil {
		return fh, err
	}
	a, err := s.handle(h)
	if err != nil {
		return fh, err
	}
	if !s.cfg.fabric {
		return fh, driver.ErrorNotPermitted
	}
	if flags != 0 || s.imported[h] || a.prop.RequestedHandleTypes&driver.HandleTypeFabric == 0 {
		return fh, driver.ErrorInvalidValue
	}
	copy(fh[:], fmt.Sprintf("cuvmm-sim-fabric pid=%d dev=%d ino=%d", unix.Getpid(), a.dev, a.ino))
	return fh, nil
}

// MemImportFromShareableHandle calls cuMemImportFromShareableHandle for POSIX_FD. fd must be a
// simulator allocation's memfd (from MemExportToShareableHandle here or in another process), else
// CUDA_ERROR_INVALID_VALUE; device memory must be on a device ordinal this simulator has, else
// CUDA_ERROR_INVALID_DEVICE. The caller keeps fd: the simulator holds its own duplicate. Imported
// device memory is not charged again (the exporter pays). Importing an allocation that is already in
// this simulator gives a new handle of it. Imported memory has the exporter's properties except its
// requested handle types, which are none (measured, also for an import in the exporting process):
// exporting it again through the handle the import gave is CUDA_ERROR_INVALID_VALUE.
func (s *Sim) MemImportFromShareableHandle(fd int, typ driver.HandleType) (driver.MemHandle, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.begin("cuMemImportFromShareableHandle", ctxBound); err != nil {
		return 0, err
	}
	if typ != driver.HandleTypePosixFD || fd < 0 {
		return 0, driver.ErrorInvalidValue
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return 0, driver.ErrorInvalidValue
	}
	buf := make([]byte, 512)
	n, err := unix.Readlink("/proc/self/fd/"+strconv.Itoa(fd), buf)
	if err != nil {
		return 0, driver.ErrorInvalidValue
	}
	name, isMemfd := strings.CutPrefix(string(buf[:n]), "/memfd:")
	if !isMemfd {
		return 0, driver.ErrorInvalidValue
	}
	prop, size, ok := parseMemfdName(name)
	if !ok || size == 0 || uint64(st.Size) != size || prop.RequestedHandleTypes&driver.HandleTypePosixFD == 0 {
		return 0, driver.ErrorInvalidValue
	}
	if prop.Location.Type == driver.LocationDevice && s.device(driver.Device(prop.Location.ID)) == nil {
		return 0, driver.ErrorInvalidDevice
	}
	for a := range s.allocs {
		if a.ino == st.Ino && a.dev == st.Dev {
			h := s.newMemHandle(a)
			s.imported[h] = true
			return h, nil
		}
	}
	dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return 0, driver.ErrorOutOfMemory
	}
	// Imported memory reports no requested handle types, so it cannot be exported again
	// (docs/driver-facts.md §5).
	prop.RequestedHandleTypes = driver.HandleTypeNone
	a, err := s.newAllocation(prop, size, dup)
	if err != nil {
		return 0, driver.ErrorOutOfMemory
	}
	a.imported = true
	return s.newMemHandle(a), nil
}

// MemGetHandleForAddressRange calls cuMemGetHandleForAddressRange for DMA_BUF_FD. The range must be
// page-aligned and fully mapped (VMM or cuMemAlloc memory), else CUDA_ERROR_INVALID_VALUE. The FD is a
// new close-on-exec memfd whose size is the range's size (what a dma-buf importer sees first); its
// contents are not the device memory.
func (s *Sim) MemGetHandleForAddressRange(ptr driver.DevicePtr, size uint64, typ driver.RangeHandleType, flags uint64) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.begin("cuMemGetHandleForAddressRange", ctxBound); err != nil {
		return -1, err
	}
	page := uint64(unix.Getpagesize())
	// flags 1 is CU_MEM_RANGE_FLAG_DMA_BUF_MAPPING_TYPE_PCIE (CUDA 12.8+).
	if typ != driver.RangeHandleTypeDMABufFD || flags > 1 || size == 0 || uint64(ptr)%page != 0 || size%page != 0 {
		return -1, driver.ErrorInvalidValue
	}
	if _, ok := s.spans(uint64(ptr), size); !ok {
		return -1, driver.ErrorInvalidValue
	}
	fd, err := newMemfd(fmt.Sprintf("cuvmm-sim-dmabuf va=%#x size=%d", uint64(ptr), size), size)
	if err != nil {
		return -1, driver.ErrorOutOfMemory
	}
	return fd, nil
}
