package metrics_test

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/metrics"
	"github.com/cuvmm/cuvmm/pool"
)

// A scrape of a pool's collector reports what the pool's own statistics say, and follows blocks
// being allocated, freed and trimmed.
func TestPoolScrapeFollowsBlocks(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		dev := b.Device(t, 0)
		p, err := pool.New(dev, pool.Options{Limit: 64 * mib, HighWater: ^uint64(0)})
		require.NoError(t, err)
		defer func() { require.NoError(t, p.Close()) }()
		st, err := dev.NewStream(true)
		require.NoError(t, err)
		defer func() { require.NoError(t, st.Close()) }()
		reg := prometheus.NewRegistry()
		reg.MustRegister(metrics.NewPool(p, "kv", metrics.Options{}))
		labels := map[string]string{"pool": "kv", "device": "0"}

		kv, err := p.AllocTag(6*mib, st, "kv")
		require.NoError(t, err)
		small, err := p.Alloc(1000, st)
		require.NoError(t, err)
		fams := scrape(t, reg)
		s := p.Stats()
		for name, want := range map[string]uint64{"mapped_bytes": s.Mapped, "allocated_bytes": s.Allocated,
			"in_use_bytes": s.InUse, "blocks": uint64(s.Blocks), "allocs_total": 2, "new_pages_total": s.NewPages,
			"limit_bytes": 64 * mib} {
			require.Equal(t, float64(want), value(fams, "cuvmm_pool_"+name, labels), name)
		}
		require.Equal(t, float64(6*mib+1000), value(fams, "cuvmm_pool_in_use_bytes", labels))
		require.Equal(t, float64(6*mib), value(fams, "cuvmm_pool_tag_in_use_bytes", map[string]string{"pool": "kv", "tag": "kv"}))

		require.NoError(t, p.Free(kv, st))
		require.NoError(t, p.Free(small, st))
		require.NoError(t, st.Synchronize())
		released, err := p.Trim()
		require.NoError(t, err)
		fams = scrape(t, reg)
		require.Equal(t, 2.0, value(fams, "cuvmm_pool_frees_total", labels))
		require.Zero(t, value(fams, "cuvmm_pool_blocks", labels))
		require.Equal(t, float64(released), value(fams, "cuvmm_pool_trimmed_bytes_total", labels))
		require.Equal(t, float64(s.Mapped), value(fams, "cuvmm_pool_peak_mapped_bytes", labels))
		require.Zero(t, value(fams, "cuvmm_pool_mapped_bytes", labels))
	})
}

// The pools of a process register side by side under names of their own; one name twice is refused.
func TestPoolCollectorsByName(t *testing.T) {
	reg := prometheus.NewRegistry()
	stats := func() pool.Stats { return pool.Stats{Limit: 1 << 30, Tags: map[string]uint64{"weights": 5}} }
	require.NoError(t, reg.Register(metrics.NewPoolFunc(stats, "kv", 0, metrics.Options{})))
	require.NoError(t, reg.Register(metrics.NewPoolFunc(stats, "activations", 0, metrics.Options{})))
	require.NoError(t, reg.Register(metrics.NewPoolFunc(stats, "kv", 1, metrics.Options{})), "another device")
	require.Error(t, reg.Register(metrics.NewPoolFunc(stats, "kv", 0, metrics.Options{})))
	fams := scrape(t, reg)
	require.Len(t, fams["cuvmm_pool_limit_bytes"].GetMetric(), 3)
	require.Equal(t, 5.0, value(fams, "cuvmm_pool_tag_in_use_bytes", map[string]string{"pool": "activations", "tag": "weights"}))

	ns := prometheus.NewRegistry()
	require.NoError(t, ns.Register(metrics.NewPoolFunc(stats, "kv", 0, metrics.Options{Namespace: "svc", ConstLabels: prometheus.Labels{"role": "decode"}})))
	require.Equal(t, float64(1<<30), value(scrape(t, ns), "svc_pool_limit_bytes", map[string]string{"role": "decode", "pool": "kv"}))
}

func TestNewPoolNamesANilPool(t *testing.T) {
	require.PanicsWithValue(t, "metrics: NewPool: nil pool", func() { metrics.NewPool(nil, "kv", metrics.Options{}) })
}
