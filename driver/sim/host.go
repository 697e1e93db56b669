package sim

import (
	"fmt"
	"sort"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
)

// hostRange is host memory the devices can reach by its own address: a cuMemHostRegister'ed range or
// a cuMemHostAlloc'ed buffer.
type hostRange struct {
	base, size uint64
	pinned     uint64 // bytes of whole pages: what the page tables of every device cover
	flags      uint32
	alloc      bool // from cuMemHostAlloc (the simulator owns the mmap of pinned bytes)
}

func (h *hostRange) end() uint64 { return h.base + h.size }

// readOnly reports whether devices may only read the range (CU_MEMHOSTREGISTER_READ_ONLY).
func (h *hostRange) readOnly() bool {
	return !h.alloc && h.flags&driver.HostRegisterReadOnly != 0
}

// hostFirst is the index of the first host range that ends after addr.
func (s *Sim) hostFirst(addr uint64) int {
	return sort.Search(len(s.hosts), func(i int) bool { return s.hosts[i].end() > addr })
}

// hostAt returns the host range containing addr, or nil.
func (s *Sim) hostAt(addr uint64) *hostRange {
	if i := s.hostFirst(addr); i < len(s.hosts) && s.hosts[i].base <= addr {
		return s.hosts[i]
	}
	return nil
}

// hostOverlaps reports whether [addr, addr+n) overlaps a host range.
func (s *Sim) hostOverlaps(addr, n uint64) bool {
	i := s.hostFirst(addr)
	return i < len(s.hosts) && s.hosts[i].base < addr+n
}

// pageSpan is the bytes of the whole pages [addr, addr+n) touches.
func pageSpan(addr, n uint64) uint64 {
	page := uint64(unix.Getpagesize())
	start := addr &^ (page - 1)
	return roundUp(addr+n, page) - start
}

func (s *Sim) addHost(h *hostRange) {
	s.hosts = insertSorted(s.hosts, h, func(h *hostRange) uint64 { return h.base })
	s.hostPinned += h.pinned
}

func (s *Sim) removeHost(h *hostRange) {
	s.hosts = removeItem(s.hosts, h)
	s.hostPinned -= h.pinned
}

// MemHostRegister calls cuMemHostRegister_v2: it pins [p, p+size) for every device, which costs each
// device page tables in MemGetInfo (2 MiB per GiB, measured). p must not be nil, size not 0, and the
// whole range mapped in the process (CUDA_ERROR_INVALID_VALUE); a range overlapping one already
// registered (or from cuMemHostAlloc) is CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED. With READ_ONLY,
// devices may read but not write it; without it, every page must be mapped writable, else
// CUDA_ERROR_INVALID_VALUE (measured on a file mapped read-only).
func (s *Sim) MemHostRegister(p unsafe.Pointer, size uint64, flags uint32) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.begin("cuMemHostRegister", ctxBound); err != nil {
		return err
	}
	addr := uint64(uintptr(p))
	known := driver.HostRegisterPortable | driver.HostRegisterDeviceMap | driver.HostRegisterIOMemory | driver.HostRegisterReadOnly
	if p == nil || size == 0 || addr+size < addr || flags&^known != 0 {
		return driver.ErrorInvalidValue
	}
	if s.touchesRes(addr, size) {
		return driver.ErrorInvalidValue // a device address is not host memory
	}
	if s.hostOverlaps(addr, size) {
		return driver.ErrorHostMemoryAlreadyRegistered
	}
	if !mapped(uintptr(addr), size) {
		return driver.ErrorInvalidValue
	}
	if flags&driver.HostRegisterReadOnly == 0 && !writable(uintptr(addr), size) {
		return driver.ErrorInvalidValue // measured: a read-only mapping needs READ_ONLY
	}
	s.addHost(&hostRange{base: addr, size: size, pinned: pageSpan(addr, size), flags: flags})
	return nil
}

// MemHostUnregister calls cuMemHostUnregister; p must start a registration, else
// CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED (also on a second call).
func (s *Sim) MemHostUnregister(p unsafe.Pointer) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.begin("cuMemHostUnregister", ctxBound); err != nil {
		return err
	}
	h := s.hostAt(uint64(uintptr(p)))
	if h == nil || h.alloc || h.base != uint64(uintptr(p)) {
		return driver.ErrorHostMemoryNotRegistered
	}
	s.removeHost(h)
	return nil
}

// MemHostGetDevicePointer calls cuMemHostGetDevicePointer_v2: for registered or cuMemHostAlloc'ed
// memory the device pointer is the host address itself (CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM is
// 1); other addresses are CUDA_ERROR_INVALID_VALUE. flags must be 0.
func (s *Sim) MemHostGetDevicePointer(p unsafe.Pointer, flags uint32) (driver.DevicePtr, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.begin("cuMemHostGetDevicePointer", ctxBound); err != nil {
		return 0, err
	}
	addr := uint64(uintptr(p))
	if flags != 0 || s.hostAt(addr) == nil {
		return 0, driver.ErrorInvalidValue
	}
	return driver.DevicePtr(addr), nil
}

