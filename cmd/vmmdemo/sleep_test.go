package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
)

func runSleepCmd(t *testing.T, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	var out, errOut bytes.Buffer
	code = run(&env{stdout: &out, stderr: &errOut}, append([]string{"sleep", "--backend", "sim"}, args...))
	return out.String(), errOut.String(), code
}

func TestSleepJSON(t *testing.T) {
	file := filepath.Join(t.TempDir(), "sleep.bin")
	for _, args := range [][]string{
		{"--size", "16MiB", "--chunk", "4MiB", "--slot", "4MiB"},
		{"--size", "8MiB", "--sim-devices", "2", "--devices", "0,1", "--mode", "discard"},
		{"--size", "8MiB", "--mode", "file", "--file", file},
		{"--size", "8MiB", "--mode", "file", "--file", file, "--io-workers", "8"},
		{"--size", "8MiB", "--mode", "file", "--file", file, "--file-part", "1MiB", "--file-buffers", "3"},
		{"--size", "8MiB", "--mode", "file", "--file", file, "--file-rounds", "5"},
		{"--size", "8MiB", "--mode", "file", "--file", file, "--rounds", "5"},
		{"--size", "8MiB", "--chunk", "4MiB", "--slot", "4MiB", "--rounds", "4"},
	} {
		stdout, stderr, code := runSleepCmd(t, append(args, "--json")...)
		require.Equal(t, 0, code, stderr)
		var res map[string]any
		require.NoError(t, json.Unmarshal([]byte(stdout), &res), stdout)
		for _, k := range []string{"verified", "ptr_unchanged", "freed_bytes", "sleep_seconds", "wake_seconds",
			"first_sleep_seconds", "sleep_gbps", "wake_gbps", "raw_d2h_gbps", "raw_h2d_gbps", "baseline_sleep_seconds", "per_device"} {
			require.Contains(t, res, k, args)
		}
		require.Equal(t, true, res["verified"], args)
		require.Equal(t, true, res["ptr_unchanged"], args)
		require.Greater(t, res["freed_ratio"].(float64), 0.99, args)
		if res["mode"] == "file" {
			require.Contains(t, res, "raw_file_write_gbps")
			require.Equal(t, 8.0, res["io_workers"], "the default, or --io-workers 8")
			rounds := 3.0 // raw and set file speeds are medians of rounds
			if slices.Contains(args, "--file-rounds") || slices.Contains(args, "--rounds") {
				rounds = 5
			}
			require.Equal(t, rounds, res["rounds"])
			require.Len(t, res["wake_vs_raw_file_rounds"], int(rounds), "each round's ratio")
			require.Len(t, res["sleep_vs_raw_file_rounds"], int(rounds))
			if slices.Contains(args, "--file-part") {
				require.Equal(t, [2]any{float64(1 << 20), 3.0}, [2]any{res["file_part_bytes"], res["file_buffers"]})
			} else {
				require.Equal(t, [2]any{float64(4 << 20), 2.0}, [2]any{res["file_part_bytes"], res["file_buffers"]}, "the defaults")
			}
			st, err := os.Stat(file)
			require.NoError(t, err, "--file is kept")
			require.EqualValues(t, 8<<20, st.Size())
		} else {
			rounds := 5.0 // warm sleeps and wakes are medians of rounds against raw copies
			if slices.Contains(args, "--rounds") {
				rounds = 4
			}
			require.Equal(t, rounds, res["rounds"], args)
			require.Len(t, res["sleep_vs_raw_rounds"], int(rounds), args)
			require.Len(t, res["wake_vs_raw_rounds"], int(rounds), args)
		}
		if res["mode"] == "discard" {
			require.Contains(t, res, "aggregate_sleep_x")
			require.Len(t, res["per_device"], 2)
		}
	}
}

// TestSleepFilePartFitsBuffer checks that the default part is cut to a buffer smaller than it, so
// that the raw file figures use the part the set uses.
func TestSleepFilePartFitsBuffer(t *testing.T) {
	stdout, stderr, code := runSleepCmd(t, "--size", "2MiB", "--mode", "file", "--json")
	require.Equal(t, 0, code, stderr)
	var res map[string]any
	require.NoError(t, json.Unmarshal([]byte(stdout), &res), stdout)
	require.Equal(t, true, res["verified"])
	require.Equal(t, float64(2<<20), res["file_part_bytes"], "the 4 MiB default, cut to the 2 MiB buffer")
}

func TestSleepHuman(t *testing.T) {
	stdout, stderr, code := runSleepCmd(t, "--size", "8MiB")
	require.Equal(t, 0, code, stderr)
	require.Contains(t, stdout, "verified yes, address unchanged yes")
	require.Contains(t, stdout, "raw D2H")
}

func TestSleepBadFlags(t *testing.T) {
	for _, args := range [][]string{
		{"--size", "0"},
		{"--size", "3MiB"},
		{"--size", "8MiB", "--mode", "maybe"},
		{"--size", "8MiB", "--file", "/tmp/x"},
		{"--size", "8MiB", "--chunk", "3MiB"},
		{"--size", "8MiB", "--devices", "5"},
		{"--size", "8MiB", "--devices", "0,0"},
		{"--size", "8MiB", "--mode", "file", "--io-workers", "-1"},
		{"--size", "8MiB", "--mode", "file", "--io-workers", "65"},
		{"--size", "8MiB", "--io-workers", "8"},
		{"--size", "8MiB", "--file-part", "1MiB"},
		{"--size", "8MiB", "--file-buffers", "2"},
		{"--size", "8MiB", "--mode", "file", "--file-part", "1000"},
		{"--size", "8MiB", "--mode", "file", "--file-part", "512MiB"},
		{"--size", "8MiB", "--mode", "file", "--slot", "4MiB", "--file-part", "8MiB"},
		{"--size", "8MiB", "--mode", "file", "--file-part", "16MiB"}, // larger than the buffer
		{"--size", "8MiB", "--mode", "file", "--file-buffers", "-1"},
		{"--size", "8MiB", "--mode", "file", "--file-buffers", "65"},
		{"--size", "8MiB", "--mode", "file", "--file-rounds", "-1"},
		{"--size", "8MiB", "--mode", "file", "--file-rounds", "51"},
		{"--size", "8MiB", "--file-rounds", "3"}, // not file mode
		{"--size", "8MiB", "--rounds", "-1"},
		{"--size", "8MiB", "--rounds", "51"},
		{"--size", "8MiB", "--mode", "file", "--rounds", "2", "--file-rounds", "3"},
	} {
		_, stderr, code := runSleepCmd(t, args...)
		require.NotEqual(t, 0, code, args)
		require.NotEmpty(t, stderr, args)
	}
}
