package vmm

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"sort"
	"sync/atomic"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/lifetime"
	"github.com/cuvmm/cuvmm/internal/units"
)

// Access is one access right: a location (a device, or the host CPU for host-NUMA memory) and what
// it may do.
type Access struct {
	Location driver.Location
	Flags    driver.AccessFlags
}

// ReadWrite grants device d read and write access.
func ReadWrite(d *Device) Access { return Access{d.Location(), driver.AccessReadWrite} }

// ReadOnly grants device d read access only (supported for peers on the measured driver).
func ReadOnly(d *Device) Access { return Access{d.Location(), driver.AccessRead} }

// NoAccess revokes device d's access.
func NoAccess(d *Device) Access { return Access{d.Location(), driver.AccessNone} }

// HostReadWrite grants the CPU read and write access to host-NUMA memory, through the same virtual
// address the GPUs use.
func HostReadWrite() Access { return Access{driver.HostLocation(), driver.AccessReadWrite} }

// HostReadOnly grants the CPU read access to host-NUMA memory.
func HostReadOnly() Access { return Access{driver.HostLocation(), driver.AccessRead} }

func (a Access) String() string { return fmt.Sprintf("%s %s", a.Location, a.Flags) }

func accessDescs(access []Access) []driver.AccessDesc {
	out := make([]driver.AccessDesc, len(access))
	for i, a := range access {
		out[i] = driver.AccessDesc{Location: a.Location, Flags: a.Flags}
	}
	return out
}

// ReserveOptions tunes Reserve.
type ReserveOptions struct {
	// Alignment of the start address; 0 means the granularity. Must be a power of two multiple of
	// the granularity.
	Alignment uint64
	// Hint asks for the range to start at this address (for example the end of another
	// reservation, to extend it in place). The driver may place it elsewhere, and when it refuses
	// the hinted range outright (out of memory), Reserve asks again without the hint; see
	// RequireHint.
	Hint driver.DevicePtr
	// RequireHint makes Reserve fail (with an error wrapping ErrHintNotGranted, nothing kept) when
	// the driver does not grant the range at Hint.
	RequireHint bool
}

// ErrHintNotGranted is returned by Reserve with RequireHint when the range at the hint is taken.
var ErrHintNotGranted = errors.New("vmm: address hint not granted")

// Reservation is a range of virtual addresses (cuMemAddressReserve) into which allocations are
// mapped. It is safe for concurrent use.
type Reservation struct {
	dev  *Device // the device whose context reserved it (any device works for VA calls)
	ptr  driver.DevicePtr
	size uint64
	gran uint64

	own      lifetime.Owner      // its lock guards mappings and offsets; mappings are its children
	mappings map[uint64]*Mapping // by offset
	offsets  []uint64            // the keys of mappings, sorted, for overlap checks in O(log n)
	pending  []*Mapping          // unmapped, their allocations' release failed: retried by Close

	unblocking atomic.Bool // Close is retrying the System's orphans (mappings, ranges) that block pending releases
}

// Granularity is the granularity the system uses for reservations: the least common multiple of the
// minimum granularities of device memory among the devices opened so far (device 0 is opened when none is). On every known
// GPU it is 2 MiB. Opening only the devices in use matters: each opened device retains its primary
// context, which costs GPU memory.
func (s *System) Granularity() (uint64, error) {
	first, err := s.anyDevice()
	if err != nil {
		return 0, err
	}
	s.mu.Lock()
	devs := make([]*Device, 0, len(s.devices))
	for _, d := range s.devices {
		if d != nil {
			devs = append(devs, d)
		}
	}
	s.mu.Unlock()
	g, err := first.DeviceGranularity()
	if err != nil {
		return 0, err
	}
	for _, d := range devs {
		dg, err := d.DeviceGranularity()
		if err != nil {
			return 0, err
		}
		g = lcm(g, dg)
	}
	return g, nil
}

