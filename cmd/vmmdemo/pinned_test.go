package main

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/measure"
)

// `vmmdemo pinned` re-executes its own binary as its workers; under `go test` that binary is the
// test binary, whose TestMain runs the worker's role before the testing package sees the arguments.
func runPinnedCmd(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	t.Setenv("GORACE", "atexit_sleep_ms=0") // race-enabled workers otherwise sleep a second at exit
	var out, errOut bytes.Buffer
	code = run(&env{stdout: &out, stderr: &errOut}, args)
	return code, out.String(), errOut.String()
}

func TestPinnedCommandJSON(t *testing.T) {
	const size = 8 << 20
	code, out, errOut := runPinnedCmd(t, "pinned", "--backend", "sim", "--sim-devices", "2", "--size", "8MiB", "--procs", "3", "--json")
	require.Equal(t, 0, code, errOut)
	var res measure.PinnedResult
	require.NoError(t, json.Unmarshal([]byte(out), &res))
	require.Equal(t, "sim", res.Backend)
	require.Equal(t, uint64(size), res.SizeBytes)
	require.Equal(t, []int{0, 1}, res.Devices)
	require.Equal(t, []int{0, 1, 0}, res.WorkerDevices)
	require.Len(t, res.Modes, 3)
	methods := map[string]bool{}
	for _, r := range res.Ready {
		methods[r.Method] = true
		require.Positive(t, r.Seconds, r.Method)
	}
	require.Equal(t, map[string]bool{"host-numa": true, "shared-memory": true, "registered-thp": true, "cuMemHostAlloc": true}, methods)
	cost := uint64(size / 512)
	want := map[string][]uint64{
		"naive":    {3 * cost, 3 * cost}, // every worker's registration costs every device
		"shared":   {2 * cost, cost},     // each worker grants its own device: two on device 0
		"cpu-only": {0, 0},
	}
	for _, m := range res.Modes {
		require.True(t, m.Verified, m.Mode)
		require.Len(t, m.WorkerOpenSeconds, 3)
		require.Len(t, m.PerDevice, 2)
		for i, pd := range m.PerDevice {
			require.Equal(t, i, pd.Device)
			require.Equal(t, want[m.Mode][i], pd.ExpectedBytes, "%s device %d", m.Mode, i)
			require.Equal(t, int64(want[m.Mode][i]), pd.OverheadBytes, "%s device %d: measured = expected", m.Mode, i)
		}
	}
	require.Equal(t, "shared-memory", res.Modes[0].RegionKind)
	require.Equal(t, "host-numa", res.Modes[1].RegionKind)
	require.InDelta(t, 2.0/3, res.SharedOverNaive, 1e-9)
	require.Zero(t, res.CPUOnlyOverhead)
	require.Empty(t, errOut, "no progress bar or notice without a terminal")
}

func TestPinnedCommandText(t *testing.T) {
	code, out, errOut := runPinnedCmd(t, "pinned", "--backend", "sim", "--size", "4MiB", "--procs", "2", "--devices", "1", "--modes", "shared,cpu-only", "--no-baseline")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "shared by 2 worker processes on devices [1 1]")
	require.Contains(t, out, "cpu-only overhead (worst device): 0.00 MiB")
	require.NotContains(t, out, "cuMemHostAlloc")

	code, _, errOut = runPinnedCmd(t, "pinned", "--backend", "sim", "--modes", "bogus")
	require.Equal(t, 2, code)
	require.Contains(t, errOut, "unknown mode")
	code, _, errOut = runPinnedCmd(t, "pinned", "--backend", "sim", "--devices", "7", "--size", "4MiB")
	require.Equal(t, 2, code)
	require.Contains(t, errOut, "there is no device 7")
}

func TestBandwidthCommand(t *testing.T) {
	code, out, errOut := runPinnedCmd(t, "bandwidth", "--backend", "sim", "--max-size", "1MiB", "--staging", "4MiB", "--staging-chunk", "1MiB", "--json")
	require.Equal(t, 0, code, errOut)
	var res measure.BandwidthResult
	require.NoError(t, json.Unmarshal([]byte(out), &res))
	require.True(t, res.Verified)
	kinds := []string{measure.HostPageable, measure.HostAlloc, measure.HostRegistered, measure.HostNUMA, measure.HostSharedMemory}
	require.Len(t, res.Setup, len(kinds))
	require.Len(t, res.Rows, len(kinds)*2*2, "kinds × directions × sizes (64 KiB, 1 MiB)")
	for _, r := range res.Rows {
		require.Positive(t, r.MedianGBs)
		require.GreaterOrEqual(t, r.BestGBs, r.MedianGBs)
		require.Positive(t, r.VsHostAlloc)
		if r.Kind == measure.HostAlloc {
			require.Equal(t, 1.0, r.VsHostAlloc)
		}
	}
	require.NotNil(t, res.Staging)
	require.Equal(t, uint64(4<<20), res.Staging.SizeBytes)
	require.Equal(t, uint64(1<<20), res.Staging.ChunkBytes)
	require.Positive(t, res.Staging.D2HGBs)
	require.Positive(t, res.Staging.D2HVsRaw)
	require.Positive(t, res.Staging.H2DVsRaw)

	code, out, errOut = runPinnedCmd(t, "bandwidth", "--backend", "sim", "--max-size", "64KiB", "--no-staging")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "host → device")
	require.Contains(t, out, "patterns verified: yes")
	require.False(t, strings.Contains(out, "async staging"))

	code, _, errOut = runPinnedCmd(t, "bandwidth", "--backend", "sim", "--max-size", "4KiB")
	require.Equal(t, 2, code)
	require.Contains(t, errOut, "below the smallest size")
}
