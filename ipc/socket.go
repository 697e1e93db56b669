package ipc

import (
	"errors"
	"fmt"
	"net"
	"os"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// The socket helpers of Listen, Serve and Dial, for packages that serve their own protocol over this
// package's transport (the copy broker): the same 0600 socket, directory check, stale-socket
// replacement and SO_PEERCRED checks, so that every server of the module applies one set of rules.

// ListenUnix creates a Unix stream socket at path exactly as Listen does: the directory holding path
// must not be writable by others (an error wrapping ErrPermission), the socket file is created with
// mode 0600 (fchmod before bind, chmod and a check after), and a stale socket left at path by a dead
// server of the same uid is replaced. Closing the listener removes the socket file.
func ListenUnix(path string) (*net.UnixListener, error) {
	if err := checkSocketDir(path); err != nil {
		return nil, err
	}
	ln, err := listen0600(path)
	if err != nil && errors.Is(err, unix.EADDRINUSE) && removeStale(path) {
		ln, err = listen0600(path)
	}
	if err != nil {
		return nil, fmt.Errorf("ipc: listen on %s: %w", path, err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		return nil, fmt.Errorf("ipc: listen on %s: chmod 0600: %w", path, err)
	}
	if st, err := os.Lstat(path); err != nil || st.Mode().Perm()&0o077 != 0 {
		ln.Close()
		return nil, fmt.Errorf("ipc: listen on %s: socket mode is not 0600 (%v): %w", path, err, ErrPermission)
	}
	return ln, nil
}

// Accept waits for the next connection on ln, retrying the transient accept errors (out of
// descriptors, a connection aborted before it was accepted) after a short pause and reporting them
// through logf. It returns (nil, nil) once closed() reports that the server was closed, and (nil,
// err) for any other listener error.
func Accept(ln *net.UnixListener, closed func() bool, logf func(format string, args ...any)) (*net.UnixConn, error) {
	for {
		conn, err := ln.AcceptUnix()
		if err == nil {
			return conn, nil
		}
		if closed() {
			return nil, nil
		}
		if errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) || errors.Is(err, syscall.ECONNABORTED) {
			logf("accept on %s: %v (retrying)", ln.Addr(), err)
			time.Sleep(10 * time.Millisecond)
			continue
		}
		return nil, fmt.Errorf("accept on %s: %w", ln.Addr(), err)
	}
}

// PeerCredentials reads the connected peer's pid, uid and gid (SO_PEERCRED, as they were at connect
// time).
func PeerCredentials(conn *net.UnixConn) (unix.Ucred, error) { return peerCredentials(conn) }

// UIDAllowed reports whether uid is in allowed; an empty list allows this process's uid only (the
// rule of ServerOptions.AllowUIDs).
func UIDAllowed(allowed []int, uid uint32) bool { return allowUID(allowed, uid) }
