// Package stripe builds one virtual address range whose physical memory is spread over several GPUs,
// and which kernels on every one of those GPUs (and on extra devices that hold none of it) can
// dereference. It is the driver's multi-device pattern (cuda-samples multiDeviceAlloc): one
// cuMemAddressReserve, one cuMemCreate per stripe on the device that holds it, cuMemMap of each at its
// offset, and cuMemSetAccess for every device that uses the range.
//
//	r, err := stripe.New([]*vmm.Device{d0, d1}, 8<<30, stripe.Interleaved{Stripe: 128 << 20}, stripe.Options{})
//	defer r.Close()
//	// r.Ptr() is valid on d0 and d1; r.Segments(d0) are the bytes that live in d0's memory.
//
// Layouts: Blocked (one contiguous slab per device) and Interleaved (round-robin stripes).
// Everything New does is undone when one step fails: no allocation, mapping or reservation is left.
package stripe

import (
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"sync/atomic"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/lifetime"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/vmm"
)

// ErrNoPeerAccess is wrapped by New when a device that must use the range cannot access the memory
// of a device that holds part of it (cuDeviceCanAccessPeer answers 0). The error names the pair.
var ErrNoPeerAccess = errors.New("stripe: peer access not supported")

// Options tunes New. The zero value gives every listed device read-write access to the whole range,
// with no shareable handle types.
type Options struct {
	// ReadOnlyPeers grants each device read-only access (PROT_READ) to the stripes it does not hold,
	// and read-write access to its own. Writes through the range from a device that does not own the
	// stripe then fail (cuMemsetD8 answers CUDA_ERROR_INVALID_VALUE on the measured driver; a kernel
	// store faults). Access-only devices (AccessOnly) get read-only access to the whole range.
	ReadOnlyPeers bool
	// AccessOnly lists devices that use the range but hold none of it. They are granted access like
	// the holders' peers, and their granularity counts in the range's granularity.
	AccessOnly []*vmm.Device
	// HandleTypes are requested for every stripe's allocation (for example driver.HandleTypePosixFD),
	// so that the chunks can be exported (package ipc exports any vmm.Chunked whole).
	HandleTypes driver.HandleType
}

// Segment is a run of the range held by one device: [Offset, Offset+Size) from Ptr. Adjacent stripes
// held by the same device are merged into one segment.
type Segment struct {
	Offset uint64
	Size   uint64
}

// End is the offset just past the segment.
func (s Segment) End() uint64 { return s.Offset + s.Size }

// Range is one virtual address range striped over several devices. Its methods are safe for
// concurrent use; Close must not race with kernels or copies still using the range.
type Range struct {
	holders []*vmm.Device // the devices that hold memory, in the caller's order
	access  []*vmm.Device // AccessOnly
	layout  Layout
	opts    Options
	gran    uint64

	res    *vmm.Reservation
	ptr    atomic.Uint64 // res's address, 0 once Close freed it: Ptr and Len read it without the lock
	pieces []piece
	maps   []*vmm.Mapping // maps[i] holds pieces[i]
	segs   map[*vmm.Device][]Segment

	own lifetime.Owner // closed once Close freed everything
}

var _ vmm.Chunked = (*Range)(nil)