// Reserve reserves at least size bytes of virtual address space (cuMemAddressReserve). The size is
// rounded up to the system's granularity (Size reports it).
func (s *System) Reserve(size uint64, opts ReserveOptions) (*Reservation, error) {
	d, err := s.anyDevice()
	if err != nil {
		return nil, err
	}
	g, err := s.Granularity()
	if err != nil {
		return nil, err
	}
	rounded, err := roundUp("reserve", size, g)
	if err != nil {
		return nil, err
	}
	if opts.Alignment != 0 && (opts.Alignment%g != 0 || opts.Alignment&(opts.Alignment-1) != 0) {
		return nil, fmt.Errorf("vmm: reserve %s: alignment %#x is not a power-of-two multiple of the granularity %s: %w", units.FormatSize(rounded), opts.Alignment, units.FormatSize(g), ErrInvalidValue)
	}
	if uint64(opts.Hint)%g != 0 {
		return nil, fmt.Errorf("vmm: reserve %s: hint %#x is not a multiple of the granularity %s: %w", units.FormatSize(rounded), opts.Hint, units.FormatSize(g), ErrInvalidValue)
	}
	if opts.RequireHint && opts.Hint == 0 {
		return nil, fmt.Errorf("vmm: reserve %s: RequireHint without a hint: %w", units.FormatSize(rounded), ErrInvalidValue)
	}
	if opts.Hint != 0 {
		_ = s.retryIn(opts.Hint, opts.Hint+driver.DevicePtr(rounded)) // still failing: the hint is not granted
	}
	r := &Reservation{dev: d, size: rounded, gran: g, mappings: map[uint64]*Mapping{}}
	err = d.create(&r.own, "reservation", func(api driver.API) error {
		var err error
		r.ptr, err = reserveVA(api, rounded, opts)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("vmm: reserve %s (hint %#x): %w", units.FormatSize(rounded), opts.Hint, err)
	}
	lifetime.Track(r, &r.own)
	if opts.RequireHint && r.ptr != opts.Hint {
		err := fmt.Errorf("vmm: reserve %s (hint %#x): %w: got %#x", units.FormatSize(rounded), opts.Hint, ErrHintNotGranted, uint64(r.ptr))
		if ferr := r.Close(); ferr != nil {
			// The misplaced range stays owned: the System retries freeing it.
			err = errors.Join(err, fmt.Errorf("freeing the misplaced range: %w", ferr), s.adoptReservation(r))
		}
		return nil, err
	}
	return r, nil
}

// reserveVA calls cuMemAddressReserve. The driver may refuse a hinted range outright
// (CUDA_ERROR_OUT_OF_MEMORY) instead of placing it elsewhere: with opts.RequireHint that is the
// hint not granted; otherwise the hint was advice, and the range is asked for again without it.
func reserveVA(api driver.API, size uint64, opts ReserveOptions) (driver.DevicePtr, error) {
	p, err := api.MemAddressReserve(size, opts.Alignment, opts.Hint, 0)
	switch {
	case err == nil:
		return p, nil
	case opts.Hint == 0 || !errors.Is(err, driver.ErrOutOfMemory):
		return 0, fmt.Errorf("cuMemAddressReserve: %w", err)
	case opts.RequireHint:
		return 0, fmt.Errorf("cuMemAddressReserve: %w (%w)", ErrHintNotGranted, err)
	}
	p, again := api.MemAddressReserve(size, opts.Alignment, 0, 0)
	if again != nil {
		return 0, fmt.Errorf("cuMemAddressReserve: %w (at the hint: %w)", again, err)
	}
	return p, nil
}

// Ptr is the first address of the range.
func (r *Reservation) Ptr() driver.DevicePtr { return r.ptr }

// Size is the range's size in bytes.
func (r *Reservation) Size() uint64 { return r.size }

// End is the first address past the range.
func (r *Reservation) End() driver.DevicePtr { return r.ptr + driver.DevicePtr(r.size) }

// Granularity is the granularity offsets in this reservation must be multiples of.
func (r *Reservation) Granularity() uint64 { return r.gran }

func (r *Reservation) String() string {
	return fmt.Sprintf("reservation %#x+%s", uint64(r.ptr), units.FormatSize(r.size))
}

// checkRange validates [off, off+size) against the reservation; the caller holds r.mu.
func (r *Reservation) checkRange(op string, off, size uint64) error {
	if r.own.Closed() {
		return fmt.Errorf("vmm: %s: %s: %w", op, r, ErrClosed)
	}
	if size == 0 {
		return fmt.Errorf("vmm: %s at offset %#x of %s: size 0: %w", op, off, r, ErrInvalidValue)
	}
	if off%r.gran != 0 || size%r.gran != 0 {
		return fmt.Errorf("vmm: %s %s at offset %#x of %s: offset and size must be multiples of the granularity %s: %w", op, units.FormatSize(size), off, r, units.FormatSize(r.gran), ErrInvalidValue)
	}
	if off > r.size || size > r.size-off {
		return fmt.Errorf("vmm: %s %s at offset %#x: past the end of %s: %w", op, units.FormatSize(size), off, r, ErrInvalidValue)
	}
	return nil
}

// overlapping returns a mapping that overlaps [off, off+size); the caller holds r.mu.
func (r *Reservation) overlapping(off, size uint64) *Mapping {
	// Mappings do not overlap each other, so only the last one starting before off+size can.
	i := sort.Search(len(r.offsets), func(i int) bool { return r.offsets[i] >= off+size })
	if i == 0 {
		return nil
	}
	if m := r.mappings[r.offsets[i-1]]; m.off+m.size > off {
		return m
	}
	return nil
}

// inTheWay returns a mapping that overlaps [off, off+size), after retrying to close the ones there
// that a failed undo left (System.Orphans): they are in the way of a new mapping, and of nothing
// else. The error is the retry's, when such a mapping still fails to close. The caller holds r's lock.
func (r *Reservation) inTheWay(off, size uint64) (*Mapping, error) {
	for {
		m := r.overlapping(off, size)
		if m == nil || !m.orphan.Load() {
			return m, nil
		}
		if err := m.closeLocked(); err != nil {
			return m, fmt.Errorf("left by a failed undo, and closing it failed again: %w", err)
		}
	}
}

// overlapError names the mapping m in the way of op at off; cause is inTheWay's error.
func (r *Reservation) overlapError(op string, off uint64, m *Mapping, cause error) error {
	if cause != nil {
		return fmt.Errorf("vmm: %s at offset %#x of %s: overlaps the mapping at offset %#x (%w): %w", op, off, r, m.off, cause, ErrInvalidValue)
	}
	return fmt.Errorf("vmm: %s at offset %#x of %s: overlaps the mapping at offset %#x: %w", op, off, r, m.off, ErrInvalidValue)
}

// Map maps the whole allocation a at offset off (cuMemMap). The mapping has no access until
// SetAccess; use MapAccess to do both atomically. The allocation must not be closed before the
// mapping.
func (r *Reservation) Map(off uint64, a *Allocation) (*Mapping, error) {
	return r.MapAccess(off, a)
}

// MapAccess maps the whole allocation a at offset off and grants access (cuMemMap then
// cuMemSetAccess). Either both happen or neither: when setting access fails the range is unmapped
// again.
func (r *Reservation) MapAccess(off uint64, a *Allocation, access ...Access) (*Mapping, error) {
	if r == nil {
		return nil, fmt.Errorf("vmm: map: nil reservation: %w", ErrInvalidValue)
	}
	if err := a.check("map"); err != nil {
		return nil, err
	}
	r.own.Lock()
	defer r.own.Unlock()
	if err := r.checkRange("map "+a.String(), off, a.size); err != nil {
		return nil, err
	}
	if m, err := r.inTheWay(off, a.size); m != nil {
		return nil, r.overlapError("map "+a.String(), off, m, err)
	}
	var m *Mapping
	err := a.withHandle("map", func(h driver.MemHandle) error {
		var err error
		m, err = r.mapLocked(off, a, h, access)
		return err
	})
	return m, err
}

// mapLocked maps a (whose handle is h) at offset off and grants access; the caller holds r's lock
// and a's, so that a is neither closed nor released between the map and its record.
func (r *Reservation) mapLocked(off uint64, a *Allocation, h driver.MemHandle, access []Access) (*Mapping, error) {
	ptr := r.ptr + driver.DevicePtr(off)
	unmapFailed := false
	err := a.dev.do(func(api driver.API) error {
		var err error
		unmapFailed, err = mapGrant(api, ptr, a.size, h, access)
		return err
	})
	if err != nil {
		if unmapFailed {
			// Still mapped: the mapping stays owned, by the System, which retries unmapping it.
			err = errors.Join(err, r.keepOrphan(off, a, false))
		}
		return nil, fmt.Errorf("vmm: map %s at offset %#x of %s: %w", a, off, r, err)
	}
	return r.addMapping(off, a, false), nil
}

// mapGrant maps h at ptr and grants access (cuMemMap, cuMemSetAccess): both or neither, except when
// granting access and then unmapping both fail; then h stays mapped without that access
// (stillMapped), and what to do with it is the caller's.
func mapGrant(api driver.API, ptr driver.DevicePtr, size uint64, h driver.MemHandle, access []Access) (stillMapped bool, err error) {
	if err := api.MemMap(ptr, size, 0, h, 0); err != nil {
		return false, fmt.Errorf("cuMemMap: %w", err)
	}
	descs := accessDescs(access)
	if len(descs) == 0 {
		return false, nil
	}
	if err := api.MemSetAccess(ptr, size, descs); err != nil {
		err = fmt.Errorf("cuMemSetAccess %v: %w", access, err)
		if uerr := api.MemUnmap(ptr, size); uerr != nil {
			return true, errors.Join(err, fmt.Errorf("undo cuMemMap: %w", uerr))
		}
		return false, err
	}
	return false, nil
}

// addMapping records a mapping; the caller holds r.mu.
func (r *Reservation) addMapping(off uint64, a *Allocation, owns bool) *Mapping {
	m := &Mapping{res: r, alloc: a, off: off, size: a.size, ownsAlloc: owns}
	m.own.Init(&r.own, "mapping")
	lifetime.Track(m, &m.own)
	a.mappings.add(r.ptr + driver.DevicePtr(off))
	r.mappings[off] = m
	i, _ := slices.BinarySearch(r.offsets, off)
	r.offsets = slices.Insert(r.offsets, i, off)
	return m
}

// MapNew creates an allocation of size bytes through device d with opts, maps it at offset off and
// grants access: cuMemCreate, cuMemMap, cuMemSetAccess with one context binding. Either all happen or
// none. The returned Mapping owns the allocation: closing it unmaps and releases. size must be a
// multiple of the location's granularity (no rounding happens here, so the mapping covers exactly the
// bytes asked for).
func (r *Reservation) MapNew(off, size uint64, d *Device, opts AllocOptions, access ...Access) (*Mapping, error) {
	if r == nil || d == nil {
		return nil, fmt.Errorf("vmm: map new: nil reservation or device: %w", ErrInvalidValue)
	}
	p := opts.prop(d)
	g, err := d.Granularity(p.Location, driver.GranularityMinimum)
	if err != nil {
		return nil, err
	}
	if size%g != 0 {
		return nil, fmt.Errorf("vmm: map new %s at offset %#x: size is not a multiple of the granularity %s: %w", units.FormatSize(size), off, units.FormatSize(g), ErrInvalidValue)
	}
	r.own.Lock()
	defer r.own.Unlock()
	if err := r.checkRange("map new", off, size); err != nil {
		return nil, err
	}
	if m, err := r.inTheWay(off, size); m != nil {
		return nil, r.overlapError("map new "+units.FormatSize(size), off, m, err)
	}
	ptr := r.ptr + driver.DevicePtr(off)
	var a *Allocation
	mapped := false // still mapped after a failure
	err = d.do(func(api driver.API) error {
		h, err := api.MemCreate(size, &p, 0)
		if err != nil {
			return fmt.Errorf("cuMemCreate: %w", err)
		}
		a = d.newAllocation(h, size, p, false)
		mapped, err = mapGrant(api, ptr, size, h, access)
		return err
	})
	if err != nil {
		err = fmt.Errorf("vmm: map new %s at %s, offset %#x of %s: %w", units.FormatSize(size), p.Location, off, r, err)
		switch {
		case mapped:
			// Still mapped: the System keeps the mapping (and its allocation) and retries.
			err = errors.Join(err, r.keepOrphan(off, a, true))
		case a != nil:
			err = errors.Join(err, a.undo())
		}
		return nil, err
	}
	return r.addMapping(off, a, true), nil
}

// SetAccess grants access over [off, off+size) of the reservation, which must consist of whole
// mappings (cuMemSetAccess covers several adjacent mappings in one call).
func (r *Reservation) SetAccess(off, size uint64, access ...Access) error {
	if r == nil {
		return fmt.Errorf("vmm: set access: nil reservation: %w", ErrInvalidValue)
	}
	if len(access) == 0 {
		return fmt.Errorf("vmm: set access at offset %#x: no access descriptors: %w", off, ErrInvalidValue)
	}
	r.own.Lock()
	defer r.own.Unlock()
	if err := r.checkRange("set access", off, size); err != nil {
		return err
	}
	if err := r.coveredByMappings(off, size); err != nil {
		return err
	}
	return r.setAccessLocked(off, size, access)
}

// setAccessLocked is cuMemSetAccess over [off, off+size); the caller holds r's lock and has checked
// that the range is made of whole mappings.
func (r *Reservation) setAccessLocked(off, size uint64, access []Access) error {
	ptr := r.ptr + driver.DevicePtr(off)
	descs := accessDescs(access)
	if err := r.dev.do(func(api driver.API) error { return api.MemSetAccess(ptr, size, descs) }); err != nil {
		return fmt.Errorf("vmm: set access %v on %s at offset %#x of %s: %w", access, units.FormatSize(size), off, r, err)
	}
	return nil
}

// coveredByMappings checks that [off, off+size) is exactly a run of whole adjacent mappings; the
// caller holds r.mu.
func (r *Reservation) coveredByMappings(off, size uint64) error {
	_, err := r.mappingsIn(off, size)
	return err
}

// mappingsIn lists the mappings that make up [off, off+size), in order, or fails when the range is
// not exactly a run of whole adjacent mappings; the caller holds r.mu.
func (r *Reservation) mappingsIn(off, size uint64) ([]*Mapping, error) {
	var ms []*Mapping
	pos, end := off, off+size
	for pos < end {
		m, ok := r.mappings[pos]
		if !ok || m.off+m.size > end {
			return nil, fmt.Errorf("vmm: range %s at offset %#x of %s is not made of whole mappings (offset %#x): %w", units.FormatSize(size), off, r, pos, ErrInvalidValue)
		}
		ms = append(ms, m)
		pos = m.off + m.size
	}
	return ms, nil
}

// Mappings are the live mappings, ordered by offset.
func (r *Reservation) Mappings() []*Mapping {
	r.own.Lock()
	defer r.own.Unlock()
	out := make([]*Mapping, 0, len(r.offsets))
	for _, off := range r.offsets {
		out = append(out, r.mappings[off])
	}
	return out
}

// ExportDMABuf returns a dma-buf file for [off, off+size) of the reservation
// (cuMemGetHandleForAddressRange), for RDMA NICs and other importers. The range must be mapped.
// The caller owns the file.
func (r *Reservation) ExportDMABuf(off, size uint64) (*os.File, error) {
	if r == nil {
		return nil, fmt.Errorf("vmm: export dma-buf: nil reservation: %w", ErrInvalidValue)
	}
	r.own.Lock()
	defer r.own.Unlock()
	if err := r.checkRange("export dma-buf", off, size); err != nil {
		return nil, err
	}
	if err := r.coveredByMappings(off, size); err != nil {
		return nil, err
	}
	ptr := r.ptr + driver.DevicePtr(off)
	var fd int
	err := r.dev.do(func(api driver.API) error {
		var err error
		fd, err = api.MemGetHandleForAddressRange(ptr, size, driver.RangeHandleTypeDMABufFD, 0)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("vmm: export dma-buf of %s at offset %#x of %s: %w", units.FormatSize(size), off, r, err)
	}
	return os.NewFile(uintptr(fd), fmt.Sprintf("cuvmm-dmabuf-%s", units.FormatSize(size))), nil
}

// UnmapRange unmaps the whole mappings in [off, off+size) with one cuMemUnmap and closes them (owned
// allocations are released). The range must be made of whole mappings.
func (r *Reservation) UnmapRange(off, size uint64) error {
	if r == nil {
		return nil
	}
	for _, m := range r.unmappableNow(off, size) {
		m.unblockRelease()
	}
	r.own.Lock()
	defer r.own.Unlock()
	ms, err := r.unmappable(off, size)
	if err != nil {
		return err
	}
	end, err := beginUnmaps(ms)
	if err != nil {
		return err
	}
	defer end()
	ptr := r.ptr + driver.DevicePtr(off)
	if err := r.dev.do(func(api driver.API) error { return api.MemUnmap(ptr, size) }); err != nil {
		return fmt.Errorf("vmm: unmap %s at offset %#x of %s: %w", units.FormatSize(size), off, r, err)
	}
	// Every mapping leaves its allocation's list before any release: an allocation mapped twice in
	// the range is then released by its owning mapping whatever their order.
	for _, m := range ms {
		m.alloc.mappings.remove(m.Ptr())
	}
	var errs []error
	for _, m := range ms {
		if err := r.forget(m); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// unmappable lists the mappings UnmapRange unmaps in [off, off+size), or fails when the range is out
// of bounds or not made of whole mappings; the caller holds r's lock.
func (r *Reservation) unmappable(off, size uint64) ([]*Mapping, error) {
	if err := r.checkRange("unmap", off, size); err != nil {
		return nil, err
	}
	return r.mappingsIn(off, size)
}

// unmappableNow is unmappable taking r's lock: the mappings UnmapRange would unmap now (none when
// it refuses the range), whose releases it unblocks before it takes the lock (Mapping.unblockRelease
// skips those that release nothing).
func (r *Reservation) unmappableNow(off, size uint64) []*Mapping {
	r.own.Lock()
	defer r.own.Unlock()
	ms, _ := r.unmappable(off, size)
	return ms
}

// forget drops an unmapped mapping from the reservation and, when it owns its allocation,
// releases it; the caller holds r's lock. Should the release fail, the mapping stays open (and still
// counts as the reservation's child) so that its Close retries the release.
func (r *Reservation) forget(m *Mapping) error {
	delete(r.mappings, m.off)
	if i, ok := slices.BinarySearch(r.offsets, m.off); ok {
		r.offsets = slices.Delete(r.offsets, i, i+1)
	}
	m.unmapped.Store(true)
	m.alloc.mappings.remove(r.ptr + driver.DevicePtr(m.off))
	if err := m.finish(); err != nil {
		r.pending = append(r.pending, m)
		return err
	}
	return nil
}

// finish releases an unmapped mapping's allocation when it owns it, then closes the mapping.
func (m *Mapping) finish() error {
	if m.ownsAlloc {
		if err := m.alloc.release(); err != nil {
			return err
		}
	}
	m.own.Lock()
	m.own.MarkClosed()
	m.own.Unlock()
	return nil
}

// Close frees the address range (cuMemAddressFree). It fails with ErrInUse while mappings remain
// (including an unmapped one whose allocation could not be released yet). Mappings that a failed
// undo left in the range (System.Orphans) are closed first. Close is idempotent and safe on nil.
func (r *Reservation) Close() error {
	if r == nil {
		return nil
	}
	r.unblockPending()
	if err := r.closeOrphans(); err != nil {
		return fmt.Errorf("vmm: close %s: %w", r, err)
	}
	return r.own.Close("vmm: close "+r.String(), func() error {
		if err := r.dev.do(func(api driver.API) error { return api.MemAddressFree(r.ptr, r.size) }); err != nil {
			return fmt.Errorf("vmm: free %s: %w", r, err)
		}
		return nil
	})
}

// unblockPending retries the orphaned mappings and ranges the System keeps that still map the
// allocations of r.pending, whose release failed after an unmap, as Mapping.Close does before it
// releases. It runs without r's lock, since closing those takes their reservations' locks, and is
// skipped when r's Close comes back here through one of them (a range kept by the System whose
// Close is retried); a second Close of r made at the same time skips it too, and may then fail
// with ErrInUse where a retry succeeds.
func (r *Reservation) unblockPending() {
	if !r.unblocking.CompareAndSwap(false, true) {
		return
	}
	defer r.unblocking.Store(false)
	r.own.Lock()
	pending := slices.Clone(r.pending)
	r.own.Unlock()
	for _, m := range pending {
		m.unblockRelease()
	}
}

// closeOrphans retries closing the mappings a failed undo left in the range, then the releases that
// failed after an unmap, which such a mapping of the same allocation may have refused.
func (r *Reservation) closeOrphans() error {
	r.own.Lock()
	defer r.own.Unlock()
	var errs []error
	for _, off := range slices.Clone(r.offsets) {
		if m := r.mappings[off]; m.orphan.Load() {
			errs = append(errs, m.closeLocked())
		}
	}
	for _, m := range slices.Clone(r.pending) {
		errs = append(errs, m.closeLocked())
	}
	return errors.Join(errs...)
}

// keepOrphan records a mapping that a failed undo could not unmap and hands it to the System; the
// caller holds r's lock.
func (r *Reservation) keepOrphan(off uint64, a *Allocation, owns bool) error {
	return r.dev.sys.adoptMapping(r.addMapping(off, a, owns))
}

// Mapping is an allocation mapped into a reservation at an offset (cuMemMap).
type Mapping struct {
	res       *Reservation
	alloc     *Allocation
	off, size uint64
	ownsAlloc bool // guarded by res's lock

	own      lifetime.Owner
	unmapped atomic.Bool // unmapped, its allocation's release still pending
	orphan   atomic.Bool // left by a failed undo, never handed to a caller: the System keeps it
}

// gone reports whether the mapping is unmapped or closed.
func (m *Mapping) gone() bool { return m.unmapped.Load() || m.own.IsClosed() }

// Ptr is the mapping's first address.
func (m *Mapping) Ptr() driver.DevicePtr { return m.res.ptr + driver.DevicePtr(m.off) }

// Offset is the mapping's offset in its reservation.
func (m *Mapping) Offset() uint64 { return m.off }

// Size is the mapping's size (the whole allocation).
func (m *Mapping) Size() uint64 { return m.size }

// Allocation is the mapped allocation.
func (m *Mapping) Allocation() *Allocation { return m.alloc }

// Reservation is the reservation the mapping lives in.
func (m *Mapping) Reservation() *Reservation { return m.res }

func (m *Mapping) String() string {
	return fmt.Sprintf("mapping of %s at %#x", units.FormatSize(m.size), uint64(m.Ptr()))
}

// SetAccess grants access to the whole mapping (cuMemSetAccess). It fails with ErrClosed once the
// mapping is closed or unmapped, even when another mapping has since taken its place.
func (m *Mapping) SetAccess(access ...Access) error {
	if m == nil {
		return fmt.Errorf("vmm: set access: nil mapping: %w", ErrInvalidValue)
	}
	if len(access) == 0 {
		return fmt.Errorf("vmm: set access on %s: no access descriptors: %w", m, ErrInvalidValue)
	}
	r := m.res
	r.own.Lock()
	defer r.own.Unlock()
	// Checked under the lock that Close and UnmapRange hold, so that the mapping cannot go between
	// the check and the call.
	if m.gone() {
		return fmt.Errorf("vmm: set access on %s: %w", m, ErrClosed)
	}
	return r.setAccessLocked(m.off, m.size, access)
}

// Access reads the access flags loc has on the mapping (cuMemGetAccess). It fails with ErrClosed
// once the mapping is closed or unmapped.
func (m *Mapping) Access(loc driver.Location) (driver.AccessFlags, error) {
	if m == nil {
		return 0, fmt.Errorf("vmm: get access: nil mapping: %w", ErrInvalidValue)
	}
	m.res.own.Lock()
	defer m.res.own.Unlock()
	if m.gone() {
		return 0, fmt.Errorf("vmm: get access on %s: %w", m, ErrClosed)
	}
	var f driver.AccessFlags
	err := m.res.dev.do(func(api driver.API) error {
		var err error
		f, err = api.MemGetAccess(loc, m.Ptr())
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("vmm: get access of %s on %s: %w", loc, m, err)
	}
	return f, nil
}

// Close unmaps the mapping (cuMemUnmap) and, when the mapping owns its allocation (MapNew),
// releases it. Close is idempotent and safe on nil. When a step fails the mapping stays open and a
// later Close retries what is left (the unmap, or only the release).
func (m *Mapping) Close() error {
	if m == nil {
		return nil
	}
	m.unblockRelease()
	return m.closeWithoutUnblock()
}

// closeWithoutUnblock is Close without unblockRelease; it takes the reservation's lock.
func (m *Mapping) closeWithoutUnblock() error {
	m.res.own.Lock()
	defer m.res.own.Unlock()
	return m.closeLocked()
}

// unblockRelease is Allocation.unblockRelease for the allocation that m's Close releases, if m owns
// it; m itself counts among its mappings until unmapped. The caller holds no lock of this package.
func (m *Mapping) unblockRelease() {
	if !m.OwnsAllocation() {
		return
	}
	mine := 1
	if m.unmapped.Load() {
		mine = 0 // unmapped already, its release failed: what still maps the allocation is not m
	}
	m.alloc.unblockRelease(mine)
}

// closeLocked is Close; the caller holds the reservation's lock.
func (m *Mapping) closeLocked() error {
	r := m.res
	if m.own.IsClosed() {
		return nil
	}
	if m.unmapped.Load() {
		if err := m.finish(); err != nil {
			return err
		}
		r.pending = slices.DeleteFunc(r.pending, func(x *Mapping) bool { return x == m })
		return nil
	}
	end, err := beginUnmaps([]*Mapping{m})
	if err != nil {
		return err
	}
	defer end()
	ptr := m.Ptr()
	if err := r.dev.do(func(api driver.API) error { return api.MemUnmap(ptr, m.size) }); err != nil {
		return fmt.Errorf("vmm: unmap %s: %w", m, err)
	}
	return r.forget(m)
}
