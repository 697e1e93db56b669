package pool_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/offload"
	"github.com/cuvmm/cuvmm/pool"
)

// strand leaves two pages mapped without access: granting access to a fresh 4 MiB block fails, and
// so does the unmap that undoes it.
func strand(t *testing.T, b *testutil.Backend, p *pool.Pool) {
	t.Helper()
	b.Sim.FailNth("cuMemSetAccess", 1, driver.ErrorUnknown)
	b.Sim.FailNth("cuMemUnmap", 1, driver.ErrorUnknown)
	_, err := p.Alloc(4*mib, nil)
	require.ErrorIs(t, err, driver.ErrorUnknown)
	require.Equal(t, 4*mib, p.Stats().Mapped, "two stranded pages")
}

// Stranded pages count in PeakMapped as in Mapped, and Chunked leaves them out: they hold nothing of
// the pool's, and without access offload could not copy them, so the pool still sleeps through it.
func TestStrandedPagesAreNotThePoolsContent(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		p, d := newPool(t, b, pool.Options{Limit: 64 * mib, HighWater: ^uint64(0)})
		strand(t, b, p)
		require.GreaterOrEqual(t, p.Stats().PeakMapped, p.Stats().Mapped)
		blk, err := p.Alloc(4*mib, nil)
		require.NoError(t, err)
		want := fill(t, d, blk, 3)
		require.Len(t, p.Chunked().Chunks(), 2, "the block's two pages, not the stranded ones")

		set := offload.NewSet(b.Sys, offload.Options{SlotSize: 8 * mib})
		defer func() { require.NoError(t, set.Close()) }()
		require.NoError(t, set.Add("pool", p.Chunked(), offload.Keep, offload.EntryOptions{}))
		ctx := context.Background()
		require.NoError(t, set.Sleep(ctx))
		require.NoError(t, set.Wake(ctx))
		check(t, d, blk, want)
		require.NoError(t, set.Remove("pool"))
		require.NoError(t, p.Free(blk, nil))
	}, testutil.SimOnly(), simMemory)
}

// A Wake whose access grant fails and whose undoing unmaps fail too stays asleep; the next Wake drops
// the page left mapped without access before mapping a new one, so the block is usable after it.
func TestWakeAfterAFailedWakeLeftAPageWithoutAccess(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		p, d := newPool(t, b, pool.Options{Limit: 64 * mib})
		blk, err := p.Alloc(2*mib, nil)
		require.NoError(t, err)
		require.NoError(t, p.Sleep())
		b.Sim.FailNth("cuMemSetAccess", 1, driver.ErrorUnknown)
		b.Sim.FailNth("cuMemUnmap", 1, driver.ErrorUnknown)
		b.Sim.FailNth("cuMemUnmap", 2, driver.ErrorUnknown)
		require.ErrorIs(t, p.Wake(), driver.ErrorUnknown)
		require.ErrorIs(t, p.Free(blk, nil), pool.ErrAsleep, "still asleep")
		b.Sim.ClearFaults()
		require.NoError(t, p.Wake())
		usable(t, d, blk)
		require.NoError(t, p.Free(blk, nil))
	}, testutil.SimOnly(), simMemory)
}
