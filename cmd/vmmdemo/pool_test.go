package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/pool"
)

func TestPoolJSON(t *testing.T) {
	// The first 4000 allocations of the serving trace keep the test quick.
	tr := pool.SyntheticServing(1)
	tr.Events = tr.Events[:4000]
	file := filepath.Join(t.TempDir(), "serving.trace")
	f, err := os.Create(file)
	require.NoError(t, err)
	_, err = tr.WriteTo(f)
	require.NoError(t, err)
	require.NoError(t, f.Close())
	code, out, errOut := runCmd(t, "pool", "--backend", "sim", "--trace", file, "--memory", "256MiB",
		"--fill-fraction", "0.6", "--cache-iters", "50", "--json")
	require.Equal(t, 0, code, errOut)
	var res struct {
		TracePeakInUse uint64                    `json:"trace_peak_in_use_bytes"`
		Order          []string                  `json:"order"`
		Allocators     map[string]map[string]any `json:"allocators"`
		Trim           map[string]float64        `json:"trim"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &res), out)
	require.Equal(t, []string{"cuvmm", "cuvmm-nostitch", "cuMemAlloc", "cuMemAllocAsync"}, res.Order)
	for _, name := range res.Order {
		a := res.Allocators[name]
		for _, k := range []string{"verified", "peak_mapped_bytes", "peak_in_use_bytes", "failed_allocs", "alloc_p50_ns", "alloc_p99_ns",
			"free_p50_ns", "free_p99_ns", "cache_alloc_free_p50_ns", "cache_alloc_free_p99_ns", "largest_request_served_bytes"} {
			require.Contains(t, a, k, name)
		}
		require.Equal(t, true, a["verified"], name)
		require.Greater(t, a["verified_blocks"], 0.0, name)
	}
	cuvmm := res.Allocators["cuvmm"]
	require.EqualValues(t, 0, cuvmm["failed_allocs"])
	require.EqualValues(t, res.TracePeakInUse, cuvmm["peak_in_use_bytes"])
	require.LessOrEqual(t, cuvmm["peak_mapped_bytes"], float64(256<<20), "within the limit")
	require.Greater(t, res.Trim["bytes"], 0.0)
}

func TestPoolBadInput(t *testing.T) {
	bad := filepath.Join(t.TempDir(), "bad.trace")
	require.NoError(t, os.WriteFile(bad, []byte("# ok\n1MiB 0 -\n2MiB zero 3\n"), 0o644))
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--trace", bad}, `trace line 3 "2MiB zero 3": stream "zero"`},
		{[]string{"--trace", filepath.Join(t.TempDir(), "missing")}, "no such file"},
		{[]string{"--synthetic", "training"}, `--synthetic "training": want serving`},
		{[]string{"--trace", bad, "--synthetic", "serving"}, "give one"},
		{[]string{}, "give --trace FILE or --synthetic serving"},
		{[]string{"--synthetic", "serving", "--streams", "100"}, "--streams 100"},
		{[]string{"--synthetic", "serving", "--allocators", "malloc"}, `allocator "malloc"`},
		{[]string{"--synthetic", "serving", "--peer", "jax"}, `--peer "jax"`},
	} {
		code, _, errOut := runCmd(t, append([]string{"pool", "--backend", "sim"}, c.args...)...)
		require.NotEqual(t, 0, code, c.args)
		require.Contains(t, errOut, c.want, c.args)
	}
}
