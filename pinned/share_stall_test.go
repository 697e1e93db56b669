package pinned

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/internal/testutil"
)

// R7 mechanism: Share holds the region's lock while it writes to a peer that does not read, and
// CopyToDevice (checkRange → own.IsClosed) waits on that lock: one stalled peer blocks every copy.
func TestStalledShareDoesNotBlockCopies(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		dev := b.Device(t, 0)
		r, err := New(dev, 4<<20, Options{})
		require.NoError(t, err)
		defer func() { require.NoError(t, r.Close()) }()
		st, err := dev.NewStream(true)
		require.NoError(t, err)
		defer st.Close()
		dst, err := dev.AllocPlain(4096)
		require.NoError(t, err)
		defer dst.Close()

		a, _ := testutil.SocketPair(t) // the peer never reads
		fill := make([]byte, 64<<10)
		for { // fill the socket buffer
			_ = a.SetWriteDeadline(time.Now().Add(20 * time.Millisecond))
			if _, err := a.Write(fill); err != nil {
				break
			}
		}
		_ = a.SetWriteDeadline(time.Now().Add(2 * time.Second)) // the broker's WriteTimeout
		shared := make(chan error, 1)
		go func() { shared <- r.Share(a) }()
		time.Sleep(100 * time.Millisecond)
		start := time.Now()
		require.NoError(t, r.CopyToDevice(st, dst.Ptr(), 0, 4096))
		took := time.Since(start)
		<-shared
		require.Less(t, took, 500*time.Millisecond, "queuing a 4 KiB copy waited %v for a stalled Share", took)
	}, testutil.SimOnly())
}
