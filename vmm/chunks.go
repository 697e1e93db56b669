package vmm

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/lifetime"
)

// Chunk is one physical allocation of a buffer made of several, at its offset from the buffer's
// first address.
type Chunk struct {
	Offset     uint64
	Allocation *Allocation
}

// Chunked is a buffer made of allocations mapped back to back at one address: growbuf.Buffer and
// stripe.Range implement it, and package ipc exports any Chunked value whole (every chunk, at its
// offset, so the receiver sees the same layout).
type Chunked interface {
	// Ptr is the buffer's first address.
	Ptr() driver.DevicePtr
	// Len is the number of bytes in use. The chunks cover at least Len bytes and may extend past it
	// (a growable buffer's capacity); exporters share every chunk.
	Len() uint64
	// Chunks lists the allocations in offset order. The allocations belong to the buffer: callers
	// may export them but must not close them, and must not use them after the buffer changes
	// (grows, shrinks or closes).
	Chunks() []Chunk
}

// ChunkSpec is one chunk for MapChunks: a new allocation of Size bytes made through Device with
// Alloc (when Allocation is nil), or the existing Allocation, mapped at Offset of Reservation with
// Access.
type ChunkSpec struct {
	Reservation *Reservation
	Offset      uint64
	// Size, Device and Alloc describe a new allocation (Reservation.MapNew); Size must be a multiple
	// of the location's granularity.
	Size   uint64
	Device *Device
	Alloc  AllocOptions
	// Allocation, when set, is mapped instead of a new one (Reservation.MapAccess). Own gives the
	// mapping its ownership (closing the mapping releases it), and makes MapChunks release it when
	// it fails.
	Allocation *Allocation
	Own        bool
	Access     []Access
}

// MapChunks maps every chunk, in order, creating those without an Allocation: cuMemCreate, cuMemMap
// and cuMemSetAccess per chunk. It is atomic: when a step fails, the mappings it made are closed in
// reverse order (unmapping them and releasing the allocations they own) and the allocations given
// with Own are released, and the error names the chunk and the driver call. An object whose clean-up
// fails is kept by the System (System.Orphans), which retries it in Close, so no failure leaves an
// object that no API can free. The mappings are returned in the order of specs.
func MapChunks(specs []ChunkSpec) ([]*Mapping, error) {
	maps := make([]*Mapping, 0, len(specs))
	for i, c := range specs {
		m, err := c.mapOne()
		if err != nil {
			err = fmt.Errorf("chunk %d of %d (offset %#x): %w", i, len(specs), c.Offset, err)
			return nil, errors.Join(err, undoChunks(maps, specs[i:]))
		}
		maps = append(maps, m)
	}
	return maps, nil
}

func (c ChunkSpec) mapOne() (*Mapping, error) {
	if c.Reservation == nil {
		return nil, fmt.Errorf("vmm: map chunk: nil reservation: %w", ErrInvalidValue)
	}
	if c.Allocation == nil {
		return c.Reservation.MapNew(c.Offset, c.Size, c.Device, c.Alloc, c.Access...)
	}
	m, err := c.Reservation.MapAccess(c.Offset, c.Allocation, c.Access...)
	if err == nil && c.Own {
		c.Reservation.own.Lock()
		m.ownsAlloc = true
		c.Reservation.own.Unlock()
	}
	return m, err
}

// undoChunks closes maps in reverse order and releases the Own allocations of the chunks not mapped;
// what fails to close goes to the System.
func undoChunks(maps []*Mapping, unmapped []ChunkSpec) error {
	var errs []error
	for i := len(maps) - 1; i >= 0; i-- {
		errs = append(errs, UndoClose(maps[i]))
	}
	for _, c := range unmapped {
		if c.Own && c.Allocation != nil {
			errs = append(errs, c.Allocation.undo())
		}
	}
	return errors.Join(errs...)
}

// Closer is any of this package's owners (Mapping, Allocation, Reservation, Stream, ...).
type Closer interface {
	Close() error
}

// describe names o for Orphans.
func describe(o Closer) string {
	if s, ok := o.(fmt.Stringer); ok {
		return s.String()
	}
	return strings.TrimPrefix(fmt.Sprintf("%T", o), "*vmm.")
}

// UndoClose closes o as part of undoing a failed operation. When the Close fails, o is handed to its
// System, which retries it in System.Close and lists it in System.Orphans, and the error says so:
// the caller may forget o without leaking it. sys is found from o's device.
func UndoClose(o Closer) error {
	if o == nil {
		return nil
	}
	err := o.Close()
	if err == nil {
		return nil
	}
	sys := systemOf(o)
	if sys == nil {
		return fmt.Errorf("undo: %w", err)
	}
	switch x := o.(type) {
	case *Mapping:
		return errors.Join(fmt.Errorf("undo: %w", err), sys.adoptMapping(x))
	case *Reservation:
		return errors.Join(fmt.Errorf("undo: %w", err), sys.adoptReservation(x))
	}
	return errors.Join(fmt.Errorf("undo: %w", err), sys.adopt(describe(o), ownerOf(o), o.Close))
}

func ownerOf(o Closer) *lifetime.Owner {
	switch x := o.(type) {
	case *Allocation:
		return &x.own
	case interface{ lifetimeOwner() *lifetime.Owner }:
		return x.lifetimeOwner()
	}
	return nil
}

func systemOf(o Closer) *System {
	switch x := o.(type) {
	case *Mapping:
		return x.res.dev.sys
	case *Allocation:
		return x.dev.sys
	case *Reservation:
		return x.dev.sys
	case interface{ Device() *Device }:
		return x.Device().sys
	}
	return nil
}

// ReserveChunks reserves size bytes of addresses (System.Reserve with opts) and maps specs into the
// new range (their Reservation field is set to it) with MapChunks. Either all of it happens or none:
// on failure the mappings are undone and the range freed (what cannot be freed goes to the System).
func (s *System) ReserveChunks(size uint64, opts ReserveOptions, specs []ChunkSpec) (*Reservation, []*Mapping, error) {
	r, err := s.Reserve(size, opts)
	if err != nil {
		var errs []error
		for _, c := range specs {
			if c.Own && c.Allocation != nil {
				errs = append(errs, c.Allocation.undo())
			}
		}
		return nil, nil, errors.Join(err, errors.Join(errs...))
	}
	specs = slices.Clone(specs)
	for i := range specs {
		specs[i].Reservation = r
	}
	maps, err := MapChunks(specs)
	if err != nil {
		return nil, nil, errors.Join(err, UndoClose(r))
	}
	return r, maps, nil
}
