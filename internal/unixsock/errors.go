// Package unixsock is the module's one Unix-socket transport: a 0600 listener in a private
// directory, an accept loop that tracks its connections under caps and deadlines, peer credentials
// (SO_PEERCRED) with a uid allow-list, and one framed connection type that carries a payload and
// file descriptors (SCM_RIGHTS) per frame. ipc's servers and the copy broker are built on it, so
// every server of the module applies one set of rules.
//
// Abstract socket names (a path starting with "@", which Go maps to Linux's abstract namespace)
// are refused: an abstract socket has no file and so no permissions, and any process in the network
// namespace can connect to it or take its name first.
package unixsock

import (
	"errors"
	"fmt"
	"os"
)

// Sentinel errors. Their texts say "ipc" because the frames are ipc's wire format; ipc re-exports
// them under the same names.
var (
	// ErrProtocol: a frame that breaks the wire format (magic, version, kind, lengths, a descriptor
	// count that disagrees with the descriptors received, truncated control data, descriptors
	// nobody asked for).
	ErrProtocol = errors.New("ipc: protocol error")
	// ErrMessageTooLarge: a frame above the limits (payload or descriptors). It also matches
	// ErrProtocol.
	ErrMessageTooLarge = fmt.Errorf("%w: above the size limit", ErrProtocol)
	// ErrPermission: a peer whose credentials are refused, a socket directory others may write to
	// or owned by another user, an abstract socket name, or a socket the filesystem does not let
	// this process reach (EACCES).
	ErrPermission = errors.New("ipc: permission denied")
	// ErrConnLimit: a connection refused because the server holds its maximum of connections in
	// total or for the peer's uid.
	ErrConnLimit = errors.New("ipc: connection limit reached")
	// ErrIdle: a peer that sent nothing for the idle timeout. It also matches
	// os.ErrDeadlineExceeded.
	ErrIdle = fmt.Errorf("ipc: peer idle: %w", os.ErrDeadlineExceeded)
	// ErrTimeout: a peer that started a message and did not finish it within the read timeout (with
	// none, the idle timeout). It also matches os.ErrDeadlineExceeded.
	ErrTimeout = fmt.Errorf("ipc: message not finished in time: %w", os.ErrDeadlineExceeded)
)
