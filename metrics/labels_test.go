package metrics_test

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/metrics"
	"github.com/cuvmm/cuvmm/offload"
	"github.com/cuvmm/cuvmm/pool"
	"github.com/cuvmm/cuvmm/vmm"
)

// A pool tag that is not valid UTF-8 is reported Go-quoted, and the rest of the page still serves.
func TestPoolTagNotUTF8KeepsScrapeWorking(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		p, err := pool.New(b.Device(t, 0), pool.Options{Limit: 64 * mib})
		require.NoError(t, err)
		defer func() { require.NoError(t, p.Close()) }()
		blk, err := p.AllocTag(4096, nil, "req-\xe9")
		require.NoError(t, err)
		defer func() { require.NoError(t, p.Free(blk, nil)) }()
		reg := prometheus.NewRegistry()
		reg.MustRegister(metrics.New(b.Sys, metrics.Options{}), metrics.NewPool(p, "kv", metrics.Options{}))

		fams := scrape(t, reg)
		require.Equal(t, 4096.0, value(fams, "cuvmm_pool_tag_in_use_bytes", map[string]string{"pool": "kv", "tag": `"req-\xe9"`}))
		require.Contains(t, fams, "cuvmm_reserved_bytes", "the system's series are on the same page")
	})
}

// An offload tag that is not valid UTF-8 is reported Go-quoted, and the rest of the page still serves.
func TestSetTagNotUTF8KeepsScrapeWorking(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		buf, err := growbuf.New(b.Device(t, 0), growbuf.Options{MaxSize: 64 * mib, Chunk: growbuf.FixedChunks(2 * mib)})
		require.NoError(t, err)
		defer func() { require.NoError(t, buf.Close()) }()
		require.NoError(t, buf.Grow(4*mib))
		set := offload.NewSet(b.Sys, offload.Options{SlotSize: 4 * mib})
		defer func() { require.NoError(t, set.Close()) }()
		require.NoError(t, set.Add("w\xff", buf, offload.Keep, offload.EntryOptions{}))
		reg := prometheus.NewRegistry()
		reg.MustRegister(metrics.New(b.Sys, metrics.Options{}), metrics.NewSet(set, "model", metrics.Options{}))

		fams := scrape(t, reg)
		w := map[string]string{"set": "model", "tag": `"w\xff"`, "policy": "keep"}
		require.Equal(t, float64(4*mib), value(fams, "cuvmm_offload_buffer_bytes", w))
		require.Contains(t, fams, "cuvmm_reserved_bytes", "the system's series are on the same page")
	})
}

// Device names and reservation kinds go through the same labels: neither can break the page.
func TestDeviceNameAndKindNotUTF8KeepScrapeWorking(t *testing.T) {
	stats := func() vmm.Stats {
		return vmm.Stats{Devices: []vmm.DeviceStats{{Ordinal: 0, Name: "GPU\xff", Opened: true,
			MappedByKind: map[string]uint64{"cache\xfe": 7}}}}
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(metrics.NewFunc(stats, metrics.Options{}))
	fams := scrape(t, reg)
	require.Equal(t, 1.0, value(fams, "cuvmm_device_info", map[string]string{"name": `"GPU\xff"`}))
	require.Equal(t, 7.0, value(fams, "cuvmm_mapped_bytes", map[string]string{"kind": `"cache\xfe"`}))
}

// Two tags that come out as one label (an invalid one, and a valid one spelled like its quoted
// form) make one series for a pool, their bytes summed, and two distinct series for a set.
func TestTagsThatQuoteAlikeKeepScrapeWorking(t *testing.T) {
	pstats := func() pool.Stats { return pool.Stats{Tags: map[string]uint64{"a\xff": 1, `"a\xff"`: 2}} }
	sstats := func() offload.Stats {
		return offload.Stats{Buffers: []offload.BufferStats{{Tag: "a\xff", Bytes: 1}, {Tag: `"a\xff"`, Bytes: 2}}}
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(metrics.NewPoolFunc(pstats, "kv", 0, metrics.Options{}), metrics.NewSetFunc(sstats, "s", metrics.Options{}))
	fams := scrape(t, reg)
	require.Equal(t, 3.0, value(fams, "cuvmm_pool_tag_in_use_bytes", map[string]string{"tag": `"a\xff"`}))
	require.Len(t, fams["cuvmm_offload_buffer_bytes"].GetMetric(), 2)
}

// A pool's or set's name that is not valid UTF-8 is Go-quoted like a tag, not refused by the registry.
func TestPoolAndSetNamesNotUTF8Register(t *testing.T) {
	reg := prometheus.NewRegistry()
	require.NoError(t, reg.Register(metrics.NewPoolFunc(func() pool.Stats { return pool.Stats{Limit: 5} }, "kv\xff", 0, metrics.Options{})))
	require.NoError(t, reg.Register(metrics.NewSetFunc(func() offload.Stats { return offload.Stats{PooledBytes: 6} }, "s\xff", metrics.Options{})))
	fams := scrape(t, reg)
	require.Equal(t, 5.0, value(fams, "cuvmm_pool_limit_bytes", map[string]string{"pool": `"kv\xff"`}))
	require.Equal(t, 6.0, value(fams, "cuvmm_offload_pooled_bytes", map[string]string{"set": `"s\xff"`}))
}

// Two reservation kinds that come out as one label (an invalid one, and a valid one spelled like its
// quoted form) make one series, their bytes summed, for device and host-NUMA memory alike: the page
// still serves.
func TestKindsThatQuoteAlikeKeepScrapeWorking(t *testing.T) {
	byKind := map[string]uint64{"cache\xfe": 7, `"cache\xfe"`: 3}
	stats := func() vmm.Stats {
		return vmm.Stats{Devices: []vmm.DeviceStats{{Ordinal: 0, Name: "GPU", Opened: true, MappedByKind: byKind}},
			Host: vmm.HostStats{NUMAMappedByKind: byKind}}
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(metrics.NewFunc(stats, metrics.Options{}))
	fams := scrape(t, reg)
	kind := map[string]string{"kind": `"cache\xfe"`}
	require.Equal(t, 10.0, value(fams, "cuvmm_mapped_bytes", kind))
	require.Equal(t, 10.0, value(fams, "cuvmm_host_numa_mapped_bytes", kind))
	require.Zero(t, value(fams, "cuvmm_mapped_bytes", map[string]string{"kind": vmm.KindVMM}), "the default kinds are still there")
	require.Len(t, fams["cuvmm_mapped_bytes"].GetMetric(), 3)
}
