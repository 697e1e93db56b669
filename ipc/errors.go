package ipc

import (
	"errors"
	"fmt"
)

// Sentinel errors of this package; match them with errors.Is.
var (
	// ErrProtocol: a message or descriptor that breaks the wire format (magic, version, kind,
	// lengths, a descriptor count that disagrees with the descriptors received, truncated control
	// data, descriptors nobody asked for).
	ErrProtocol = errors.New("ipc: protocol error")
	// ErrTooLarge: a message, name or chunk table above the limits (MaxPayload, MaxFDsPerMessage,
	// MaxChunks, MaxNameLen). It also matches ErrProtocol.
	ErrTooLarge = fmt.Errorf("%w: above the size limit", ErrProtocol)
	// ErrNotFound: the server has no buffer published under the name fetched.
	ErrNotFound = errors.New("ipc: no such buffer")
	// ErrExists: Publish of a name already published.
	ErrExists = errors.New("ipc: name already published")
	// ErrPermission: a peer whose credentials the server (or client) does not accept, or a socket
	// directory that others may write to.
	ErrPermission = errors.New("ipc: permission denied")
	// ErrClosed: a server or client used after Close.
	ErrClosed = errors.New("ipc: closed")
)

// Error codes carried by KindError messages.
const (
	CodeNotFound   uint16 = 1 // the name is not published
	CodePermission uint16 = 2 // the peer's credentials are refused
	CodeProtocol   uint16 = 3 // the request broke the protocol
	CodeInternal   uint16 = 4 // the server failed (for example exporting the buffer)
)

// RemoteError is an error the peer reported in a KindError message. It matches ErrNotFound,
// ErrPermission or ErrProtocol with errors.Is according to its code.
type RemoteError struct {
	Code    uint16
	Message string
}

func (e *RemoteError) Error() string {
	return fmt.Sprintf("ipc: the server refused (code %d): %s", e.Code, e.Message)
}

// Is makes errors.Is(err, ErrNotFound) hold for CodeNotFound, and likewise for the other codes.
func (e *RemoteError) Is(target error) bool {
	switch e.Code {
	case CodeNotFound:
		return target == ErrNotFound
	case CodePermission:
		return target == ErrPermission
	case CodeProtocol:
		return target == ErrProtocol
	}
	return false
}
