package broker

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/vmm"
)

// The multi-process tests re-execute this test binary as the other process (so they run on a GPU
// host without Go): CUVMM_BROKER_CHILD names its role and TestMain runs it instead of the tests.
const (
	envChild  = "CUVMM_BROKER_CHILD"
	envSocket = "CUVMM_BROKER_SOCKET"
)

// TestMain runs the child's role when one is named, and otherwise the tests, followed in builds with
// the cuvmmleak tag by the report of objects that were never closed.
func TestMain(m *testing.M) {
	if role := os.Getenv(envChild); role != "" {
		if err := childMain(role); err != nil {
			fmt.Fprintf(os.Stderr, "broker test child (%s): %v\n", role, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(testutil.Main(m))
}

func childMain(role string) error {
	dev, closeSys, err := testutil.ChildDevice()
	if err != nil {
		return err
	}
	defer closeSys()
	path := os.Getenv(envSocket)
	switch role {
	case "worker":
		// Register a buffer and keep copies in flight both ways until killed.
		res, err := dev.System().Reserve(4*mib, vmm.ReserveOptions{})
		if err != nil {
			return err
		}
		for off := uint64(0); off < 4*mib; off += 2 * mib {
			if _, err := res.MapNew(off, 2*mib, dev, vmm.AllocOptions{HandleTypes: driver.HandleTypePosixFD}, vmm.ReadWrite(dev)); err != nil {
				return err
			}
		}
		c, err := Dial(path)
		if err != nil {
			return err
		}
		ctx := context.Background()
		rb, err := c.Register(ctx, ipc.FromReservation(res))
		if err != nil {
			return err
		}
		fmt.Println("registered")
		var inflight []*Completion
		for i := 0; ; i++ {
			if len(inflight) == 8 {
				if err := inflight[0].Wait(ctx); err != nil {
					return err
				}
				inflight = inflight[1:]
			}
			if i == 16 {
				fmt.Println("busy")
			}
			cp, err := c.CopyAsync(Request{Buffer: rb.ID(), Dir: Direction(1 + i%2), HostOffset: uint64(i%2) * 4 * mib, Length: 4 * mib})
			if err != nil {
				return err
			}
			inflight = append(inflight, cp)
		}

	case "broker":
		// Serve a region until stdin closes (or until killed).
		region, err := pinned.New(dev, 8*mib, pinned.Options{})
		if err != nil {
			return err
		}
		defer region.Close()
		srv, err := Listen(region, path, Options{})
		if err != nil {
			return err
		}
		go srv.Serve()
		fmt.Println("ready")
		_, _ = io.Copy(io.Discard, os.Stdin)
		return srv.Close()
	}
	return fmt.Errorf("unknown role %q", role)
}

// readyBroker starts a broker process on a new socket and waits until it listens.
func readyBroker(t *testing.T, b *testutil.Backend) (br *testutil.Child, path string) {
	t.Helper()
	path = filepath.Join(privateDir(t), "broker.sock")
	br = startChild(t, b, "broker", path)
	require.Equal(t, "ready", br.Line())
	return br, path
}

// startChild runs this test binary as the other process in role, with b's backend, serving or
// dialling the socket at socket.
func startChild(t *testing.T, b *testutil.Backend, role, socket string) *testutil.Child {
	t.Helper()
	return testutil.StartChild(t, b, []string{envChild + "=" + role, envSocket + "=" + socket})
}

// A worker process killed with SIGKILL while its copies are in flight: the broker drains them,
// releases its buffer and goes on serving the other worker.
func TestWorkerKilled(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		ctx := testCtx(t)
		dev := b.Device(t, 0)
		region := newRegion(t, dev, 8*mib, pinned.Options{})
		srv, path := startServer(t, region, Options{})
		stay := dial(t, path)
		stayBuf := newDevBuffer(t, dev, 1, 2*mib)
		srb, err := stay.Register(ctx, stayBuf)
		require.NoError(t, err)

		w := startChild(t, b, "worker", path)
		require.Equal(t, "registered", w.Line())
		require.Equal(t, "busy", w.Line())
		require.Equal(t, 2, srv.Stats().Buffers)
		sawInFlight := false
		for i := 0; i < 1000 && !sawInFlight; i++ {
			sawInFlight = srv.Stats().InFlight > 0
		}
		t.Logf("copies in flight seen before the kill: %v", sawInFlight)
		w.Kill()
		eventually(t, "the broker to drain the killed worker", func() bool {
			st := srv.Stats()
			return st.Workers == 1 && st.Buffers == 1 && st.InFlight == 0 && st.Drained == 1
		})
		require.GreaterOrEqual(t, srv.Stats().Copies, uint64(8), "the worker waited for 8 copies before it said busy")

		fillHost(region.Bytes()[:2*mib], 0, 51)
		require.NoError(t, stay.Copy(ctx, Request{Buffer: srb.ID(), Dir: ToDevice, Length: 2 * mib}))
		requireDevicePattern(t, dev, stayBuf.Ptr(), 2*mib, 0, 51)
	})
}

// Client.Close of a worker whose broker process was killed returns at once: the kernel ended the
// connection with the process.
func TestClientCloseAfterBrokerKilled(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		ctx := testCtx(t)
		dev := b.Device(t, 0)
		buf := newDevBuffer(t, dev, 2, 2*mib)
		br, path := readyBroker(t, b)
		c, err := Dial(path)
		require.NoError(t, err)
		_, err = c.Register(ctx, buf)
		require.NoError(t, err)
		require.NoError(t, c.Ping(ctx))
		br.Kill()
		t0 := time.Now()
		require.NoError(t, c.Close())
		require.Less(t, time.Since(t0), 5*time.Second, "Close waited for a broker that was killed")
	})
}

