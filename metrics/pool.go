package metrics

import (
	"maps"
	"strconv"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/cuvmm/cuvmm/pool"
)

// PoolCollector is a prometheus.Collector over a pool's statistics (pool.Pool.Stats): what it maps,
// hands out and caches, and how often it allocates, fails, borrows, stitches and trims. It is safe for
// concurrent use.
type PoolCollector struct {
	stats  func() pool.Stats
	gauges []poolSeries
	counts []poolSeries
	tags   *prometheus.Desc
}

// poolSeries is a series of a pool and how to read it from a snapshot.
type poolSeries struct {
	d   *prometheus.Desc
	get func(pool.Stats) float64
}

// NewPool returns a collector that reports p under the name given: every series carries the const
// labels pool (the name) and device (p's device ordinal), so that the pools of a process, each with a
// name of its own, register side by side. Every scrape takes one p.Stats snapshot (one lock, no
// driver call). Like prometheus.NewDesc, it panics on a programming error: a nil pool.
func NewPool(p *pool.Pool, name string, opts Options) *PoolCollector {
	if p == nil {
		panic("metrics: NewPool: nil pool")
	}
	return NewPoolFunc(p.Stats, name, p.Device().Ordinal(), opts)
}

// NewPoolFunc is NewPool over any source of pool statistics (a fixed snapshot in a test).
func NewPoolFunc(stats func() pool.Stats, name string, device int, opts Options) *PoolCollector {
	labels := prometheus.Labels{}
	maps.Copy(labels, opts.ConstLabels)
	labels["pool"], labels["device"] = labelValue(name), strconv.Itoa(device)
	desc := func(series, help string, vars ...string) *prometheus.Desc {
		return prometheus.NewDesc(prometheus.BuildFQName(namespace(opts), "pool", series), help, vars, labels)
	}
	c := &PoolCollector{stats: stats, tags: desc("tag_in_use_bytes", "Bytes asked for by the pool's live blocks, by the tag given to AllocTag.", "tag")}
	for _, g := range poolGauges {
		c.gauges = append(c.gauges, poolSeries{desc(g.name, g.help), g.get})
	}
	for _, k := range poolCounters {
		c.counts = append(c.counts, poolSeries{desc(k.name, k.help), k.get})
	}
	return c
}

// Describe sends every series' description.
func (c *PoolCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, s := range append(c.gauges, c.counts...) {
		ch <- s.d
	}
	ch <- c.tags
}

// Collect takes one snapshot and sends its series.
func (c *PoolCollector) Collect(ch chan<- prometheus.Metric) {
	st := c.stats()
	for _, s := range c.gauges {
		gauge(ch, s.d, s.get(st))
	}
	for _, s := range c.counts {
		counter(ch, s.d, s.get(st))
	}
	for tag, n := range byLabel(st.Tags) {
		gauge(ch, c.tags, float64(n), tag)
	}
}

// byLabel sums the bytes of tags by the label each is reported under (labelValue), so that an
// invalid tag and a valid one spelled like its quoted form make one series, not two that clash.
func byLabel(tags map[string]uint64) map[string]uint64 {
	out := make(map[string]uint64, len(tags))
	for tag, n := range tags {
		out[labelValue(tag)] += n
	}
	return out
}

// poolSpec names a series of a pool, says what it means and reads it from a snapshot.
type poolSpec struct {
	name, help string
	get        func(pool.Stats) float64
}

func num(n uint64) float64 { return float64(n) }

var poolGauges = []poolSpec{
	{"limit_bytes", "The most physical memory the pool maps.", func(s pool.Stats) float64 { return num(s.Limit) }},
	{"mapped_bytes", "Physical memory mapped into the pool now.", func(s pool.Stats) float64 { return num(s.Mapped) }},
	{"allocated_bytes", "Bytes in live blocks, each block's span.", func(s pool.Stats) float64 { return num(s.Allocated) }},
	{"in_use_bytes", "Bytes asked for by live blocks.", func(s pool.Stats) float64 { return num(s.InUse) }},
	{"cached_bytes", "Mapped bytes no live block uses: free, or freed on a stream not yet past the free.", func(s pool.Stats) float64 { return num(s.Cached) }},
	{"pending_bytes", "Of the cached bytes, frees some stream has not yet passed.", func(s pool.Stats) float64 { return num(s.Pending) }},
	{"peak_mapped_bytes", "The most the pool has mapped.", func(s pool.Stats) float64 { return num(s.PeakMapped) }},
	{"peak_allocated_bytes", "The most bytes live blocks have held.", func(s pool.Stats) float64 { return num(s.PeakAllocated) }},
	{"largest_free_bytes", "The largest request served without a driver call from a range free for every stream (the small pages' free ranges serve up to the pool's small size).", func(s pool.Stats) float64 { return num(s.LargestFree) }},
	{"fragmentation_ratio", "1 - largest free range / free bytes ready for every stream; 0 when none is free.", func(s pool.Stats) float64 { return s.Fragmentation }},
	{"blocks", "Live blocks.", func(s pool.Stats) float64 { return float64(s.Blocks) }},
}

var poolCounters = []poolSpec{
	{"allocs_total", "Successful Alloc calls.", func(s pool.Stats) float64 { return num(s.Allocs) }},
	{"frees_total", "Successful Free calls.", func(s pool.Stats) float64 { return num(s.Frees) }},
	{"failures_total", "Alloc calls that failed after their arguments were accepted: out of memory, or a failed driver call.", func(s pool.Stats) float64 { return num(s.Failures) }},
	{"borrows_total", "Requests served from another stream's pending free by waiting on its event.", func(s pool.Stats) float64 { return num(s.Borrows) }},
	{"stitches_total", "Requests served by remapping idle pages into a fresh range.", func(s pool.Stats) float64 { return num(s.Stitches) }},
	{"stitched_bytes_total", "Bytes of pages remapped by stitching.", func(s pool.Stats) float64 { return num(s.StitchedBytes) }},
	{"new_pages_total", "Pages created (cuMemCreate).", func(s pool.Stats) float64 { return num(s.NewPages) }},
	{"trims_total", "Releases of idle pages (Trim, the high-water mark, Close).", func(s pool.Stats) float64 { return num(s.Trims) }},
	{"trimmed_bytes_total", "Bytes unmapped and released by trims.", func(s pool.Stats) float64 { return num(s.TrimmedBytes) }},
	{"driver_seconds_total", "Time the pool spent in driver calls (mapping, unmapping, events).", func(s pool.Stats) float64 { return s.DriverTime.Seconds() }},
}
