package measure_test

import (
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/internal/testutil"
)

// fileWakePeer is the bare file-wake pipeline that offload's File mode is compared with.
const fileWakePeer = "../scripts/peers/file_wake.c"

// buildFileWakePeer compiles the peer with the host's C compiler, warnings as errors.
func buildFileWakePeer(t *testing.T) string {
	t.Helper()
	cc := cmp.Or(os.Getenv("CC"), "gcc") // as the driver's and nccl's C-built tests
	if _, err := exec.LookPath(cc); err != nil {
		if testutil.RequireGPU() {
			t.Fatalf("CUVMM_REQUIRE_GPU=1 but no C compiler to build %s: %v", fileWakePeer, err)
		}
		t.Skipf("no C compiler to build %s: %v", fileWakePeer, err)
	}
	bin := filepath.Join(t.TempDir(), "file_wake")
	out, err := exec.Command(cc, "-O2", "-Wall", "-Wextra", "-Werror", "-o", bin, fileWakePeer, "-ldl", "-lpthread").CombinedOutput()
	require.NoError(t, err, "%s", out)
	return bin
}

// runPeer runs the peer and returns its exit code, stdout and stderr.
func runPeer(t *testing.T, bin string, args ...string) (int, string, string) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		return exit.ExitCode(), stdout.String(), stderr.String()
	}
	require.NoError(t, err)
	return 0, stdout.String(), stderr.String()
}

// The peer builds, refuses bad arguments by name, and where the driver loads, wakes 64 MiB on one
// GPU from its file and finds the device's bytes equal to the file's.
func TestFileWakePeer(t *testing.T) {
	bin := buildFileWakePeer(t)
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--gpus", "0"}, "want 1-8 GPUs"},
		{[]string{"--part", "1000"}, "multiple of 4 KiB"},
		{[]string{"--size", "1XiB"}, "not 1XiB"},
		{[]string{"--bogus", "1"}, "unknown flag --bogus"},
		{[]string{"--gpus"}, "every flag takes a value: --gpus"},
	} {
		code, _, stderr := runPeer(t, bin, c.args...)
		require.Equal(t, 2, code, "%v: %s", c.args, stderr)
		require.Contains(t, stderr, c.want, "%v", c.args)
	}
	code, stdout, stderr := runPeer(t, bin, "--gpus", "1", "--size", "64MiB", "--rounds", "2", "--dir", t.TempDir())
	if code != 0 && strings.Contains(stderr, "libcuda.so.1") && !testutil.RequireGPU() {
		t.Skipf("the peer needs the CUDA driver (set CUVMM_REQUIRE_GPU=1 to fail instead): %s", stderr)
	}
	require.Equal(t, 0, code, "%s", stderr)
	var res struct {
		Verified       bool      `json:"verified"`
		ReadGBps       []float64 `json:"read_gbps"`
		MedianReadGBps float64   `json:"median_read_gbps"`
		MedianWakeGBps float64   `json:"median_wake_gbps"`
		MedianH2DGBps  float64   `json:"median_h2d_gbps"`
	}
	require.NoError(t, json.Unmarshal([]byte(stdout), &res), stdout)
	require.True(t, res.Verified, stdout)
	require.Len(t, res.ReadGBps, 2, stdout)
	require.Positive(t, res.MedianReadGBps, stdout)
	require.Positive(t, res.MedianWakeGBps, stdout)
	require.Positive(t, res.MedianH2DGBps, stdout)
}
