package pool_test

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/pool"
	"github.com/cuvmm/cuvmm/vmm"
)

// allocFree allocates size bytes on s and frees the block at once, failing the test if either fails.
func allocFree(t *testing.T, p *pool.Pool, size uint64, s *vmm.Stream) {
	t.Helper()
	blk, err := p.Alloc(size, s)
	require.NoError(t, err, "alloc %d MiB with %d B allocated", size/mib, p.Stats().Allocated)
	require.NoError(t, p.Free(blk, s))
}

// The high-water mark releases the tails of freed ranges and stitching unmaps the ranges it takes
// pages from, so the idle pages kept cut the large blocks' address range into pieces that are each
// too short for the limit. An empty pool must still serve its limit: the idle pages in the way are
// moved aside.
func TestEmptyPoolServesItsLimitAfterHighWaterReleases(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		p, d := newPool(t, b, pool.Options{Limit: 32 * mib})
		alloc := func(size uint64) *pool.Block {
			blk, err := p.Alloc(size, nil)
			require.NoError(t, err, "alloc %d MiB with %d MiB allocated", size/mib, p.Stats().Allocated/mib)
			return blk
		}
		a := alloc(26 * mib)
		bb := alloc(4 * mib)
		require.NoError(t, p.Free(a, nil))
		c := alloc(4 * mib)
		require.NoError(t, p.Free(bb, nil))
		require.NoError(t, p.Free(c, nil))
		allocFree(t, p, 28*mib, nil)
		require.Zero(t, p.Stats().Allocated)
		e := alloc(32 * mib)
		usable(t, d, e)
		require.LessOrEqual(t, p.Stats().PeakMapped, 32*mib, "no page beyond the limit")
		require.NoError(t, p.Free(e, nil))
	}, simMemory)
}

// Stitching alone (no high-water release) leaves the same kind of pieces: a 32 MiB block's pages
// moved into a 48 MiB range leave unmapped address space before it and idle pages inside.
func TestEmptyPoolServesItsLimitWithoutHighWater(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		p, _ := newPool(t, b, pool.Options{Limit: 64 * mib, HighWater: ^uint64(0)})
		for _, size := range []uint64{32 * mib, 48 * mib, 64 * mib} {
			allocFree(t, p, size, nil)
		}
		st := p.Stats()
		require.Equal(t, 64*mib, st.PeakMapped)
		require.Equal(t, 64*mib, st.Mapped, "the high-water mark is off: every page stays cached")
	}, simMemory)
}

// TestRandomizedEmptyPoolServesItsLimit replays random allocations and frees of every size on two
// streams, under several high-water marks, and checks the promise that a request fails only when
// stitching and mapping new memory up to the limit are not enough: whenever nothing is allocated, a
// request of the whole limit succeeds. Live blocks never overlap, and random requests fail only for
// lack of memory.
func TestRandomizedEmptyPoolServesItsLimit(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		for seed := uint64(0); seed < 30; seed++ {
			highWater := []uint64{0, 2 * mib, ^uint64(0)}[seed%3]
			t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) {
				p, d := newPool(t, b, pool.Options{Limit: 32 * mib, HighWater: highWater})
				s, err := d.NewStream(true)
				require.NoError(t, err)
				defer s.Close()
				randomAllocFree(t, p, []*vmm.Stream{nil, s}, rand.New(rand.NewPCG(seed, 11)), 400)
			})
		}
	}, simMemory)
}

// randomAllocFree runs steps random allocations and frees on random streams, then frees what is left;
// every time nothing is allocated, it allocates and frees the pool's whole limit.
func randomAllocFree(t *testing.T, p *pool.Pool, streams []*vmm.Stream, r *rand.Rand, steps int) {
	var reg liveSet
	var live []*pool.Block
	free := func(i int) {
		reg.remove(live[i])
		require.NoError(t, p.Free(live[i], streams[r.IntN(len(streams))]))
		live = append(live[:i], live[i+1:]...)
		if len(live) == 0 {
			allocFree(t, p, p.Limit(), streams[r.IntN(len(streams))])
		}
	}
	for step := 0; step < steps; step++ {
		if len(live) > 0 && r.IntN(5) < 2 {
			free(r.IntN(len(live)))
			continue
		}
		size := uint64(1 + r.IntN(1<<20))
		if r.IntN(3) > 0 {
			size = uint64(1 + r.IntN(int(p.Limit()*3/4)))
		}
		blk, err := p.Alloc(size, streams[r.IntN(len(streams))])
		if err != nil {
			require.ErrorIs(t, err, driver.ErrOutOfMemory)
			continue
		}
		require.NoError(t, reg.add(blk))
		live = append(live, blk)
	}
	for len(live) > 0 {
		free(len(live) - 1)
	}
}
