package metrics_test

import (
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/metrics"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/stripe"
	"github.com/cuvmm/cuvmm/vmm"
)

const mib = 1 << 20

// scrape gets the registry's page over HTTP, as Prometheus would, and parses it.
func scrape(t *testing.T, reg *prometheus.Registry) map[string]*dto.MetricFamily {
	t.Helper()
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	defer srv.Close()
	resp, err := srv.Client().Get(srv.URL)
	require.NoError(t, err)
	defer resp.Body.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(resp.Body)
	require.NoError(t, err)
	return fams
}

// value is the series name{labels} of a scrape, 0 when absent.
func value(fams map[string]*dto.MetricFamily, name string, labels map[string]string) float64 {
	f := fams[name]
	if f == nil {
		return 0
	}
next:
	for _, m := range f.GetMetric() {
		have := map[string]string{}
		for _, l := range m.GetLabel() {
			have[l.GetName()] = l.GetValue()
		}
		for k, v := range labels {
			if have[k] != v {
				continue next
			}
		}
		if m.GetGauge() != nil {
			return m.GetGauge().GetValue()
		}
		return m.GetCounter().GetValue()
	}
	return 0
}

func pinnedTotal(fams map[string]*dto.MetricFamily) float64 {
	var n float64
	for _, src := range []string{"registered", "host_alloc", "host_numa"} {
		n += value(fams, "cuvmm_pinned_host_bytes", map[string]string{"source": src})
	}
	return n
}

// A scrape shows the reserved, mapped, pinned and page-table series move with what the test makes
// and come back when it frees it.
func TestScrapeFollowsAllocations(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		dev := b.Device(t, 0)
		reg := prometheus.NewRegistry()
		reg.MustRegister(metrics.New(b.Sys, metrics.Options{}))
		d0 := map[string]string{"device": "0"}
		growbufKind := map[string]string{"device": "0", "kind": "growbuf"}
		before := scrape(t, reg)
		require.Equal(t, 1.0, value(before, "cuvmm_device_info", map[string]string{"device": "0", "name": dev.Name()}))

		buf, err := growbuf.New(dev, growbuf.Options{MaxSize: 64 * mib})
		require.NoError(t, err)
		require.NoError(t, buf.Grow(8*mib))
		region, err := pinned.New(dev, 64*mib, pinned.Options{})
		require.NoError(t, err)
		mid := scrape(t, reg)

		require.Equal(t, float64(buf.Reserved()), value(mid, "cuvmm_reserved_bytes", d0)-value(before, "cuvmm_reserved_bytes", d0)-regionReserved(region))
		require.Equal(t, float64(buf.Cap()), value(mid, "cuvmm_mapped_bytes", growbufKind)-value(before, "cuvmm_mapped_bytes", growbufKind))
		require.Equal(t, float64(buf.Cap()), value(mid, "cuvmm_created_bytes", d0)-value(before, "cuvmm_created_bytes", d0))
		require.Equal(t, float64(region.Len()), pinnedTotal(mid)-pinnedTotal(before))
		require.Equal(t, float64(region.PageTableCost()[0]), value(mid, "cuvmm_page_table_bytes", d0)-value(before, "cuvmm_page_table_bytes", d0),
			"the page-table estimate agrees with the region's own")
		require.Positive(t, value(mid, "cuvmm_page_table_bytes", d0)-value(before, "cuvmm_page_table_bytes", d0))
		create := map[string]string{"device": "0", "op": "create"}
		require.Greater(t, value(mid, "cuvmm_driver_calls_total", create), value(before, "cuvmm_driver_calls_total", create))

		require.NoError(t, region.Close())
		require.NoError(t, buf.Close())
		after := scrape(t, reg)
		for _, name := range []string{"cuvmm_reserved_bytes", "cuvmm_created_bytes", "cuvmm_page_table_bytes", "cuvmm_host_visible_bytes"} {
			require.Equal(t, value(before, name, d0), value(after, name, d0), name)
		}
		require.Equal(t, value(before, "cuvmm_mapped_bytes", growbufKind), value(after, "cuvmm_mapped_bytes", growbufKind))
		require.Equal(t, pinnedTotal(before), pinnedTotal(after))
	})
}

// regionReserved is the address space a host-NUMA region reserves (a registered one reserves none).
func regionReserved(r *pinned.Region) float64 {
	if r.Kind() == pinned.HostNUMA {
		return float64(r.Len())
	}
	return 0
}

