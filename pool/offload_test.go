package pool_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/offload"
	"github.com/cuvmm/cuvmm/pool"
)

// TestOffloadSleepsAPool: a pool's Chunked view in an offload set sleeps like any buffer: the device
// gets the memory back, and after Wake every block is at its address with its content, and the pool
// goes on allocating and freeing.
func TestOffloadSleepsAPool(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		p, d := newPool(t, b, pool.Options{Limit: 64 * mib, HighWater: ^uint64(0)})
		large, err := p.Alloc(6*mib, nil)
		require.NoError(t, err)
		small, err := p.Alloc(3000, nil)
		require.NoError(t, err)
		wl, ws := fill(t, d, large, 3), fill(t, d, small, 4)
		mapped := p.Stats().Mapped

		set := offload.NewSet(b.Sys, offload.Options{SlotSize: 8 * mib})
		defer func() { require.NoError(t, set.Close()) }()
		require.NoError(t, set.Add("pool", p.Chunked(), offload.Keep, offload.EntryOptions{}))
		ctx := context.Background()
		before, _, err := d.MemInfo()
		require.NoError(t, err)
		require.NoError(t, set.Sleep(ctx))
		after, _, err := d.MemInfo()
		require.NoError(t, err)
		require.GreaterOrEqual(t, after+2*mib, before+mapped, "the pool's pages went back to the driver")

		require.NoError(t, set.Wake(ctx))
		check(t, d, large, wl)
		check(t, d, small, ws)
		require.NoError(t, set.Remove("pool"))
		more, err := p.Alloc(4*mib, nil)
		require.NoError(t, err)
		for _, blk := range []*pool.Block{large, small, more} {
			require.NoError(t, p.Free(blk, nil))
		}
	}, simMemory)
}
