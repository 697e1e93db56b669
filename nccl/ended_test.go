package nccl_test

import (
	"context"
	"math"
	"net"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/nccl"
)

// An operation or a registration whose context has already ended queues nothing and fails with
// the context's error: the communicator is not aborted, and the next call with a live context
// works.
func TestEndedContextQueuesNothing(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		c, buf, s := soloWithStream(t, b)
		defer func() { require.NoError(t, s.Close()) }()
		ended, cancel := context.WithCancel(context.Background())
		cancel()
		err := c.AllReduce(ended, buf.Ptr(), buf.Ptr(), 16, nccl.Float32, nccl.Sum, s)
		require.ErrorIs(t, err, context.Canceled)
		require.NotErrorIs(t, err, nccl.ErrAborted)
		require.ErrorContains(t, err, "nothing queued")
		_, err = c.Register(ended, buf)
		require.ErrorIs(t, err, context.Canceled)
		require.ErrorContains(t, err, "nothing registered")
		ctx := deadline(t, 8*time.Second)
		require.NoError(t, c.AllReduce(ctx, buf.Ptr(), buf.Ptr(), 16, nccl.Float32, nccl.Sum, s))
		require.NoError(t, c.Wait(ctx, s))
	})
}

// Inputs NCCL could not take are refused, and Layout describes any buffer without panicking.
func TestRanksBeyondNCCLAndLayoutOfNil(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		lib := library(t, b)
		id, err := lib.GetUniqueID()
		require.NoError(t, err)
		_, err = nccl.NewComm(deadline(t, 8*time.Second), lib, id, 0, math.MaxInt32+1, b.Device(t, 0))
		require.ErrorIs(t, err, nccl.ErrInvalidValue)
		require.ErrorContains(t, err, "more than NCCL's")
	}, testutil.SimOnly())
	require.Nil(t, nccl.Layout(nil))
}

// DialID fails at once on an address no server could ever answer at, and keeps retrying one whose
// server is not up yet until its context ends.
func TestDialIDRefusesMalformedAddressesAtOnce(t *testing.T) {
	for _, c := range []struct{ network, address, says string }{
		{"tcp", "127.0.0.1", "missing port"},
		{"tcp", "127.0.0.1:99999", "invalid port"},
		{"udpx", "127.0.0.1:1", "unknown network"},
	} {
		start := time.Now()
		_, err := nccl.DialID(deadline(t, 5*time.Second), c.network, c.address)
		require.ErrorIs(t, err, nccl.ErrRendezvous, c.address)
		require.ErrorContains(t, err, c.says)
		require.Less(t, time.Since(start), time.Second, "%s %s was retried", c.network, c.address)
	}
	_, err := nccl.DialID(deadline(t, 200*time.Millisecond), "unix", filepath.Join(t.TempDir(), "not-yet.sock"))
	require.ErrorIs(t, err, context.DeadlineExceeded, "a socket not there yet is retried until the context ends")
}

// wrappedListener hides the listener's SetDeadline, as a TLS listener does.
type wrappedListener struct{ net.Listener }

// ServeID ends with its context also on a listener that takes no deadline.
func TestServeIDOnAWrappedListenerEndsWithItsContext(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	start := time.Now()
	err = nccl.ServeID(deadline(t, 100*time.Millisecond), wrappedListener{ln}, nccl.UniqueID{}, 1)
	require.ErrorIs(t, err, nccl.ErrRendezvous)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Less(t, time.Since(start), 2*time.Second)
}

// A call waiting for another goroutine's call on the communicator (a receive whose sender never
// comes) stops waiting when its own context ends, aborting nothing; the receive goes on.
func TestCallWaitingForTheCommunicatorKeepsItsDeadline(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		comms := ranks(t, b, library(t, b), 2)
		buf := buffer(t, b.Device(t, 0), 2*mib, 2*mib)
		recv := make(chan error, 1)
		go func() { recv <- comms[0].Recv(deadline(t, time.Minute), buf.Ptr(), 16, nccl.Uint8, 1, nil) }()
		time.Sleep(100 * time.Millisecond) // the receive holds the communicator
		for name, call := range map[string]func(context.Context) error{
			"Wait": func(ctx context.Context) error { return comms[0].Wait(ctx, nil) },
			"Send": func(ctx context.Context) error { return comms[0].Send(ctx, buf.Ptr(), 16, nccl.Uint8, 1, nil) },
			"Register": func(ctx context.Context) error {
				_, err := comms[0].Register(ctx, buf)
				return err
			},
		} {
			start := time.Now()
			err := call(deadline(t, 100*time.Millisecond))
			require.ErrorIs(t, err, context.DeadlineExceeded, name)
			require.ErrorIs(t, err, nccl.ErrInUse, name)
			require.NotErrorIs(t, err, nccl.ErrAborted, name)
			require.ErrorContains(t, err, "another call on the communicator was still running", name)
			require.Less(t, time.Since(start), 2*time.Second, name)
		}
		require.NoError(t, buf.Shrink(0), "Register released its holds")
		require.NoError(t, comms[0].Abort()) // ends the receive
		require.ErrorIs(t, <-recv, nccl.ErrAborted)
	}, testutil.Devices(2), testutil.SimOnly())
}
