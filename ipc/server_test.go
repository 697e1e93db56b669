package ipc_test

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/ipc"
)

// serve starts a server on a socket in a private directory; it is closed at the end of the test.
func serve(t *testing.T, opts ipc.ServerOptions, setup ...func(*ipc.Server)) *ipc.Server {
	t.Helper()
	path := filepath.Join(privateDir(t), "ipc.sock")
	s, err := ipc.Listen(path, opts)
	require.NoError(t, err)
	for _, f := range setup {
		f(s)
	}
	done := make(chan error, 1)
	go func() { done <- s.Serve() }()
	t.Cleanup(func() {
		require.NoError(t, s.Close())
		require.NoError(t, <-done)
	})
	return s
}

func TestServerFetch(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		dev := b.Device(t, 0)
		src := newBuffer(t, dev, 3, 2*mib, driver.Location{}, 31)
		var logMu sync.Mutex
		var logs []string
		s := serve(t, ipc.ServerOptions{Logf: func(f string, a ...any) {
			logMu.Lock()
			logs = append(logs, fmt.Sprintf(f, a...))
			logMu.Unlock()
		}})
		st, err := os.Lstat(s.Path())
		require.NoError(t, err)
		require.Equal(t, os.ModeSocket|0o600, st.Mode(), "the socket is 0600")

		require.NoError(t, s.Publish("weights", src))
		require.ErrorIs(t, s.Publish("weights", src), ipc.ErrExists)
		require.ErrorIs(t, s.Publish("", src), ipc.ErrProtocol)
		require.Equal(t, []string{"weights"}, s.Names())

		c, err := ipc.Dial(s.Path())
		require.NoError(t, err)
		defer c.Close()
		require.Equal(t, int32(os.Getpid()), c.Server().Pid)

		buf, err := c.Open(dev, "weights")
		require.NoError(t, err)
		require.Equal(t, "weights", buf.Descriptor().Name)
		verifyChunks(t, dev, buf, 31)

		// A name that does not exist: the server's sentinel, and the connection stays usable.
		_, err = c.Fetch("nope")
		require.ErrorIs(t, err, ipc.ErrNotFound)
		require.ErrorContains(t, err, `no buffer named "nope"`)
		r, err := c.Fetch("weights")
		require.NoError(t, err)
		require.Len(t, r.Files, 3)
		require.NoError(t, r.Close())

		// Unpublish: gone for new fetches, the importer's mapping stays, and so does the memory
		// after the exporter closes its buffer.
		require.NoError(t, s.Unpublish("weights"))
		require.ErrorIs(t, s.Unpublish("weights"), ipc.ErrNotFound)
		_, err = c.Fetch("weights")
		require.ErrorIs(t, err, ipc.ErrNotFound)
		src.Close(t)
		verifyChunks(t, dev, buf, 31)
		require.NoError(t, buf.Close())

		// Several clients at once.
		src2 := newBuffer(t, dev, 2, 2*mib, driver.Location{}, 32)
		require.NoError(t, s.Publish("kv", src2))
		var wg sync.WaitGroup
		errs := make(chan error, 4)
		for range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				c, err := ipc.Dial(s.Path())
				if err != nil {
					errs <- err
					return
				}
				defer c.Close()
				r, err := c.Fetch("kv")
				if err == nil {
					err = r.Close()
				}
				errs <- err
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			require.NoError(t, err)
		}
		require.NoError(t, c.Close())
		_, err = c.Fetch("kv")
		require.ErrorIs(t, err, ipc.ErrClosed)
	})
}

func TestServerSocketDirectory(t *testing.T) {
	for _, mode := range []os.FileMode{0o777, 0o1777} {
		dir := t.TempDir()
		require.NoError(t, os.Chmod(dir, mode))
		_, err := ipc.Listen(filepath.Join(dir, "s.sock"), ipc.ServerOptions{})
		require.ErrorIs(t, err, ipc.ErrPermission, "mode %v", mode)
		require.ErrorContains(t, err, "writable by group or others")
	}
	_, err := ipc.Listen(filepath.Join(t.TempDir(), "missing", "s.sock"), ipc.ServerOptions{})
	require.ErrorIs(t, err, os.ErrNotExist)
	_, err = ipc.Listen(filepath.Join(t.TempDir(), strings.Repeat("x", 120)), ipc.ServerOptions{})
	require.ErrorContains(t, err, "Unix socket path")

	// A live server's socket is not taken over; a stale one (its server died) is replaced.
	dir := t.TempDir()
	path := filepath.Join(dir, "s.sock")
	s, err := ipc.Listen(path, ipc.ServerOptions{})
	require.NoError(t, err)
	_, err = ipc.Listen(path, ipc.ServerOptions{})
	require.ErrorIs(t, err, unix.EADDRINUSE)
	require.NoError(t, s.Close())
	_, err = os.Lstat(path)
	require.ErrorIs(t, err, os.ErrNotExist, "Close removes the socket")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	require.NoError(t, err)
	l.SetUnlinkOnClose(false)
	require.NoError(t, l.Close())
	s, err = ipc.Listen(path, ipc.ServerOptions{})
	require.NoError(t, err, "a stale socket is replaced")
	require.NoError(t, s.Close())
	require.NoError(t, s.Close(), "Close is idempotent")
	// Anything else at the path stays.
	require.NoError(t, os.WriteFile(path, nil, 0o600))
	_, err = ipc.Listen(path, ipc.ServerOptions{})
	require.ErrorIs(t, err, unix.EADDRINUSE)
}

