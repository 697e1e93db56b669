package ipc

import (
	"errors"
	"fmt"
	"net"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/internal/unixsock"
)

// The socket helpers below were exported for packages that served their own protocol over this
// package's transport. That transport now lives in one internal package, which this package's
// Server and the copy broker share; these remain for existing callers.

// Deprecated: ListenUnix creates a Unix stream socket at path with Listen's rules (a private
// directory, mode 0600, no abstract names, a stale socket replaced) and returns the bare listener.
// Use Listen, whose server also caps connections and drops silent peers.
func ListenUnix(path string) (*net.UnixListener, error) {
	ln, err := unixsock.ListenUnix(path)
	if err != nil {
		return nil, fmt.Errorf("ipc: %w", err)
	}
	return ln, nil
}

// Deprecated: Accept waits for the next connection on ln, pausing (5 ms to 1 s, growing) on the
// transient accept errors (out of descriptors, a connection aborted before it was accepted) and
// reporting them through logf. It returns (nil, nil) once closed() reports that the server was
// closed, and (nil, err) for any other listener error. Listen's server has its own accept loop.
func Accept(ln *net.UnixListener, closed func() bool, logf func(format string, args ...any)) (*net.UnixConn, error) {
	delay := 5 * time.Millisecond
	for {
		conn, err := ln.AcceptUnix()
		if err == nil {
			return conn, nil
		}
		if closed() {
			return nil, nil
		}
		if errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) || errors.Is(err, syscall.ECONNABORTED) {
			logf("accept on %s: %v (pausing %v)", ln.Addr(), err, delay)
			time.Sleep(delay)
			delay = min(2*delay, time.Second)
			continue
		}
		return nil, fmt.Errorf("accept on %s: %w", ln.Addr(), err)
	}
}

// Deprecated: PeerCredentials reads the connected peer's pid, uid and gid (SO_PEERCRED, as they
// were at connect time).
func PeerCredentials(conn *net.UnixConn) (unix.Ucred, error) { return unixsock.PeerCred(conn) }

// Deprecated: UIDAllowed reports whether uid is in allowed; an empty list allows this process's uid
// only (the rule of ServerOptions.AllowUIDs).
func UIDAllowed(allowed []int, uid uint32) bool { return unixsock.UIDAllowed(allowed, uid) }
