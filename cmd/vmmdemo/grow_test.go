package main

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func runGrowCmd(t *testing.T, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	var out, errOut bytes.Buffer
	code = run(&env{stdout: &out, stderr: &errOut}, append([]string{"grow", "--backend", "sim"}, args...))
	return out.String(), errOut.String(), code
}

func TestGrowJSON(t *testing.T) {
	for _, tc := range []struct {
		step     string
		chunk    uint64
		wantPeak uint64
	}{
		{"8MiB", 8 << 20, 32 << 20}, // the step is the chunk: the peak is the final size
		{"3MiB", 0, 32 << 20},       // geometric chunks, cut at the 32 MiB reservation
	} {
		stdout, stderr, code := runGrowCmd(t, "--to", "32MiB", "--step", tc.step, "--json")
		require.Equal(t, 0, code, stderr)
		var res map[string]any
		require.NoError(t, json.Unmarshal([]byte(stdout), &res), stdout)
		for _, k := range []string{"to_bytes", "step_bytes", "growbuf_seconds", "realloc_seconds", "speedup",
			"growbuf_peak_bytes", "realloc_peak_bytes", "verified"} {
			require.Contains(t, res, k)
		}
		require.Equal(t, true, res["verified"])
		require.EqualValues(t, 32<<20, res["to_bytes"])
		require.EqualValues(t, tc.chunk, res["chunk_bytes"])
		require.EqualValues(t, tc.wantPeak, res["growbuf_peak_bytes"], tc.step)
		require.Greater(t, res["realloc_peak_bytes"].(float64), res["growbuf_peak_bytes"].(float64),
			"realloc holds the old and the new buffer at once")
		require.Greater(t, res["growbuf_seconds"].(float64), 0.0)
		require.Greater(t, res["speedup"].(float64), 0.0)
	}
}

func TestGrowHuman(t *testing.T) {
	stdout, stderr, code := runGrowCmd(t, "--to", "16MiB", "--step", "4MiB")
	require.Equal(t, 0, code, stderr)
	require.Contains(t, stdout, "grow to 16 MiB in 4 steps of 4 MiB")
	require.Contains(t, stdout, "speedup")
	require.Contains(t, stdout, "verified")
}

func TestGrowBadFlags(t *testing.T) {
	for _, args := range [][]string{
		{"--to", "0"},
		{"--to", "16MiB", "--step", "0"},
		{"--to", "17", "--step", "8"},
		{"--to", "16MiB", "--step", "4MiB", "--chunk", "3MiB"},
		{"--to", "16MiB", "--device", "5"},
		{"--to", "lots"},
		{"--to", "18446744073709551608", "--step", "8MiB"}, // more than the device has, not an overflow deep in growbuf
	} {
		_, stderr, code := runGrowCmd(t, args...)
		require.Equal(t, 2, code, "%v: %s", args, stderr)
		require.True(t, strings.Contains(stderr, "vmmdemo grow") || strings.Contains(stderr, "invalid value"), stderr)
	}
}
