package broker

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"

	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/ipc"
)

// The request path reads and writes its frames itself rather than through ipc.ReadMessage and
// ipc.WriteMessage: the frames are the same (an ipc header, then the payload), but a request or the
// fixed part of a response arrives with one receive into a buffer the connection reuses, instead of
// one receive for the header and one for the payload into fresh buffers. Only the bytes of one
// frame are ever read, so the frames that follow (a buffer after a register request, a region after
// its response) are left for ipc.Receive and pinned.Receive. Any descriptor that arrives here was
// sent where none belongs: it is closed and the frame refused.

const (
	frameMagic = 'C' | 'V'<<8 | 'M'<<16 | 'I'<<24
	// requestFrame is the size of a whole request frame.
	requestFrame = ipc.HeaderSize + RequestSize
	// responseFrame is the size of a response frame without its text.
	responseFrame = ipc.HeaderSize + ResponseSize
)

// oobSize fits a few descriptors; more are cut off (MSG_CTRUNC, and the kernel closes them).
var oobSize = unix.CmsgSpace(16 * 4)

// putFrameHeader writes the ipc header of a frame of kind with n payload bytes into b.
func putFrameHeader(b []byte, kind uint16, n int) {
	binary.LittleEndian.PutUint32(b[0:], frameMagic)
	binary.LittleEndian.PutUint16(b[4:], ipc.Version)
	binary.LittleEndian.PutUint16(b[6:], kind)
	binary.LittleEndian.PutUint32(b[8:], uint32(n))
	binary.LittleEndian.PutUint32(b[12:], 0) // no descriptors, reserved
}

// readExact fills b from conn. A descriptor arriving with any byte is closed and refused; a peer
// that hangs up before the first byte gives io.EOF, after it io.ErrUnexpectedEOF. When b starts a
// frame, header checks the frame's header as soon as it is in, so that a frame shorter than b is
// refused at once rather than waited on.
func readExact(conn *net.UnixConn, b, oob []byte, header func(h []byte) error) error {
	got := 0
	for got < len(b) {
		if header != nil && got >= ipc.HeaderSize {
			if err := header(b[:ipc.HeaderSize]); err != nil {
				return err
			}
			header = nil
		}
		n, oobn, flags, _, err := conn.ReadMsgUnix(b[got:], oob)
		if oobn > 0 || flags&unix.MSG_CTRUNC != 0 {
			closed := closeRights(oob[:oobn])
			return fmt.Errorf("broker: %d descriptors arrived with a message that carries none (closed): %w", closed, ErrProtocol)
		}
		got += n
		if err == nil && n == 0 {
			err = io.EOF
		}
		if err != nil {
			if errors.Is(err, io.EOF) && got > 0 {
				return fmt.Errorf("broker: peer closed the connection after %d of %d bytes: %w", got, len(b), io.ErrUnexpectedEOF)
			}
			return fmt.Errorf("broker: read: %w", err)
		}
	}
	return nil
}

// closeRights closes every descriptor of the SCM_RIGHTS messages in oob and counts them.
func closeRights(oob []byte) int {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return 0
	}
	n := 0
	for i := range msgs {
		if fds, err := unix.ParseUnixRights(&msgs[i]); err == nil {
			for _, fd := range fds {
				_ = unix.Close(fd)
				n++
			}
		}
	}
	return n
}

// checkFrameHeader validates an ipc header for a frame of kind with a payload of minLen to maxLen
// bytes and no descriptors, and returns the payload length.
func checkFrameHeader(h []byte, kind uint16, minLen, maxLen int) (int, error) {
	if m := binary.LittleEndian.Uint32(h[0:]); m != frameMagic {
		return 0, fmt.Errorf("broker: not a cuvmm ipc frame (magic %#08x): %w", m, ErrProtocol)
	}
	if v := binary.LittleEndian.Uint16(h[4:]); v != ipc.Version {
		return 0, fmt.Errorf("broker: ipc frame version %d, this side speaks %d: %w", v, ipc.Version, ErrProtocol)
	}
	if k := binary.LittleEndian.Uint16(h[6:]); k != kind {
		return 0, fmt.Errorf("broker: message kind %#x, want %#x: %w", k, kind, ErrProtocol)
	}
	n := int(binary.LittleEndian.Uint32(h[8:]))
	if n < minLen || n > maxLen {
		return 0, fmt.Errorf("broker: kind %#x payload of %d bytes, want %d to %d: %w", kind, n, minLen, maxLen, ErrProtocol)
	}
	if d, r := binary.LittleEndian.Uint16(h[12:]), binary.LittleEndian.Uint16(h[14:]); d != 0 || r != 0 {
		return 0, fmt.Errorf("broker: kind %#x frame announces %d descriptors (reserved %#x): %w", kind, d, r, ErrProtocol)
	}
	return n, nil
}

// frameReader reads one connection's request or response frames into buffers it reuses. It is used
// by one goroutine at a time.
type frameReader struct {
	buf [ipc.HeaderSize + ResponseSize + MaxText]byte
	oob []byte
}

func newFrameReader() *frameReader { return &frameReader{oob: make([]byte, oobSize)} }

// request reads and decodes one request frame.
func (r *frameReader) request(conn *net.UnixConn) (request, error) {
	b := r.buf[:requestFrame]
	check := func(h []byte) error {
		_, err := checkFrameHeader(h, KindRequest, RequestSize, RequestSize)
		return err
	}
	if err := readExact(conn, b, r.oob, check); err != nil {
		return request{}, err
	}
	if err := check(b); err != nil {
		return request{}, err
	}
	return decodeRequest(b[ipc.HeaderSize:])
}

// response reads and decodes one response frame: the fixed part, then the text if there is one.
func (r *frameReader) response(conn *net.UnixConn) (response, error) {
	b := r.buf[:responseFrame]
	check := func(h []byte) error {
		_, err := checkFrameHeader(h, KindResponse, ResponseSize, ResponseSize+MaxText)
		return err
	}
	if err := readExact(conn, b, r.oob, check); err != nil {
		return response{}, err
	}
	n, err := checkFrameHeader(b, KindResponse, ResponseSize, ResponseSize+MaxText)
	if err != nil {
		return response{}, err
	}
	if n > ResponseSize {
		if err := readExact(conn, r.buf[responseFrame:ipc.HeaderSize+n], r.oob, nil); err != nil {
			return response{}, err
		}
	}
	return decodeResponse(r.buf[ipc.HeaderSize : ipc.HeaderSize+n])
}

// writeFrame sends b, a whole frame, with one write.
func writeFrame(conn *net.UnixConn, b []byte) error {
	_, err := conn.Write(b)
	return err
}
