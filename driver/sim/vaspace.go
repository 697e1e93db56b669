package sim

import (
	"sort"

	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
)

// reservation is a range of virtual address space: a real PROT_NONE mmap of this process, so that
// no host allocation can ever land on a simulated device address.
type reservation struct {
	base, size uint64
	legacy     bool       // backs a cuMemAlloc buffer: invisible to the VMM calls
	maps       []*mapping // sorted by va, never overlapping
}

func (r *reservation) end() uint64 { return r.base + r.size }

// mapping is an allocation mapped at va, with the access each device and the host have to it.
type mapping struct {
	va, size uint64
	alloc    *allocation
	res      *reservation
	dev      []driver.AccessFlags // per device ordinal
	host     driver.AccessFlags   // CPU access (host-visible memory only); the VA is mapped when non-zero
}

func (m *mapping) end() uint64 { return m.va + m.size }

// findRes returns the reservation containing addr, or nil.
func (s *Sim) findRes(addr uint64) *reservation {
	i := sort.Search(len(s.res), func(i int) bool { return s.res[i].end() > addr })
	if i < len(s.res) && s.res[i].base <= addr {
		return s.res[i]
	}
	return nil
}

// firstMap is the index of the first mapping of r that ends after addr.
func (r *reservation) firstMap(addr uint64) int {
	return sort.Search(len(r.maps), func(i int) bool { return r.maps[i].end() > addr })
}

// findMap returns r's mapping containing addr, or nil.
func (r *reservation) findMap(addr uint64) *mapping {
	if i := r.firstMap(addr); i < len(r.maps) && r.maps[i].va <= addr {
		return r.maps[i]
	}
	return nil
}

// mappingAt returns the mapping containing addr, or nil.
func (s *Sim) mappingAt(addr uint64) *mapping {
	if r := s.findRes(addr); r != nil {
		return r.findMap(addr)
	}
	return nil
}

// touchesRes reports whether [addr, addr+n) overlaps any reservation (the simulator's address
// space, where memory is device memory or VMM host memory rather than plain host memory).
func (s *Sim) touchesRes(addr, n uint64) bool {
	i := sort.Search(len(s.res), func(i int) bool { return s.res[i].end() > addr })
	return i < len(s.res) && s.res[i].base < addr+n
}

// span is the part [off, off+n) of mapping m that a range covers.
type span struct {
	m      *mapping
	off, n uint64
}

// spans splits [addr, addr+n) into the mappings that cover it, across adjacent mappings and adjacent
// reservations (a buffer is made of many chunks, possibly in several reservations after in-place
// growth). ok is false when any byte is not mapped.
func (s *Sim) spans(addr, n uint64) (out []span, ok bool) {
	if addr+n < addr {
		return nil, false
	}
	for n > 0 {
		m := s.mappingAt(addr)
		if m == nil {
			return nil, false
		}
		off := addr - m.va
		k := min(n, m.size-off)
		out = append(out, span{m, off, k})
		addr += k
		n -= k
	}
	return out, true
}

// wholeMappings returns the VMM mappings that exactly tile [addr, addr+n); ok is false when a byte is
// unmapped, a mapping is cut, or a mapping is cuMemAlloc memory.
func (s *Sim) wholeMappings(addr, n uint64) ([]*mapping, bool) {
	sp, ok := s.spans(addr, n)
	if !ok {
		return nil, false
	}
	maps := make([]*mapping, 0, len(sp))
	for _, x := range sp {
		if x.off != 0 || x.n != x.m.size || x.m.res.legacy {
			return nil, false
		}
		maps = append(maps, x.m)
	}
	return maps, true
}

// reserved reports whether [addr, addr+n) lies in VMM reservations (adjacent ones may be crossed).
func (s *Sim) reserved(addr, n uint64) bool {
	end := addr + n
	if end < addr {
		return false
	}
	for addr < end {
		r := s.findRes(addr)
		if r == nil || r.legacy {
			return false
		}
		addr = r.end()
	}
	return true
}

// MemAddressReserve calls cuMemAddressReserve. size must be a non-zero multiple of the granularity;
// alignment 0 or a power of two (one below the granularity is raised to it); flags 0. A non-zero hint
// is honored when the range there is free, which is how a reservation is extended in place (hint =
// end of the existing one), except at the end of a reservation under 32 MiB, which the driver does
// not extend (see va.go); otherwise the range goes anywhere. Sizes over MaxReservation (64 TiB), or
// address space that cannot be had, are CUDA_ERROR_OUT_OF_MEMORY.
func (s *Sim) MemAddressReserve(size, alignment uint64, hint driver.DevicePtr, flags uint64) (driver.DevicePtr, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.begin("cuMemAddressReserve", ctxBound); err != nil {
		return 0, err
	}
	if flags != 0 || size == 0 || !s.aligned(size) || alignment&(alignment-1) != 0 {
		return 0, driver.ErrorInvalidValue
	}
	if size > MaxReservation {
		return 0, driver.ErrorOutOfMemory
	}
	align := max(alignment, s.gran())
	base, ok := reserveVA(size, align, uint64(hint), s.cfg.refuseHints)
	if !ok {
		return 0, driver.ErrorOutOfMemory
	}
	s.addReservation(&reservation{base: base, size: size})
	return driver.DevicePtr(base), nil
}