// The exposition passes the Prometheus linter and has a description for every series.
func TestLintAndDescribe(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		b.Device(t, 0)
		c := metrics.New(b.Sys, metrics.Options{ConstLabels: prometheus.Labels{"role": "test"}})
		problems, err := promtest.CollectAndLint(c)
		require.NoError(t, err)
		require.Empty(t, problems)
		reg := prometheus.NewPedanticRegistry() // checks that Collect matches Describe
		reg.MustRegister(c)
		_, err = reg.Gather()
		require.NoError(t, err)
	}, testutil.SimOnly())
}

// A fixed snapshot renders as documented in docs/metrics.md.
func TestExposition(t *testing.T) {
	st := vmm.Stats{Devices: []vmm.DeviceStats{{Ordinal: 0, Name: "GPU", Opened: true, ReservedBytes: 64 * mib,
		MappedBytes: 8 * mib, MappedByKind: map[string]uint64{"growbuf": 8 * mib}, HostVisibleBytes: 1 << 30,
		PageTableBytes: 2 * mib}}, Host: vmm.HostStats{RegisteredBytes: 1 << 30, PinnedBytes: 1 << 30}}
	c := metrics.NewFunc(func() vmm.Stats { return st }, metrics.Options{})
	want := `
# HELP cuvmm_mapped_bytes Device memory mapped into reservations, by kind; each mapping counted once.
# TYPE cuvmm_mapped_bytes gauge
cuvmm_mapped_bytes{device="0",kind="growbuf"} 8.388608e+06
cuvmm_mapped_bytes{device="0",kind="imported"} 0
cuvmm_mapped_bytes{device="0",kind="vmm"} 0
# HELP cuvmm_page_table_bytes Estimated GPU memory taken by page tables for host memory visible to the GPU: 2 MiB per GiB.
# TYPE cuvmm_page_table_bytes gauge
cuvmm_page_table_bytes{device="0"} 2.097152e+06
# HELP cuvmm_pinned_host_bytes Page-locked host memory made by this process, by how it was pinned.
# TYPE cuvmm_pinned_host_bytes gauge
cuvmm_pinned_host_bytes{source="host_alloc"} 0
cuvmm_pinned_host_bytes{source="host_numa"} 0
cuvmm_pinned_host_bytes{source="registered"} 1.073741824e+09
# HELP cuvmm_reserved_bytes Virtual address space reserved through the device's context and not freed.
# TYPE cuvmm_reserved_bytes gauge
cuvmm_reserved_bytes{device="0"} 6.7108864e+07
`
	require.NoError(t, promtest.CollectAndCompare(c, strings.NewReader(want),
		"cuvmm_mapped_bytes", "cuvmm_page_table_bytes", "cuvmm_pinned_host_bytes", "cuvmm_reserved_bytes"))
}

func TestHandler(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		b.Device(t, 0)
		srv := httptest.NewServer(metrics.Handler(b.Sys, metrics.Options{Namespace: "svc"}))
		defer srv.Close()
		resp, err := srv.Client().Get(srv.URL)
		require.NoError(t, err)
		defer resp.Body.Close()
		require.Equal(t, 200, resp.StatusCode)
		parser := expfmt.NewTextParser(model.UTF8Validation)
		fams, err := parser.TextToMetricFamilies(resp.Body)
		require.NoError(t, err)
		require.Contains(t, fams, "svc_page_table_bytes")
		require.Contains(t, fams, "svc_driver_calls_total")
		require.NotContains(t, fams, "cuvmm_page_table_bytes")
	}, testutil.SimOnly())
}

// A striped range is reported under kind "stripe" on each device that holds part of it.
func TestStripeKind(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d0, d1 := b.Device(t, 0), b.Device(t, 1)
		reg := prometheus.NewRegistry()
		reg.MustRegister(metrics.New(b.Sys, metrics.Options{}))
		before := scrape(t, reg)
		r, err := stripe.New([]*vmm.Device{d0, d1}, 64*mib, stripe.Interleaved{Stripe: 8 * mib}, stripe.Options{})
		require.NoError(t, err)
		mid := scrape(t, reg)
		for _, dev := range []string{"0", "1"} {
			l := map[string]string{"device": dev, "kind": "stripe"}
			require.Equal(t, float64(32*mib), value(mid, "cuvmm_mapped_bytes", l)-value(before, "cuvmm_mapped_bytes", l), "device %s", dev)
		}
		require.NoError(t, r.Close())
		after := scrape(t, reg)
		l := map[string]string{"device": "1", "kind": "stripe"}
		require.Equal(t, value(before, "cuvmm_mapped_bytes", l), value(after, "cuvmm_mapped_bytes", l))
	}, testutil.Devices(2))
}
