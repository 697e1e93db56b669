package unixsock

import (
	"net"
	"os"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// socketPair is a connected pair of Unix stream sockets, closed at the end of the test.
func socketPair(t testing.TB) (*net.UnixConn, *net.UnixConn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	a, b := fileConn(t, fds[0]), fileConn(t, fds[1])
	t.Cleanup(func() { a.Close(); b.Close() })
	return a, b
}

func fileConn(t testing.TB, fd int) *net.UnixConn {
	t.Helper()
	f := os.NewFile(uintptr(fd), "socket")
	c, err := net.FileConn(f)
	require.NoError(t, f.Close())
	require.NoError(t, err)
	return c.(*net.UnixConn)
}

// openFDs counts this process's open descriptors.
func openFDs(t testing.TB) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	return len(ents)
}

// privateDir is a 0700 directory of this uid for sockets.
func privateDir(t testing.TB) string {
	t.Helper()
	d, err := os.MkdirTemp("", "unixsock")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(d) })
	return d
}
