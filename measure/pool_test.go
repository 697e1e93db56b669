package measure

import (
	"math"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/pool"
	"github.com/cuvmm/cuvmm/vmm"
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
		{PoolOptions{Env: Env{Backend: b}, Trace: tr, FillFraction: math.NaN()}, "--fill-fraction NaN"},
		{PoolOptions{Env: Env{Backend: b}, Trace: tr, FillFraction: math.Inf(1)}, "--fill-fraction +Inf"},
		{PoolOptions{Env: Env{Backend: b}, Trace: tr, FillFraction: -0.5}, "--fill-fraction -0.5: want 0 to 1"},
		{PoolOptions{Env: Env{Backend: b}, Trace: tr, Allocators: []string{PoolCuvmm, PoolCuvmm}}, `--allocators: "cuvmm" is listed twice`},
		{PoolOptions{Env: Env{Backend: b}, Trace: tr, CacheIters: -1}, "--cache-iters -1"},
		{PoolOptions{Env: Env{Backend: b}, Trace: tr, VerifyEvery: -1}, "--verify-every -1"},
		{PoolOptions{Env: Env{Backend: b}, Trace: tr, Device: 3}, "--device 3: the sim backend has 1 devices"},
		{PoolOptions{Env: Env{Backend: b}, Trace: tr, Memory: 64 << 20}, "--memory 64 MiB: want at least 128 MiB"},
		{PoolOptions{Env: Env{Backend: b}, Trace: tr, Memory: 1}, "--memory 1 B: want at least 128 MiB"},
		{PoolOptions{Env: Env{Backend: b}, Trace: &pool.Trace{Events: []pool.TraceEvent{{Size: 256 << 20, Lifetime: -1}}}, Memory: 128 << 20},
			"--memory 128 MiB: below the trace's largest request, 256 MiB"},
	} {
		_, err := Pool(c.o)
		require.ErrorIs(t, err, ErrInvalidOption)
		require.Contains(t, err.Error(), c.want)
	}
}

// TestPoolOneAllocation replays a one-block trace on every allocator: each serves and verifies it.
func TestPoolOneAllocation(t *testing.T) {
	b, err := OpenSim(1)
	require.NoError(t, err)
	defer func() { require.NoError(t, b.Close()) }()
	tr := &pool.Trace{Events: []pool.TraceEvent{{Size: 3 << 20, Lifetime: -1}, {Size: 100, Stream: 1, Lifetime: 0}}}
	r, err := Pool(PoolOptions{Env: Env{Backend: b}, Trace: tr, Memory: PoolMinMemory, VerifyEvery: 1, CacheIters: 8})
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

// TestPoolPeerTraceInTempDir: the trace written for the peer goes to Env.TempDir's directory.
func TestPoolPeerTraceInTempDir(t *testing.T) {
	b, err := OpenSim(1)
	require.NoError(t, err)
	defer func() { require.NoError(t, b.Close()) }()
	dir := t.TempDir()
	script := filepath.Join(t.TempDir(), "peer.sh")
	require.NoError(t, os.WriteFile(script, []byte(`echo "{\"note\": \"$2\"}"`+"\n"), 0o644))
	tr := &pool.Trace{Events: []pool.TraceEvent{{Size: 3 << 20, Lifetime: -1}}}
	r, err := Pool(PoolOptions{Env: Env{Backend: b, TempDir: func() (string, error) { return dir, nil }}, Trace: tr,
		Memory: PoolMinMemory, CacheIters: 8, Allocators: []string{PoolCuvmm}, Peer: "torch", Python: "sh", PeerScript: script})
	require.NoError(t, err)
	peer := r.Allocators[PoolPeerTorch]
	require.Empty(t, peer.Error)
	require.Equal(t, dir, filepath.Dir(peer.Note), "the peer's trace was in TempDir")
	left, _ := os.ReadDir(dir)
	require.Empty(t, left, "and is removed")
}

// TestPoolZeroTrace: a trace whose sizes are all 0 is refused (it would scale by +Inf).
func TestPoolZeroTrace(t *testing.T) {
	b, err := OpenSim(1)
	require.NoError(t, err)
	defer func() { require.NoError(t, b.Close()) }()
	tr := &pool.Trace{Events: []pool.TraceEvent{{Size: 0, Lifetime: -1}, {Size: 0, Lifetime: -1}}}
	_, err = Pool(PoolOptions{Env: Env{Backend: b}, Trace: tr, FillFraction: 0.5})
	require.ErrorIs(t, err, ErrInvalidOption)
	require.Contains(t, err.Error(), "trace's 2 allocations are all of 0 bytes")
}

// TestPoolTrimRates: each trim run's rate is its own bytes over its own seconds, and an Alloc error
// other than out-of-memory (here a block above the pool's limit) is returned, not taken as the end.
func TestPoolTrimRates(t *testing.T) {
	b, err := OpenSim(1)
	require.NoError(t, err)
	defer func() { require.NoError(t, b.Close()) }()
	d, err := b.Sys.Device(0)
	require.NoError(t, err)
	o := PoolOptions{Env: Env{Backend: b}, Memory: 256 << 20, TrimBytes: 128 << 20}
	r, err := poolTrim(o, d)
	require.NoError(t, err)
	require.Equal(t, uint64(128<<20), r.SequentialBytes)
	require.Equal(t, uint64(128<<20), r.Bytes)
	require.InDelta(t, float64(r.SequentialBytes)/1e9/r.SequentialSeconds, r.SequentialGBps, 1e-9)
	require.InDelta(t, float64(r.Bytes)/1e9/r.Seconds, r.GBps, 1e-9)

	o.Memory = 32 << 20 // a 64 MiB block is above the limit: invalid, not out of memory
	_, _, err = poolTrimOnce(o, d, 1)
	require.ErrorIs(t, err, vmm.ErrInvalidValue)
}
