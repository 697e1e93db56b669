package measure

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/pool"
)

func TestPoolBadOptions(t *testing.T) {
	b, err := OpenSim(1)
	require.NoError(t, err)
	defer func() { require.NoError(t, b.Close()) }()
	tr := &pool.Trace{Events: []pool.TraceEvent{{Size: 1 << 20, Lifetime: -1}}}
	for _, c := range []struct {
		o    PoolOptions
		want string
	}{
		{PoolOptions{Env: Env{Backend: b}}, "a non-empty trace"},
		{PoolOptions{Env: Env{Backend: b}, Trace: tr, FillFraction: 2}, "--fill-fraction 2"},
		{PoolOptions{Env: Env{Backend: b}, Trace: tr, Streams: -1}, "--streams -1"},
		{PoolOptions{Env: Env{Backend: b}, Trace: tr, Allocators: []string{"jemalloc"}}, `allocator "jemalloc"`},
		{PoolOptions{Trace: tr}, "no backend"},
	} {
		_, err := Pool(c.o)
		require.ErrorIs(t, err, ErrInvalidOption)
		require.Contains(t, err.Error(), c.want)
	}
	_, err = Pool(PoolOptions{Env: Env{Backend: b}, Trace: tr, Device: 3})
	require.Error(t, err, "no device 3")
}

// TestPoolOneAllocation replays a one-block trace on every allocator: each serves and verifies it.
func TestPoolOneAllocation(t *testing.T) {
	b, err := OpenSim(1)
	require.NoError(t, err)
	defer func() { require.NoError(t, b.Close()) }()
	tr := &pool.Trace{Events: []pool.TraceEvent{{Size: 3 << 20, Lifetime: -1}, {Size: 100, Stream: 1, Lifetime: 0}}}
	r, err := Pool(PoolOptions{Env: Env{Backend: b}, Trace: tr, Memory: 64 << 20, VerifyEvery: 1, CacheIters: 8})
	require.NoError(t, err)
	require.NoError(t, r.Check())
	require.Equal(t, 2, r.Streams)
	for _, name := range PoolAllocators {
		a := r.Allocators[name]
		require.Empty(t, a.Error, name)
		require.Equal(t, 2, a.VerifiedBlocks, name)
		require.Equal(t, uint64(3<<20+100), a.PeakInUseBytes, name)
		require.GreaterOrEqual(t, a.PeakMappedBytes, a.PeakInUseBytes, name)
	}
	require.Equal(t, uint64(6<<20), r.Allocators[PoolCuvmm].PeakMappedBytes, "two large pages and a small one")
}
