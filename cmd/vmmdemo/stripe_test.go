package main

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/measure"
)

func runStripeCmd(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errOut bytes.Buffer
	code = run(&env{stdout: &out, stderr: &errOut}, append([]string{"stripe", "--backend", "sim"}, args...))
	return code, out.String(), errOut.String()
}

func TestStripeCommandJSON(t *testing.T) {
	for _, layout := range []string{"interleaved", "blocked"} {
		args := []string{"--devices", "0,1", "--size", "16MiB", "--layout", layout, "--json", "--builds", "2"}
		if layout == "interleaved" {
			args = append(args, "--stripe", "4MiB") // --stripe is refused with --layout blocked
		}
		code, out, errOut := runStripeCmd(t, args...)
		require.Equal(t, 0, code, errOut)
		var raw map[string]any
		require.NoError(t, json.Unmarshal([]byte(out), &raw))
		keys := []string{"devices", "layout", "stripe_bytes", "size_bytes", "build_seconds", "raw_build_seconds", "verified", "per_device"}
		require.Len(t, raw, len(keys))
		for _, k := range keys {
			require.Contains(t, raw, k)
		}
		var res measure.StripeResult
		require.NoError(t, json.Unmarshal([]byte(out), &res))
		require.Equal(t, []int{0, 1}, res.Devices)
		require.Equal(t, layout, res.Layout)
		require.Equal(t, uint64(16<<20), res.SizeBytes)
		if layout == "interleaved" {
			require.Equal(t, uint64(4<<20), res.StripeBytes)
		} else {
			require.Equal(t, uint64(8<<20), res.StripeBytes, "blocked: device 0's slab")
		}
		require.True(t, res.Verified)
		require.Positive(t, res.BuildSeconds)
		require.Positive(t, res.RawBuildSeconds)
		require.Len(t, res.PerDevice, 2)
		for i, pd := range res.PerDevice {
			require.Equal(t, i, pd.Device)
		}
		var perDevice []map[string]any
		require.NoError(t, json.Unmarshal(mustJSON(t, raw["per_device"]), &perDevice))
		for _, pd := range perDevice {
			require.ElementsMatch(t, []string{"device", "local_read_gbps", "whole_read_gbps", "plain_local_read_gbps", "raw_whole_read_gbps"}, keysOf(pd))
		}
	}
}

func mustJSON(t *testing.T, v any) []byte {
	b, err := json.Marshal(v)
	require.NoError(t, err)
	return b
}

func keysOf(m map[string]any) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

func TestStripeCommandText(t *testing.T) {
	code, out, errOut := runStripeCmd(t, "--size", "8MiB", "--stripe", "2MiB", "--read-only-peers", "--sim-devices", "3", "--devices", "0,1", "--access-only", "2")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "verified: every device")
	require.Contains(t, out, "access only: devices 2")

	// The tour's arguments on a single device: a plain range and a notice, not a failure.
	code, out, errOut = runStripeCmd(t, append([]string{"--sim-devices", "1"}, commands["stripe"].tour...)...)
	require.Equal(t, 0, code, errOut)
	require.Contains(t, errOut, "one device")
	require.Contains(t, out, "over devices 0 ")
}

func TestStripeCommandBadInput(t *testing.T) {
	for _, c := range []struct {
		args    []string
		code    int
		message string
	}{
		{[]string{"--devices", "0,5"}, 2, "there is no device 5: the sim backend has 2"},
		{[]string{"--devices", "0,0"}, 2, "device 0 is listed twice"},
		{[]string{"--devices", "zero"}, 2, "not a device ordinal"},
		{[]string{"--devices", ""}, 2, "no devices"},
		{[]string{"--layout", "diagonal"}, 2, "want interleaved or blocked"},
		{[]string{"--size", "64MiB", "--stripe", "3MiB"}, 2, "--stripe 3 MiB: want a multiple of the granularity 2 MiB"},
		{[]string{"--size", "0"}, 2, "--size 0: want a size above 0"},
		{[]string{"--devices", "0,1", "--size", "0", "--stripe", "8MiB"}, 2, "--size 0: want a size above 0"},
		{[]string{"--devices", "0,1", "--size", "64MiB", "--stripe", "0"}, 2, "--stripe 0: want a non-zero multiple of the granularity"},
		{[]string{"--access-only", "1", "--size", "8MiB"}, 2, "--access-only 1: device 1 is also in --devices"},
		{[]string{"--devices", "0,1", "--access-only", "0", "--size", "8MiB"}, 2, "--access-only 0: device 0 is also in --devices"},
		{[]string{"--sim-devices", "3", "--devices", "0,1", "--access-only", "2,5", "--size", "8MiB"}, 2, "--access-only 2,5: there is no device 5"},
		{[]string{"--layout", "blocked", "--stripe", "4MiB", "--size", "8MiB"}, 2, "--stripe is for --layout interleaved"},
	} {
		code, _, errOut := runStripeCmd(t, c.args...)
		require.Equal(t, c.code, code, "%v: %s", c.args, errOut)
		require.True(t, strings.Contains(errOut, c.message), "%v: %s", c.args, errOut)
	}
}

// --access-only all is every device that --devices does not list: with --devices all, none.
func TestStripeAccessOnlyAll(t *testing.T) {
	code, out, errOut := runStripeCmd(t, "--sim-devices", "3", "--devices", "0", "--access-only", "all", "--size", "8MiB", "--builds", "1", "--json")
	require.Equal(t, 0, code, errOut)
	var res measure.StripeResult
	require.NoError(t, json.Unmarshal([]byte(out), &res))
	require.Equal(t, []int{0}, res.Devices)
	require.Len(t, res.PerDevice, 3, "devices 1 and 2 access the range")
	require.True(t, res.Verified)

	code, out, errOut = runStripeCmd(t, "--sim-devices", "3", "--devices", "2,0", "--access-only", "all", "--size", "8MiB", "--builds", "1")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "access only: devices 1")

	code, out, errOut = runStripeCmd(t, "--access-only", "all", "--size", "8MiB", "--builds", "1")
	require.Equal(t, 0, code, errOut)
	require.NotContains(t, out, "access only", "--devices all leaves no device to access only")
}
