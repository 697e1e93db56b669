package main

import (
	"bytes"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/measure"
)

// runCmd runs vmmdemo with args in-process and returns its exit code, stdout and stderr.
func runCmd(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var out, errOut bytes.Buffer
	code := run(&env{stdout: &out, stderr: &errOut}, args)
	return code, out.String(), errOut.String()
}

func TestInfoSimJSON(t *testing.T) {
	code, out, stderr := runCmd(t, "info", "--backend", "sim", "--sim-devices", "2", "--json")
	require.Equal(t, 0, code, stderr)
	var res measure.InfoResult
	require.NoError(t, json.Unmarshal([]byte(out), &res))
	require.Equal(t, "sim", res.Backend)
	require.Len(t, res.Devices, 2)
	for _, d := range res.Devices {
		require.Equal(t, uint64(2<<20), d.GranularityBytes)
		require.True(t, d.VMM)
		require.True(t, d.PosixFD)
		require.True(t, d.GPUDirectRDMA)
		require.True(t, d.DMABuf)
	}
	require.Equal(t, [][]bool{{true, true}, {true, true}}, res.PeerAccess)
}

func TestInfoText(t *testing.T) {
	code, out, stderr := runCmd(t, "info", "--backend", "sim", "--sim-devices", "2")
	require.Equal(t, 0, code, stderr)
	require.Contains(t, out, "granularity: device 2 MiB")
	require.Contains(t, out, "peer access")
}

func TestBadArguments(t *testing.T) {
	code, _, stderr := runCmd(t, "info", "--backend", "gpu")
	require.Equal(t, 2, code)
	require.Contains(t, stderr, `--backend "gpu"`)
	code, _, stderr = runCmd(t, "nosuch")
	require.Equal(t, 2, code)
	require.Contains(t, stderr, "unknown subcommand")
	code, _, _ = runCmd(t, "info", "--sim-devices", "0", "--backend", "sim")
	require.Equal(t, 2, code)
	code, _, _ = runCmd(t, "info", "extra")
	require.Equal(t, 2, code)
}
