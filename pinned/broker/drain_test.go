package broker

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/vmm"
)

// failSyncs makes the next n cuStreamSynchronize calls fail.
func failSyncs(b *testutil.Backend, n int) {
	for range n {
		b.Sim.FailNth("cuStreamSynchronize", 1, driver.ErrorUnknown)
	}
}

// oneLane is a server over a 4 MiB region whose device 0 has a single copy stream.
type oneLane struct {
	ctx    context.Context
	dev    *vmm.Device
	region *pinned.Region
	srv    *Server
	path   string
}

func newOneLane(t *testing.T, b *testutil.Backend) oneLane { return newOneLaneWith(t, b, Options{}) }

// newOneLaneWith is newOneLane with opts (StreamsPerDevice is set to 1).
func newOneLaneWith(t *testing.T, b *testutil.Backend, opts Options) oneLane {
	l := oneLane{ctx: testCtx(t), dev: b.Device(t, 0)}
	l.region = newRegion(t, l.dev, 4*mib, pinned.Options{})
	opts.StreamsPerDevice = 1
	l.srv, l.path = startServer(t, l.region, opts)
	return l
}

// filledWorker dials a client and registers a 2 MiB buffer of it whose bytes are the pattern of
// devSeed, with the region's first 4 MiB the pattern of hostSeed.
func (l oneLane) filledWorker(t *testing.T, devSeed, hostSeed uint64) (*Client, *devBuffer, *Buffer) {
	t.Helper()
	c := dial(t, l.path)
	buf := newDevBuffer(t, l.dev, 1, 2*mib)
	require.NoError(t, l.dev.Fill(buf.Ptr(), 2*mib, 0, devSeed))
	fillHost(l.region.Bytes(), 0, hostSeed)
	rb, err := c.Register(l.ctx, buf)
	require.NoError(t, err)
	return c, buf, rb
}

// stuckCopy registers a 2 MiB buffer through a new client and fails its first copy with a stream
// that cannot be drained (every synchronization fails until the faults are cleared).
func (l oneLane) stuckCopy(t *testing.T, b *testutil.Backend) (*Client, *Buffer) {
	c := dial(t, l.path)
	rb, err := c.Register(l.ctx, newDevBuffer(t, l.dev, 1, 2*mib))
	require.NoError(t, err)
	failSyncs(b, 1+vmm.DrainAttempts+1000)
	require.ErrorIs(t, c.Copy(l.ctx, Request{Buffer: rb.ID(), Dir: ToHost, Length: mib}), ErrInternal)
	return c, rb
}

// A copy whose wait fails is answered ErrInternal, but its stream and buffer go back only once the
// stream is drained: the buffer cannot be unmapped under the copy, and the next request on that
// stream (another worker's) does not inherit the copy's failure.
func TestFailedCopyWaitDrainsStreamBeforeReuse(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		l := newOneLane(t, b)
		ctx, dev, path := l.ctx, l.dev, l.path
		c1, c2 := dial(t, path), dial(t, path)
		rb1, err := c1.Register(ctx, newDevBuffer(t, dev, 1, 2*mib))
		require.NoError(t, err)
		rb2, err := c2.Register(ctx, newDevBuffer(t, dev, 1, 2*mib))
		require.NoError(t, err)
		failSyncs(b, 1)
		require.ErrorIs(t, c1.Copy(ctx, Request{Buffer: rb1.ID(), Dir: ToDevice, Length: 4096}), ErrInternal)
		require.NoError(t, rb1.Close())
		err = c2.Copy(ctx, Request{Buffer: rb2.ID(), Dir: ToDevice, HostOffset: mib, Length: 4096})
		require.NoError(t, err, "worker 2's copy failed because of worker 1's copy, still queued into a released buffer")
		require.NoError(t, rb2.Close())
	}, testutil.SimOnly())
}

