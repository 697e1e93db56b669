package pinned

import (
	"errors"
	"fmt"
	"net"
	"os"

	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/vmm"
)

// regionImpl is what one kind of region does its own way. Its methods run with the region's lock
// held (or before the region is shared).
type regionImpl interface {
	// visible lists the ordinals of the devices that can reach the region.
	visible(r *Region) []int
	// setAccess grants or revokes per-device access (HostNUMA only).
	setAccess(r *Region, acc []vmm.Access) error
	// chunks lists the allocations (vmm.Chunked), if any.
	chunks() []vmm.Chunk
	// prepareShare duplicates what Share sends (the chunks' or the memfd's descriptors), so that the
	// writes can run without the region's lock.
	prepareShare(r *Region) (outgoing, error)
	// release frees what the region holds, in teardown order; what it could not free it keeps, so
	// that a later call retries.
	release(r *Region) error
}

// hostNUMARegion is a HostNUMA region made in this process: its chunks mapped (each mapping owning
// its allocation) into one reservation.
type hostNUMARegion struct {
	res  *vmm.Reservation
	maps []*vmm.Mapping
}

func (h *hostNUMARegion) visible(r *Region) []int { return r.grantedDevices() }

func (h *hostNUMARegion) setAccess(r *Region, acc []vmm.Access) error {
	return h.res.SetAccess(0, r.size, acc...)
}

func (h *hostNUMARegion) chunks() []vmm.Chunk {
	out := make([]vmm.Chunk, 0, len(h.maps))
	for _, m := range h.maps {
		out = append(out, vmm.Chunk{Offset: m.Offset(), Allocation: m.Allocation()})
	}
	return out
}

func (h *hostNUMARegion) prepareShare(r *Region) (outgoing, error) { return exportChunks(r) }

func (h *hostNUMARegion) release(*Region) error {
	for len(h.maps) > 0 {
		if err := h.maps[len(h.maps)-1].Close(); err != nil {
			return err
		}
		h.maps = h.maps[:len(h.maps)-1]
	}
	if h.res != nil {
		if err := h.res.Close(); err != nil {
			return err
		}
		h.res = nil
	}
	return nil
}

// importedHostNUMARegion is a HostNUMA region opened from another process's descriptors.
type importedHostNUMARegion struct{ buf *ipc.Buffer }

func (h *importedHostNUMARegion) visible(r *Region) []int { return r.grantedDevices() }

func (h *importedHostNUMARegion) setAccess(_ *Region, acc []vmm.Access) error {
	return h.buf.SetAccess(acc...)
}

func (h *importedHostNUMARegion) chunks() []vmm.Chunk {
	if h.buf == nil { // released
		return nil
	}
	return h.buf.Chunks()
}

func (h *importedHostNUMARegion) prepareShare(r *Region) (outgoing, error) { return exportChunks(r) }

func (h *importedHostNUMARegion) release(*Region) error {
	if h.buf == nil {
		return nil
	}
	if err := h.buf.Close(); err != nil {
		return err
	}
	h.buf = nil
	return nil
}

// outgoing is what Share sends, with descriptors of its own: the region may close while it is
// written.
type outgoing interface {
	// send writes the header message, then what follows it.
	send(conn *net.UnixConn, hdr []byte) error
	// Close closes the descriptors (the peer has its own once they are sent).
	Close() error
}

// exportedChunks is a HostNUMA region's chunks, exported (ipc.Export).
type exportedChunks struct{ e *ipc.Exported }

func exportChunks(r *Region) (outgoing, error) {
	e, err := ipc.Export(lockedChunks{r}) // the caller holds r's lock, which Region.Chunks takes
	if err != nil {
		return nil, err
	}
	return exportedChunks{e}, nil
}

// send writes the header, then the chunks as an ipc buffer (ipc.Send).
func (x exportedChunks) send(conn *net.UnixConn, hdr []byte) error {
	if err := ipc.WriteMessage(conn, KindRegion, hdr, nil); err != nil {
		return err
	}
	return ipc.Send(conn, x.e)
}