func (s *Sim) addReservation(r *reservation) {
	s.res = insertSorted(s.res, r, func(r *reservation) uint64 { return r.base })
}

// MemAddressFree calls cuMemAddressFree. (ptr, size) must be exactly one reservation with nothing
// mapped in it; anything else, including a second free, is CUDA_ERROR_INVALID_VALUE.
func (s *Sim) MemAddressFree(ptr driver.DevicePtr, size uint64) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.begin("cuMemAddressFree", ctxBound); err != nil {
		return err
	}
	r := s.findRes(uint64(ptr))
	if r == nil || r.legacy || r.base != uint64(ptr) || r.size != size || len(r.maps) != 0 {
		return driver.ErrorInvalidValue
	}
	if err := releaseVA(r.base, r.size); err != nil {
		return driver.ErrorInvalidValue
	}
	s.res = removeItem(s.res, r)
	return nil
}

// MemMap calls cuMemMap: the whole allocation h at offset 0 (measured: offset != 0 and part of an
// allocation are CUDA_ERROR_NOT_SUPPORTED) into [ptr, ptr+size), which must be granularity-aligned and
// inside one reservation (CUDA_ERROR_INVALID_VALUE) and free of mappings
// (CUDA_ERROR_ALREADY_MAPPED). The new mapping has no access for anyone.
func (s *Sim) MemMap(ptr driver.DevicePtr, size, offset uint64, h driver.MemHandle, flags uint64) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.begin("cuMemMap", ctxBound); err != nil {
		return err
	}
	a, err := s.handle(h)
	if err != nil {
		return err
	}
	va := uint64(ptr)
	if flags != 0 || size == 0 || !s.aligned(va) || !s.aligned(size) {
		return driver.ErrorInvalidValue
	}
	if offset != 0 || size < a.size {
		return driver.ErrorNotSupported
	}
	if size > a.size {
		return driver.ErrorInvalidValue
	}
	r := s.findRes(va)
	if r == nil || r.legacy || va+size > r.end() {
		return driver.ErrorInvalidValue
	}
	if i := r.firstMap(va); i < len(r.maps) && r.maps[i].va < va+size {
		return driver.ErrorAlreadyMapped
	}
	s.addMapping(r, va, a)
	return nil
}

func (s *Sim) addMapping(r *reservation, va uint64, a *allocation) *mapping {
	m := &mapping{va: va, size: a.size, alloc: a, res: r, dev: make([]driver.AccessFlags, len(s.devs))}
	r.maps = insertSorted(r.maps, m, func(m *mapping) uint64 { return m.va })
	a.refs++
	return m
}

// MemUnmap calls cuMemUnmap. The range must lie in reserved space and cut no mapping
// (CUDA_ERROR_INVALID_VALUE); it may span several whole mappings, and a range with nothing mapped is
// a success, as measured. The mappings' access rights go with them.
func (s *Sim) MemUnmap(ptr driver.DevicePtr, size uint64) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.begin("cuMemUnmap", ctxBound); err != nil {
		return err
	}
	va := uint64(ptr)
	if size == 0 || !s.aligned(va) || !s.aligned(size) || !s.reserved(va, size) {
		return driver.ErrorInvalidValue
	}
	end := va + size
	var doomed []*mapping
	for addr := va; addr < end; {
		r := s.findRes(addr)
		for _, m := range r.maps[r.firstMap(addr):] {
			if m.va >= end {
				break
			}
			if m.va < va || m.end() > end {
				return driver.ErrorInvalidValue
			}
			doomed = append(doomed, m)
		}
		addr = r.end()
	}
	for _, m := range doomed {
		s.removeMapping(m)
	}
	return nil
}

// removeMapping drops m with its access rights (restoring PROT_NONE where the host could see it).
func (s *Sim) removeMapping(m *mapping) {
	if m.host != driver.AccessNone {
		_ = protectNone(uintptr(m.va), m.size)
	}
	for i := range m.dev {
		s.setDevAccess(m, i, driver.AccessNone)
	}
	m.res.maps = removeItem(m.res.maps, m)
	s.unref(m.alloc)
}

// setDevAccess sets device i's access to m, keeping the page-table accounting of host memory visible
// to devices.
func (s *Sim) setDevAccess(m *mapping, i int, f driver.AccessFlags) {
	old := m.dev[i]
	m.dev[i] = f
	if !m.alloc.hostVisible() {
		return
	}
	switch {
	case old == driver.AccessNone && f != driver.AccessNone:
		s.devs[i].hostVisible += m.size
	case old != driver.AccessNone && f == driver.AccessNone:
		s.devs[i].hostVisible -= m.size
	}
}

