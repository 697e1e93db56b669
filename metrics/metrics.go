// Package metrics exposes what a vmm.System holds as Prometheus metrics: bytes reserved, made and
// mapped per device and kind, pinned host bytes, the estimated GPU page-table bytes, live owners, and
// the count, errors, bytes and time of each kind of driver call. It is the only package of the module
// that imports the Prometheus client library, so only programs that import it carry that dependency.
//
//	reg := prometheus.NewRegistry()
//	reg.MustRegister(metrics.New(sys, metrics.Options{}))
//	http.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
//
// Every scrape takes one vmm.System.Stats snapshot (one lock, no driver call). NewPool reports a
// pool.Pool and NewSet an offload.Set the same way, from their own statistics. docs/metrics.md
// lists the series.
package metrics

import (
	"slices"
	"strconv"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/cuvmm/cuvmm/vmm"
)

// Options tunes New.
type Options struct {
	// Namespace prefixes every series name; empty means "cuvmm".
	Namespace string
	// ConstLabels are added to every series (for example the service's role).
	ConstLabels prometheus.Labels
}

// Collector is a prometheus.Collector over a System's statistics. It is safe for concurrent use.
type Collector struct {
	stats func() vmm.Stats
	d     descs
}

type descs struct {
	info, reserved, created, mapped, plain, visible, pageTables, owners, objects *prometheus.Desc
	pinned, numaMapped                                                           *prometheus.Desc
	calls, errors, bytes, seconds                                                *prometheus.Desc
}

// New returns a collector that reports sys. Register it with a prometheus.Registerer.
func New(sys *vmm.System, opts Options) *Collector {
	return NewFunc(sys.Stats, opts)
}

// NewFunc returns a collector that reports the snapshots stats returns (for example the sum of
// several Systems, or a fixed snapshot in a test).
func NewFunc(stats func() vmm.Stats, opts Options) *Collector {
	ns := namespace(opts)
	desc := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc(prometheus.BuildFQName(ns, "", name), help, labels, opts.ConstLabels)
	}
	dev := "device"
	return &Collector{stats: stats, d: descs{
		info:       desc("device_info", "A device of the system, 1 when this process holds its primary context, else 0.", dev, "name"),
		reserved:   desc("reserved_bytes", "Virtual address space reserved through the device's context and not freed.", dev),
		created:    desc("created_bytes", "Physical memory on the device made by cuMemCreate and not released.", dev),
		mapped:     desc("mapped_bytes", "Device memory mapped into reservations, by kind; each mapping counted once.", dev, "kind"),
		plain:      desc("plain_bytes", "Device memory from cuMemAlloc not freed.", dev),
		visible:    desc("host_visible_bytes", "Host memory the GPU can reach in this process (registered, cuMemHostAlloc, granted host-NUMA mappings).", dev),
		pageTables: desc("page_table_bytes", "Estimated GPU memory taken by page tables for host memory visible to the GPU: 2 MiB per GiB.", dev),
		owners:     desc("live_owners", "vmm owners of the device not yet closed, by kind.", dev, "kind"),
		objects:    desc("live_objects", "Driver objects made through the device's context and not yet freed, by type.", dev, "type"),
		pinned:     desc("pinned_host_bytes", "Page-locked host memory made by this process, by how it was pinned.", "source"),
		numaMapped: desc("host_numa_mapped_bytes", "Host-NUMA memory mapped into reservations, by kind; each mapping counted once.", "kind"),
		calls:      desc("driver_calls_total", "Driver calls made through the device's context, by operation.", dev, "op"),
		errors:     desc("driver_errors_total", "Driver calls that failed, by operation.", dev, "op"),
		bytes:      desc("driver_bytes_total", "Bytes the driver calls were given (sizes of reserve, create, map, set access, register, allocations, copies, memsets), by operation.", dev, "op"),
		seconds:    desc("driver_seconds_total", "Wall time spent inside the driver calls, by operation; asynchronous copies count their enqueue time.", dev, "op"),
	}}
}

// namespace is the prefix of every series: Options.Namespace, else "cuvmm".
func namespace(opts Options) string {
	if opts.Namespace == "" {
		return "cuvmm"
	}
	return opts.Namespace
}

// Describe sends every series' description.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.d.info, c.d.reserved, c.d.created, c.d.mapped, c.d.plain, c.d.visible,
		c.d.pageTables, c.d.owners, c.d.objects, c.d.pinned, c.d.numaMapped, c.d.calls, c.d.errors, c.d.bytes, c.d.seconds} {
		ch <- d
	}
}