func (x exportedChunks) Close() error { return x.e.Close() }

// dupMemfd is a duplicate of a SharedMemory region's memfd, sent with the header.
type dupMemfd struct{ f *os.File }

func (x dupMemfd) send(conn *net.UnixConn, hdr []byte) error {
	return ipc.WriteMessage(conn, KindRegion, hdr, []*os.File{x.f})
}

func (x dupMemfd) Close() error { return x.f.Close() }

// registration is the cuMemHostRegister part that SharedMemory and Registered regions share.
type registration struct{ reg *vmm.HostRegistration }

// visible: a registration is visible to every device where the process holds a context (the
// devices opened in the System, now or later); no registration, to none.
func (g *registration) visible(r *Region) []int {
	if g.reg == nil {
		return nil
	}
	return r.sys.OpenedDevices()
}

func (g *registration) setAccess(r *Region, _ []vmm.Access) error {
	return fmt.Errorf("only host-NUMA regions have per-device access (a registration is visible to every device): %w", ErrNotSupported)
}

func (g *registration) chunks() []vmm.Chunk { return nil }

// register pins r.mem with cuMemHostRegister. The pages are populated first, in parallel (see
// populate), so that registration finds them present; that is most of the time pinning takes.
func (g *registration) register(r *Region, readOnly bool, progress func(done, total uint64)) error {
	flags, err := registerFlags(r.dev, readOnly)
	if err != nil {
		return err
	}
	if err := populate(r.mem, readOnly, progress); err != nil {
		return err
	}
	reg, err := r.dev.HostRegister(r.mem, flags)
	if err != nil {
		return fmt.Errorf("pinned: register %s region of %s: %w", r.kind, units.FormatSize(r.size), classify(err))
	}
	g.reg = reg
	r.ptr = reg.Ptr()
	registryAdd(r)
	return nil
}

// unregister undoes register. Memory found already unregistered (ErrNotRegistered) counts as
// unregistered, and the error says someone else did it.
func (g *registration) unregister(r *Region) error {
	if g.reg == nil {
		return nil
	}
	var errs error
	if err := g.reg.Close(); err != nil {
		err = classify(err)
		if !errors.Is(err, ErrNotRegistered) {
			return err
		}
		errs = fmt.Errorf("someone else unregistered the memory: %w", err)
	}
	registryRemove(r)
	g.reg = nil
	return errs
}

// sharedMemoryRegion is a memfd mapped here, registered when devices are granted.
type sharedMemoryRegion struct {
	registration
	memfd *os.File
}

func (s *sharedMemoryRegion) prepareShare(*Region) (outgoing, error) {
	fd, err := unix.FcntlInt(s.memfd.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("duplicate the memfd: %w", err)
	}
	return dupMemfd{os.NewFile(uintptr(fd), s.memfd.Name())}, nil
}

func (s *sharedMemoryRegion) release(r *Region) error {
	err := s.unregister(r)
	if err != nil && !errors.Is(err, ErrNotRegistered) {
		return err
	}
	if r.mem != nil {
		if merr := unix.Munmap(r.mem); merr != nil {
			return errors.Join(err, fmt.Errorf("munmap: %w", merr))
		}
		r.mem = nil
	}
	if s.memfd != nil {
		if cerr := s.memfd.Close(); cerr != nil {
			err = errors.Join(err, fmt.Errorf("memfd: %w", cerr))
		}
		s.memfd = nil
	}
	return err
}

// registeredRegion is memory the caller owns, registered.
type registeredRegion struct{ registration }

func (g *registeredRegion) prepareShare(*Region) (outgoing, error) {
	return nil, fmt.Errorf("memory the caller registered has no file descriptor to pass (use New): %w", ErrNotSupported)
}

func (g *registeredRegion) release(r *Region) error { return g.unregister(r) }