// A stream that cannot be drained is retired: a new stream serves the lane at once, and the buffer
// stays mapped until the retired stream drains, so the queued copy lands before an unregister
// unmaps it.
func TestUndrainableCopyStreamIsRetiredAndHoldsBuffer(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		l := newOneLane(t, b)
		ctx, dev, region, srv, path := l.ctx, l.dev, l.region, l.srv, l.path
		c1, c2 := dial(t, path), dial(t, path)
		buf1 := newDevBuffer(t, dev, 1, 2*mib)
		require.NoError(t, dev.Fill(buf1.Ptr(), 2*mib, 0, 5))
		rb1, err := c1.Register(ctx, buf1)
		require.NoError(t, err)
		rb2, err := c2.Register(ctx, newDevBuffer(t, dev, 1, 2*mib))
		require.NoError(t, err)
		failSyncs(b, 1+vmm.DrainAttempts)
		err = c1.Copy(ctx, Request{Buffer: rb1.ID(), Dir: ToHost, Length: mib})
		require.ErrorIs(t, err, ErrInternal)
		require.ErrorContains(t, err, "retired")
		require.NoError(t, c2.Copy(ctx, Request{Buffer: rb2.ID(), Dir: ToDevice, HostOffset: 2 * mib, Length: 4096}),
			"the lane's only stream was retired and not replaced")
		require.NoError(t, rb1.Close())
		require.Zero(t, badHost(region.Bytes()[:mib], 0, 5), "the retired stream's copy did not land before the buffer was unmapped")
		require.NoError(t, rb2.Close())
		eventually(t, "the retired stream destroyed", func() bool {
			srv.own.Lock()
			defer srv.own.Unlock()
			return len(srv.lanes[dev.Ordinal()].streams) == 1
		})
	}, testutil.SimOnly())
}

// A stream still not drained when the server closes leaves its buffer mapped: the System keeps it
// and frees it after a device synchronization succeeds.
func TestStreamUndrainedAtCloseKeepsBufferMapped(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		l := newOneLane(t, b)
		dev, srv := l.dev, l.srv
		l.stuckCopy(t, b)
		require.NoError(t, srv.Close())
		require.Zero(t, srv.Stats().Buffers)
		require.Len(t, dev.System().Orphans(), 1, "the buffer a copy may still target was unmapped")
		b.Sim.ClearFaults()
		require.NoError(t, dev.System().RetryOrphans())
		require.Empty(t, dev.System().Orphans())
	}, testutil.SimOnly())
}

// A stream retired without a replacement (creating one failed) and still undrained at Close goes back
// to its lane at Close, so that a copy waiting for that lane fails on it instead of waiting forever
// (and Server.Close with it).
func TestCloseWithAnUnreplacedRetiredStream(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		l := newOneLane(t, b)
		ctx, dev, srv := l.ctx, l.dev, l.srv
		b.Sim.FailNth("cuStreamCreate", 1, driver.ErrorOutOfMemory) // the replacement stream the failed copy asks for
		c, rb := l.stuckCopy(t, b)
		call, err := c.CopyAsync(Request{Buffer: rb.ID(), Dir: ToHost, Length: 4096}) // waits for the lane
		require.NoError(t, err)
		eventually(t, "second copy in flight", func() bool { return srv.Stats().InFlight == 1 })
		closed := make(chan error, 1)
		go func() { closed <- srv.Close() }()
		select {
		case <-closed:
		case <-time.After(10 * time.Second):
			t.Fatal("Server.Close blocked: a copy waits forever for the retired stream")
		}
		_ = call.Wait(ctx)
		b.Sim.ClearFaults()
		require.NoError(t, dev.System().RetryOrphans(), "the stuck buffer is freed once the device drains")
	}, testutil.SimOnly())
}

// A Close made while another Close is still draining the copies in flight waits for it: it does not
// destroy the streams those copies run on (nor report the server closed before it is).
func TestConcurrentCloseWaitsForTheCopiesInFlight(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		l := newOneLane(t, b)
		c := dial(t, l.path)
		rb, err := c.Register(l.ctx, newDevBuffer(t, l.dev, 1, 2*mib))
		require.NoError(t, err)
		st := l.srv.lanes[l.dev.Ordinal()].streams[0].st.Handle()
		require.NoError(t, b.Sim.HoldStream(st))
		for range 2 {
			_, err := c.CopyAsync(Request{Buffer: rb.ID(), Dir: ToDevice, Length: mib})
			require.NoError(t, err)
		}
		eventually(t, "both copies to be in flight", func() bool { return l.srv.Stats().InFlight == 2 })
		first := make(chan error, 1)
		go func() { first <- l.srv.Close() }()
		eventually(t, "the first Close to begin", l.srv.own.IsClosed)
		second := make(chan error, 1)
		go func() { second <- l.srv.Close() }()
		var secondErr error
		returned := false
		select {
		case secondErr = <-second:
			returned = true
			t.Errorf("a second Close returned (%v) while the first was still draining the copies", secondErr)
		case <-time.After(100 * time.Millisecond):
		}
		require.NoError(t, b.Sim.ReleaseStream(st))
		require.NoError(t, <-first)
		if !returned {
			secondErr = <-second
		}
		require.NoError(t, secondErr)
		// The copy queued on the stream completed; the one waiting for the stream was not started.
		require.Equal(t, uint64(1), l.srv.Stats().Copies, "the copy in flight failed: its stream was destroyed under it")
		require.Equal(t, uint64(1), l.srv.Stats().Failed)
	}, testutil.SimOnly())
}

