package ipc

import (
	"errors"
	"fmt"
	"os"
	"slices"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/lifetime"
	"github.com/cuvmm/cuvmm/internal/memfd"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/vmm"
)

// Buffer is a received buffer mapped in this process: one reservation with every chunk imported and
// mapped at its offset, so it has the exporter's layout. It implements vmm.Chunked. (The driver
// reports no handle types for imported memory, so Export refuses it with an error wrapping
// vmm.ErrInvalidValue: share the original instead.) The memory stays valid until Close, whatever the
// exporter does meanwhile.
type Buffer struct {
	dev    *vmm.Device
	desc   Descriptor
	res    *vmm.Reservation
	allocs []*vmm.Allocation // imported, by chunk
	maps   []*vmm.Mapping    // by chunk
	access []vmm.Access      // the access last granted over every chunk; guarded by own's lock

	own lifetime.Owner // its lock serializes SetAccess and Close; closed once Close freed everything
}

var _ vmm.Chunked = (*Buffer)(nil)

// Open imports every chunk of r through dev (cuMemImportFromShareableHandle), reserves one range of
// r.Desc.Size bytes (cuMemAddressReserve), maps each chunk at its offset (cuMemMap) and grants access
// (cuMemSetAccess, one call per run of adjacent chunks). access is the receiver's choice: devices
// read-write or read-only (vmm.ReadWrite, vmm.ReadOnly), the CPU for host-NUMA memory
// (vmm.HostReadWrite, vmm.HostReadOnly); none means vmm.ReadWrite(dev). Open is atomic: when a step
// fails for any chunk, what was done is undone and the error names the chunk and the step. r keeps its
// files; close r once Open returns.
func Open(dev *vmm.Device, r *Received, access ...vmm.Access) (*Buffer, error) {
	if dev == nil || r == nil {
		return nil, fmt.Errorf("ipc: open: nil device or received buffer: %w", vmm.ErrInvalidValue)
	}
	desc := r.Desc
	desc.Chunks = slices.Clone(desc.Chunks) // the buffer's own: r may be changed or reused after Open
	if err := desc.Validate(); err != nil {
		return nil, fmt.Errorf("ipc: open: %w", err)
	}
	if len(r.Files) != len(desc.Chunks) {
		return nil, fmt.Errorf("ipc: open %s: %d files for %d chunks: %w", &desc, len(r.Files), len(desc.Chunks), ErrProtocol)
	}
	if len(access) == 0 {
		access = []vmm.Access{vmm.ReadWrite(dev)}
	}
	allocs, err := importChunks(dev, r)
	if err != nil {
		return nil, err
	}
	specs := make([]vmm.ChunkSpec, len(allocs))
	for i, a := range allocs {
		specs[i] = vmm.ChunkSpec{Offset: desc.Chunks[i].Offset, Allocation: a, Own: true}
	}
	// Atomic: on failure the mappings are undone, the imports released and the range freed; what
	// cannot be is kept by the System, which retries it in Close.
	res, maps, err := dev.System().ReserveChunks(desc.Size, vmm.ReserveOptions{}, specs)
	if err != nil {
		return nil, fmt.Errorf("ipc: open %s: reserve and map (cuMemAddressReserve, cuMemMap): %w", &desc, err)
	}
	b := &Buffer{dev: dev, desc: desc, res: res, allocs: allocs, maps: maps, access: slices.Clone(access)}
	if i, err := b.setAccess(access); err != nil {
		err = fmt.Errorf("ipc: open %s: %s: set access (cuMemSetAccess): %w", &desc, chunkName(&desc, i), err)
		return nil, errors.Join(err, b.undo())
	}
	b.own.Init(nil, "received buffer")
	lifetime.Track(b, &b.own)
	return b, nil
}

// importChunks checks every received file's seals and imports it (cuMemImportFromShareableHandle).
// On failure the imports made are released (what cannot be goes to the System) and the error names
// the chunk and the step.
func importChunks(dev *vmm.Device, r *Received) ([]*vmm.Allocation, error) {
	desc := &r.Desc
	allocs := make([]*vmm.Allocation, 0, len(desc.Chunks))
	fail := func(i int, step string, err error) ([]*vmm.Allocation, error) {
		err = fmt.Errorf("ipc: open %s: %s: %s: %w", desc, chunkName(desc, i), step, err)
		for _, a := range allocs {
			err = errors.Join(err, vmm.UndoClose(a))
		}
		return nil, err
	}
	for i, c := range desc.Chunks {
		if err := checkSeals(r.Files[i], c.Size); err != nil {
			return fail(i, "check seals", err)
		}
		a, err := dev.Import(r.Files[i], c.Size, c.HandleType)
		if err != nil {
			return fail(i, "import (cuMemImportFromShareableHandle)", err)
		}
		allocs = append(allocs, a)
	}
	return allocs, nil
}

func chunkName(d *Descriptor, i int) string {
	c := d.Chunks[i]
	return fmt.Sprintf("chunk %d of %d (%s at offset %#x, %s)", i, len(d.Chunks), units.FormatSize(c.Size), c.Offset, c.Location)
}

// setAccess grants access over each run of adjacent chunks; on error it reports the first chunk of
// the run that failed.
func (b *Buffer) setAccess(access []vmm.Access) (int, error) {
	return b.setAccessBefore(len(b.desc.Chunks), access)
}

