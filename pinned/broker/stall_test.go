package broker

import (
	"context"
	"net"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/internal/unixsock"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/pinned"
)

// stalledBroker connects a Client to a broker (one end of a socket pair) that answers the hello
// and then reads nothing more.
func stalledBroker(t *testing.T) *Client {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	ends := make([]*net.UnixConn, 2)
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "pair")
		c, err := net.FileConn(f)
		f.Close()
		require.NoError(t, err)
		ends[i] = c.(*net.UnixConn)
	}
	t.Cleanup(func() { ends[1].Close() })
	var b [ResponseSize + MaxText]byte
	hi := response{op: OpHello, id: 1, buffer: uint32(pinned.HostNUMA) << 8, values: [4]uint64{4 * mib, 0, 4 * mib, 1}}
	require.NoError(t, ipc.WriteMessage(ends[1], KindResponse, hi.encode(b[:0]), nil))
	c, err := hello(testCtx(t), unixsock.NewConn(ends[0], unix.Ucred{}), "stalled")
	if err != nil {
		ends[0].Close()
	}
	require.NoError(t, err)
	t.Cleanup(func() {
		// The broker's end goes first: Close waits for it. A connection the Client closed itself,
		// a write cut off by its context, cannot confirm that end.
		ends[1].Close()
		if err := c.Close(); err != nil {
			require.ErrorIs(t, err, ErrBrokerGone)
		}
	})
	return c
}

// fillSocket writes requests on c's socket until the broker's side takes no more.
func fillSocket(t *testing.T, c *Client) {
	t.Helper()
	uc := c.conn.Unix()
	require.NoError(t, uc.SetWriteDeadline(time.Now().Add(50*time.Millisecond)))
	for id := uint64(1 << 40); ; id++ {
		if ipc.WriteMessage(uc, KindRequest, encodeReq(request{op: OpPing, id: id}), nil) != nil {
			break
		}
	}
	require.NoError(t, uc.SetWriteDeadline(time.Time{}))
}

// blockCopies has CopyAsync fill the socket on its own goroutine, so that it holds the write lock
// in a write that does not end.
func blockCopies(t *testing.T, c *Client) {
	t.Helper()
	var sent atomic.Int64
	go func() {
		for {
			if _, err := c.CopyAsync(Request{Buffer: 1, Dir: ToDevice, Length: 1}); err != nil {
				return
			}
			sent.Add(1)
		}
	}()
	for last := int64(-1); sent.Load() != last; time.Sleep(100 * time.Millisecond) {
		last = sent.Load()
	}
}

// Every call with a context returns by the context's end when the broker stops reading: whether
// its write blocks (a write cut off closes the connection, and later calls say so) or another
// request's write holds the connection (the connection stays as it is).
func TestCallsHonourContextWhenBrokerStopsReading(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		dev := b.Device(t, 0)
		calls := map[string]func(ctx context.Context, c *Client) error{
			"ping": func(ctx context.Context, c *Client) error { return c.Ping(ctx) },
			"unregister": func(ctx context.Context, c *Client) error {
				return c.Unregister(ctx, &Buffer{c: c, id: 1})
			},
			"register": func(ctx context.Context, c *Client) error {
				_, err := c.Register(ctx, newDevBuffer(t, dev, 2, 2*mib))
				return err
			},
			"copy": func(ctx context.Context, c *Client) error {
				return c.Copy(ctx, Request{Buffer: 1, Dir: ToHost, Length: 1})
			},
		}
		for name, call := range calls {
			for how, stall := range map[string]func(*testing.T, *Client){"write": fillSocket, "lock": blockCopies} {
				c := stalledBroker(t)
				stall(t, c)
				ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
				errc := make(chan error, 1)
				go func() { errc <- call(ctx, c) }()
				select {
				case err := <-errc:
					require.ErrorIs(t, err, context.DeadlineExceeded, "%s (%s)", name, how)
				case <-time.After(5 * time.Second):
					t.Fatalf("%s (%s): still blocked 5 s after its context ended", name, how)
				}
				cancel()
				if how == "write" {
					err := c.Ping(context.Background())
					require.ErrorIs(t, err, ErrBrokerGone, "%s: a later call", name)
					require.ErrorIs(t, err, context.DeadlineExceeded, "%s: a later call", name)
				}
			}
		}
	}, testutil.SimOnly())
}
