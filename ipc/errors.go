package ipc

import (
	"errors"
	"fmt"

	"github.com/cuvmm/cuvmm/internal/unixsock"
	"github.com/cuvmm/cuvmm/vmm"
)

// Sentinel errors of this package; match them with errors.Is.
var (
	// ErrProtocol: a message or descriptor that breaks the wire format (magic, version, kind,
	// lengths, a descriptor count that disagrees with the descriptors received, truncated control
	// data, descriptors nobody asked for, a memfd its sender did not seal).
	ErrProtocol = unixsock.ErrProtocol
	// ErrMessageTooLarge: a message, name or chunk table above the limits (MaxPayload,
	// MaxFDsPerMessage, MaxChunks, MaxNameLen). It also matches ErrProtocol.
	ErrMessageTooLarge = unixsock.ErrMessageTooLarge
	// ErrNotFound: the server has no buffer published under the name fetched.
	ErrNotFound = errors.New("ipc: no such buffer")
	// ErrExists: Publish of a name already published.
	ErrExists = errors.New("ipc: name already published")
	// ErrPermission: a peer whose credentials the server (or client) does not accept, a socket
	// directory that group or others may write to or that another user owns, an abstract socket
	// name, or a socket the filesystem does not let this process reach (EACCES).
	ErrPermission = unixsock.ErrPermission
	// ErrConnLimit: the server holds its maximum of connections (in total or for the peer's uid).
	ErrConnLimit = unixsock.ErrConnLimit
	// ErrIdle: the server dropped a peer that sent nothing for ServerOptions.IdleTimeout.
	ErrIdle = unixsock.ErrIdle
	// ErrTimeout: the server dropped a peer that left a message half-sent for
	// ServerOptions.ReadTimeout.
	ErrTimeout = unixsock.ErrTimeout
	// ErrClosed is vmm.ErrClosed: a server, client or buffer used after Close.
	ErrClosed = vmm.ErrClosed

	// Deprecated: ErrTooLarge is ErrMessageTooLarge (a different meaning from growbuf.ErrTooLarge,
	// a size above a buffer's limit).
	ErrTooLarge = ErrMessageTooLarge
)

// Error codes carried by KindError messages.
const (
	CodeNotFound   uint16 = 1 // the name is not published
	CodePermission uint16 = 2 // the peer's credentials are refused
	CodeProtocol   uint16 = 3 // the request broke the protocol
	CodeInternal   uint16 = 4 // the server failed (for example exporting the buffer)
	CodeConnLimit  uint16 = 5 // the server holds its maximum of connections
	CodeIdle       uint16 = 6 // the peer sent nothing for the idle timeout; the server hung up
	CodeTimeout    uint16 = 7 // the peer left a message half-sent; the server hung up
)

// ServerError is an error an ipc server reported in a KindError message. It matches ErrNotFound,
// ErrPermission, ErrProtocol, ErrConnLimit, ErrIdle or ErrTimeout with errors.Is according to its
// code.
type ServerError struct {
	Code    uint16
	Message string
}

// Deprecated: RemoteError is ServerError.
type RemoteError = ServerError

func (e *ServerError) Error() string {
	return fmt.Sprintf("ipc: the server refused (code %d): %s", e.Code, e.Message)
}

// Is makes errors.Is(err, ErrNotFound) hold for CodeNotFound, and likewise for the other codes.
func (e *ServerError) Is(target error) bool {
	switch e.Code {
	case CodeNotFound:
		return target == ErrNotFound
	case CodePermission:
		return target == ErrPermission
	case CodeProtocol:
		return target == ErrProtocol
	case CodeConnLimit:
		return target == ErrConnLimit
	case CodeIdle:
		return target == ErrIdle
	case CodeTimeout:
		return target == ErrTimeout
	}
	return false
}

// codeOf is the KindError code for a refusal made by the transport.
func codeOf(err error) uint16 {
	switch {
	case errors.Is(err, ErrConnLimit):
		return CodeConnLimit
	case errors.Is(err, ErrIdle):
		return CodeIdle
	case errors.Is(err, ErrTimeout):
		return CodeTimeout
	case errors.Is(err, ErrPermission):
		return CodePermission
	case errors.Is(err, ErrProtocol):
		return CodeProtocol
	}
	return CodeInternal
}