// setAccessBefore is setAccess over the runs that start before chunk n.
func (b *Buffer) setAccessBefore(n int, access []vmm.Access) (int, error) {
	cs := b.desc.Chunks
	for i := 0; i < n; {
		j := i + 1
		for j < len(cs) && cs[j].Offset == cs[j-1].Offset+cs[j-1].Size {
			j++
		}
		end := cs[j-1].Offset + cs[j-1].Size
		if err := b.res.SetAccess(cs[i].Offset, end-cs[i].Offset, access...); err != nil {
			return i, err
		}
		i = j
	}
	return 0, nil
}

// teardown unmaps (releasing the imports the mappings own) and frees, in that order, keeping going
// after errors. What it could not close stays with the buffer for the next Close: Mapping and
// Reservation Close are idempotent.
func (b *Buffer) teardown() error {
	var errs []error
	for _, m := range b.maps {
		if err := m.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	if err := b.res.Close(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// undo is teardown for a failed Open: what cannot be closed goes to the System, which retries it in
// Close, since no Buffer is returned to own it.
func (b *Buffer) undo() error {
	var errs []error
	for i := len(b.maps) - 1; i >= 0; i-- {
		errs = append(errs, vmm.UndoClose(b.maps[i]))
	}
	errs = append(errs, vmm.UndoClose(b.res))
	return errors.Join(errs...)
}

// Ptr is the buffer's first address in this process (not the exporter's address); 0 once closed,
// since the driver may give the freed range to another reservation.
func (b *Buffer) Ptr() driver.DevicePtr {
	if b.closed() {
		return 0
	}
	return b.res.Ptr()
}

// Len is the exporter's length, the bytes in use (Descriptor.Len); the mapping may be larger (Cap).
// A closed buffer's is 0, as it has no chunks.
func (b *Buffer) Len() uint64 {
	if b.closed() {
		return 0
	}
	return b.desc.Len
}

// Cap is the mapped capacity, the descriptor's size: every chunk lies inside [0, Cap). 0 once
// closed.
func (b *Buffer) Cap() uint64 {
	if b.closed() {
		return 0
	}
	return b.desc.Size
}

func (b *Buffer) closed() bool { return b.own.IsClosed() }

// Chunks are the imported allocations at their offsets. They belong to the buffer. A closed buffer
// has none (so that callers such as package nccl refuse it).
func (b *Buffer) Chunks() []vmm.Chunk {
	b.own.Lock()
	defer b.own.Unlock()
	if b.own.Closed() {
		return nil
	}
	out := make([]vmm.Chunk, len(b.allocs))
	for i, a := range b.allocs {
		out[i] = vmm.Chunk{Offset: b.desc.Chunks[i].Offset, Allocation: a}
	}
	return out
}

// Descriptor is the descriptor the buffer was opened from (a copy: changing it changes nothing).
func (b *Buffer) Descriptor() Descriptor {
	d := b.desc
	d.Chunks = slices.Clone(d.Chunks)
	return d
}

// Device is the device the chunks were imported through.
func (b *Buffer) Device() *vmm.Device { return b.dev }

// Reservation is the buffer's address range. It belongs to the buffer.
func (b *Buffer) Reservation() *vmm.Reservation { return b.res }

// SetAccess changes the access rights over the whole buffer (cuMemSetAccess per run of adjacent
// chunks), for example to grant a second device or the CPU. When a run fails, the runs before it
// get the access they had back, so that the whole buffer keeps one access; should that fail too,
// the error says so.
func (b *Buffer) SetAccess(access ...vmm.Access) error {
	b.own.Lock()
	defer b.own.Unlock()
	if b.own.Closed() {
		return fmt.Errorf("ipc: set access on %s: %w", &b.desc, vmm.ErrClosed)
	}
	i, err := b.setAccess(access)
	if err == nil {
		b.access = slices.Clone(access)
		return nil
	}
	err = fmt.Errorf("ipc: set access on %s: %s: %w", &b.desc, chunkName(&b.desc, i), err)
	if _, rerr := b.setAccessBefore(i, b.access); rerr != nil {
		err = errors.Join(err, fmt.Errorf("ipc: restoring the access of the chunks before it failed too, so the buffer's access is mixed: %w", rerr))
	}
	return err
}

func (b *Buffer) String() string {
	return fmt.Sprintf("%s mapped at %#x", &b.desc, uint64(b.res.Ptr()))
}

// Close unmaps every chunk (cuMemUnmap), releases the imports (cuMemRelease) and frees the range
// (cuMemAddressFree). The physical memory stays for the exporter and other importers. Close is
// idempotent and safe on nil.
func (b *Buffer) Close() error {
	if b == nil {
		return nil
	}
	b.own.Lock()
	defer b.own.Unlock()
	if b.own.Closed() {
		return nil
	}
	if err := b.teardown(); err != nil {
		return fmt.Errorf("ipc: close %s: %w", &b.desc, err)
	}
	b.own.MarkClosed()
	return nil
}

// checkSeals refuses a memfd (the simulator's handles, or a hostile peer's file) that its sender
// could still resize, or whose size is not the chunk's: mapping it would let that process kill this
// one with SIGBUS by truncating it. The real driver's handles are not memfds and pass untouched.
func checkSeals(f *os.File, size uint64) error {
	if f == nil {
		return fmt.Errorf("nil file: %w", ErrProtocol)
	}
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var cerr error
	if err := rc.Control(func(fd uintptr) {
		if memfd.IsMemfd(int(fd)) {
			cerr = memfd.CheckSealedFD(int(fd), size)
		}
	}); err != nil {
		return err
	}
	if cerr != nil {
		return fmt.Errorf("%w: %w", ErrProtocol, cerr)
	}
	return nil
}
