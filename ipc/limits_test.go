package ipc_test

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/ipc"
)

// Idle peers and peers that send half a request are dropped on time, told why, while another
// client is served throughout; a Client dropped for idleness dials again on its next Fetch.
func TestServerDropsSilentPeers(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		dev := b.Device(t, 0)
		src := newBuffer(t, dev, 1, 2*mib, driver.Location{}, 0)
		const timeout = 300 * time.Millisecond
		s := serve(t, ipc.ServerOptions{IdleTimeout: timeout, ReadTimeout: timeout})
		require.NoError(t, s.Publish("buf", src))
		good, err := ipc.Dial(s.Path())
		require.NoError(t, err)
		defer good.Close()
		sleeper, err := ipc.Dial(s.Path())
		require.NoError(t, err)
		defer sleeper.Close()
		idle, err := net.Dial("unix", s.Path())
		require.NoError(t, err)
		defer idle.Close()
		half, err := net.Dial("unix", s.Path())
		require.NoError(t, err)
		defer half.Close()
		_, err = half.Write(ipc.EncodeHeader(ipc.KindFetch, 3, 0)[:9])
		require.NoError(t, err)

		start := time.Now()
		for time.Since(start) < 2*timeout {
			t0 := time.Now()
			r, err := good.Fetch("buf")
			require.NoError(t, err)
			require.NoError(t, r.Close())
			require.Less(t, time.Since(t0), 200*time.Millisecond, "the good client waited")
			time.Sleep(20 * time.Millisecond)
		}
		for name, c := range map[string]net.Conn{"idle": idle, "half": half} {
			uc := c.(*net.UnixConn)
			require.NoError(t, uc.SetReadDeadline(time.Now().Add(time.Second)))
			_, err := ipc.Receive(uc)
			want := ipc.ErrIdle
			if name == "half" {
				want = ipc.ErrTimeout
			}
			require.ErrorIs(t, err, want, name)
		}
		require.Less(t, time.Since(start), 4*timeout)
		r, err := sleeper.Fetch("buf")
		require.NoError(t, err, "the sleeping client dials again")
		require.NoError(t, r.Close())
	})
}

func TestServerConnectionCap(t *testing.T) {
	s := serve(t, ipc.ServerOptions{MaxConns: 2})
	for range 2 {
		c, err := ipc.Dial(s.Path())
		require.NoError(t, err)
		defer c.Close()
		_, err = c.Fetch("none")
		require.ErrorIs(t, err, ipc.ErrNotFound, "admitted")
	}
	c, err := ipc.Dial(s.Path())
	require.NoError(t, err)
	defer c.Close()
	_, err = c.Fetch("none")
	require.ErrorIs(t, err, ipc.ErrConnLimit)
	require.ErrorContains(t, err, "MaxConns")
}

func TestAbstractNamesAndEACCES(t *testing.T) {
	_, err := ipc.Listen("@cuvmm-test", ipc.ServerOptions{})
	require.ErrorIs(t, err, ipc.ErrPermission)
	require.ErrorContains(t, err, "abstract")
	_, err = ipc.Dial("@cuvmm-test")
	require.ErrorIs(t, err, ipc.ErrPermission)
	_, err = ipc.ListenUnix("@x") // the deprecated bare listener applies the same rules
	require.ErrorIs(t, err, ipc.ErrPermission)
	require.NoFileExists(t, "@x")

	s := serve(t, ipc.ServerOptions{})
	errc := make(chan error, 1)
	if os.Geteuid() == 0 {
		// Root passes permission checks: dial from a thread with nobody's filesystem uid (the
		// goroutine ends locked, retiring the thread).
		go func() {
			runtime.LockOSThread()
			unix.Setfsuid(65534)
			_, err := ipc.DialContext(context.Background(), s.Path(), ipc.DialOptions{})
			errc <- err
		}()
	} else {
		dir := filepath.Dir(s.Path())
		require.NoError(t, os.Chmod(dir, 0))
		defer os.Chmod(dir, 0o700)
		_, err := ipc.Dial(s.Path())
		errc <- err
	}
	err = <-errc
	require.ErrorIs(t, err, ipc.ErrPermission)
	require.ErrorIs(t, err, syscall.EACCES)
}