// New builds a range of at least size bytes over devices (the devices that hold memory, in layout
// order) and grants access to every device in devices and opts.AccessOnly.
//
// Granularity: the size and every stripe are multiples of the granularity common to the holders, the
// access-only devices and the system's reservations (vmm.System.CommonGranularity: the least common
// multiple of their minimum granularities; 2 MiB on every current GPU).
// size is rounded up to it; Size reports the result. For Interleaved, the stripe size must already be
// a multiple of it (it is not rounded: an error wrapping vmm.ErrInvalidValue says so).
//
// Before anything is allocated, New checks its input (an empty list, a nil device, a device listed
// twice or from another System, size 0, HandleTypes with a bit the driver does not define, a size
// that overflows when rounded or exceeds the holders' total memory: errors wrapping
// vmm.ErrInvalidValue, or driver.ErrOutOfMemory for the last) and peer capability: every listed
// device must be able to access every holder's memory (vmm.Device.CanAccessPeer), else the error
// wraps ErrNoPeerAccess and names the pair. Whether a device supports a defined handle type is the
// driver's answer when the stripes are created.
//
// Then it reserves one address range (cuMemAddressReserve) and, stripe by stripe in offset order,
// creates the stripe's memory on its holder, maps it and grants access (cuMemCreate, cuMemMap,
// cuMemSetAccess, with one context binding per stripe: Reservation.MapNew). When a step fails, the
// stripes already built are undone through vmm.MapChunks, last first, each unmapped (one cuMemUnmap
// per stripe) and released, and the address range freed; the error names the stripe and the driver
// call that failed.
//
// One device is allowed: the result is a plain VMM range on that device.
func New(devices []*vmm.Device, size uint64, layout Layout, opts Options) (*Range, error) {
	if len(devices) == 0 {
		return nil, fmt.Errorf("stripe: new: no devices: %w", vmm.ErrInvalidValue)
	}
	if nilLayout(layout) {
		return nil, fmt.Errorf("stripe: new: nil layout (want stripe.Blocked{} or stripe.Interleaved{Stripe: n}): %w", vmm.ErrInvalidValue)
	}
	all, err := checkDevices(devices, opts.AccessOnly)
	if err != nil {
		return nil, err
	}
	names := deviceNames(devices)
	if size == 0 {
		return nil, fmt.Errorf("stripe: new range over devices %s: size 0: %w", names, vmm.ErrInvalidValue)
	}
	if err := vmm.CheckHandleTypes(opts.HandleTypes); err != nil {
		return nil, fmt.Errorf("stripe: new range over devices %s: %w", names, err)
	}

	// The granularity: common to the devices that hold or access the range, and to the reservation.
	sys := devices[0].System()
	gran, err := sys.CommonGranularity(driver.Location{}, all...)
	if err != nil {
		return nil, fmt.Errorf("stripe: new range over devices %s: %w", names, err)
	}
	rounded, err := vmm.RoundUp("stripe: new range over devices "+names, size, gran)
	if err != nil {
		return nil, err
	}
	var total uint64
	for _, d := range devices {
		total += d.TotalMemory()
	}
	if rounded > total {
		return nil, fmt.Errorf("stripe: new range of %s over devices %s: more than the %s they have together: %w",
			units.FormatSize(rounded), names, units.FormatSize(total), driver.ErrOutOfMemory)
	}
	pieces, err := layout.plan(rounded, len(devices), gran)
	if err != nil {
		return nil, err
	}
	if err := checkPeers(devices, all); err != nil {
		return nil, err
	}

	r := &Range{
		holders: append([]*vmm.Device(nil), devices...),
		access:  append([]*vmm.Device(nil), opts.AccessOnly...),
		layout:  layout, opts: opts, gran: gran, pieces: pieces,
	}
	r.opts.AccessOnly = r.access
	if err := r.build(all); err != nil {
		return nil, fmt.Errorf("stripe: build %s %s over devices %s: %w", units.FormatSize(rounded), layout, names, err)
	}
	r.segs = segments(r.holders, pieces)
	r.own.Init(nil, "stripe range")
	lifetime.Track(r, &r.own)
	return r, nil
}

// checkDevices validates the holders and access-only devices and returns them all, holders first.
func checkDevices(devices, accessOnly []*vmm.Device) ([]*vmm.Device, error) {
	all := make([]*vmm.Device, 0, len(devices)+len(accessOnly))
	seen := map[int]string{}
	var sys *vmm.System
	check := func(list string, i int, d *vmm.Device) error {
		if d == nil {
			return fmt.Errorf("stripe: new: %s[%d] is a nil device: %w", list, i, vmm.ErrInvalidValue)
		}
		if sys == nil {
			sys = d.System()
		} else if d.System() != sys {
			return fmt.Errorf("stripe: new: %s[%d] (%s) belongs to another vmm.System: %w", list, i, d, vmm.ErrInvalidValue)
		}
		if where, dup := seen[d.Ordinal()]; dup {
			return fmt.Errorf("stripe: new: device %d is listed twice (%s and %s[%d]): %w", d.Ordinal(), where, list, i, vmm.ErrInvalidValue)
		}
		seen[d.Ordinal()] = fmt.Sprintf("%s[%d]", list, i)
		all = append(all, d)
		return nil
	}
	for i, d := range devices {
		if err := check("devices", i, d); err != nil {
			return nil, err
		}
	}
	for i, d := range accessOnly {
		if err := check("Options.AccessOnly", i, d); err != nil {
			return nil, err
		}
	}
	return all, nil
}

