package pinned

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/memfd"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/vmm"
)

// Message kinds pinned sends over the ipc transport (ipc.KindUser + 0x20 onwards).
const (
	// KindRegion announces a shared region: its kind and size. For a SharedMemory region it carries
	// the memfd; a HostNUMA region's chunks follow as an ipc buffer (ipc.Send).
	KindRegion = ipc.KindUser + 0x20
)

// regionHeader is KindRegion's payload (little-endian): kind u32, reserved u32 (zero), size u64.
const regionHeaderSize = 16

// Share sends the region to the peer on conn, which opens it with Receive. A HostNUMA region goes as
// its chunks' file descriptors (ipc.Export, ipc.Send); a SharedMemory region as its memfd. Memory the
// caller registered (Registered) has no file to send: ErrNotSupported. The region stays the
// sender's; the peer's view stays valid after the sender closes it (the memory lives until the last
// process lets go). Writes on conn must not run concurrently. Share holds the region's lock only to
// duplicate the descriptors it sends, not while it writes them: a peer that does not read holds up
// that Share alone (bound its writes with a deadline on conn), never another Share or a Close.
func (r *Region) Share(conn *net.UnixConn) error {
	p, err := r.PrepareShare()
	if err != nil {
		return err
	}
	return p.Send(conn)
}

// Prepared is one Share of a region whose descriptors are duplicated (PrepareShare) but not sent yet.
type Prepared struct {
	r   *Region
	out outgoing // nil once sent or closed
}

// PrepareShare does what Share does before it writes: it duplicates the descriptors to send (and
// exports a HostNUMA region's chunks), so that a caller who must answer before it sends (the broker,
// which replies OK and then sends) learns first whether the region can be shared. Send them once
// with Send, or drop them with Close.
func (r *Region) PrepareShare() (*Prepared, error) {
	out, err := r.prepareShare()
	if err != nil {
		return nil, fmt.Errorf("pinned: share %s: %w", r, err)
	}
	return &Prepared{r: r, out: out}, nil
}

// Send writes the region on conn, as Share does, and closes the descriptors this process duplicated.
func (p *Prepared) Send(conn *net.UnixConn) error {
	if p == nil || p.out == nil {
		return fmt.Errorf("pinned: send a prepared share: already sent or closed: %w", ErrInvalidValue)
	}
	defer p.Close()
	hdr := make([]byte, regionHeaderSize)
	binary.LittleEndian.PutUint32(hdr[0:], uint32(p.r.kind))
	binary.LittleEndian.PutUint64(hdr[8:], p.r.size)
	if err := p.out.send(conn, hdr); err != nil {
		return fmt.Errorf("pinned: share %s: %w", p.r, err)
	}
	return nil
}

// Close drops a prepared share unsent. It is idempotent, and Send closes it too.
func (p *Prepared) Close() error {
	if p == nil || p.out == nil {
		return nil
	}
	err := p.out.Close()
	p.out = nil
	return err
}

// prepareShare duplicates, under the region's lock, the descriptors Share sends.
func (r *Region) prepareShare() (outgoing, error) {
	r.own.Lock()
	defer r.own.Unlock()
	if r.closed {
		return nil, ErrClosed
	}
	return r.impl.prepareShare(r)
}

// OpenOptions is the opener's choice of access for Receive.
type OpenOptions struct {
	// Grant lists the devices that may reach the region. Empty: the CPU alone, which costs no GPU
	// memory. A HostNUMA region is granted to exactly these devices; a SharedMemory region is
	// registered (cuMemHostRegister), which makes it visible to every device.
	Grant []*vmm.Device
	// ReadOnly lets the granted devices only read.
	ReadOnly bool
}

// Receive opens a region another process sent with Share. dev is the device through which a
// HostNUMA region's chunks are imported (its context makes the driver calls); it may be nil for a
// SharedMemory region opened for the CPU alone, which then needs no CUDA context at all, or when
// opts.Grant names a device (the first is used). The CPU can always read and write the region
// (Bytes). On error every received descriptor is closed and nothing is mapped.
func Receive(conn *net.UnixConn, dev *vmm.Device, opts OpenOptions) (*Region, error) {
	kind, payload, files, err := ipc.ReadMessage(conn)
	if err != nil {
		return nil, fmt.Errorf("pinned: receive region: %w", err)
	}
	owned := files
	defer func() {
		for _, f := range owned {
			f.Close()
		}
	}()
	if kind != KindRegion {
		return nil, fmt.Errorf("pinned: receive region: message kind %#x, want %#x (a region): %w", kind, KindRegion, ipc.ErrProtocol)
	}
	if len(payload) != regionHeaderSize || binary.LittleEndian.Uint32(payload[4:]) != 0 {
		return nil, fmt.Errorf("pinned: receive region: malformed header of %d bytes: %w", len(payload), ipc.ErrProtocol)
	}
	rk := Kind(binary.LittleEndian.Uint32(payload[0:]))
	size := binary.LittleEndian.Uint64(payload[8:])
	if size == 0 {
		return nil, fmt.Errorf("pinned: receive region: size 0: %w", ipc.ErrProtocol)
	}
	dev, grants, err := opts.resolve(dev)
	if err == nil && dev == nil && rk == HostNUMA {
		err = fmt.Errorf("a device to import a host-NUMA region through is needed: %w", ErrInvalidValue)
	}
	if err != nil {
		if rk == HostNUMA && len(files) == 0 {
			discardChunks(conn)
		}
		return nil, fmt.Errorf("pinned: receive region: %w", err)
	}
	var sys *vmm.System
	if dev != nil {
		sys = dev.System()
	}
	switch rk {
	case HostNUMA:
		if len(files) != 0 {
			return nil, fmt.Errorf("pinned: receive host-NUMA region: %d descriptors with the header: %w", len(files), ipc.ErrProtocol)
		}
		return receiveHostNUMA(conn, dev, size, grants, opts.ReadOnly)
	case SharedMemory:
		if len(files) != 1 {
			return nil, fmt.Errorf("pinned: receive shared-memory region: %d descriptors, want the memfd: %w", len(files), ipc.ErrProtocol)
		}
		owned = nil
		return openSharedMemory(files[0], dev, sys, size, grants, opts.ReadOnly)
	}
	return nil, fmt.Errorf("pinned: receive region: kind %d cannot be shared: %w", int(rk), ipc.ErrProtocol)
}