// hostProt is the CPU protection for host access flags.
func hostProt(f driver.AccessFlags) int {
	if f == driver.AccessReadWrite {
		return unix.PROT_READ | unix.PROT_WRITE
	}
	return unix.PROT_READ
}

// setHostAccess makes the CPU's view of m match f: the memfd mapped at the mapping's own address with
// the right protection, or inaccessible reserved space again.
func setHostAccess(m *mapping, f driver.AccessFlags) error {
	if f == m.host {
		return nil
	}
	var err error
	if f == driver.AccessNone {
		err = protectNone(uintptr(m.va), m.size)
	} else {
		err = mapFileAt(uintptr(m.va), m.size, hostProt(f), m.alloc.fd)
	}
	if err == nil {
		m.host = f
	}
	return err
}

func validFlags(f driver.AccessFlags) bool {
	return f == driver.AccessNone || f == driver.AccessRead || f == driver.AccessReadWrite
}

// MemSetAccess calls cuMemSetAccess. The range must be exactly tiled by whole VMM mappings
// (CUDA_ERROR_INVALID_VALUE otherwise, as measured; several mappings are fine). Each descriptor names
// a device, or the host (HOST, or HOST_NUMA node 0) for host-NUMA memory, which the CPU then reads and
// writes through the same virtual address; a host location for device memory is
// CUDA_ERROR_INVALID_VALUE. Granting a device access to another device's memory when the pair cannot
// access each other is CUDA_ERROR_PEER_ACCESS_UNSUPPORTED. Flags are NONE, READ or READWRITE. Nothing
// changes unless every descriptor is valid.
func (s *Sim) MemSetAccess(ptr driver.DevicePtr, size uint64, desc []driver.AccessDesc) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.begin("cuMemSetAccess", ctxBound); err != nil {
		return err
	}
	va := uint64(ptr)
	if size == 0 || !s.aligned(va) || !s.aligned(size) || len(desc) == 0 {
		return driver.ErrorInvalidValue
	}
	maps, ok := s.wholeMappings(va, size)
	if !ok {
		return driver.ErrorInvalidValue
	}
	for _, d := range desc {
		if !validFlags(d.Flags) {
			return driver.ErrorInvalidValue
		}
		switch d.Location.Type {
		case driver.LocationDevice:
			dev := s.device(driver.Device(d.Location.ID))
			if dev == nil {
				return driver.ErrorInvalidDevice
			}
			if d.Flags == driver.AccessNone {
				continue
			}
			for _, m := range maps {
				if o := m.alloc.owner(); o >= 0 && !dev.canAccess(o) {
					return driver.ErrorPeerAccessUnsupported
				}
			}
		case driver.LocationHost, driver.LocationHostNUMA:
			if d.Location.Type == driver.LocationHostNUMA && d.Location.ID != 0 {
				return driver.ErrorInvalidValue
			}
			for _, m := range maps {
				if !m.alloc.hostVisible() {
					return driver.ErrorInvalidValue
				}
			}
		default:
			return driver.ErrorInvalidValue
		}
	}
	// The host side first: it is the only step that can fail (mmap), and it is undone on failure.
	hostFlags := driver.AccessFlags(-1)
	for _, d := range desc {
		if d.Location.Type != driver.LocationDevice {
			hostFlags = d.Flags
		}
	}
	if hostFlags >= 0 {
		old := make([]driver.AccessFlags, len(maps))
		for i, m := range maps {
			old[i] = m.host
			if err := setHostAccess(m, hostFlags); err != nil {
				for j := range i {
					_ = setHostAccess(maps[j], old[j])
				}
				return driver.ErrorOutOfMemory
			}
		}
	}
	for _, d := range desc {
		if d.Location.Type == driver.LocationDevice {
			for _, m := range maps {
				s.setDevAccess(m, int(d.Location.ID), d.Flags)
			}
		}
	}
	return nil
}

// MemGetAccess calls cuMemGetAccess: the access loc has to the mapping containing ptr
// (CUDA_ERROR_INVALID_VALUE where nothing is mapped).
func (s *Sim) MemGetAccess(loc driver.Location, ptr driver.DevicePtr) (driver.AccessFlags, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.begin("cuMemGetAccess", ctxBound); err != nil {
		return 0, err
	}
	m := s.mappingAt(uint64(ptr))
	if m == nil {
		return 0, driver.ErrorInvalidValue
	}
	switch loc.Type {
	case driver.LocationDevice:
		if s.device(driver.Device(loc.ID)) == nil {
			return 0, driver.ErrorInvalidDevice
		}
		return m.dev[loc.ID], nil
	case driver.LocationHost:
		return m.host, nil
	case driver.LocationHostNUMA:
		if loc.ID != 0 {
			return 0, driver.ErrorInvalidValue
		}
		return m.host, nil
	}
	return 0, driver.ErrorInvalidValue
}
