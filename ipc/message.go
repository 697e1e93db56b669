package ipc

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"

	"golang.org/x/sys/unix"
)

// Wire format of one message on a Unix stream socket (little-endian):
//
//	offset size field
//	0      4    magic "CVMI"
//	4      2    version (1)
//	6      2    kind
//	8      4    payload length (at most MaxPayload)
//	12     2    number of file descriptors carried (at most MaxFDsPerMessage)
//	14     2    reserved, zero
//	16     n    payload
//
// The descriptors travel as one SCM_RIGHTS control message attached to the first byte of the
// header, sent in the same sendmsg as the header and payload.
const (
	// HeaderSize is the size of a message header.
	HeaderSize = 16
	// Version is the wire format version this package writes and accepts.
	Version = 1
	// MaxPayload is the largest payload a message may carry (1 MiB); larger ones are refused by
	// both WriteMessage and ReadMessage.
	MaxPayload = 1 << 20
	// MaxFDsPerMessage is the most descriptors one message carries. The kernel allows 253 per
	// SCM_RIGHTS message (SCM_MAX_FD); a buffer with more chunks is sent as several messages.
	MaxFDsPerMessage = 250
)

// magic is "CVMI" read as a little-endian uint32.
const magic uint32 = 'C' | 'V'<<8 | 'M'<<16 | 'I'<<24

// Message kinds. Kinds below KindUser belong to this package; other packages (pinned's copy broker,
// for example) use KindUser and above for their own messages.
const (
	// KindBuffer carries a Descriptor and the first descriptors of its chunks.
	KindBuffer uint16 = 1
	// KindFDs carries more chunk descriptors of a KindBuffer message with more than
	// MaxFDsPerMessage chunks; its payload is the index of its first chunk (uint32).
	KindFDs uint16 = 2
	// KindFetch asks a Server for the buffer named by the payload.
	KindFetch uint16 = 3
	// KindError reports a refusal: a uint16 code (CodeNotFound, ...) then a UTF-8 message.
	KindError uint16 = 4
	// KindUser is the first kind free for other packages.
	KindUser uint16 = 0x100
)

// oobSize fits one SCM_RIGHTS message of MaxFDsPerMessage descriptors: a peer that sends more gets
// its control data truncated (MSG_CTRUNC), which ReadMessage reports. (SCM_CREDENTIALS arrives only
// on sockets where the receiver set SO_PASSCRED, which this package never does.)
var oobSize = unix.CmsgSpace(MaxFDsPerMessage * 4)

type header struct {
	kind   uint16
	length uint32
	nfds   uint16
}

func (h header) put(b []byte) {
	binary.LittleEndian.PutUint32(b[0:], magic)
	binary.LittleEndian.PutUint16(b[4:], Version)
	binary.LittleEndian.PutUint16(b[6:], h.kind)
	binary.LittleEndian.PutUint32(b[8:], h.length)
	binary.LittleEndian.PutUint16(b[12:], h.nfds)
	binary.LittleEndian.PutUint16(b[14:], 0)
}

// parseHeader validates a message header.
func parseHeader(b []byte) (header, error) {
	if len(b) < HeaderSize {
		return header{}, fmt.Errorf("%w: header of %d bytes, want %d", ErrProtocol, len(b), HeaderSize)
	}
	if m := binary.LittleEndian.Uint32(b[0:]); m != magic {
		return header{}, fmt.Errorf("%w: not a cuvmm ipc message (magic %#08x, want %#08x \"CVMI\")", ErrProtocol, m, magic)
	}
	if v := binary.LittleEndian.Uint16(b[4:]); v != Version {
		return header{}, fmt.Errorf("%w: message version %d, this side speaks version %d", ErrProtocol, v, Version)
	}
	h := header{
		kind:   binary.LittleEndian.Uint16(b[6:]),
		length: binary.LittleEndian.Uint32(b[8:]),
		nfds:   binary.LittleEndian.Uint16(b[12:]),
	}
	if r := binary.LittleEndian.Uint16(b[14:]); r != 0 {
		return header{}, fmt.Errorf("%w: reserved header field is %#x, want 0", ErrProtocol, r)
	}
	if h.kind == 0 {
		return header{}, fmt.Errorf("%w: message kind 0", ErrProtocol)
	}
	if h.length > MaxPayload {
		return header{}, fmt.Errorf("%w: payload of %d bytes (limit %d)", ErrTooLarge, h.length, MaxPayload)
	}
	if h.nfds > MaxFDsPerMessage {
		return header{}, fmt.Errorf("%w: %d descriptors in one message (limit %d)", ErrTooLarge, h.nfds, MaxFDsPerMessage)
	}
	return h, nil
}

