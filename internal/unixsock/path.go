package unixsock

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// checkPath refuses what cannot be a private socket file: an empty path, one too long for
// sockaddr_un, one with a NUL byte, and an abstract name ("@x": no file, so no permissions).
func checkPath(path string) error {
	switch {
	case path == "":
		return fmt.Errorf("empty socket path: %w", syscall.EINVAL)
	case strings.HasPrefix(path, "@"):
		return fmt.Errorf("%q is an abstract socket name, which has no file permissions (any process in the network namespace could connect or take the name): use a path in a private directory: %w", path, ErrPermission)
	case strings.IndexByte(path, 0) >= 0:
		return fmt.Errorf("socket path %q has a NUL byte: %w", path, syscall.EINVAL)
	case len(path) >= len(unix.RawSockaddrUnix{}.Path):
		return fmt.Errorf("the path is %d bytes, a Unix socket path must be under %d: %w", len(path), len(unix.RawSockaddrUnix{}.Path), syscall.ENAMETOOLONG)
	}
	return nil
}

// CheckDir refuses a socket directory that another user could use to put a socket of theirs in
// place of this one: writable by group or others (sticky or not), or owned by a user other than
// this process's effective uid and root.
func CheckDir(dir string) error {
	st, err := os.Stat(dir)
	if err != nil {
		return fmt.Errorf("socket directory: %w", err)
	}
	if !st.IsDir() {
		return fmt.Errorf("%s is not a directory: %w", dir, syscall.ENOTDIR)
	}
	if st.Mode().Perm()&0o022 != 0 {
		return fmt.Errorf("the directory %s is writable by group or others (mode %v): another user could put a socket of theirs there; use a private directory (os.MkdirTemp, $XDG_RUNTIME_DIR): %w", dir, st.Mode(), ErrPermission)
	}
	if sys, ok := st.Sys().(*syscall.Stat_t); ok && sys.Uid != 0 && int(sys.Uid) != os.Geteuid() {
		return fmt.Errorf("the directory %s belongs to uid %d, not to this process's uid %d or root: %w", dir, sys.Uid, os.Geteuid(), ErrPermission)
	}
	return nil
}

// listenFile binds a Unix stream socket at path in a checked directory, with mode 0600 (fchmod
// before bind, chmod and a check after), replacing a stale socket of this uid that nobody listens
// on.
func listenFile(path string) (*net.UnixListener, error) {
	if err := checkPath(path); err != nil {
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	if err := CheckDir(filepath.Dir(path)); err != nil {
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	ln, err := listen0600(path)
	if err != nil && errors.Is(err, unix.EADDRINUSE) && removeStale(path) {
		ln, err = listen0600(path)
	}
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", path, permission(err))
	}
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		return nil, fmt.Errorf("listen on %s: chmod 0600: %w", path, err)
	}
	if st, err := os.Lstat(path); err != nil || st.Mode().Perm()&0o077 != 0 {
		ln.Close()
		return nil, fmt.Errorf("listen on %s: socket mode is not 0600 (%v): %w", path, err, ErrPermission)
	}
	return ln, nil
}

// listen0600 binds with the socket's mode set to 0600 before bind, so that no other user can
// connect in a window between bind and chmod.
func listen0600(path string) (*net.UnixListener, error) {
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
		var ferr error
		if err := c.Control(func(fd uintptr) { ferr = unix.Fchmod(int(fd), 0o600) }); err != nil {
			return err
		}
		if ferr != nil {
			return fmt.Errorf("fchmod 0600 on the socket: %w", ferr)
		}
		return nil
	}}
	l, err := lc.Listen(context.Background(), "unix", path)
	if err != nil {
		return nil, err
	}
	return l.(*net.UnixListener), nil
}

// removeStale removes a socket at path that belongs to this uid and that nobody listens on.
func removeStale(path string) bool {
	st, err := os.Lstat(path)
	if err != nil || st.Mode()&os.ModeSocket == 0 {
		return false
	}
	if sys, ok := st.Sys().(*syscall.Stat_t); !ok || int(sys.Uid) != os.Getuid() {
		return false
	}
	c, err := net.DialTimeout("unix", path, time.Second)
	if err == nil {
		c.Close()
		return false
	}
	if !errors.Is(err, syscall.ECONNREFUSED) {
		return false
	}
	return os.Remove(path) == nil
}

// permission makes a filesystem refusal (EACCES, EPERM) match ErrPermission as well.
func permission(err error) error {
	if errors.Is(err, syscall.EACCES) || errors.Is(err, syscall.EPERM) {
		return fmt.Errorf("%w: %w", ErrPermission, err)
	}
	return err
}

func isClosedErr(err error) bool { return errors.Is(err, net.ErrClosed) }
