package pinned_test

import (
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/pinned"
)

// stalledConn is a connection whose peer never reads, its socket buffer already full; writes to it
// give up after d.
func stalledConn(t *testing.T, d time.Duration) *net.UnixConn {
	a, _ := testutil.SocketPair(t)
	fill := make([]byte, 64<<10)
	for {
		require.NoError(t, a.SetWriteDeadline(time.Now().Add(20*time.Millisecond)))
		if _, err := a.Write(fill); err != nil {
			break
		}
	}
	require.NoError(t, a.SetWriteDeadline(time.Now().Add(d)))
	return a
}

// A Share blocked on a peer that does not read holds its own duplicates of the descriptors, not the
// region's lock: another Share (to a peer that reads) and Close go on meanwhile.
func TestShareToStalledPeerDoesNotHoldRegion(t *testing.T) {
	for _, kind := range []pinned.Kind{pinned.HostNUMA, pinned.SharedMemory} {
		t.Run(kind.String(), func(t *testing.T) {
			testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
				d := b.Device(t, 0)
				r, err := pinned.New(d, 4*mib, pinned.Options{Kind: kind})
				require.NoError(t, err)
				stalled, peer := make(chan error, 1), stalledConn(t, 3*time.Second)
				go func() { stalled <- r.Share(peer) }()
				time.Sleep(100 * time.Millisecond)

				t0 := time.Now()
				send, recv := testutil.SocketPair(t)
				shared := make(chan error, 1)
				go func() { shared <- r.Share(send) }()
				got, err := pinned.Receive(recv, d, pinned.OpenOptions{})
				require.NoError(t, err)
				require.NoError(t, <-shared)
				require.NoError(t, got.Close())
				require.NoError(t, r.Close())
				require.Less(t, time.Since(t0), time.Second, "a Share to a peer that reads, and Close, waited for a stalled Share")
				require.NoError(t, peer.Close()) // ends the stalled Share's write at once
				require.ErrorIs(t, <-stalled, net.ErrClosed)
			}, testutil.SimOnly())
		})
	}
}
