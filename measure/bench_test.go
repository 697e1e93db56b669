package measure_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/measure"
)

// benchBackend is the real driver when it loads and has a device, else the simulator (where only
// the ratios' shape means anything).
func benchBackend(b *testing.B) *measure.Backend {
	b.Helper()
	be, err := measure.OpenBackend("auto", 1, func(err error) { b.Logf("no real driver (%v): the simulator", err) })
	require.NoError(b, err)
	b.Cleanup(func() { require.NoError(b, be.Close()) })
	return be
}

// BenchmarkGrow is vmmdemo grow as a benchmark: growing a growbuf in place step by step against
// realloc-and-copy, reported as the speedup over realloc (x_realloc) and growbuf's time per step.
func BenchmarkGrow(b *testing.B) {
	env := measure.Env{Backend: benchBackend(b)}
	to, step := uint64(256<<20), uint64(32<<20)
	if !env.Backend.Sim() {
		to, step = 4<<30, 256<<20
	}
	var speedup, perStep float64
	for i := 0; i < b.N; i++ {
		res, err := measure.Grow(measure.GrowOptions{Env: env, To: to, Step: step})
		require.NoError(b, err)
		require.NoError(b, res.Check())
		speedup += res.Speedup
		perStep += res.GrowbufSeconds / float64(res.Steps)
	}
	b.ReportMetric(speedup/float64(b.N), "x_realloc")
	b.ReportMetric(perStep/float64(b.N)*1e9, "ns/step")
}