// Server.Close with copies in flight on every path (one spinning on its stream, one sleeping on its
// event, two waiting for a stream) and stream and event values reused by the driver: Close drains
// the copies queued on a stream (the copy to the host has landed when it returns) and starts none of
// those still waiting for one, which fail with ErrBrokerGone; then it destroys the streams, and
// nothing is left.
func TestServerCloseWithCopiesInFlight(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		ctx, dev := testCtx(t), b.Device(t, 0)
		region := newRegion(t, dev, 8*mib, pinned.Options{})
		srv, path := startServer(t, region, Options{StreamsPerDevice: 2, InlineMax: -1, SpinMax: 64 << 10})
		c1, c2 := dial(t, path), dial(t, path)
		buf1, buf2 := newDevBuffer(t, dev, 1, 2*mib), newDevBuffer(t, dev, 1, 2*mib)
		require.NoError(t, dev.Fill(buf1.Ptr(), 2*mib, 0, 21))
		require.NoError(t, dev.Fill(buf2.Ptr(), 2*mib, 0, 22))
		rb1, err := c1.Register(ctx, buf1)
		require.NoError(t, err)
		rb2, err := c2.Register(ctx, buf2)
		require.NoError(t, err)
		var held []driver.Stream
		for _, cs := range srv.lanes[dev.Ordinal()].streams {
			require.NoError(t, b.Sim.HoldStream(cs.st.Handle()))
			held = append(held, cs.st.Handle())
		}
		var calls []*Completion
		for _, r := range []struct {
			c   *Client
			req Request
		}{
			{c1, Request{Buffer: rb1.ID(), Dir: ToHost, Length: 4096}},                     // spins on its stream
			{c1, Request{Buffer: rb1.ID(), Dir: ToHost, HostOffset: 2 * mib, Length: mib}}, // sleeps on its event
			{c1, Request{Buffer: rb1.ID(), Dir: ToDevice, HostOffset: 4 * mib, Length: mib}},
			{c2, Request{Buffer: rb2.ID(), Dir: ToDevice, HostOffset: 6 * mib, Length: 4096}},
		} {
			call, err := r.c.CopyAsync(r.req)
			require.NoError(t, err)
			calls = append(calls, call)
			n := len(calls)
			eventually(t, "the copy to be in flight", func() bool {
				return srv.Stats().InFlight == int64(n) && len(srv.lanes[dev.Ordinal()].free) == max(2-n, 0)
			})
		}
		closed := make(chan error, 1)
		go func() { closed <- srv.Close() }()
		eventually(t, "Close to begin", srv.own.IsClosed)
		select {
		case err := <-closed:
			t.Fatalf("Server.Close returned (%v) before the copies in flight completed", err)
		case <-time.After(100 * time.Millisecond):
		}
		for i, call := range calls {
			select {
			case <-call.Done():
				t.Errorf("copy %d answered (%v) while the copies queued were held", i, call.Wait(ctx))
			default:
			}
		}
		for _, st := range held {
			require.NoError(t, b.Sim.ReleaseStream(st))
		}
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		for i, call := range calls {
			err := call.Wait(wctx)
			if i < 2 && err == nil {
				continue // queued before Close: its answer may beat the closing of the connection
			}
			require.ErrorIs(t, err, ErrBrokerGone, "copy %d", i)
		}
		select {
		case err := <-closed:
			require.NoError(t, err)
		case <-time.After(10 * time.Second):
			t.Fatal("Server.Close did not return once the copies completed")
		}
		st := srv.Stats()
		require.Zero(t, st.InFlight)
		require.Zero(t, st.Buffers)
		// The copies still waiting for a stream would overwrite the devices' bytes after their workers
		// were told the broker was gone.
		requireDevicePattern(t, dev, buf1.Ptr(), mib, 0, 21)
		requireDevicePattern(t, dev, buf2.Ptr(), 4096, 0, 22)
		require.Equal(t, uint64(2), st.Copies, "a copy failed (its stream or event destroyed under it), or one still waiting for a stream when Close began ran after its worker was told the broker was gone")
		require.Equal(t, uint64(2), st.Failed)
		require.Zero(t, badHost(region.Bytes()[:4096], 0, 21), "Close returned before the copy to the host landed")
		require.Zero(t, badHost(region.Bytes()[2*mib:3*mib], 0, 21), "Close returned before the copy to the host landed")
		for _, l := range srv.lanes {
			require.Empty(t, l.streams, "copy streams left after Close")
		}
		require.ErrorIs(t, rb1.Close(), ErrBrokerGone)
		require.ErrorIs(t, rb2.Close(), ErrBrokerGone)
	}, testutil.SimOnly(), testutil.SimOptions(sim.ReuseHandles()))
}

