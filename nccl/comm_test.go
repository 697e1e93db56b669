package nccl_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/nccl"
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
