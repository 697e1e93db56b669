package unixsock

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// echo serves frames back until the peer leaves or is dropped; dropped records why.
func echo(dropped chan<- error) func(*Conn) {
	return func(c *Conn) {
		for {
			f, err := c.Read()
			if err != nil {
				if dropped != nil {
					dropped <- err
				}
				return
			}
			_ = c.Write(f.Kind, f.Payload, nil)
			_ = CloseFiles(f.Files)
		}
	}
}

func serve(t *testing.T, opts Options, handle func(*Conn)) *Listener {
	t.Helper()
	l, err := Listen(filepath.Join(privateDir(t), "s.sock"), opts)
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- l.Serve(handle) }()
	t.Cleanup(func() {
		require.NoError(t, l.Close())
		require.NoError(t, <-done)
	})
	return l
}

func dial(t *testing.T, path string) *Conn {
	t.Helper()
	c, err := Dial(context.Background(), path, DialOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	return c
}

func roundTrip(t *testing.T, c *Conn) {
	t.Helper()
	require.NoError(t, c.Write(9, []byte("ping"), nil))
	f, err := c.Read()
	require.NoError(t, err)
	require.Equal(t, "ping", string(f.Payload))
}

func TestListenDirectoryChecks(t *testing.T) {
	for _, mode := range []os.FileMode{0o770, 0o707, 0o1777, 0o720} {
		d := privateDir(t)
		require.NoError(t, os.Chmod(d, mode))
		_, err := Listen(filepath.Join(d, "s.sock"), Options{})
		require.ErrorIs(t, err, ErrPermission, "mode %v", mode)
		require.Contains(t, err.Error(), "writable by group or others")
		require.NoFileExists(t, filepath.Join(d, "s.sock"))
	}
	if os.Geteuid() == 0 {
		d := privateDir(t)
		require.NoError(t, os.Chown(d, 12345, 12345))
		_, err := Listen(filepath.Join(d, "s.sock"), Options{})
		require.ErrorIs(t, err, ErrPermission)
		require.Contains(t, err.Error(), "belongs to uid 12345")
	}
	// A directory of this uid, mode 0700 or 0755, is fine; the socket is 0600.
	for _, mode := range []os.FileMode{0o700, 0o755} {
		d := privateDir(t)
		require.NoError(t, os.Chmod(d, mode))
		l, err := Listen(filepath.Join(d, "s.sock"), Options{})
		require.NoError(t, err)
		st, err := os.Lstat(filepath.Join(d, "s.sock"))
		require.NoError(t, err)
		require.Equal(t, os.FileMode(0o600), st.Mode().Perm())
		require.NoError(t, l.Close())
		require.NoFileExists(t, filepath.Join(d, "s.sock"))
	}
	_, err := Listen(filepath.Join(privateDir(t), strings.Repeat("x", 120)), Options{})
	require.ErrorIs(t, err, syscall.ENAMETOOLONG)
	_, err = Listen(filepath.Join(privateDir(t), "missing", "s.sock"), Options{})
	require.ErrorIs(t, err, os.ErrNotExist)
}

// "@x" is an abstract name: refused on both sides, without looking at a file "./@x".
func TestAbstractNamesRefused(t *testing.T) {
	d := privateDir(t)
	wd, err := os.Getwd()
	require.NoError(t, err)
	require.NoError(t, os.Chdir(d))
	defer os.Chdir(wd)
	require.NoError(t, os.Chmod(d, 0o777)) // a file check of "./@x" would say world-writable
	_, err = Listen("@x", Options{})
	require.ErrorIs(t, err, ErrPermission)
	require.Contains(t, err.Error(), "abstract socket name")
	require.NotContains(t, err.Error(), "writable")
	_, err = Dial(context.Background(), "@x", DialOptions{})
	require.ErrorIs(t, err, ErrPermission)
	require.Contains(t, err.Error(), "abstract socket name")
}

// A socket the filesystem does not let the dialer reach is ErrPermission (and EACCES).
func TestDialEACCES(t *testing.T) {
	l := serve(t, Options{}, echo(nil))
	dir := filepath.Dir(l.Path())
	errc := make(chan error, 1)
	if os.Geteuid() == 0 {
		// Root passes every permission check: dial from a thread whose filesystem uid is nobody's
		// (setfsuid drops the thread's file capabilities). The goroutine ends locked, so the thread
		// is retired with it.
		go func() {
			runtime.LockOSThread()
			unix.Setfsuid(65534)
			_, err := Dial(context.Background(), l.Path(), DialOptions{})
			errc <- err
		}()
	} else {
		require.NoError(t, os.Chmod(dir, 0o000))
		defer os.Chmod(dir, 0o700)
		_, err := Dial(context.Background(), l.Path(), DialOptions{})
		errc <- err
	}
	err := <-errc
	require.ErrorIs(t, err, ErrPermission)
	require.ErrorIs(t, err, syscall.EACCES)
}

func TestDialChecksServerUID(t *testing.T) {
	l := serve(t, Options{}, echo(nil))
	_, err := Dial(context.Background(), l.Path(), DialOptions{AllowUIDs: []int{os.Getuid() + 1}})
	require.ErrorIs(t, err, ErrPermission)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	_, err = Dial(ctx, filepath.Join(privateDir(t), "none.sock"), DialOptions{Retry: true})
	require.ErrorIs(t, err, context.DeadlineExceeded)
}

// Peers refused by uid or Authorize are told why and never reach the handler.
func TestRefusedPeers(t *testing.T) {
	var reached atomic.Int32
	refuse := func(c *Conn, err error) { _ = c.Write(0xffff, []byte(err.Error()), nil) }
	for _, opts := range []Options{
		{AllowUIDs: []int{os.Getuid() + 1}, Refuse: refuse},
		{Authorize: func(unix.Ucred) error { return errors.New("not today") }, Refuse: refuse},
	} {
		l := serve(t, opts, func(*Conn) { reached.Add(1) })
		c := dial(t, l.Path())
		f, err := c.Read()
		require.NoError(t, err)
		require.Equal(t, uint16(0xffff), f.Kind)
		require.Contains(t, string(f.Payload), "permission denied")
		require.Equal(t, uint64(1), l.Stats().Refused)
	}
	require.Zero(t, reached.Load())
}

// Idle peers and peers that send half a frame are dropped on time while another client is served
// throughout.
func TestIdleAndHalfMessagePeersDropped(t *testing.T) {
	const timeout = 300 * time.Millisecond
	dropped := make(chan error, 8)
	l := serve(t, Options{IdleTimeout: timeout, ReadTimeout: timeout}, echo(dropped))
	good := dial(t, l.Path())
	idle := dial(t, l.Path())
	half := dial(t, l.Path())
	hb := make([]byte, HeaderSize)
	Header{Kind: 3, Length: 100}.Put(hb)
	_, err := half.Unix().Write(hb[:10])
	require.NoError(t, err)
	start := time.Now()

	// The good client keeps talking (faster than the idle timeout) and is always served.
	var errs []error
	deadline := start.Add(2 * timeout)
	for time.Now().Before(deadline) {
		t0 := time.Now()
		roundTrip(t, good)
		require.Less(t, time.Since(t0), 100*time.Millisecond, "the good client waited")
		time.Sleep(20 * time.Millisecond)
	}
	for range 2 {
		select {
		case err := <-dropped:
			errs = append(errs, err)
		case <-time.After(time.Second):
			t.Fatal("a silent peer was not dropped")
		}
	}
	took := time.Since(start)
	require.True(t, errors.Is(errs[0], ErrIdle) || errors.Is(errs[1], ErrIdle), "%v", errs)
	require.True(t, errors.Is(errs[0], ErrTimeout) || errors.Is(errs[1], ErrTimeout), "%v", errs)
	require.Less(t, took, 3*timeout)
	for _, c := range []*Conn{idle, half} {
		_ = c.Unix().SetReadDeadline(time.Now().Add(time.Second))
		_, err := c.Read()
		require.Error(t, err, "the server hung up")
	}
	roundTrip(t, good)
	require.Equal(t, 1, l.Stats().Active)
}

func TestConnectionCaps(t *testing.T) {
	refuse := func(c *Conn, err error) { _ = c.Write(0xffff, []byte(err.Error()), nil) }
	l := serve(t, Options{MaxConns: 3, Refuse: refuse}, echo(nil))
	var conns []*Conn
	for range 3 {
		c := dial(t, l.Path())
		roundTrip(t, c)
		conns = append(conns, c)
	}
	extra := dial(t, l.Path())
	f, err := extra.Read()
	require.NoError(t, err)
	require.Contains(t, string(f.Payload), "MaxConns")
	require.Contains(t, string(f.Payload), ErrConnLimit.Error())
	conns[0].Close()
	require.Eventually(t, func() bool { return l.Stats().Active == 2 }, time.Second, 5*time.Millisecond)
	roundTrip(t, dial(t, l.Path()))

	l2 := serve(t, Options{MaxConnsPerUID: 1, Refuse: refuse}, echo(nil))
	roundTrip(t, dial(t, l2.Path()))
	f, err = dial(t, l2.Path()).Read()
	require.NoError(t, err)
	require.Contains(t, string(f.Payload), "MaxConnsPerUID")
}

// The accept loop pauses longer and longer on EMFILE and logs at most once a second.
func TestAcceptBacksOffOnEMFILE(t *testing.T) {
	var mu sync.Mutex
	var lines []string
	l, err := Listen(filepath.Join(privateDir(t), "s.sock"), Options{Logf: func(f string, a ...any) {
		mu.Lock()
		lines = append(lines, f)
		mu.Unlock()
	}})
	require.NoError(t, err)
	var calls atomic.Int32
	l.accept = func() (*net.UnixConn, error) {
		calls.Add(1)
		return nil, &net.OpError{Op: "accept", Err: os.NewSyscallError("accept4", syscall.EMFILE)}
	}
	done := make(chan error, 1)
	go func() { done <- l.Serve(echo(nil)) }()
	time.Sleep(1500 * time.Millisecond)
	require.NoError(t, l.Close())
	require.NoError(t, <-done, "Serve returns nil after Close, even while pausing")
	mu.Lock()
	defer mu.Unlock()
	// 5+10+...+640 ms is 1.275 s: about 9 tries in 1.5 s, not thousands.
	require.LessOrEqual(t, calls.Load(), int32(12))
	require.GreaterOrEqual(t, calls.Load(), int32(5))
	require.LessOrEqual(t, len(lines), 2, "%q", lines)
	require.Equal(t, uint64(calls.Load()), l.Stats().Backoffs)
}

func TestBackoffLogLine(t *testing.T) {
	var b backoff
	now := time.Unix(100, 0)
	line, ok := b.note(syscall.EMFILE, now)
	require.True(t, ok)
	require.Contains(t, line, "pausing 5ms")
	for i := range 5 {
		_, ok = b.note(syscall.EMFILE, now.Add(time.Duration(i+1)*100*time.Millisecond))
		require.False(t, ok)
	}
	line, ok = b.note(syscall.EMFILE, now.Add(1100*time.Millisecond))
	require.True(t, ok)
	require.Contains(t, line, "and 5 more such events")
	for range 20 {
		b.note(syscall.EMFILE, now)
	}
	require.Equal(t, backoffMax, b.delay)
	b.reset()
	require.Zero(t, b.delay)
}

// With no per-message limit (ReadTimeout < 0), a peer that stops in the middle of a frame is still
// dropped by the idle timeout, and the error says so (ErrIdle).
func TestHalfMessageDroppedByIdleTimeoutAlone(t *testing.T) {
	const timeout = 200 * time.Millisecond
	dropped := make(chan error, 1)
	l := serve(t, Options{IdleTimeout: timeout, ReadTimeout: -1}, echo(dropped))
	half := dial(t, l.Path())
	hb := make([]byte, HeaderSize)
	Header{Kind: 3, Length: 100}.Put(hb)
	_, err := half.Unix().Write(hb[:10])
	require.NoError(t, err)
	select {
	case err := <-dropped:
		require.ErrorIs(t, err, ErrTimeout) // a frame begun is not idle: its framing is lost
		require.NotErrorIs(t, err, ErrIdle)
		require.ErrorContains(t, err, "then nothing for")
	case <-time.After(5 * timeout):
		t.Fatal("the peer that stopped mid-frame was not dropped")
	}
}

// A Close made while another waits for a handler waits for it too: it does not report the listener
// closed while a handler still runs.
func TestSecondCloseWaitsForFirst(t *testing.T) {
	entered, release := make(chan struct{}), make(chan struct{})
	l := serve(t, Options{}, func(c *Conn) {
		close(entered)
		<-release // a handler that does not notice its connection closing
	})
	dial(t, l.Path())
	<-entered
	first := make(chan error, 1)
	go func() { first <- l.Close() }()
	for !l.isClosed() {
		time.Sleep(time.Millisecond)
	}
	second := make(chan error, 1)
	go func() { second <- l.Close() }()
	select {
	case err := <-second:
		t.Fatalf("the second Close returned (%v) while the first waits for a handler", err)
	case <-time.After(200 * time.Millisecond):
	}
	close(release)
	require.NoError(t, <-first)
	require.NoError(t, <-second)
}
