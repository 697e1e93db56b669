package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/measure"
)

func TestXferSimJSON(t *testing.T) {
	for _, extra := range [][]string{nil, {"--transport", "socket", "--register"}, {"--by-chunks"}} {
		code, out, stderr := runCmd(t, append([]string{"xfer", "--backend", "sim", "--size", "8MiB", "--iters", "2", "--warmup", "1", "--json"}, extra...)...)
		require.Equal(t, 0, code, stderr)
		var m map[string]any
		require.NoError(t, json.Unmarshal([]byte(out), &m))
		for _, k := range []string{"verified", "nccl_gbps", "native_gbps", "transport", "registered", "by_chunks", "init_seconds", "chunks", "nccl_version"} {
			require.Contains(t, m, k)
		}
		require.Equal(t, true, m["verified"])
		require.Greater(t, m["nccl_gbps"], 0.0)
		require.Greater(t, m["native_gbps"], 0.0)
		require.Equal(t, extra != nil, m["by_chunks"], "--register and --by-chunks move the buffers chunk by chunk")
		if len(extra) > 1 {
			require.Equal(t, "socket", m["transport"])
			require.Equal(t, true, m["registered"])
			env := m["nccl_env"].(map[string]any) // with whatever NCCL_* the host sets besides
			require.Equal(t, "1", env["NCCL_P2P_DISABLE"])
			require.Equal(t, "1", env["NCCL_SHM_DISABLE"])
			require.NotEmpty(t, env["NCCL_SOCKET_IFNAME"])
		}
	}
}

// TestXferPeer runs the peer step with a stand-in for the PyTorch script, which reports the transport
// environment it inherited.
func TestXferPeer(t *testing.T) {
	t.Setenv("NCCL_P2P_DISABLE", "")
	t.Setenv("NCCL_SHM_DISABLE", "")
	t.Setenv("NCCL_SOCKET_IFNAME", "")
	script := filepath.Join(t.TempDir(), "peer.sh")
	require.NoError(t, os.WriteFile(script, []byte(`echo "some log line"
echo '{"gbps": 0.5, "seconds": 1, "size_bytes": 8388608, "warmup": 1, "iters": 2, "verified": true, "init_seconds": 0.25, "torch_version": "stand-in", "nccl_version": "'"$NCCL_P2P_DISABLE$NCCL_SHM_DISABLE"'"}'
`), 0o644))
	code, out, stderr := runCmd(t, "xfer", "--backend", "sim", "--size", "8MiB", "--iters", "2", "--warmup", "1", "--json",
		"--transport", "socket", "--peer", "torch", "--python", "sh", "--peer-script", script)
	require.Equal(t, 0, code, stderr)
	var res measure.XferResult
	require.NoError(t, json.Unmarshal([]byte(out), &res))
	require.Equal(t, 0.5, res.PyTorchGBps)
	require.InDelta(t, res.NCCLGBps/0.5, res.NCCLVsPyTorch, 1e-9)
	require.Equal(t, "11", res.PyTorch.NCCLVersion, "the peer inherits NCCL_P2P_DISABLE=1 and NCCL_SHM_DISABLE=1")
	require.True(t, res.Verified)
}

// TestXferOneDevice: with --or-skip (what the tour passes) a backend of one device is a notice, not
// a failure.
func TestXferOneDevice(t *testing.T) {
	code, out, stderr := runCmd(t, "xfer", "--backend", "sim", "--sim-devices", "1", "--size", "4MiB", "--or-skip")
	require.Equal(t, 0, code, stderr)
	require.Contains(t, out, "skipped")
	code, _, stderr = runCmd(t, "xfer", "--backend", "sim", "--sim-devices", "1", "--size", "4MiB")
	require.Equal(t, 2, code, stderr)
}

func TestXferBadFlags(t *testing.T) {
	for _, args := range [][]string{
		{"--size", "3MiB"}, {"--size", "0"}, {"--transport", "ib"}, {"--peer", "mpi"}, {"--devices", "0,0"}, {"--devices", "0"},
	} {
		code, _, stderr := runCmd(t, append([]string{"xfer", "--backend", "sim"}, args...)...)
		require.Equal(t, 2, code, "%v: %s", args, stderr)
	}
}
