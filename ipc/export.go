package ipc

import (
	"encoding/binary"
	"fmt"
	"net"
	"os"
	"sync"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/vmm"
)

// Exported is a buffer's descriptor with one POSIX file descriptor per chunk, ready to send. It owns
// its files: Close closes them (the exporter's buffer and any importer's mappings are unaffected).
type Exported struct {
	Desc  Descriptor
	Files []*os.File

	once sync.Once
	err  error
}

// Close closes the files. It is idempotent and safe on nil.
func (e *Exported) Close() error {
	if e == nil {
		return nil
	}
	e.once.Do(func() { e.err = closeFiles(e.Files) })
	return e.err
}

// Export exports every chunk of buf as a POSIX file descriptor (cuMemExportToShareableHandle) and
// describes the layout. The descriptor's Len is buf.Len() and its Size the larger of that and the
// end of the last chunk, so a growable buffer is shared with its whole capacity and its length. Every chunk's allocation must have been created with driver.HandleTypePosixFD
// among its handle types (see Allocate and HandleTypes). The buffer must not change (grow, shrink,
// close) while Export runs; the result stays valid after it does. On error nothing is left open.
func Export(buf vmm.Chunked) (*Exported, error) {
	if buf == nil {
		return nil, fmt.Errorf("ipc: export: nil buffer: %w", vmm.ErrInvalidValue)
	}
	chunks := buf.Chunks()
	if len(chunks) == 0 {
		return nil, fmt.Errorf("ipc: export: the buffer has no chunks: %w", vmm.ErrInvalidValue)
	}
	// The descriptor covers every chunk: a growable buffer's chunks may extend past its Len (its
	// capacity), and the receiver maps them all.
	desc := Descriptor{Size: buf.Len(), Len: buf.Len(), Chunks: make([]ChunkDesc, len(chunks))}
	for i, c := range chunks {
		if c.Allocation == nil {
			return nil, fmt.Errorf("ipc: export: chunk %d at offset %#x has no allocation: %w", i, c.Offset, vmm.ErrInvalidValue)
		}
		desc.Chunks[i] = ChunkDesc{Offset: c.Offset, Size: c.Allocation.Size(), Location: c.Allocation.Location(), HandleType: driver.HandleTypePosixFD}
		desc.Size = max(desc.Size, c.Offset+c.Allocation.Size())
	}
	if err := desc.Validate(); err != nil {
		return nil, fmt.Errorf("ipc: export %s: %w", units.FormatSize(desc.Size), err)
	}
	e := &Exported{Desc: desc, Files: make([]*os.File, 0, len(chunks))}
	for i, c := range chunks {
		f, err := c.Allocation.Export(driver.HandleTypePosixFD)
		if err != nil {
			_ = e.Close()
			return nil, fmt.Errorf("ipc: export chunk %d of %d (%s at offset %#x): %w", i, len(chunks), units.FormatSize(c.Allocation.Size()), c.Offset, err)
		}
		e.Files = append(e.Files, f)
	}
	return e, nil
}

// Send writes e's descriptor and files to conn: one KindBuffer message with the first
// MaxFDsPerMessage files, then KindFDs messages with the rest. The caller keeps e (close it after
// sending; the peer has its own descriptors).
func Send(conn *net.UnixConn, e *Exported) error {
	if e == nil {
		return fmt.Errorf("ipc: send: nil export: %w", vmm.ErrInvalidValue)
	}
	if len(e.Files) != len(e.Desc.Chunks) {
		return fmt.Errorf("ipc: send %s: %d files for %d chunks: %w", &e.Desc, len(e.Files), len(e.Desc.Chunks), ErrProtocol)
	}
	payload, err := e.Desc.MarshalBinary()
	if err != nil {
		return fmt.Errorf("ipc: send: %w", err)
	}
	first := min(len(e.Files), MaxFDsPerMessage)
	if err := WriteMessage(conn, KindBuffer, payload, e.Files[:first]); err != nil {
		return fmt.Errorf("ipc: send %s: %w", &e.Desc, err)
	}
	for i := first; i < len(e.Files); i += MaxFDsPerMessage {
		j := min(i+MaxFDsPerMessage, len(e.Files))
		var idx [4]byte
		binary.LittleEndian.PutUint32(idx[:], uint32(i))
		if err := WriteMessage(conn, KindFDs, idx[:], e.Files[i:j]); err != nil {
			return fmt.Errorf("ipc: send %s: chunks %d to %d: %w", &e.Desc, i, j-1, err)
		}
	}
	return nil
}

// Received is a descriptor with its chunks' files, as read by Receive. It owns the files; Close them
// once the buffer is open (Open does not need them afterwards).
type Received struct {
	Desc  Descriptor
	Files []*os.File

	once sync.Once
	err  error
}