// Collect takes one snapshot and sends its series.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	st := c.stats()
	for _, d := range st.Devices {
		c.collectDevice(ch, d)
	}
	h := st.Host
	gauge(ch, c.d.pinned, float64(h.RegisteredBytes), "registered")
	gauge(ch, c.d.pinned, float64(h.HostAllocBytes), "host_alloc")
	gauge(ch, c.d.pinned, float64(h.NUMACreatedBytes), "host_numa")
	for k, n := range kinds(h.NUMAMappedByKind) {
		gauge(ch, c.d.numaMapped, float64(n), k)
	}
}

func (c *Collector) collectDevice(ch chan<- prometheus.Metric, d vmm.DeviceStats) {
	o := strconv.Itoa(d.Ordinal)
	opened := 0.0
	if d.Opened {
		opened = 1
	}
	gauge(ch, c.d.info, opened, o, d.Name)
	gauge(ch, c.d.reserved, float64(d.ReservedBytes), o)
	gauge(ch, c.d.created, float64(d.CreatedBytes), o)
	for k, n := range kinds(d.MappedByKind) {
		gauge(ch, c.d.mapped, float64(n), o, k)
	}
	gauge(ch, c.d.plain, float64(d.PlainBytes), o)
	gauge(ch, c.d.visible, float64(d.HostVisibleBytes), o)
	gauge(ch, c.d.pageTables, float64(d.PageTableBytes), o)
	for _, k := range ownerKinds(d.LiveOwnersByKind) {
		gauge(ch, c.d.owners, float64(d.LiveOwnersByKind[k]), o, k)
	}
	l := d.Live
	for typ, n := range map[string]int{"allocation": l.Allocations, "reservation": l.Reservations, "mapping": l.Mappings,
		"stream": l.Streams, "event": l.Events, "plain_buffer": l.PlainBuffers, "host_buffer": l.HostBuffers,
		"registration": l.Registrations} {
		gauge(ch, c.d.objects, float64(n), o, typ)
	}
	for _, op := range vmm.Ops() {
		s := d.Ops[op]
		counter(ch, c.d.calls, float64(s.Calls), o, op.String())
		counter(ch, c.d.errors, float64(s.Errors), o, op.String())
		counter(ch, c.d.bytes, float64(s.Bytes), o, op.String())
		counter(ch, c.d.seconds, s.Time.Seconds(), o, op.String())
	}
}

// kinds sums a by-kind map by the label each kind is reported under (byLabel), so that an invalid
// kind and a valid one spelled like its quoted form make one series, not two that fail the scrape;
// the two kinds every process can have are always there, so that their series exist from the first
// scrape.
func kinds(m map[string]uint64) map[string]uint64 {
	out := byLabel(m)
	for _, k := range []string{vmm.KindVMM, vmm.KindImported} {
		out[k] += 0
	}
	return out
}

// ownerKinds lists the owner kinds vmm has, and any other the map holds, so that every series exists
// from the first scrape.
func ownerKinds(m map[string]int) []string {
	out := []string{"allocation", "reservation", "stream", "event", "plain buffer", "host buffer", "host registration"}
	for k := range m {
		if !slices.Contains(out, k) {
			out = append(out, k)
		}
	}
	return out
}

func gauge(ch chan<- prometheus.Metric, d *prometheus.Desc, v float64, labels ...string) {
	ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labelValues(labels)...)
}

func counter(ch chan<- prometheus.Metric, d *prometheus.Desc, v float64, labels ...string) {
	ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, v, labelValues(labels)...)
}

// labelValues makes every value a valid label value (labelValue), in place: gauge and counter
// are where every variable label is made, so no tag, kind or device name can make
// MustNewConstMetric panic, which the registry would turn into a failed scrape of the whole page.
func labelValues(labels []string) []string {
	for i, l := range labels {
		labels[i] = labelValue(l)
	}
	return labels
}

// labelValue is s when it is valid UTF-8 (as Prometheus requires of a label value), else s
// Go-quoted (strconv.Quote: "req-\xe9"), so that the invalid bytes stay visible and two strings
// that differ only in them stay apart.
func labelValue(s string) string {
	if utf8.ValidString(s) {
		return s
	}
	return strconv.Quote(s)
}