// A worker told by Server.Close that the broker is gone may use its memory and the region at once: a
// copy of its already queued on a stream has landed by then (Close drains the queued copies before
// it closes the connections).
func TestServerCloseDrainsQueuedCopiesBeforeWorkersSeeItGone(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		l := newOneLane(t, b)
		c := dial(t, l.path)
		buf := newDevBuffer(t, l.dev, 1, 2*mib)
		require.NoError(t, l.dev.Fill(buf.Ptr(), mib, 0, 31))
		rb, err := c.Register(l.ctx, buf)
		require.NoError(t, err)
		st := l.srv.lanes[l.dev.Ordinal()].streams[0].st.Handle()
		require.NoError(t, b.Sim.HoldStream(st))
		call, err := c.CopyAsync(Request{Buffer: rb.ID(), Dir: ToHost, Length: mib})
		require.NoError(t, err)
		eventually(t, "the copy to be queued", func() bool { return len(l.srv.lanes[l.dev.Ordinal()].free) == 0 })
		closed := make(chan error, 1)
		go func() { closed <- l.srv.Close() }()
		eventually(t, "Close to begin", l.srv.own.IsClosed)
		select {
		case <-call.Done():
			t.Errorf("the worker was told %v while its copy was still queued", call.Wait(l.ctx))
		case <-time.After(100 * time.Millisecond):
		}
		require.NoError(t, b.Sim.ReleaseStream(st))
		if err := call.Wait(l.ctx); err != nil {
			require.ErrorIs(t, err, ErrBrokerGone)
		}
		require.NoError(t, <-closed)
		require.Zero(t, badHost(l.region.Bytes()[:mib], 0, 31))
		require.ErrorIs(t, rb.Close(), ErrBrokerGone)
	}, testutil.SimOnly())
}

// A worker that closes its client while copies of its wait for a copy stream: the broker starts none
// of them once it has seen the connection end (the worker's memory and the region keep their bytes,
// and Stats counts them failed); the copy already queued on the stream lands before the worker's
// buffer is released, and nothing is left.
func TestWorkerCloseDropsCopiesWaitingForAStream(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		l := newOneLane(t, b)
		c, buf, rb := l.filledWorker(t, 41, 42)
		w := l.onlyWorker(t)
		st := l.srv.lanes[l.dev.Ordinal()].streams[0].st.Handle()
		require.NoError(t, b.Sim.HoldStream(st))
		t.Cleanup(func() { _ = b.Sim.ReleaseStream(st) }) // before the server's Close, should the test stop early
		queued := b.Sim.Calls("cuMemcpyDtoHAsync")
		_, err := c.CopyAsync(Request{Buffer: rb.ID(), Dir: ToHost, Length: mib})
		require.NoError(t, err)
		eventually(t, "the first copy to be queued on the stream", func() bool { return b.Sim.Calls("cuMemcpyDtoHAsync") == queued+1 })
		for _, r := range []Request{
			{Buffer: rb.ID(), Dir: ToDevice, HostOffset: 2 * mib, BufferOffset: mib, Length: mib},
			{Buffer: rb.ID(), Dir: ToHost, HostOffset: 3 * mib, Length: 4096},
		} {
			_, err := c.CopyAsync(r)
			require.NoError(t, err)
		}
		eventually(t, "the other copies to wait for the stream", func() bool { return l.srv.Stats().InFlight == 3 })
		closed := make(chan error, 1)
		go func() { closed <- c.Close() }() // it waits for the queued copy
		eventually(t, "the broker to see the connection end", func() bool { return connEnded(w) })
		require.NoError(t, b.Sim.ReleaseStream(st))
		require.NoError(t, <-closed)
		eventually(t, "the worker to be cleaned up", func() bool { return l.srv.Stats().Drained == 1 })
		s := l.srv.Stats()
		require.Zero(t, s.InFlight)
		require.Zero(t, s.Buffers)
		require.Zero(t, s.Workers)
		require.Zero(t, badHost(l.region.Bytes()[:mib], 0, 41), "the copy queued before the worker left did not land")
		// The copies still waiting for the stream would write the worker's memory and the region after
		// it closed its client.
		requireDevicePattern(t, l.dev, buf.Ptr()+mib, mib, mib, 41)
		require.Zero(t, badHost(l.region.Bytes()[3*mib:], 3*mib, 42), "a copy waiting for a stream ran after its worker left")
		require.Equal(t, uint64(1), s.Copies, "a copy waiting for a stream ran after its worker left")
		require.Equal(t, uint64(2), s.Failed)
	}, testutil.SimOnly())
}

