package broker

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/vmm"
)

// An unregister whose cuMemUnmap fails is answered ErrInternal and the buffer no longer counts, but
// nothing leaks: the System keeps it and frees it when the test's cleanup closes the System (which
// fails, "still owned", when the buffer is dropped).
func TestUnregisterCloseFailureKeepsBuffer(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		ctx, dev, srv, path := serveDevice0(t, b, Options{})
		c := dial(t, path)
		buf := newDevBuffer(t, dev, 1, 2*mib)
		rb, err := c.Register(ctx, buf)
		require.NoError(t, err)
		b.Sim.FailNth("cuMemUnmap", 1, driver.ErrorUnknown)
		require.ErrorIs(t, c.Unregister(ctx, rb), ErrInternal)
		require.Zero(t, srv.Stats().Buffers)
		require.Len(t, dev.System().Orphans(), 1)
		require.NoError(t, dev.System().RetryOrphans())
		require.Empty(t, dev.System().Orphans())
	}, testutil.SimOnly())
}

// The same on disconnect: the buffer whose release fails goes to the System, which frees it.
func TestDisconnectCloseFailureKeepsBuffer(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		ctx, dev, srv, path := serveDevice0(t, b, Options{})
		c, err := DialContext(ctx, path, DialOptions{})
		require.NoError(t, err)
		buf := newDevBuffer(t, dev, 1, 2*mib)
		_, err = c.Register(ctx, buf)
		require.NoError(t, err)
		b.Sim.FailNth("cuMemUnmap", 1, driver.ErrorUnknown)
		require.NoError(t, c.Close())
		eventually(t, "drain", func() bool { return srv.Stats().Drained == 1 })
		require.Zero(t, srv.Stats().Buffers)
		require.Len(t, dev.System().Orphans(), 1)
	}, testutil.SimOnly())
}

// A Register whose context ends before the answer unregisters the buffer when the answer comes:
// with MaxBuffers 1 the worker can register again.
func TestCancelledRegisterIsUnregistered(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		dev := b.Device(t, 0)
		region := newRegion(t, dev, 4*mib, pinned.Options{})
		srv, path := startServer(t, region, Options{MaxBuffers: 1})
		c := dial(t, path)
		buf := newDevBuffer(t, dev, 1, 2*mib)
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		_, err := c.Register(ctx, buf)
		require.ErrorIs(t, err, context.Canceled)
		eventually(t, "a second register", func() bool {
			_, err := c.Register(testCtx(t), buf)
			if err != nil {
				require.ErrorIs(t, err, ErrLimit)
			}
			return err == nil
		})
		require.Equal(t, 1, srv.Stats().Buffers)
	}, testutil.SimOnly())
}

// A bad argument to Client.Region (a nil device in Grant) is refused before anything is sent: the
// connection stays usable.
func TestRegionBadGrantKeepsClient(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		ctx, dev, _, path := serveDevice0(t, b, Options{})
		c := dial(t, path)
		_, err := c.Region(ctx, dev, pinned.OpenOptions{Grant: []*vmm.Device{nil}})
		require.ErrorIs(t, err, ErrInvalidValue)
		require.NoError(t, c.Ping(ctx), "a rejected argument must not cost the connection")
		r, err := c.Region(ctx, dev, pinned.OpenOptions{})
		require.NoError(t, err)
		require.NoError(t, r.Close())
	}, testutil.SimOnly())
}

// A refusal (here an idle drop) counts once in Stats.Failed.
func TestRefusalCountedOnce(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		dev := b.Device(t, 0)
		region := newRegion(t, dev, 4*mib, pinned.Options{})
		srv, path := startServer(t, region, Options{IdleTimeout: 100 * time.Millisecond})
		_ = rawConn(t, path, true)
		eventually(t, "drop", func() bool { return srv.Stats().Dropped == 1 })
		time.Sleep(50 * time.Millisecond)
		require.Equal(t, uint64(1), srv.Stats().Failed)
	}, testutil.SimOnly())
}

// A worker that stops reading loses its connection after WriteTimeout (Options.WriteTimeout), and
// counts as dropped, whether the write that timed out was an answer (pings) or the region's (region
// requests).
func TestStalledReaderLosesConnection(t *testing.T) {
	for name, op := range map[string]uint16{"ping": OpPing, "region": OpRegion} {
		t.Run(name, func(t *testing.T) {
			testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
				dev := b.Device(t, 0)
				region := newRegion(t, dev, 4*mib, pinned.Options{})
				srv, path := startServer(t, region, Options{WriteTimeout: 50 * time.Millisecond})
				conn := rawConn(t, path, true)
				go requestWithoutReading(conn, op, 2)
				eventually(t, "the stalled worker dropped", func() bool { return srv.Stats().Workers == 0 })
				require.Equal(t, uint64(1), srv.Stats().Dropped)
			}, testutil.SimOnly())
		})
	}
}

// An idle timeout below what the hello can carry (100 ms) is refused; a longer one is announced
// rounded down, so that the client's keep-alive is never late.
func TestIdleTimeoutAnnouncedNoLonger(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		dev := b.Device(t, 0)
		region := newRegion(t, dev, 4*mib, pinned.Options{})
		_, err := Listen(region, privateDir(t)+"/b.sock", Options{IdleTimeout: 50 * time.Millisecond})
		require.ErrorIs(t, err, ErrInvalidValue)
		_, path := startServer(t, region, Options{IdleTimeout: 250 * time.Millisecond})
		c := dial(t, path)
		require.Equal(t, 200*time.Millisecond, c.Info().IdleTimeout)
	}, testutil.SimOnly())
}
