package broker

import (
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/vmm"
)

// retiredCopy registers a 2 MiB buffer whose first MiB is the pattern of seed through a raw
// connection, and fails its copy of that MiB to the host with a stream that cannot be drained, so
// that the stream is retired with the copy still queued on it. The stream is held from before the
// copy, and the faults are cleared after: the copy stays queued, and the retired stream's
// synchronizations wait, until the release returned is called.
func (l oneLane) retiredCopy(t *testing.T, b *testutil.Backend, seed uint64) (*net.UnixConn, func() error) {
	t.Helper()
	buf := newDevBuffer(t, l.dev, 1, 2*mib)
	require.NoError(t, l.dev.Fill(buf.Ptr(), mib, 0, seed))
	conn := rawConn(t, l.path, true)
	id := rawRegister(t, conn, buf)
	release := holdStream(t, b, l.srv, l.dev)
	failSyncs(b, 1+vmm.DrainAttempts+1000)
	require.NoError(t, ipc.WriteMessage(conn, KindRequest, encodeReq(request{op: OpCopy, id: 3, buffer: id, dir: ToHost, length: mib}), nil))
	resp, err := rawResponse(conn)
	require.NoError(t, err)
	require.NotEqual(t, StatusOK, resp.status)
	require.Contains(t, resp.text, "retired")
	b.Sim.ClearFaults()
	return conn, release
}

// requireEndAfterRelease checks that the raw worker's connection does not end while its copy is
// queued on the held, retired stream, and that it ends once the stream is released, with the copy
// landed by then.
func (l oneLane) requireEndAfterRelease(t *testing.T, conn *net.UnixConn, release func() error, seed uint64) {
	t.Helper()
	ended := testutil.StillWaiting(t, 200*time.Millisecond, "the worker's connection, while its copy was still queued on a retired stream,",
		func() error { return connEnd(conn) })
	require.NoError(t, release())
	requireEnds(t, ended, "the worker's connection, once the retired stream was released,")
	require.Zero(t, badHost(l.region.Bytes()[:mib], 0, seed), "the retired stream's copy had not landed when the connection ended")
}

// Server.Close waits for a copy queued on a retired stream (one that could not be drained) as for
// any queued copy before it closes the connections: a worker told the broker is gone may use its
// memory and the region at once.
func TestServerCloseWaitsForRetiredStreamBeforeWorkersSeeItGone(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		l := newOneLane(t, b)
		conn, release := l.retiredCopy(t, b, 71)
		closed := make(chan error, 1)
		go func() { closed <- l.srv.Close() }()
		eventually(t, "Close to begin", l.srv.own.IsClosed)
		l.requireEndAfterRelease(t, conn, release, 71)
		require.NoError(t, <-closed)
		require.Zero(t, l.srv.Stats().Buffers)
	}, testutil.SimOnly())
}

// A worker dropped for WriteTimeout sees its connection end only once its copy queued on a retired
// stream has landed, as with a copy queued on a stream in service.
func TestWriteTimeoutDropWaitsForRetiredStream(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		l := newOneLaneWith(t, b, Options{WriteTimeout: 50 * time.Millisecond})
		conn, release := l.retiredCopy(t, b, 72)
		go pingWithoutReading(conn, 4)
		eventually(t, "the worker to be dropped", func() bool { return l.srv.Stats().Dropped == 1 })
		require.Equal(t, 1, l.srv.Stats().Buffers, "the buffer was released while a copy into it was queued on a retired stream")
		l.requireEndAfterRelease(t, conn, release, 72)
		eventually(t, "the worker to be cleaned up", func() bool { return l.srv.Stats().Drained == 1 })
		require.Zero(t, l.srv.Stats().Buffers)
	}, testutil.SimOnly())
}
