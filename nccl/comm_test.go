package nccl_test

import (
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/nccl"
	"github.com/cuvmm/cuvmm/nccl/ncclsim"
	"github.com/cuvmm/cuvmm/vmm"
)

const mib = 1 << 20

// TestSendRecvBuffer moves a growable buffer of several chunks from rank 0 to rank 1, whole and then
// chunk by chunk, and checks the pattern arrived each time.
func TestSendRecvBuffer(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		lib := library(t, b)
		comms := ranks(t, b, lib, 2)
		require.Equal(t, 1, comms[1].Rank())
		require.Equal(t, 2, comms[1].NRanks())
		const size = 7 * mib
		d0, d1 := b.Device(t, 0), b.Device(t, 1)
		src, dst := buffer(t, d0, size, 2*mib), buffer(t, d1, size, 2*mib)
		s0, s1 := stream(t, d0), stream(t, d1)
		for seed, chunked := range []bool{false, true} {
			require.NoError(t, d0.Fill(src.Ptr(), size, 0, uint64(seed)))
			require.NoError(t, d1.Memset(dst.Ptr(), 0, size))
			noErrors(t, parallel(2, func(rank int) error {
				ctx := deadline(t, 30*time.Second)
				c := comms[rank]
				g := c.Group()
				switch {
				case rank == 0 && chunked:
					g.SendChunks(src, 1, s0)
				case rank == 0:
					g.SendBuffer(src, 1, s0)
				case chunked:
					g.RecvChunks(dst, 0, s1)
				default:
					g.RecvBuffer(dst, 0, s1)
				}
				if err := g.Run(ctx); err != nil {
					return err
				}
				return c.Wait(ctx, []*vmm.Stream{s0, s1}[rank])
			}))
			bad, err := d1.Verify(dst.Ptr(), size, 0, uint64(seed))
			require.NoError(t, err)
			require.Zero(t, bad, "chunked=%v: words that differ from the pattern", chunked)
		}
		require.Len(t, nccl.Layout(src), 4)
	}, testutil.Devices(2))
}

// blockedDestroy is an NCCL whose ncclCommDestroy waits for release, as NCCL's does while a rank of
// another process has not closed its communicator.
type blockedDestroy struct {
	nccl.API
	release chan struct{}
}

func (b blockedDestroy) CommDestroy(h nccl.CommHandle) error {
	<-b.release
	return b.API.CommDestroy(h)
}

// TestCloseWhilePeersStayOpen: a destroy that waits for peers makes Close return ErrInUse after
// CloseTimeout instead of hanging; the destroy ends once the peers close, releasing everything.
func TestCloseWhilePeersStayOpen(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		lib := library(t, b).(*ncclsim.Lib)
		slow := blockedDestroy{API: lib, release: make(chan struct{})}
		var releaseOnce sync.Once
		release := func() { releaseOnce.Do(func() { close(slow.release) }) }
		t.Cleanup(release) // also when the test fails early
		buf := buffer(t, b.Device(t, 0), 2*mib, 2*mib)
		id, err := slow.GetUniqueID()
		require.NoError(t, err)
		comms := make([]*nccl.Comm, 2)
		noErrors(t, parallel(2, func(r int) (err error) {
			comms[r], err = nccl.NewComm(deadline(t, 10*time.Second), slow, id, r, 2, b.Device(t, r),
				nccl.Options{CloseTimeout: 100 * time.Millisecond})
			return err
		}))
		start := time.Now()
		err = comms[0].Close()
		require.ErrorIs(t, err, nccl.ErrInUse)
		require.Contains(t, err.Error(), "ranks of other processes")
		require.Less(t, time.Since(start), 5*time.Second)
		require.ErrorIs(t, comms[0].Group().Send(buf.Ptr(), 1, nccl.Uint8, 1, nil).Run(deadline(t, time.Second)), nccl.ErrClosed)
		require.NoError(t, comms[0].Close(), "closed once; Close is idempotent")
		release()
		require.NoError(t, comms[1].Close())
		require.Eventually(t, func() bool { return lib.Live().Zero() }, 5*time.Second, 10*time.Millisecond,
			"the destroy left in the background ends once released")
	}, testutil.Devices(2), testutil.SimOnly())
}