// Peers of another uid are refused with a clear error, by the server and by the client.
func TestServerPeerCredentials(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		dev := b.Device(t, 0)
		src := newBuffer(t, dev, 1, 2*mib, driver.Location{}, 0)
		me := os.Getuid()
		publish := func(s *ipc.Server) { require.NoError(t, s.Publish("buf", src)) }
		fakeUID := func(uid uint32) func(*ipc.Server) {
			return func(s *ipc.Server) {
				ipc.SetPeerCredentials(s, func(*net.UnixConn) (unix.Ucred, error) {
					return unix.Ucred{Pid: 4242, Uid: uid, Gid: uid}, nil
				})
			}
		}
		fetch := func(s *ipc.Server) error {
			c, err := ipc.Dial(s.Path())
			require.NoError(t, err)
			defer c.Close()
			r, err := c.Fetch("buf")
			if err == nil {
				require.NoError(t, r.Close())
				return nil
			}
			// Once refused, the connection is not used again.
			_, err2 := c.Fetch("buf")
			require.Error(t, err2)
			return err
		}

		// The allow-list excludes this process's uid.
		err := fetch(serve(t, ipc.ServerOptions{AllowUIDs: []int{me + 1000}}, publish))
		require.ErrorIs(t, err, ipc.ErrPermission)
		require.ErrorContains(t, err, fmt.Sprintf("runs as uid %d", me))

		// A peer of another uid (credentials injected): refused by default, allowed when listed.
		err = fetch(serve(t, ipc.ServerOptions{}, publish, fakeUID(uint32(me+7))))
		require.ErrorIs(t, err, ipc.ErrPermission)
		require.ErrorContains(t, err, fmt.Sprintf("peer pid 4242 runs as uid %d", me+7))
		require.NoError(t, fetch(serve(t, ipc.ServerOptions{AllowUIDs: []int{me, me + 7}}, publish, fakeUID(uint32(me+7)))))

		// The extra check.
		err = fetch(serve(t, ipc.ServerOptions{Authorize: func(c unix.Ucred) error {
			return errors.New("not in the inference cgroup")
		}}, publish))
		require.ErrorIs(t, err, ipc.ErrPermission)
		require.ErrorContains(t, err, "not in the inference cgroup")

		// The client checks the server too.
		s := serve(t, ipc.ServerOptions{}, publish)
		_, err = ipc.DialWithOptions(s.Path(), ipc.DialOptions{AllowUIDs: []int{me + 1}})
		require.ErrorIs(t, err, ipc.ErrPermission)
		require.ErrorContains(t, err, "server")
	})
}

// Requests that break the protocol: an error reply, descriptors closed, the connection dropped.
func TestServerBadRequests(t *testing.T) {
	s := serve(t, ipc.ServerOptions{})
	before := testutil.OpenFDs(t)
	dial := func() *net.UnixConn {
		c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: s.Path(), Net: "unix"})
		require.NoError(t, err)
		return c
	}
	pr, pw, err := os.Pipe()
	require.NoError(t, err)
	for _, tc := range []struct {
		name     string
		send     func(c *net.UnixConn) error
		contains string
	}{
		{"descriptors with a fetch", func(c *net.UnixConn) error {
			return ipc.WriteMessage(c, ipc.KindFetch, []byte("x"), []*os.File{pr, pr})
		}, "2 descriptors nobody asked for"},
		{"wrong kind", func(c *net.UnixConn) error { return ipc.WriteMessage(c, ipc.KindUser, nil, nil) }, "unexpected message kind"},
		{"bad name", func(c *net.UnixConn) error { return ipc.WriteMessage(c, ipc.KindFetch, []byte("a\x00b"), nil) }, "control character"},
		{"wrong magic", func(c *net.UnixConn) error { _, err := c.Write([]byte("GET / HTTP/1.1\r\n")); return err }, "magic"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := dial()
			defer c.Close()
			require.NoError(t, tc.send(c))
			_, err := ipc.Receive(c)
			require.ErrorIs(t, err, ipc.ErrProtocol)
			require.ErrorContains(t, err, tc.contains)
			_, _, _, err = ipc.ReadMessage(c)
			require.Error(t, err, "the server hangs up")
		})
	}
	require.NoError(t, pr.Close())
	// The server closed the copies it received: the pipe has no reader.
	_, err = pw.Write([]byte("x"))
	require.ErrorIs(t, err, unix.EPIPE)
	require.NoError(t, pw.Close())
	require.Equal(t, before, testutil.OpenFDs(t))
}

// A Close made while another runs waits for it: it does not report the server closed while a
// connection's goroutine still runs (here, in Authorize).
func TestServerSecondCloseWaitsForFirst(t *testing.T) {
	entered, release := make(chan struct{}), make(chan struct{})
	s := serve(t, ipc.ServerOptions{Authorize: func(unix.Ucred) error {
		close(entered)
		<-release
		return nil
	}})
	c, err := ipc.Dial(s.Path())
	require.NoError(t, err)
	defer c.Close()
	<-entered
	first := make(chan error, 1)
	go func() { first <- s.Close() }()
	for !errors.Is(s.Publish("b", nil), ipc.ErrClosed) { // the first Close has begun
		time.Sleep(time.Millisecond)
	}
	second := testutil.StillWaiting(t, 200*time.Millisecond, "the second Close, while the first waits for a connection,", s.Close)
	close(release)
	require.NoError(t, <-first)
	require.NoError(t, <-second)
}
