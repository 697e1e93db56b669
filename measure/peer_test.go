package measure_test

import (
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
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
	bin := filepath.Join(t.TempDir(), "file_wake")
	compileC(t, "-O2", "-Wall", "-Wextra", "-Werror", "-o", bin, fileWakePeer, "-ldl", "-lpthread")
	return bin
}

// buildFakeCUDA compiles testdata/fakecuda.c as a libcuda.so.1 and returns its directory.
func buildFakeCUDA(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	compileC(t, "-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-o", filepath.Join(dir, "libcuda.so.1"), "testdata/fakecuda.c")
	return dir
}

// compileC runs the host's C compiler ($CC, else gcc, as the driver's and nccl's C-built tests);
// without one the test skips, or fails under CUVMM_REQUIRE_GPU=1.
func compileC(t *testing.T, args ...string) {
	t.Helper()
	cc := cmp.Or(os.Getenv("CC"), "gcc")
	if _, err := exec.LookPath(cc); err != nil {
		if testutil.RequireGPU() {
			t.Fatalf("CUVMM_REQUIRE_GPU=1 but no C compiler for %v: %v", args, err)
		}
		t.Skipf("no C compiler for %v: %v", args, err)
	}
	out, err := exec.Command(cc, args...).CombinedOutput()
	require.NoError(t, err, "%s", out)
}

// peerResult is the part of the peer's JSON line that the tests check.
type peerResult struct {
	GPUs           int       `json:"gpus"`
	SizeBytes      uint64    `json:"size_bytes"`
	Verified       bool      `json:"verified"`
	ReadGBps       []float64 `json:"read_gbps"`
	WakeGBps       []float64 `json:"wake_gbps"`
	WakeVsRead     []float64 `json:"wake_vs_read"`
	MedianReadGBps float64   `json:"median_read_gbps"`
	MedianWakeGBps float64   `json:"median_wake_gbps"`
	MedianH2DGBps  float64   `json:"median_h2d_gbps"`
}

// runPeer runs the peer and returns its exit code, stdout and stderr.
func runPeer(t *testing.T, bin string, args ...string) (int, string, string) {
	t.Helper()
	return runPeerEnv(t, bin, nil, args...)
}

// badArgs is a command line a C program must refuse, and what its error must say.
type badArgs struct {
	args []string
	want string
}

// requireRefuses runs bin with each command line of cases: each must exit with 2 and say its want.
func requireRefuses(t *testing.T, bin string, cases []badArgs) {
	t.Helper()
	for _, c := range cases {
		code, _, stderr := runPeer(t, bin, c.args...)
		require.Equal(t, 2, code, "%v: %s", c.args, stderr)
		require.Contains(t, stderr, c.want, "%v", c.args)
	}
}

// runPeerEnv is runPeer with env added to the test's environment.
func runPeerEnv(t *testing.T, bin string, env []string, args ...string) (int, string, string) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr, cmd.Env = &stdout, &stderr, append(os.Environ(), env...)
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
	requireRefuses(t, bin, []badArgs{
		{[]string{"--gpus", "0"}, "want 1-8 GPUs"},
		{[]string{"--part", "1000"}, "multiple of 4 KiB"},
		{[]string{"--sub", "1000"}, "want a --sub that is a multiple of 4 KiB, at most the part"},
		{[]string{"--part", "4MiB", "--sub", "8MiB"}, "want a --sub that is a multiple of 4 KiB, at most the part"},
		{[]string{"--size", "1XiB"}, "not 1XiB"},
		{[]string{"--bogus", "1"}, "unknown flag --bogus"},
		{[]string{"--gpus"}, "every flag takes a value: --gpus"},
	})
	code, stdout, stderr := runPeer(t, bin, "--gpus", "1", "--size", "64MiB", "--rounds", "2", "--dir", t.TempDir())
	if code != 0 && strings.Contains(stderr, "libcuda.so.1") && !testutil.RequireGPU() {
		t.Skipf("the peer needs the CUDA driver (set CUVMM_REQUIRE_GPU=1 to fail instead): %s", stderr)
	}
	require.Equal(t, 0, code, "%s", stderr)
	var res peerResult
	require.NoError(t, json.Unmarshal([]byte(stdout), &res), stdout)
	require.True(t, res.Verified, stdout)
	require.Len(t, res.ReadGBps, 2, stdout)
	require.Positive(t, res.MedianReadGBps, stdout)
	require.Positive(t, res.MedianWakeGBps, stdout)
	require.Positive(t, res.MedianH2DGBps, stdout)
}

// The peer's whole pipeline over a driver made of host memory (testdata/fakecuda.c), so that it
// runs without a GPU: two GPUs, a size that ends inside a part, more threads than one part each.
// Its check finds every byte equal, and names the part where one byte was flipped.
func TestFileWakePeerPipeline(t *testing.T) {
	bin, lib := buildFileWakePeer(t), buildFakeCUDA(t)
	args := []string{"--gpus", "2", "--size", "9MiB", "--part", "1MiB", "--threads", "3", "--buffers", "2", "--rounds", "3", "--dir", t.TempDir()}
	env := []string{"LD_LIBRARY_PATH=" + lib}
	code, stdout, stderr := runPeerEnv(t, bin, env, args...)
	require.Equal(t, 0, code, "%s", stderr)
	var res peerResult
	require.NoError(t, json.Unmarshal([]byte(stdout), &res), stdout)
	require.True(t, res.Verified, stdout)
	require.Equal(t, 2, res.GPUs)
	require.Equal(t, uint64(9<<20), res.SizeBytes)
	require.Len(t, res.WakeGBps, 3, stdout)
	require.Len(t, res.WakeVsRead, 3, stdout)
	for _, at := range []int{0, 5<<20 + 7, 9<<20 - 1} {
		code, stdout, stderr = runPeerEnv(t, bin, append(env, fmt.Sprintf("FAKECUDA_FLIP_AT=%d", at)), args...)
		require.Equal(t, 0, code, "%s", stderr)
		require.Contains(t, stdout, `"verified": false`, "byte %d flipped", at)
		require.Contains(t, stderr, fmt.Sprintf("GPU 0 differs from its file in the part at byte %d", at/(1<<20)*(1<<20)))
	}
}

