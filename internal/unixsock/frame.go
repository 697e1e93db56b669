package unixsock

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"time"

	"golang.org/x/sys/unix"
)

// Wire format of one frame on a Unix stream socket (little-endian):
//
//	offset size field
//	0      4    magic "CVMI"
//	4      2    version (1)
//	6      2    kind (not 0)
//	8      4    payload length (at most MaxPayload)
//	12     2    number of file descriptors carried (at most MaxFDs)
//	14     2    reserved, zero
//	16     n    payload
//
// The descriptors travel as one SCM_RIGHTS control message attached to the header's bytes, sent in
// the same sendmsg as the header and payload.
const (
	// HeaderSize is the size of a frame header.
	HeaderSize = 16
	// Version is the frame format version written and accepted.
	Version = 1
	// MaxPayload is the largest payload a frame may carry (1 MiB).
	MaxPayload = 1 << 20
	// MaxFDs is the most descriptors one frame carries (the kernel allows 253 per SCM_RIGHTS
	// message).
	MaxFDs = 250
	// Magic is "CVMI" read as a little-endian uint32.
	Magic uint32 = 'C' | 'V'<<8 | 'M'<<16 | 'I'<<24
)

// growStep is how far a frame's buffer may grow ahead of the bytes received (or as far as the bytes
// received, if more).
const growStep = 64 << 10

// oobSize fits one SCM_RIGHTS message of MaxFDs descriptors: a peer that sends more gets its control
// data truncated (MSG_CTRUNC), which is refused.
var oobSize = unix.CmsgSpace(MaxFDs * 4)

// Header is a decoded frame header.
type Header struct {
	Kind   uint16
	Length uint32
	NFDs   uint16
}

// Put writes h into b (at least HeaderSize bytes).
func (h Header) Put(b []byte) {
	binary.LittleEndian.PutUint32(b[0:], Magic)
	binary.LittleEndian.PutUint16(b[4:], Version)
	binary.LittleEndian.PutUint16(b[6:], h.Kind)
	binary.LittleEndian.PutUint32(b[8:], h.Length)
	binary.LittleEndian.PutUint16(b[12:], h.NFDs)
	binary.LittleEndian.PutUint16(b[14:], 0)
}

// ParseHeader validates a frame header against maxPayload (MaxPayload when 0).
func ParseHeader(b []byte, maxPayload int) (Header, error) {
	if maxPayload <= 0 {
		maxPayload = MaxPayload
	}
	if len(b) < HeaderSize {
		return Header{}, fmt.Errorf("%w: header of %d bytes, want %d", ErrProtocol, len(b), HeaderSize)
	}
	if m := binary.LittleEndian.Uint32(b[0:]); m != Magic {
		return Header{}, fmt.Errorf("%w: not a cuvmm ipc message (magic %#08x, want %#08x \"CVMI\")", ErrProtocol, m, Magic)
	}
	if v := binary.LittleEndian.Uint16(b[4:]); v != Version {
		return Header{}, fmt.Errorf("%w: message version %d, this side speaks version %d", ErrProtocol, v, Version)
	}
	h := Header{Kind: binary.LittleEndian.Uint16(b[6:]), Length: binary.LittleEndian.Uint32(b[8:]), NFDs: binary.LittleEndian.Uint16(b[12:])}
	if r := binary.LittleEndian.Uint16(b[14:]); r != 0 {
		return Header{}, fmt.Errorf("%w: reserved header field is %#x, want 0", ErrProtocol, r)
	}
	if h.Kind == 0 {
		return Header{}, fmt.Errorf("%w: message kind 0", ErrProtocol)
	}
	if int64(h.Length) > int64(maxPayload) {
		return Header{}, fmt.Errorf("%w: payload of %d bytes (limit %d)", ErrMessageTooLarge, h.Length, maxPayload)
	}
	if h.NFDs > MaxFDs {
		return Header{}, fmt.Errorf("%w: %d descriptors in one message (limit %d)", ErrMessageTooLarge, h.NFDs, MaxFDs)
	}
	return h, nil
}