// Check reports whether Receive accepts dev and o, reading nothing: a nil device in Grant, or one
// of another System than dev's, is an error wrapping ErrInvalidValue. Check before asking a peer for
// its region, so that a bad argument costs no message on the connection.
func (o OpenOptions) Check(dev *vmm.Device) error {
	if _, _, err := o.resolve(dev); err != nil {
		return fmt.Errorf("pinned: receive region: %w", err)
	}
	return nil
}

// resolve is the device that imports (dev, else the first granted) and the granted devices.
func (o OpenOptions) resolve(dev *vmm.Device) (*vmm.Device, []*vmm.Device, error) {
	if dev == nil && len(o.Grant) > 0 {
		dev = o.Grant[0]
	}
	if len(o.Grant) == 0 {
		return dev, nil, nil
	}
	var sys *vmm.System
	if dev != nil {
		sys = dev.System()
	}
	grants, err := uniqueDevices(sys, o.Grant)
	return dev, grants, err
}

// discardChunks reads and closes a host-NUMA region's chunks that Receive does not open, so that
// the stream stays in step.
func discardChunks(conn *net.UnixConn) {
	if rcv, err := ipc.Receive(conn); err == nil {
		rcv.Close()
	}
}

func receiveHostNUMA(conn *net.UnixConn, dev *vmm.Device, size uint64, grants []*vmm.Device, readOnly bool) (*Region, error) {
	rcv, err := ipc.Receive(conn)
	if err != nil {
		return nil, fmt.Errorf("pinned: receive host-NUMA region: %w", err)
	}
	defer rcv.Close()
	if rcv.Desc.Size != size {
		return nil, fmt.Errorf("pinned: receive host-NUMA region: the header says %s, the descriptor %s: %w", units.FormatSize(size), units.FormatSize(rcv.Desc.Size), ipc.ErrProtocol)
	}
	if err := checkCovered(&rcv.Desc); err != nil {
		return nil, fmt.Errorf("pinned: receive host-NUMA region of %s: %w", units.FormatSize(size), err)
	}
	access := hostNUMAAccess(grants, readOnly)
	buf, err := ipc.Open(dev, rcv, access...)
	if err != nil {
		return nil, fmt.Errorf("pinned: open host-NUMA region of %s: %w", units.FormatSize(size), err)
	}
	r := &Region{kind: HostNUMA, dev: dev, sys: dev.System(), size: size, ptr: buf.Ptr(), impl: &importedHostNUMARegion{buf: buf},
		readOnly: readOnly, imported: true, granted: map[int]driver.AccessFlags{}}
	for _, a := range access[1:] {
		r.granted[int(a.Location.ID)] = a.Flags
	}
	r.mem = vmm.HostView(buf.Ptr(), size)
	r.track()
	return r, nil
}

// checkCovered requires a region's chunks to map every byte of [0, d.Size), back to back: Bytes
// covers the whole size, and touching a hole would kill the process. (ipc's Validate has already
// checked that they are in order, do not overlap and lie inside the size.)
func checkCovered(d *ipc.Descriptor) error {
	var end uint64
	for i, c := range d.Chunks {
		if c.Offset != end {
			return fmt.Errorf("chunk %d of %d starts at %#x, leaving a hole after %#x: %w", i, len(d.Chunks), c.Offset, end, ipc.ErrProtocol)
		}
		end = c.Offset + c.Size
	}
	if end != d.Size {
		return fmt.Errorf("the chunks end at %#x, leaving a hole up to the size %#x: %w", end, d.Size, ipc.ErrProtocol)
	}
	return nil
}

// openSharedMemory maps a received memfd (taking f over) and registers it when devices are granted.
func openSharedMemory(f *os.File, dev *vmm.Device, sys *vmm.System, size uint64, grants []*vmm.Device, readOnly bool) (*Region, error) {
	if size%pageSize != 0 {
		f.Close()
		return nil, fmt.Errorf("pinned: open shared-memory region: size %s is not a multiple of the page: %w", units.FormatSize(size), ipc.ErrProtocol)
	}
	// The sender must have sealed the file at exactly size bytes: a file it could still truncate
	// would kill this process (SIGBUS) at the next access past the new end.
	if err := memfd.CheckSealed(f, size); err != nil {
		f.Close()
		return nil, fmt.Errorf("pinned: open shared-memory region of %s: %w: %w", units.FormatSize(size), err, ipc.ErrProtocol)
	}
	mem, err := mapMemfd(f, size)
	if err != nil {
		f.Close()
		return nil, err
	}
	r := &Region{kind: SharedMemory, dev: dev, sys: sys, size: size, mem: mem, impl: &sharedMemoryRegion{memfd: f},
		readOnly: readOnly, imported: true, ptr: devicePtrOf(mem)}
	if len(grants) > 0 {
		if err := r.register(readOnly, nil); err != nil {
			return nil, errors.Join(err, r.undo())
		}
	}
	r.track()
	return r, nil
}