// checkPeers makes sure every device that uses the range can reach every holder's memory.
func checkPeers(holders, all []*vmm.Device) error {
	for _, a := range all {
		for _, h := range holders {
			if a == h {
				continue
			}
			ok, err := a.CanAccessPeer(h)
			if err != nil {
				return fmt.Errorf("stripe: new: peer check: %w", err)
			}
			if !ok {
				return fmt.Errorf("stripe: new: device %d cannot access the memory of device %d (cuDeviceCanAccessPeer(%d, %d) = 0): %w",
					a.Ordinal(), h.Ordinal(), a.Ordinal(), h.Ordinal(), ErrNoPeerAccess)
			}
		}
	}
	return nil
}

// build reserves the range and maps every piece (vmm.System.ReserveChunks: all or nothing).
func (r *Range) build(all []*vmm.Device) error {
	sys := r.holders[0].System()
	size := r.size()
	// The access each holder's stripes get: read-write for the holder, read-write or read-only for the
	// others.
	access := make([][]vmm.Access, len(r.holders))
	for i, h := range r.holders {
		acc := make([]vmm.Access, 0, len(all))
		for _, d := range all {
			if d == h || !r.opts.ReadOnlyPeers {
				acc = append(acc, vmm.ReadWrite(d))
			} else {
				acc = append(acc, vmm.ReadOnly(d))
			}
		}
		access[i] = acc
	}
	aopts := vmm.AllocOptions{HandleTypes: r.opts.HandleTypes}
	specs := make([]vmm.ChunkSpec, len(r.pieces))
	for i, p := range r.pieces {
		specs[i] = vmm.ChunkSpec{Offset: p.off, Size: p.size, Device: r.holders[p.holder], Alloc: aopts, Access: access[p.holder]}
	}
	res, maps, err := sys.ReserveChunks(size, vmm.ReserveOptions{}, specs)
	if err != nil {
		return err
	}
	res.SetKind("stripe")
	if res.Size() != size {
		err := fmt.Errorf("reserved %s instead of %s: %w", units.FormatSize(res.Size()), units.FormatSize(size), vmm.ErrInvalidValue)
		for i := len(maps) - 1; i >= 0; i-- {
			err = errors.Join(err, vmm.UndoClose(maps[i]))
		}
		return errors.Join(err, vmm.UndoClose(res))
	}
	r.res, r.maps = res, maps
	r.ptr.Store(uint64(res.Ptr()))
	return nil
}

// segments merges each holder's adjacent pieces.
func segments(holders []*vmm.Device, pieces []piece) map[*vmm.Device][]Segment {
	out := make(map[*vmm.Device][]Segment, len(holders))
	for _, p := range pieces {
		d := holders[p.holder]
		s := out[d]
		if n := len(s); n > 0 && s[n-1].End() == p.off {
			s[n-1].Size += p.size
		} else {
			s = append(s, Segment{Offset: p.off, Size: p.size})
		}
		out[d] = s
	}
	return out
}

func deviceNames(devs []*vmm.Device) string {
	parts := make([]string, len(devs))
	for i, d := range devs {
		if d == nil {
			parts[i] = "nil"
		} else {
			parts[i] = strconv.Itoa(d.Ordinal())
		}
	}
	return strings.Join(parts, ",")
}

func (r *Range) size() uint64 {
	if n := len(r.pieces); n > 0 {
		return r.pieces[n-1].off + r.pieces[n-1].size
	}
	return 0
}

// Ptr is the range's first address, valid on every holder and access-only device until Close, and
// 0 once Close succeeded (as growbuf's Buffer.Ptr): the freed addresses may be handed to another
// reservation. After a Close that failed, the range is still open and Ptr still its address. It is
// one atomic load, as Len.
func (r *Range) Ptr() driver.DevicePtr { return driver.DevicePtr(r.ptr.Load()) }

// Size is the range's size in bytes: the size asked of New rounded up to Granularity.
func (r *Range) Size() uint64 { return r.size() }