// writeFrame sends one frame built in buf (reused when large enough; the possibly grown buffer is
// returned) with duplicates of files as SCM_RIGHTS (the caller keeps its files).
func writeFrame(conn *net.UnixConn, buf []byte, kind uint16, payload []byte, files []*os.File) ([]byte, error) {
	if conn == nil {
		return buf, fmt.Errorf("write message: nil connection: %w", ErrProtocol)
	}
	if kind == 0 {
		return buf, fmt.Errorf("write message: kind 0: %w", ErrProtocol)
	}
	if len(payload) > MaxPayload {
		return buf, fmt.Errorf("write message kind %d: payload of %d bytes (limit %d): %w", kind, len(payload), MaxPayload, ErrMessageTooLarge)
	}
	if len(files) > MaxFDs {
		return buf, fmt.Errorf("write message kind %d: %d descriptors (limit %d per message): %w", kind, len(files), MaxFDs, ErrMessageTooLarge)
	}
	n := HeaderSize + len(payload)
	if cap(buf) < n {
		buf = make([]byte, n)
	}
	b := buf[:n]
	Header{Kind: kind, Length: uint32(len(payload)), NFDs: uint16(len(files))}.Put(b)
	copy(b[HeaderSize:], payload)
	var oob []byte
	if len(files) > 0 {
		fds := make([]int, len(files))
		for i, f := range files {
			if f == nil {
				return buf, fmt.Errorf("write message kind %d: file %d is nil: %w", kind, i, ErrProtocol)
			}
			fds[i] = int(f.Fd())
		}
		oob = unix.UnixRights(fds...)
	}
	w, _, err := conn.WriteMsgUnix(b, oob, nil)
	if err == nil && w < len(b) {
		// A stream socket may take part of the bytes; the descriptors went with the first ones.
		_, err = conn.Write(b[w:])
	}
	runtime.KeepAlive(files)
	if err != nil {
		return buf, fmt.Errorf("write message kind %d (%d bytes, %d descriptors): %w", kind, len(payload), len(files), err)
	}
	return buf, nil
}

// WriteMessage sends one frame of kind with payload and duplicates of files (the caller keeps its
// files). Writes on one connection must not run concurrently.
func WriteMessage(conn *net.UnixConn, kind uint16, payload []byte, files []*os.File) error {
	_, err := writeFrame(conn, nil, kind, payload, files)
	return err
}

// ReadMessage reads one frame with fresh buffers and no deadlines (see Conn.Read for the rules).
func ReadMessage(conn *net.UnixConn) (kind uint16, payload []byte, files []*os.File, err error) {
	var r reader
	f, err := r.read(conn, readLimits{}, 0)
	return f.Kind, f.Payload, f.Files, err
}

// Frame is one frame read by Conn.Read.
type Frame struct {
	Kind uint16
	// Payload is valid until the next Read on the same Conn.
	Payload []byte
	// Files are the received descriptors, close-on-exec and the caller's.
	Files []*os.File
}

// readLimits are what a read enforces beyond the format.
type readLimits struct {
	idle, message time.Duration // 0: no deadline
	maxPayload    int
}

// reader holds one connection's read buffers, reused from frame to frame.
type reader struct {
	hdr     [HeaderSize]byte
	payload []byte
	oob     []byte
	fds     []int
}

