package metrics

import (
	"net/http"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/cuvmm/cuvmm/vmm"
)

// Handler serves sys's series alone, from a registry of their own, for a program that has no
// Prometheus registry yet: http.Handle("/metrics", metrics.Handler(sys, metrics.Options{})). A
// program that has one registers New with it instead, so that one page serves everything.
func Handler(sys *vmm.System, opts Options) http.Handler {
	reg := prometheus.NewRegistry()
	reg.MustRegister(New(sys, opts))
	return promhttp.HandlerFor(reg, promhttp.HandlerOpts{})
}
