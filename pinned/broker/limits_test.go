package broker

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

	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/pinned"
)

// A peer that says hello and goes silent, and one that sends half a request, are dropped on time
// with their buffers released, while a working client is served throughout and a quiet Client
// (which pings ahead of the idle timeout) is kept.
func TestBrokerDropsSilentPeers(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		ctx := testCtx(t)
		dev := b.Device(t, 0)
		region := newRegion(t, dev, 4*mib, pinned.Options{})
		const timeout = 300 * time.Millisecond
		srv, path := startServer(t, region, Options{StreamsPerDevice: 1, IdleTimeout: timeout, ReadTimeout: timeout})
		good := dial(t, path)
		gb, err := good.Register(ctx, newDevBuffer(t, dev, 1, 2*mib))
		require.NoError(t, err)
		quiet := dial(t, path)
		require.Equal(t, timeout, quiet.Info().IdleTimeout)
		qb, err := quiet.Register(ctx, newDevBuffer(t, dev, 1, 2*mib))
		require.NoError(t, err)
		silent := rawConn(t, path, true)
		half := rawConn(t, path, true)
		frame := append(frameHeader(KindRequest, RequestSize, 0), encodeReq(request{op: OpPing, id: 2})...)
		_, err = half.Write(frame[:20])
		require.NoError(t, err)

		start := time.Now()
		for time.Since(start) < 2*timeout {
			t0 := time.Now()
			require.NoError(t, good.Copy(ctx, Request{Buffer: gb.ID(), Dir: ToDevice, Length: mib}))
			require.Less(t, time.Since(t0), 200*time.Millisecond, "the working client waited")
			time.Sleep(20 * time.Millisecond)
		}
		for name, c := range map[string]*net.UnixConn{"silent": silent, "half": half} {
			require.NoError(t, c.SetReadDeadline(time.Now().Add(time.Second)))
			resp, err := rawResponse(c)
			require.NoError(t, err, name)
			want := StatusIdle
			if name == "half" {
				want = StatusTimeout
			}
			require.Equal(t, want, resp.status, "%s: %s", name, resp.text)
		}
		require.Less(t, time.Since(start), 4*timeout)
		eventually(t, "the silent peers to be dropped", func() bool { return srv.Stats().Workers == 2 })
		require.Equal(t, uint64(2), srv.Stats().Dropped)
		require.NoError(t, quiet.Copy(ctx, Request{Buffer: qb.ID(), Dir: ToHost, Length: mib}), "the quiet client was kept")
	})
}

func TestBrokerConnectionCapAndPaths(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		ctx := testCtx(t)
		dev := b.Device(t, 0)
		region := newRegion(t, dev, 4*mib, pinned.Options{})
		_, path := startServer(t, region, Options{StreamsPerDevice: 1, MaxConnsPerUID: 1})
		dial(t, path)
		_, err := DialContext(ctx, path, DialOptions{})
		require.ErrorIs(t, err, ErrConnLimit)
		require.ErrorContains(t, err, "MaxConnsPerUID")

		_, err = Listen(region, "@cuvmm-broker", Options{})
		require.ErrorIs(t, err, ErrPermission)
		_, err = DialContext(ctx, "@cuvmm-broker", DialOptions{})
		require.ErrorIs(t, err, ErrPermission)

		_, path2 := startServer(t, region, Options{StreamsPerDevice: 1})
		errc := make(chan error, 1)
		if os.Geteuid() == 0 {
			go func() {
				runtime.LockOSThread() // retired with the goroutine, filesystem uid and all
				unix.Setfsuid(65534)
				_, err := DialContext(context.Background(), path2, DialOptions{})
				errc <- err
			}()
		} else {
			dir := filepath.Dir(path2)
			require.NoError(t, os.Chmod(dir, 0))
			defer os.Chmod(dir, 0o700)
			_, err := DialContext(ctx, path2, DialOptions{})
			errc <- err
		}
		err = <-errc
		require.ErrorIs(t, err, ErrPermission)
		require.ErrorIs(t, err, syscall.EACCES)
	}, testutil.SimOnly())
}

// A worker that sends a register request and only part of the buffer after it is dropped once
// ReadTimeout has passed, with StatusTimeout and counted in Dropped, as for a half-sent request; with
// no ReadTimeout, the idle timeout still bounds it (StatusTimeout as well: the message was begun).
func TestBrokerDropsHalfSentRegister(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		const timeout = 300 * time.Millisecond
		for _, tc := range []struct {
			opts Options
			want uint16
		}{
			{Options{StreamsPerDevice: 1, ReadTimeout: timeout}, StatusTimeout},
			{Options{StreamsPerDevice: 1, ReadTimeout: -1, IdleTimeout: timeout}, StatusTimeout},
		} {
			_, _, srv, path := serveDevice0(t, b, tc.opts)
			half := rawConn(t, path, true)
			require.NoError(t, ipc.WriteMessage(half, KindRequest, encodeReq(request{op: OpRegister, id: 2}), nil))
			_, err := half.Write(frameHeader(ipc.KindBuffer, 64, 0)[:10])
			require.NoError(t, err)
			start := time.Now()
			require.NoError(t, half.SetReadDeadline(time.Now().Add(10*timeout)))
			resp, err := rawResponse(half)
			require.NoError(t, err)
			require.Equal(t, tc.want, resp.status, resp.text)
			require.Less(t, time.Since(start), 4*timeout)
			eventually(t, "the half-sent register to be dropped", func() bool { return srv.Stats().Dropped == 1 })
		}
	})
}