// firstPinProbe times how fast the host hands out and pins memory a process has never used.
const firstPinProbe = "../scripts/host/first_pin.c"

// firstPinResult is the probe's JSON line.
type firstPinResult struct {
	SizeBytes uint64    `json:"size_bytes"`
	Threads   int       `json:"threads"`
	GPUs      int       `json:"gpus"`
	Mode      string    `json:"mode"`
	Touch     []float64 `json:"touch_seconds"`
	Register  []float64 `json:"register_seconds"`
	// The stage mode's.
	Copy          []float64 `json:"copy_seconds"`
	Stage         []float64 `json:"stage_seconds"`
	RegisterAfter []float64 `json:"register_after_seconds"`
	Wake          []float64 `json:"wake_seconds"`
}

// The probe builds, refuses bad arguments by name, times each pass's touching without a driver,
// and with the fake driver registers each pass's range (a register or unregister that failed would
// end it with 1).
func TestFirstPinProbe(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "first_pin")
	compileC(t, "-O2", "-Wall", "-Wextra", "-Werror", "-o", bin, firstPinProbe, "-ldl", "-lpthread")
	requireRefuses(t, bin, []badArgs{
		{[]string{"--gpus", "x"}, "--gpus wants 0-64, not x"},
		{[]string{"--threads", "0"}, "--threads wants 1-256, not 0"},
		{[]string{"--passes", "101"}, "--passes wants 1-100, not 101"},
		{[]string{"--size", "1XiB"}, "--size wants a positive size such as 16GiB, not 1XiB"},
		{[]string{"--bogus", "1"}, "unknown flag --bogus"},
		{[]string{"--gpus"}, "every flag takes a value: --gpus"},
		{[]string{"--mode", "fast"}, "--mode wants pin or stage, not fast"},
		{[]string{"--mode", "stage"}, "--mode stage copies from GPU 0: it needs --gpus 1 or more"},
		{[]string{"--mode", "stage", "--gpus", "1", "--piece", "3MiB"}, "--mode stage wants --piece a multiple of 2MiB that divides --size"},
		{[]string{"--ring", "1"}, "--ring wants 2-64, not 1"},
		{[]string{"--piece", "0"}, "--piece wants a positive size such as 32MiB, not 0"},
	})
	run := func(env []string, gpus string) firstPinResult {
		code, stdout, stderr := runPeerEnv(t, bin, env, "--size", "8MiB", "--threads", "3", "--passes", "2", "--gpus", gpus)
		require.Equal(t, 0, code, "%s", stderr)
		var res firstPinResult
		require.NoError(t, json.Unmarshal([]byte(stdout), &res), stdout)
		require.Equal(t, uint64(8<<20), res.SizeBytes)
		require.Len(t, res.Touch, 2, stdout)
		require.Len(t, res.Register, 2, stdout)
		require.Positive(t, res.Touch[0], stdout)
		return res
	}
	require.Equal(t, []float64{0, 0}, run(nil, "0").Register, "no registering without --gpus")
	fake := buildFakeCUDA(t)
	res := run([]string{"LD_LIBRARY_PATH=" + fake}, "2")
	require.Equal(t, 2, res.GPUs)
	require.Equal(t, "pin", res.Mode)
	requireStagesThroughARing(t, bin, fake)
}

// The stage mode times, each pass, the pinned backup's steps and the staged one's, over the fake
// driver, and fails when the staged backup differs from the device's memory.
func requireStagesThroughARing(t *testing.T, bin, fake string) {
	t.Helper()
	args := []string{"--size", "16MiB", "--threads", "3", "--passes", "3", "--gpus", "2", "--mode", "stage", "--piece", "4MiB", "--ring", "2"}
	code, stdout, stderr := runPeerEnv(t, bin, []string{"LD_LIBRARY_PATH=" + fake}, args...)
	require.Equal(t, 0, code, "%s", stderr)
	var res firstPinResult
	require.NoError(t, json.Unmarshal([]byte(stdout), &res), stdout)
	require.Equal(t, "stage", res.Mode)
	for _, l := range [][]float64{res.Touch, res.Register, res.Copy, res.Stage, res.RegisterAfter, res.Wake} {
		require.Len(t, l, 3, stdout)
	}
	require.Positive(t, res.Stage[2], stdout)
	code, _, stderr = runPeerEnv(t, bin, []string{"LD_LIBRARY_PATH=" + fake, "FAKECUDA_FLIP_AT=12288"}, args...)
	require.Equal(t, 1, code)
	require.Contains(t, stderr, "the staged backup differs from the device's memory")
}