// The broker process killed under a connected worker: pending and later requests fail with
// ErrBrokerGone wrapping the I/O error, and the worker reconnects to a new broker on the same path.
func TestBrokerKilled(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		ctx := testCtx(t)
		dev := b.Device(t, 0)
		buf := newDevBuffer(t, dev, 2, 2*mib)
		br, path := readyBroker(t, b)

		c, err := Dial(path)
		require.NoError(t, err)
		require.Equal(t, int32(br.Pid()), c.Info().Server.Pid)
		rb, err := c.Register(ctx, buf)
		require.NoError(t, err)
		require.NoError(t, dev.Fill(buf.Ptr(), 4*mib, 0, 61))
		require.NoError(t, c.Copy(ctx, Request{Buffer: rb.ID(), Dir: ToHost, Length: 4 * mib}))

		br.Kill()
		err = c.Copy(ctx, Request{Buffer: rb.ID(), Dir: ToDevice, Length: 4 * mib})
		require.ErrorIs(t, err, ErrBrokerGone)
		require.True(t, errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE),
			"the I/O error is wrapped too: %v", err)
		require.ErrorIs(t, c.Ping(ctx), ErrBrokerGone)
		_, err = c.Register(ctx, buf)
		require.ErrorIs(t, err, ErrBrokerGone)
		t0 := time.Now()
		require.NoError(t, c.Close())
		require.Less(t, time.Since(t0), 5*time.Second, "Close waited for a broker that was killed")

		// A new broker on the same path (the dead one's socket file is replaced).
		br2 := startChild(t, b, "broker", path)
		dctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		c2, err := DialContext(dctx, path, DialOptions{Retry: true})
		require.NoError(t, err)
		require.Equal(t, "ready", br2.Line())
		require.Equal(t, int32(br2.Pid()), c2.Info().Server.Pid)
		rb2, err := c2.Register(ctx, buf)
		require.NoError(t, err)
		view, err := c2.Region(ctx, dev, pinned.OpenOptions{})
		require.NoError(t, err)
		fillHost(view.Bytes()[4*mib:8*mib], 0, 62)
		require.NoError(t, c2.Copy(ctx, Request{Buffer: rb2.ID(), Dir: ToDevice, HostOffset: 4 * mib, Length: 4 * mib}))
		requireDevicePattern(t, dev, buf.Ptr(), 4*mib, 0, 62)
		require.NoError(t, dev.Fill(buf.Ptr(), 4*mib, 0, 63))
		require.NoError(t, c2.Copy(ctx, Request{Buffer: rb2.ID(), Dir: ToHost, Length: 4 * mib}))
		require.Zero(t, badHost(view.Bytes()[:4*mib], 0, 63))
		require.NoError(t, view.Close())
		require.NoError(t, rb2.Close())
		require.NoError(t, c2.Close())
		br2.Wait()
	})
}