// holdStream holds the first copy stream of dev's lane (nothing queued on it completes) until the
// release it returns is called, or else until the test ends.
func holdStream(t *testing.T, b *testutil.Backend, srv *Server, dev *vmm.Device) (release func() error) {
	t.Helper()
	st := srv.lanes[dev.Ordinal()].streams[0].st.Handle()
	require.NoError(t, b.Sim.HoldStream(st))
	released := false
	t.Cleanup(func() {
		if !released {
			_ = b.Sim.ReleaseStream(st)
		}
	})
	return func() error {
		released = true
		return b.Sim.ReleaseStream(st)
	}
}

// connEnded reports whether the broker has seen the worker's connection end: its gate refuses copies.
func connEnded(w *worker) bool {
	if !w.gate.Begin() {
		return true
	}
	w.gate.End()
	return false
}

// Client.Close waits for the broker to end the connection: a copy of the worker queued on a broker
// stream lands before Close returns, the copy still waiting for a stream never runs, the broker has
// released the worker's buffers by then, and nothing is written after.
func TestClientCloseWaitsForItsQueuedCopies(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		l := newOneLane(t, b)
		c, buf, rb := l.filledWorker(t, 51, 52)
		release := holdStream(t, b, l.srv, l.dev)
		first := l.queueHeld(t, b, c, Request{Buffer: rb.ID(), Dir: ToHost, Length: mib})
		second, err := c.CopyAsync(Request{Buffer: rb.ID(), Dir: ToDevice, HostOffset: 2 * mib, BufferOffset: mib, Length: mib})
		require.NoError(t, err)
		eventually(t, "the second copy to wait for the stream", func() bool { return l.srv.Stats().InFlight == 2 })

		closed := testutil.StillWaiting(t, 200*time.Millisecond, "Close, while a copy of the worker was still queued on a broker stream,", c.Close)
		again := testutil.StillWaiting(t, 50*time.Millisecond, "a second Close, while the first still waited,", c.Close)
		require.NoError(t, release())
		for _, ch := range []<-chan error{closed, again} {
			select {
			case err := <-ch:
				require.NoError(t, err)
			case <-time.After(10 * time.Second):
				t.Fatal("Close did not return once the stream was released")
			}
		}
		// Every Completion is done: the queued copy with its answer, the dropped one with ErrClosed.
		require.NoError(t, first.Wait(l.ctx))
		require.ErrorIs(t, second.Wait(l.ctx), ErrClosed)
		s := l.srv.Stats()
		require.Zero(t, s.InFlight)
		require.Zero(t, s.Buffers, "the broker closed the connection before releasing the worker's buffers")
		require.Zero(t, badHost(l.region.Bytes()[:mib], 0, 51), "the queued copy had not landed when Close returned")
		requireDevicePattern(t, l.dev, buf.Ptr()+mib, mib, mib, 51)
		time.Sleep(50 * time.Millisecond)
		require.Zero(t, badHost(l.region.Bytes()[:mib], 0, 51))
		require.Zero(t, badHost(l.region.Bytes()[mib:], mib, 52), "a copy wrote the region after Close returned")
		requireDevicePattern(t, l.dev, buf.Ptr(), mib, 0, 51)
		requireDevicePattern(t, l.dev, buf.Ptr()+mib, mib, mib, 51)
		require.Equal(t, uint64(1), s.Copies)
	}, testutil.SimOnly())
}