// Options follow the limits table of docs/broker.md: zero takes the default, a negative timeout or
// connection cap turns it off, and a negative count that cannot be off is refused.
func TestOptionsZeroAndNegative(t *testing.T) {
	var o Options
	require.NoError(t, o.defaults())
	require.Equal(t, 10*time.Second, o.HelloTimeout)
	require.Equal(t, time.Minute, o.IdleTimeout)
	require.Equal(t, int64(DefaultMaxRegisteredBytes), o.MaxRegisteredBytes)

	o = Options{HelloTimeout: -1, IdleTimeout: -1, ReadTimeout: -1, WriteTimeout: -1, MaxConns: -1, MaxConnsPerUID: -1, MaxRegisteredBytes: -1}
	require.NoError(t, o.defaults())
	for name, v := range map[string]int64{"HelloTimeout": int64(o.HelloTimeout), "IdleTimeout": int64(o.IdleTimeout),
		"ReadTimeout": int64(o.ReadTimeout), "WriteTimeout": int64(o.WriteTimeout), "MaxConns": int64(o.MaxConns),
		"MaxConnsPerUID": int64(o.MaxConnsPerUID), "MaxRegisteredBytes": o.MaxRegisteredBytes} {
		require.Negative(t, v, "%s: a negative value turns it off", name)
	}
	for _, o := range []Options{{MaxBuffers: -1}, {MaxInFlight: -1}, {StreamsPerDevice: -1}} {
		require.ErrorIs(t, o.defaults(), ErrInvalidValue, "%+v", o)
	}
}

// With HelloTimeout off, a connection may take its time to say hello; the idle timeout is for
// workers past the hello.
func TestHelloTimeoutOff(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		_, _, _, path := serveDevice0(t, b, Options{HelloTimeout: -1, IdleTimeout: 200 * time.Millisecond})
		conn := rawConn(t, path, false)
		time.Sleep(400 * time.Millisecond)
		require.NoError(t, ipc.WriteMessage(conn, KindRequest, encodeReq(request{op: OpHello, id: 1}), nil))
		resp, err := rawResponse(conn)
		require.NoError(t, err)
		require.Equal(t, StatusOK, resp.status, resp.text)
	}, testutil.SimOnly())
}

// With ReadTimeout off, a request left half-sent is still a message not finished: the idle
// timeout drops the worker with StatusTimeout, even while one of its copies is in flight, and the
// broker does not read on in the middle of a frame.
func TestHalfSentRequestWithCopyInFlight(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		const idle = 200 * time.Millisecond
		ctx, dev, srv, path := serveDevice0(t, b, Options{StreamsPerDevice: 1, ReadTimeout: -1, IdleTimeout: idle})
		c := dial(t, path)
		rb, err := c.Register(ctx, newDevBuffer(t, dev, 1, 2*mib))
		require.NoError(t, err)
		st := srv.lanes[dev.Ordinal()].streams[0].st.Handle()
		require.NoError(t, b.Sim.HoldStream(st))
		done, err := c.CopyAsync(Request{Buffer: rb.ID(), Dir: ToDevice, Length: mib})
		require.NoError(t, err)
		eventually(t, "the copy to be in flight", func() bool { return srv.Stats().InFlight == 1 })
		frame := append(frameHeader(KindRequest, RequestSize, 0), encodeReq(request{op: OpPing, id: 1 << 40})...)
		c.wlock <- struct{}{} // the client's own writes (its keep-alive pings) wait
		_, err = c.conn.Unix().Write(frame[:20])
		require.NoError(t, err)
		time.Sleep(2 * idle)
		_, _ = c.conn.Unix().Write(frame[20:])
		<-c.wlock
		require.NoError(t, b.Sim.ReleaseStream(st))
		err = done.Wait(ctx)
		require.ErrorIs(t, err, ErrTimeout)
		require.NotErrorIs(t, err, ErrProtocol)
		eventually(t, "the worker to be dropped", func() bool { return srv.Stats().Workers == 0 })
		require.Equal(t, uint64(1), srv.Stats().Dropped)
	}, testutil.SimOnly())
}