// MemHostAlloc calls cuMemHostAlloc: page-aligned, zeroed, pinned host memory (an anonymous mmap) that
// every device can reach by its address; it counts for page tables like a registration.
func (s *Sim) MemHostAlloc(size uint64, flags uint32) (unsafe.Pointer, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.begin("cuMemHostAlloc", ctxBound); err != nil {
		return nil, err
	}
	known := driver.HostAllocPortable | driver.HostAllocDeviceMap | driver.HostAllocWriteCombined
	if size == 0 || flags&^known != 0 {
		return nil, driver.ErrorInvalidValue
	}
	n := roundUp(size, uint64(unix.Getpagesize()))
	if n < size {
		return nil, driver.ErrorOutOfMemory
	}
	p, err := mmap(0, uintptr(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS, -1, 0)
	if err != nil {
		return nil, driver.ErrorOutOfMemory
	}
	s.addHost(&hostRange{base: uint64(p), size: size, pinned: n, flags: flags, alloc: true})
	return addrPtr(p), nil
}

// MemFreeHost calls cuMemFreeHost; p must be what MemHostAlloc returned, else
// CUDA_ERROR_INVALID_VALUE.
func (s *Sim) MemFreeHost(p unsafe.Pointer) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.begin("cuMemFreeHost", ctxBound); err != nil {
		return err
	}
	s.drainAll() // DeferWork: the driver synchronizes first
	h := s.hostAt(uint64(uintptr(p)))
	if h == nil || !h.alloc || h.base != uint64(uintptr(p)) {
		return driver.ErrorInvalidValue
	}
	s.removeHost(h)
	_ = munmap(uintptr(h.base), h.pinned)
	return nil
}

// legacyAlloc is a cuMemAlloc buffer: an internal reservation, allocation and mapping, invisible to
// the VMM calls.
type legacyAlloc struct {
	res *reservation
	m   *mapping
}

// MemAlloc calls cuMemAlloc_v2: device memory on the current context's device, counted in MemGetInfo
// (the size rounded up to the granularity), freed with the context (its last release). That device
// reads and writes it by kernels, memsets and copies; every device that can access it (PeerAccess)
// only by copies, as peer access (cuCtxEnablePeerAccess) is never enabled.
func (s *Sim) MemAlloc(size uint64) (driver.DevicePtr, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	d, err := s.begin("cuMemAlloc", ctxBound)
	if err != nil {
		return 0, err
	}
	l, err := s.newLegacyBuffer(d, size)
	if err != nil {
		return 0, err
	}
	s.legacy[driver.DevicePtr(l.res.base)] = l
	return driver.DevicePtr(l.res.base), nil
}

// newLegacyBuffer makes the backing of a cuMemAlloc or cuMemAllocAsync buffer of size bytes (rounded
// up to the granularity) on d: an internal reservation, allocation and mapping, invisible to the VMM
// calls. The caller holds s.mu.
func (s *Sim) newLegacyBuffer(d *device, size uint64) (*legacyAlloc, error) {
	if size == 0 {
		return nil, driver.ErrorInvalidValue
	}
	n := roundUp(size, s.gran())
	if n < size {
		return nil, driver.ErrorOutOfMemory
	}
	prop := driver.AllocationProp{Type: driver.AllocationTypePinned, Location: driver.DeviceLocation(driver.Device(d.ordinal))}
	a, err := s.createAllocation(prop, n, fmt.Sprintf("cuvmm-sim-legacy dev=%d size=%d", d.ordinal, n))
	if err != nil {
		return nil, err
	}
	a.legacy = true
	a.refs++ // held by the buffer itself until MemFree
	base, ok := reserveVA(n, s.gran(), 0, false)
	if !ok {
		s.unref(a)
		return nil, driver.ErrorOutOfMemory
	}
	r := &reservation{base: base, size: n, legacy: true}
	s.addReservation(r)
	m := s.addMapping(r, base, a)
	s.unref(a)
	// Copies only for peers: resolve refuses their kernels and memsets.
	for _, peer := range s.devs {
		if peer.canAccess(d.ordinal) {
			s.setDevAccess(m, peer.ordinal, driver.AccessReadWrite)
		}
	}
	return &legacyAlloc{res: r, m: m}, nil
}

// dropLegacyBuffer frees what newLegacyBuffer made. The caller holds s.mu.
func (s *Sim) dropLegacyBuffer(l *legacyAlloc) {
	s.removeMapping(l.m)
	_ = releaseVA(l.res.base, l.res.size)
	s.res = removeItem(s.res, l.res)
}

// MemFree calls cuMemFree_v2; ptr must be what MemAlloc returned, else CUDA_ERROR_INVALID_VALUE.
func (s *Sim) MemFree(ptr driver.DevicePtr) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.begin("cuMemFree", ctxBound); err != nil {
		return err
	}
	s.drainAll() // DeferWork: the driver synchronizes first
	l, ok := s.legacy[ptr]
	if !ok {
		return driver.ErrorInvalidValue
	}
	delete(s.legacy, ptr)
	s.dropLegacyBuffer(l)
	return nil
}
