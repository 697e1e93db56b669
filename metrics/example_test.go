package metrics_test

import (
	"context"
	"fmt"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/prometheus/common/expfmt"

	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/metrics"
	"github.com/cuvmm/cuvmm/offload"
	"github.com/cuvmm/cuvmm/vmm"
)

// Register the collector with the registry a service already serves (promhttp.HandlerFor); every
// scrape reports what the System holds at that moment.
func Example() {
	s := sim.New()
	defer s.Close()
	sys, _ := vmm.Open(s)
	defer sys.Close()
	dev, _ := sys.Device(0)

	reg := prometheus.NewRegistry()
	reg.MustRegister(metrics.New(sys, metrics.Options{}))

	buf, _ := growbuf.New(dev, growbuf.Options{MaxSize: 1 << 30})
	defer buf.Close()
	_ = buf.Grow(48 << 20)

	fams, _ := reg.Gather()
	for _, f := range fams {
		for _, m := range f.GetMetric() {
			var labels []string
			for _, l := range m.GetLabel() {
				labels = append(labels, l.GetName()+"="+l.GetValue())
			}
			v := m.GetGauge().GetValue() + m.GetCounter().GetValue()
			switch name := f.GetName(); {
			case name == "cuvmm_mapped_bytes" && v > 0, name == "cuvmm_reserved_bytes":
				fmt.Printf("%s{%s} %g MiB\n", name, strings.Join(labels, ","), v/(1<<20))
			case name == "cuvmm_driver_calls_total" && labels[1] == "op=map":
				fmt.Printf("%s{%s} %g\n", name, strings.Join(labels, ","), v)
			}
		}
	}
	// Output:
	// cuvmm_driver_calls_total{device=0,op=map} 6
	// cuvmm_mapped_bytes{device=0,kind=growbuf} 64 MiB
	// cuvmm_reserved_bytes{device=0} 1024 MiB
}

// An offload set's collector shows which buffers sleep and what the sleeps and wakes did; a scrape
// never waits for one in progress.
func ExampleNewSet() {
	s := sim.New()
	defer s.Close()
	sys, _ := vmm.Open(s)
	defer sys.Close()
	dev, _ := sys.Device(0)
	buf, _ := growbuf.New(dev, growbuf.Options{MaxSize: 1 << 30})
	defer buf.Close()
	_ = buf.Grow(64 << 20)

	set := offload.NewSet(sys, offload.Options{SlotSize: 32 << 20})
	defer set.Close()
	_ = set.Add("weights", buf, offload.Keep, offload.EntryOptions{})
	c := metrics.NewSet(set, "model", metrics.Options{})
	_ = set.Sleep(context.Background())

	// What a scrape shows (prometheus' testutil formats it as the exposition text a server sends).
	text, _ := promtest.CollectAndFormat(c, expfmt.TypeTextPlain,
		"cuvmm_offload_buffer_asleep", "cuvmm_offload_asleep_bytes", "cuvmm_offload_calls_total")
	fmt.Print(string(text))
	_ = set.Wake(context.Background())
	// Output:
	// # HELP cuvmm_offload_asleep_bytes GPU memory of the sleeping buffers, given back to the driver.
	// # TYPE cuvmm_offload_asleep_bytes gauge
	// cuvmm_offload_asleep_bytes{set="model"} 6.7108864e+07
	// # HELP cuvmm_offload_buffer_asleep 1 while the buffer sleeps (its GPU memory given back), else 0.
	// # TYPE cuvmm_offload_buffer_asleep gauge
	// cuvmm_offload_buffer_asleep{policy="keep",set="model",tag="weights"} 1
	// # HELP cuvmm_offload_calls_total Sleeps and wakes that slept or woke at least one buffer.
	// # TYPE cuvmm_offload_calls_total counter
	// cuvmm_offload_calls_total{op="sleep",set="model"} 1
	// cuvmm_offload_calls_total{op="wake",set="model"} 0
}
