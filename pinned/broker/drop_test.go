package broker

import (
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/internal/testutil"
)

// A worker dropped for WriteTimeout sees its connection end only once the broker has dropped its
// copy still waiting for a stream and released its buffer, as at every other end (cleanup): the end
// tells the worker that the broker holds nothing of it any more.
func TestWriteTimeoutDropEndsAfterTheBuffersAreReleased(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		l := newOneLaneWith(t, b, Options{WriteTimeout: 50 * time.Millisecond})
		// Another worker's copy, queued on the lane's only stream, holds it.
		other, _, orb := l.filledWorker(t, 81, 82)
		release := holdStream(t, b, l.srv, l.dev)
		held := l.queueHeld(t, b, other, Request{Buffer: orb.ID(), Dir: ToDevice, Length: 4096})
		// The worker dropped: a copy waiting for the stream, then pings it does not read.
		buf := newDevBuffer(t, l.dev, 1, 2*mib)
		require.NoError(t, l.dev.Fill(buf.Ptr(), mib, 0, 83))
		conn := rawConn(t, l.path, true)
		sendCopy(t, conn, 3, rawRegister(t, conn, buf))
		eventually(t, "its copy to wait for the stream", func() bool { return l.srv.Stats().InFlight == 2 })
		go pingWithoutReading(conn, 4)
		eventually(t, "the worker to be dropped", func() bool { return l.srv.Stats().Dropped == 1 })

		ended := testutil.StillWaiting(t, 200*time.Millisecond, "the dropped worker's connection, while a copy of it waited for a stream and its buffer was registered,",
			func() error { return connEnd(conn) })
		require.NoError(t, release())
		requireEnds(t, ended, "the dropped worker's connection")
		require.Equal(t, 1, l.srv.Stats().Buffers, "the broker ended the dropped worker's connection before releasing its buffer")
		require.NoError(t, held.Wait(l.ctx))
		eventually(t, "the worker to be cleaned up", func() bool { return l.srv.Stats().Drained == 1 })
		requireDevicePattern(t, l.dev, buf.Ptr(), 4096, 0, 83) // its copy, dropped, never ran
		require.Equal(t, uint64(1), l.srv.Stats().Copies)
	}, testutil.SimOnly())
}

// A worker dropped for WriteTimeout on the answer of a copy (written by the copy's goroutine, while
// the reader waits for the next request) loses its connection then, not at the idle timeout: the
// failed write wakes the reader, which ends the connection.
func TestWriteTimeoutDropOnACopyAnswerEndsTheConnection(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		l := newOneLaneWith(t, b, Options{WriteTimeout: 50 * time.Millisecond, InlineMax: -1, IdleTimeout: time.Hour})
		conn := rawConn(t, l.path, true)
		id := rawRegister(t, conn, newDevBuffer(t, l.dev, 1, 2*mib))
		w := l.onlyWorker(t)
		require.NoError(t, w.conn.Unix().SetWriteBuffer(1)) // the least: a few answers fill it
		release := holdStream(t, b, l.srv, l.dev)
		const n = 32
		for i := range n {
			sendCopy(t, conn, uint64(3+i), id)
		}
		eventually(t, "every copy read", func() bool { return l.srv.Stats().InFlight == n })
		require.NoError(t, release())
		eventually(t, "the worker to be dropped", func() bool { return l.srv.Stats().Dropped == 1 })
		requireEnds(t, endOf(conn), "the dropped worker's connection")
		eventually(t, "the worker to be cleaned up", func() bool { return l.srv.Stats().Drained == 1 })
		require.Zero(t, l.srv.Stats().Buffers)
	}, testutil.SimOnly())
}

// A client whose broker stopped reading its requests after a failed write to it, while a copy of
// the client is still queued, gets EPIPE on its next write. That does not end the connection on the
// client's side: Close still waits for the broker's end, which comes once the copy has landed.
func TestClientOfABrokerThatStoppedReadingWaitsForItsEnd(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		l := newOneLane(t, b)
		c, _, rb := l.filledWorker(t, 93, 94)
		release := holdStream(t, b, l.srv, l.dev)
		held := l.queueHeld(t, b, c, Request{Buffer: rb.ID(), Dir: ToDevice, Length: 4096})
		w := l.onlyWorker(t)
		w.conn.Lock()
		w.lost.Store(true)
		w.conn.Unlock()
		w.writeFailed("writing a response", os.ErrDeadlineExceeded)
		eventually(t, "a write to the broker to fail", func() bool { return c.Ping(l.ctx) != nil })

		closed := testutil.StillWaiting(t, 200*time.Millisecond, "Close, while the broker drained a copy of the client,", c.Close)
		require.NoError(t, release())
		requireEnds(t, closed, "Close")
		require.Error(t, held.Wait(l.ctx), "its answer was not sent")
	}, testutil.SimOnly())
}