// Close closes the files. It is idempotent and safe on nil.
func (r *Received) Close() error {
	if r == nil {
		return nil
	}
	r.once.Do(func() { r.err = closeFiles(r.Files) })
	return r.err
}

// Receive reads a buffer sent by Send (or a server's reply to a fetch). A KindError reply is
// returned as a *ServerError (errors.Is(err, ErrNotFound) for a name that is not published). The
// descriptor is validated strictly and must list exactly as many chunks as descriptors arrive: a
// mismatch, descriptors nobody asked for, or any other fault closes every received descriptor and
// returns an error.
func Receive(conn *net.UnixConn) (*Received, error) {
	kind, payload, files, err := ReadMessage(conn)
	if err != nil {
		return nil, fmt.Errorf("ipc: receive: %w", err)
	}
	switch kind {
	case KindBuffer:
	case KindError:
		if len(files) > 0 {
			n := len(files)
			_ = closeFiles(files)
			return nil, fmt.Errorf("ipc: receive: an error reply carried %d descriptors nobody asked for (closed): %w", n, ErrProtocol)
		}
		return nil, fmt.Errorf("ipc: receive: %w", decodeRemoteError(payload))
	default:
		_ = closeFiles(files)
		return nil, fmt.Errorf("ipc: receive: unexpected message kind %d (want %d, a buffer): %w", kind, KindBuffer, ErrProtocol)
	}
	r := &Received{Files: files}
	fail := func(err error) (*Received, error) {
		_ = r.Close()
		return nil, fmt.Errorf("ipc: receive: %w", err)
	}
	if err := r.Desc.UnmarshalBinary(payload); err != nil {
		return fail(err)
	}
	n := len(r.Desc.Chunks)
	if want := min(n, MaxFDsPerMessage); len(files) != want {
		return fail(descriptorCountError(&r.Desc, len(files), want))
	}
	for len(r.Files) < n {
		kind, payload, more, err := ReadMessage(conn)
		if err != nil {
			return fail(err)
		}
		r.Files = append(r.Files, more...)
		if kind != KindFDs {
			return fail(fmt.Errorf("%s: message kind %d where the descriptors of chunk %d onwards were due (kind %d): %w", &r.Desc, kind, len(r.Files)-len(more), KindFDs, ErrProtocol))
		}
		if len(payload) != 4 || int(binary.LittleEndian.Uint32(payload)) != len(r.Files)-len(more) {
			return fail(fmt.Errorf("%s: continuation for the wrong chunk (payload %x, want index %d): %w", &r.Desc, payload, len(r.Files)-len(more), ErrProtocol))
		}
		if want := min(n-(len(r.Files)-len(more)), MaxFDsPerMessage); len(more) != want {
			return fail(descriptorCountError(&r.Desc, len(more), want))
		}
	}
	return r, nil
}

func descriptorCountError(d *Descriptor, got, want int) error {
	if got > want {
		return fmt.Errorf("%s: %d descriptors arrived where %d were due: extra descriptors nobody asked for (closed): %w", d, got, want, ErrProtocol)
	}
	return fmt.Errorf("%s: the chunk table disagrees with the descriptors: %d arrived where %d were due: %w", d, got, want, ErrProtocol)
}

// encodeRemoteError builds a KindError payload.
func encodeRemoteError(code uint16, msg string) []byte {
	const maxMsg = 1024
	if len(msg) > maxMsg {
		msg = msg[:maxMsg]
	}
	b := make([]byte, 2+len(msg))
	binary.LittleEndian.PutUint16(b, code)
	copy(b[2:], msg)
	return b
}

func decodeRemoteError(b []byte) error {
	if len(b) < 2 {
		return fmt.Errorf("malformed error reply of %d bytes: %w", len(b), ErrProtocol)
	}
	return &ServerError{Code: binary.LittleEndian.Uint16(b), Message: string(b[2:])}
}

// FromReservation is the vmm.Chunked view of a reservation's mappings at the time of the call: the
// chunks are its mapped allocations at their offsets and Len is the end of the last one. Use it to
// export memory mapped with vmm directly (Reservation.MapNew with driver.HandleTypePosixFD).
func FromReservation(r *vmm.Reservation) vmm.Chunked {
	if r == nil {
		return &reservationChunks{} // no chunks: Export refuses it
	}
	rc := &reservationChunks{ptr: r.Ptr()}
	for _, m := range r.Mappings() {
		rc.chunks = append(rc.chunks, vmm.Chunk{Offset: m.Offset(), Allocation: m.Allocation()})
		rc.len = max(rc.len, m.Offset()+m.Size())
	}
	return rc
}

type reservationChunks struct {
	ptr    driver.DevicePtr
	len    uint64
	chunks []vmm.Chunk
}

func (r *reservationChunks) Ptr() driver.DevicePtr { return r.ptr }
func (r *reservationChunks) Len() uint64           { return r.len }
func (r *reservationChunks) Chunks() []vmm.Chunk   { return r.chunks }