// A Client whose broker closed its server, or whose connection is already gone, closes at once.
func TestClientCloseAfterServerClose(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		l := newOneLane(t, b)
		c := dial(t, l.path)
		require.NoError(t, c.Ping(l.ctx))
		require.NoError(t, l.srv.Close())
		t0 := time.Now()
		require.NoError(t, c.Close())
		require.Less(t, time.Since(t0), 5*time.Second)
	}, testutil.SimOnly())
}

// A Close that does not see the broker end the connection within DialOptions.CloseTimeout (a copy
// held on its stream) says so with ErrTimeout, and still frees the client's side.
func TestClientCloseTimesOut(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		l := newOneLane(t, b)
		c, err := DialContext(l.ctx, l.path, DialOptions{CloseTimeout: 200 * time.Millisecond})
		require.NoError(t, err)
		rb, err := c.Register(l.ctx, newDevBuffer(t, l.dev, 1, 2*mib))
		require.NoError(t, err)
		st := l.srv.lanes[l.dev.Ordinal()].streams[0].st.Handle()
		require.NoError(t, b.Sim.HoldStream(st))
		queued := b.Sim.Calls("cuMemcpyHtoDAsync")
		done, err := c.CopyAsync(Request{Buffer: rb.ID(), Dir: ToDevice, Length: mib})
		require.NoError(t, err)
		eventually(t, "the copy to be queued on the stream", func() bool { return b.Sim.Calls("cuMemcpyHtoDAsync") == queued+1 })
		t0 := time.Now()
		err = c.Close()
		require.ErrorIs(t, err, ErrTimeout)
		require.Less(t, time.Since(t0), 5*time.Second)
		require.ErrorIs(t, done.Wait(l.ctx), ErrClosed)
		require.NoError(t, c.Close(), "a second Close")
		require.NoError(t, b.Sim.ReleaseStream(st))
		eventually(t, "the worker to be cleaned up", func() bool { return l.srv.Stats().Workers == 0 })
		require.Zero(t, l.srv.Stats().Buffers)
	}, testutil.SimOnly())
}

// A worker dropped for WriteTimeout (it stopped reading its answers) sees its connection end only
// once its copy queued on a broker stream has landed, as a worker that closes its client does: the
// end tells it that it may use its memory and the region again.
func TestWriteTimeoutDropDrainsQueuedCopiesBeforeTheEnd(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		_, dev, srv, path := serveDevice0(t, b, Options{StreamsPerDevice: 1, WriteTimeout: 50 * time.Millisecond})
		buf := newDevBuffer(t, dev, 1, 2*mib)
		require.NoError(t, dev.Fill(buf.Ptr(), mib, 0, 61))
		conn := rawConn(t, path, true)
		id := rawRegister(t, conn, buf)
		release := holdStream(t, b, srv, dev)
		queued := b.Sim.Calls("cuMemcpyDtoHAsync")
		require.NoError(t, ipc.WriteMessage(conn, KindRequest, encodeReq(request{op: OpCopy, id: 3, buffer: id, dir: ToHost, length: mib}), nil))
		eventually(t, "the copy to be queued on the stream", func() bool { return b.Sim.Calls("cuMemcpyDtoHAsync") == queued+1 })
		go pingWithoutReading(conn, 4)
		eventually(t, "the worker to be dropped", func() bool { return srv.Stats().Dropped == 1 })

		ended := testutil.StillWaiting(t, 200*time.Millisecond, "the dropped worker's connection, while a copy of it was still queued on a broker stream,",
			func() error { return connEnd(conn) })
		// The buffer is released only once the copy is complete (the simulator fails a queued copy
		// whose memory was unmapped before its stream ran it).
		require.Equal(t, 1, srv.Stats().Buffers, "the dropped worker's buffer was released while a copy into it was queued")
		require.NoError(t, release())
		requireEnds(t, ended, "the dropped worker's connection, once the stream was released,") // a reset too: pings were left unread
		require.Zero(t, badHost(srv.Region().Bytes()[:mib], 0, 61), "the queued copy had not landed when the connection ended")
		eventually(t, "the worker to be cleaned up", func() bool { return srv.Stats().Drained == 1 })
		s := srv.Stats()
		require.Zero(t, s.InFlight)
		require.Zero(t, s.Buffers)
		require.Equal(t, uint64(1), s.Copies)
	}, testutil.SimOnly())
}