// read reads one frame. minPayload > 0 lets the first receive take the header and that many payload
// bytes at once (a frame shorter than that is refused). On any error every descriptor that arrived
// is closed and no file is returned: a bad header, truncated control data (MSG_CTRUNC), a number of
// descriptors other than the header announces, a peer that closes mid-frame (io.ErrUnexpectedEOF),
// or one that closes between frames (io.EOF).
func (r *reader) read(conn *net.UnixConn, lim readLimits, minPayload int) (f Frame, err error) {
	if conn == nil {
		return Frame{}, fmt.Errorf("read message: nil connection: %w", ErrProtocol)
	}
	if r.oob == nil {
		r.oob = make([]byte, oobSize)
	}
	r.fds = r.fds[:0]
	defer func() {
		if err != nil {
			closeFDs(r.fds)
			f = Frame{}
		}
	}()
	first := HeaderSize + max(minPayload, 0)
	if cap(r.payload) < first {
		r.payload = make([]byte, first, max(first, 512))
	}
	if lim.idle > 0 {
		_ = conn.SetReadDeadline(time.Now().Add(lim.idle))
	}
	got, err := r.fill(conn, 0, HeaderSize, first, 0, "header", lim)
	if err != nil {
		return Frame{}, err
	}
	// The header is checked as soon as it is in, so that a frame shorter than first is refused at
	// once rather than waited on.
	h, err := ParseHeader(r.payload[:HeaderSize], lim.maxPayload)
	if err != nil {
		return Frame{}, fmt.Errorf("read message: %w", err)
	}
	if int(h.Length) < minPayload {
		return Frame{}, fmt.Errorf("read message kind %d: payload of %d bytes, want at least %d: %w", h.Kind, h.Length, minPayload, ErrProtocol)
	}
	total := HeaderSize + int(h.Length)
	if _, err := r.fill(conn, got, total, total, HeaderSize, fmt.Sprintf("kind %d payload", h.Kind), lim); err != nil {
		return Frame{}, err
	}
	if lim.idle > 0 || lim.message > 0 {
		_ = conn.SetReadDeadline(time.Time{})
	}
	return r.finish(h, r.payload[HeaderSize:total])
}

// finish checks the descriptors against the header and wraps them as files.
func (r *reader) finish(h Header, payload []byte) (Frame, error) {
	if len(r.fds) != int(h.NFDs) {
		extra := ""
		if len(r.fds) > int(h.NFDs) {
			extra = ": extra descriptors nobody asked for (closed)"
		}
		return Frame{}, fmt.Errorf("read message kind %d: %d descriptors arrived, the header announces %d%s: %w", h.Kind, len(r.fds), h.NFDs, extra, ErrProtocol)
	}
	f := Frame{Kind: h.Kind, Payload: payload}
	if len(r.fds) > 0 {
		f.Files = make([]*os.File, len(r.fds))
		for i, fd := range r.fds {
			f.Files[i] = os.NewFile(uintptr(fd), fmt.Sprintf("ipc-received-%d", i))
		}
		r.fds = r.fds[:0]
	}
	return f, nil
}

// fill reads into r.payload[got:limit] from conn until at least need bytes are in, collecting the
// descriptors that arrive with the frame's first bytes, and returns how many are. Descriptors that
// arrive with any later bytes are closed and refused at once: the format attaches them to the
// header, so a peer cannot make a reader hold more than one message's worth by sending a frame in
// many pieces. Once a frame has started (its first byte is in), the deadline becomes the message
// timeout. Bytes base to limit are the part named what, for errors; base 0 is the start of a frame.
func (r *reader) fill(conn *net.UnixConn, got, need, limit, base int, what string, lim readLimits) (int, error) {
	atStart := base == 0
	for got < need {
		firstRead := atStart && got == 0
		r.grow(got, limit)
		n, oobn, flags, _, err := conn.ReadMsgUnix(r.payload[got:], r.oob)
		n, oobn = max(n, 0), max(oobn, 0)
		if oobn > 0 {
			if perr := r.takeRights(r.oob[:oobn], firstRead); perr != nil && err == nil {
				err = perr
			}
		}
		if flags&unix.MSG_CTRUNC != 0 && err == nil {
			err = truncatedRights(oobn, len(r.oob))
		}
		if atStart && got == 0 && n > 0 && lim.message > 0 {
			_ = conn.SetReadDeadline(time.Now().Add(lim.message))
		}
		got += n
		if err == nil && n == 0 {
			err = io.EOF
		}
		if err != nil {
			return got, readError(err, got-base, limit-base, what, atStart && got == 0, lim)
		}
	}
	return got, nil
}