// Len is Size (vmm.Chunked), and 0 once the range is closed: the chunks (none then) cover Len.
func (r *Range) Len() uint64 {
	if r.Ptr() == 0 {
		return 0
	}
	return r.size()
}

// Granularity is the granularity the range's size and stripes are multiples of.
func (r *Range) Granularity() uint64 { return r.gran }

// Layout is the layout the range was built with.
func (r *Range) Layout() Layout { return r.layout }

// Devices are the devices that hold the range's memory, in layout order (a copy).
func (r *Range) Devices() []*vmm.Device { return append([]*vmm.Device(nil), r.holders...) }

// AccessOnly are the devices that access the range without holding any of it (a copy).
func (r *Range) AccessOnly() []*vmm.Device { return append([]*vmm.Device(nil), r.access...) }

// ReadOnlyPeers reports whether devices other than a stripe's holder may only read it.
func (r *Range) ReadOnlyPeers() bool { return r.opts.ReadOnlyPeers }

func (r *Range) String() string {
	return fmt.Sprintf("striped range %#x+%s %s over devices %s", uint64(r.Ptr()), units.FormatSize(r.size()), r.layout, deviceNames(r.holders))
}

func (r *Range) isClosed() bool { return r.own.IsClosed() }

// Owner is the device whose memory holds the byte at offset. Offsets at or past Size are errors
// wrapping vmm.ErrInvalidValue; after Close, vmm.ErrClosed.
func (r *Range) Owner(offset uint64) (*vmm.Device, error) {
	if r.isClosed() {
		return nil, fmt.Errorf("stripe: owner of offset %#x: %w", offset, vmm.ErrClosed)
	}
	if offset >= r.size() {
		return nil, fmt.Errorf("stripe: owner of offset %#x: past the end of %s: %w", offset, r, vmm.ErrInvalidValue)
	}
	i := sort.Search(len(r.pieces), func(i int) bool { return r.pieces[i].off+r.pieces[i].size > offset })
	return r.holders[r.pieces[i].holder], nil
}

// Segments are the runs of the range held in d's memory, in offset order, adjacent stripes merged
// (a copy). A device that holds nothing (an access-only device, one not in the range, or a holder of
// a range too small to reach it) has none; so has a closed range.
func (r *Range) Segments(d *vmm.Device) []Segment {
	if r.isClosed() {
		return nil
	}
	return append([]Segment(nil), r.segs[d]...)
}

// LocalBytes is how many bytes of the range d holds.
func (r *Range) LocalBytes(d *vmm.Device) uint64 {
	var n uint64
	for _, s := range r.Segments(d) {
		n += s.Size
	}
	return n
}

// Chunks lists the range's allocations, one per stripe (per slab for Blocked), in offset order
// (vmm.Chunked). Allocation.Device tells a chunk's holder. The allocations belong to the range: export
// them, but do not close them or use them after Close. A closed range has none.
func (r *Range) Chunks() []vmm.Chunk {
	if r.isClosed() {
		return nil
	}
	out := make([]vmm.Chunk, len(r.maps))
	for i, m := range r.maps {
		out[i] = vmm.Chunk{Offset: m.Offset(), Allocation: m.Allocation()}
	}
	return out
}

// Close unmaps the whole range with one cuMemUnmap, releases every stripe's memory and frees the
// address range. Work still using the range must have finished. Afterwards Ptr and Len are 0, and
// Segments and Chunks empty; Size still tells what the range was. Close is idempotent and safe on
// nil; when it fails the range stays open (it never reports success while memory is held) and Close
// may be called again.
func (r *Range) Close() error {
	if r == nil {
		return nil
	}
	what := "stripe: close " + r.String()
	return r.own.Close(what, func() error {
		if len(r.res.Mappings()) > 0 {
			// A failed cuMemUnmap changes nothing; a failed release leaves its mapping pending in
			// the reservation, whose Close retries it.
			if err := r.res.UnmapRange(0, r.size()); err != nil && len(r.res.Mappings()) > 0 {
				return fmt.Errorf("%s: %w", what, err)
			}
		}
		if err := r.res.Close(); err != nil {
			return fmt.Errorf("%s: %w", what, err)
		}
		r.ptr.Store(0)
		return nil
	})
}