// WriteMessage sends one message of the given kind with payload and, as SCM_RIGHTS, duplicates of
// files (the caller keeps its files open and owns them). conn must be a Unix stream socket. Writes
// on one connection must not run concurrently: serialize them.
func WriteMessage(conn *net.UnixConn, kind uint16, payload []byte, files []*os.File) error {
	if conn == nil {
		return fmt.Errorf("ipc: write message: nil connection: %w", ErrProtocol)
	}
	if kind == 0 {
		return fmt.Errorf("ipc: write message: kind 0: %w", ErrProtocol)
	}
	if len(payload) > MaxPayload {
		return fmt.Errorf("ipc: write message kind %d: payload of %d bytes (limit %d): %w", kind, len(payload), MaxPayload, ErrTooLarge)
	}
	if len(files) > MaxFDsPerMessage {
		return fmt.Errorf("ipc: write message kind %d: %d descriptors (limit %d per message): %w", kind, len(files), MaxFDsPerMessage, ErrTooLarge)
	}
	buf := make([]byte, HeaderSize+len(payload))
	header{kind: kind, length: uint32(len(payload)), nfds: uint16(len(files))}.put(buf)
	copy(buf[HeaderSize:], payload)
	var oob []byte
	if len(files) > 0 {
		fds := make([]int, len(files))
		for i, f := range files {
			if f == nil {
				return fmt.Errorf("ipc: write message kind %d: file %d is nil: %w", kind, i, ErrProtocol)
			}
			fds[i] = int(f.Fd())
		}
		oob = unix.UnixRights(fds...)
	}
	n, _, err := conn.WriteMsgUnix(buf, oob, nil)
	if err == nil && n < len(buf) {
		// A stream socket may take part of the bytes; the descriptors went with the first ones.
		_, err = conn.Write(buf[n:])
	}
	runtime.KeepAlive(files)
	if err != nil {
		return fmt.Errorf("ipc: write message kind %d (%d bytes, %d descriptors): %w", kind, len(payload), len(files), err)
	}
	return nil
}

// ReadMessage reads one message written by WriteMessage. The files it returns are the caller's and
// are close-on-exec (received with MSG_CMSG_CLOEXEC). On any error every descriptor that arrived is
// closed and no file is returned: a bad magic or version, a kind of 0, a payload above MaxPayload,
// truncated control data (MSG_CTRUNC), a number of descriptors other than the header announces, or a
// peer that closes mid-message (an error wrapping io.ErrUnexpectedEOF). A peer that closes between
// messages gives an error wrapping io.EOF. After an error the stream's framing is lost: close the
// connection.
func ReadMessage(conn *net.UnixConn) (kind uint16, payload []byte, files []*os.File, err error) {
	if conn == nil {
		return 0, nil, nil, fmt.Errorf("ipc: read message: nil connection: %w", ErrProtocol)
	}
	var fds []int
	defer func() {
		if err != nil {
			closeFDs(fds)
			kind, payload, files = 0, nil, nil
		}
	}()
	oob := make([]byte, oobSize)
	var hb [HeaderSize]byte
	if err := readFull(conn, hb[:], oob, &fds, "header", true); err != nil {
		return 0, nil, nil, err
	}
	h, err := parseHeader(hb[:])
	if err != nil {
		return 0, nil, nil, fmt.Errorf("ipc: read message: %w", err)
	}
	payload = make([]byte, h.length)
	if err := readFull(conn, payload, oob, &fds, fmt.Sprintf("kind %d payload", h.kind), false); err != nil {
		return 0, nil, nil, err
	}
	if len(fds) > int(h.nfds) {
		return 0, nil, nil, fmt.Errorf("ipc: read message kind %d: %d descriptors arrived, the header announces %d: extra descriptors nobody asked for (closed): %w", h.kind, len(fds), h.nfds, ErrProtocol)
	}
	if len(fds) < int(h.nfds) {
		return 0, nil, nil, fmt.Errorf("ipc: read message kind %d: %d descriptors arrived, the header announces %d: %w", h.kind, len(fds), h.nfds, ErrProtocol)
	}
	if len(fds) > 0 {
		files = make([]*os.File, len(fds))
		for i, fd := range fds {
			files[i] = os.NewFile(uintptr(fd), fmt.Sprintf("ipc-received-%d", i))
		}
	}
	return h.kind, payload, files, nil
}

// readFull fills b from conn, collecting the descriptors that arrive with any of its bytes into fds.
// atStart says b is the beginning of a message, where a clean EOF is io.EOF rather than a truncated
// message.
func readFull(conn *net.UnixConn, b, oob []byte, fds *[]int, what string, atStart bool) error {
	got := 0
	for got < len(b) {
		n, oobn, flags, _, err := conn.ReadMsgUnix(b[got:], oob)
		if oobn > 0 {
			if perr := collectRights(oob[:oobn], fds); perr != nil && err == nil {
				err = perr
			}
		}
		if flags&unix.MSG_CTRUNC != 0 && err == nil {
			err = fmt.Errorf("%w: control data truncated (MSG_CTRUNC): the peer sent more descriptors than one message may carry (%d)", ErrProtocol, MaxFDsPerMessage)
		}
		got += n
		if err == nil && n == 0 {
			err = io.EOF
		}
		if err != nil {
			if errors.Is(err, io.EOF) {
				if atStart && got == 0 {
					return fmt.Errorf("ipc: read message: peer closed the connection: %w", io.EOF)
				}
				return fmt.Errorf("ipc: read message: peer closed the connection after %d of %d %s bytes: %w", got, len(b), what, io.ErrUnexpectedEOF)
			}
			return fmt.Errorf("ipc: read message %s: %w", what, err)
		}
	}
	return nil
}

// collectRights appends the descriptors of every SCM_RIGHTS control message in oob to fds, and
// ignores other control messages (SCM_CREDENTIALS).
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

// closeFiles closes every file and reports the first error.
func closeFiles(files []*os.File) error {
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
