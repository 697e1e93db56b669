package ipc

import (
	"fmt"
	"net"
	"os"

	"github.com/cuvmm/cuvmm/internal/unixsock"
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
// header, sent in the same sendmsg as the header and payload. Every server and client of the module
// (this package's, the copy broker's) speaks these frames.
const (
	// HeaderSize is the size of a message header.
	HeaderSize = unixsock.HeaderSize
	// Version is the wire format version this package writes and accepts.
	Version = unixsock.Version
	// MaxPayload is the largest payload a message may carry (1 MiB); larger ones are refused by
	// both WriteMessage and ReadMessage.
	MaxPayload = unixsock.MaxPayload
	// MaxFDsPerMessage is the most descriptors one message carries. The kernel allows 253 per
	// SCM_RIGHTS message (SCM_MAX_FD); a buffer with more chunks is sent as several messages.
	MaxFDsPerMessage = unixsock.MaxFDs
)

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

// WriteMessage sends one message of the given kind with payload and, as SCM_RIGHTS, duplicates of
// files (the caller keeps its files open and owns them). conn must be a Unix stream socket. Writes
// on one connection must not run concurrently: serialize them.
func WriteMessage(conn *net.UnixConn, kind uint16, payload []byte, files []*os.File) error {
	if err := unixsock.WriteMessage(conn, kind, payload, files); err != nil {
		return fmt.Errorf("ipc: %w", err)
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
	kind, payload, files, err = unixsock.ReadMessage(conn)
	if err != nil {
		return 0, nil, nil, fmt.Errorf("ipc: %w", err)
	}
	return kind, payload, files, nil
}

// closeFiles closes every file and reports the first error.
func closeFiles(files []*os.File) error { return unixsock.CloseFiles(files) }