// truncatedRights says why the kernel cut a message's descriptors short (MSG_CTRUNC), from the
// control data that arrived (oobn bytes) and its room. Full: the peer sent more descriptors than
// one message may carry. Room left: this process could not take them all, as it is out of file
// descriptors (RLIMIT_NOFILE), and the kernel dropped the rest.
func truncatedRights(oobn, room int) error {
	if oobn < room {
		return fmt.Errorf("control data truncated (MSG_CTRUNC) with room left for descriptors: this process could not take every descriptor the peer sent (out of file descriptors, RLIMIT_NOFILE): %w", unix.EMFILE)
	}
	return fmt.Errorf("%w: control data truncated (MSG_CTRUNC): the peer sent more descriptors than one message may carry (%d)", ErrProtocol, MaxFDs)
}

// grow makes r.payload longer than got, up to limit bytes, but at most growStep (or got, if more)
// ahead of the bytes in: a peer that announces a large frame and sends little of it makes the
// reader hold little, and a large frame is copied a few times at most.
func (r *reader) grow(got, limit int) {
	if n := min(cap(r.payload), limit); n > got {
		r.payload = r.payload[:n]
		return
	}
	grown := make([]byte, min(limit, got+max(growStep, got)))
	copy(grown, r.payload[:got])
	r.payload = grown
}

// takeRights collects the descriptors of oob; after a frame's first bytes any descriptor is a
// protocol error (the caller's clean-up closes what was collected).
func (r *reader) takeRights(oob []byte, firstRead bool) error {
	had := len(r.fds)
	err := collectRights(oob, &r.fds)
	if err == nil && !firstRead && len(r.fds) > had {
		err = fmt.Errorf("%w: %d descriptors arrived after the frame's first bytes (closed): they must come with the header", ErrProtocol, len(r.fds)-had)
	}
	return err
}

func readError(err error, got, want int, what string, none bool, lim readLimits) error {
	switch {
	case errors.Is(err, io.EOF) && none:
		return fmt.Errorf("read message: peer closed the connection: %w", io.EOF)
	case errors.Is(err, io.EOF):
		return fmt.Errorf("read message: peer closed the connection after %d of %d %s bytes: %w", got, want, what, io.ErrUnexpectedEOF)
	case errors.Is(err, os.ErrDeadlineExceeded) && none && lim.idle > 0:
		return fmt.Errorf("read message: nothing received for %v: %w", lim.idle, ErrIdle)
	case errors.Is(err, os.ErrDeadlineExceeded) && lim.message > 0:
		return fmt.Errorf("read message: %d of %d %s bytes received, the rest not within %v: %w", got, want, what, lim.message, ErrTimeout)
	case errors.Is(err, os.ErrDeadlineExceeded) && lim.idle > 0:
		// No per-message limit: the idle deadline still bounds a peer that stops mid-message. Not
		// ErrIdle, which says that nothing was read and the framing holds.
		return fmt.Errorf("read message: %d of %d %s bytes received, then nothing for %v: %w", got, want, what, lim.idle, ErrTimeout)
	}
	return fmt.Errorf("read message %s: %w", what, err)
}

// collectRights appends the descriptors of every SCM_RIGHTS control message in oob to fds, and
// ignores other control messages.
func collectRights(oob []byte, fds *[]int) error {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return fmt.Errorf("%w: malformed control data: %v", ErrProtocol, err)
	}
	var firstErr error
	for i := range msgs {
		m := &msgs[i]
		if m.Header.Level != unix.SOL_SOCKET || m.Header.Type != unix.SCM_RIGHTS {
			continue
		}
		got, err := unix.ParseUnixRights(m)
		if err != nil && firstErr == nil {
			firstErr = fmt.Errorf("%w: malformed SCM_RIGHTS: %v", ErrProtocol, err)
		}
		*fds = append(*fds, got...)
	}
	return firstErr
}

func closeFDs(fds []int) {
	for _, fd := range fds {
		_ = unix.Close(fd)
	}
}

// CloseFiles closes every file and reports the first error (a file already closed is not one).
func CloseFiles(files []*os.File) error {
	var first error
	for _, f := range files {
		if f == nil {
			continue
		}
		if err := f.Close(); err != nil && first == nil && !errors.Is(err, os.ErrClosed) {
			first = err
		}
	}
	return first
}
