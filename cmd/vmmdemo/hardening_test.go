package main

import (
	"encoding/json"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/measure"
)

// TestBadOptionsRefused: options that used to be accepted silently are refused with an error that
// names the flag, exit status 2.
func TestBadOptionsRefused(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"broker", "--devices", "0,0"}, "device 0 is listed twice"},
		{[]string{"pinned", "--devices", "1,1"}, "device 1 is listed twice"},
		{[]string{"broker", "--max-request", "3MiB"}, "--max-request 3 MiB: want one of 1MiB, 16MiB, 256MiB"},
		{[]string{"broker", "--max-request", "0"}, "--max-request 0"},
		{[]string{"bandwidth", "--max-size", "0"}, "--max-size 0: want a size above 0"},
		{[]string{"share", "--size", "1KiB"}, "--size 1 KiB in 8 chunks: each chunk must be a whole multiple of the granularity 2 MiB (try --size 16MiB)"},
		{[]string{"share", "--size", "3MiB", "--chunks", "1"}, "(try --size 4MiB)"},
		{[]string{"info", "--sim-devices", "100000"}, "--sim-devices 100000: want 1 to 64"},
		// An empty --devices is refused by the flag all subcommands share (pinned and broker panicked).
		{[]string{"pinned", "--size", "8MiB", "--procs", "2", "--devices", ""}, `invalid value "" for flag -devices: no devices given`},
		{[]string{"broker", "--size", "8MiB", "--workers", "2", "--devices", ""}, `invalid value "" for flag -devices: no devices given`},
		{[]string{"sleep", "--size", "8MiB", "--devices", ""}, `invalid value "" for flag -devices: no devices given`},
		{[]string{"stripe", "--size", "8MiB", "--devices", ""}, `invalid value "" for flag -devices: no devices given`},
		// measure checks --fill-fraction (its TestPoolBadOptions has the other bad values); the
		// command passes it on and reports measure's error as a bad command line.
		{[]string{"pool", "--synthetic", "serving", "--fill-fraction", "1.5"}, "--fill-fraction 1.5: want 0 to 1"},
		{[]string{"pool", "--synthetic", "serving", "--cache-iters", "-1"}, "--cache-iters -1: want at least 1"},
		{[]string{"pool", "--synthetic", "serving", "--cache-iters", "0"}, "--cache-iters 0: want at least 1"},
		{[]string{"pool", "--synthetic", "serving", "--allocators", "cuvmm,cuvmm"}, `--allocators: "cuvmm" is listed twice`},
		{[]string{"sleep", "--size", "8MiB", "--slot", "1MiB"}, "--slot 1 MiB: want a multiple of 2 MiB"},
		{[]string{"sleep", "--size", "8MiB", "--slot", "1"}, "--slot 1 B: want a multiple of 2 MiB"},
		{[]string{"sleep", "--size", "8MiB", "--mode", "file", "--prepare"}, "--prepare is for --mode keep"},
		{[]string{"xfer", "--size", "1000TiB"}, "--size 1000 TiB: more than device 0's memory"},
		{[]string{"xfer", "--size", "8MiB", "--iters", "-5"}, "--iters -5: want at least 1"},
		{[]string{"xfer", "--size", "8MiB", "--iters", "0"}, "--iters 0: want at least 1"},
		{[]string{"xfer", "--size", "8MiB", "--warmup", "-1"}, "--warmup -1: want 0 or more"},
		{[]string{"pinned", "--size", "8MiB", "--procs", "3000"}, "--procs 3000: want at most 256"},
		{[]string{"broker", "--size", "8MiB", "--workers", "257"}, "--workers 257: want at most 256"},
		{[]string{"bandwidth", "--max-size", "1000TiB"}, "--max-size 1000 TiB: want at most 1 GiB"},
		{[]string{"grow", "--to", "1EiB"}, `size "1EiB": unknown unit "EiB" (want B, KiB, MiB, GiB, TiB`},
		{[]string{"grow", "--to", "18446744073709551608", "--step", "8MiB"}, "--to 16777216.00 TiB: more than device 0's memory"},
		{[]string{"pool", "--synthetic", "serving", "--memory", "256MiB", "--device", "4"}, "--device 4: the sim backend has 1 devices"},
		{[]string{"pool", "--synthetic", "serving", "--memory", "16MiB"}, "--memory 16 MiB: want at least 128 MiB"},
		{[]string{"pool", "--synthetic", "serving", "--memory", "64MiB"}, "--memory 64 MiB: want at least 128 MiB"},
		{[]string{"pool", "--synthetic", "serving", "--memory", "1"}, "--memory 1 B: want at least 128 MiB"},
		{[]string{"pool", "--synthetic", "serving", "--memory", "256MiB", "--fill-fraction", "0"}, "--memory 256 MiB: below the trace's largest request"},
		{[]string{"bandwidth", "--no-staging", "--staging-buffers", "4"}, "--no-staging skips the staging measurement that --staging, --staging-chunk, --staging-buffers and --staging-spin set up"},
		{[]string{"bandwidth", "--no-staging", "--staging", "0"}, "--no-staging skips the staging measurement"},
		{[]string{"bandwidth", "--no-staging", "--staging", "64MiB"}, "--no-staging skips the staging measurement"},
		{[]string{"bandwidth", "--staging", "0"}, "--staging 0: want a size above 0"},
	} {
		t0 := time.Now()
		code, out, stderr := runPinnedCmd(t, append(tc.args, "--backend", "sim")...)
		require.Equal(t, 2, code, "%v: %s", tc.args, stderr)
		require.Empty(t, out, tc.args)
		require.Contains(t, stderr, "vmmdemo "+tc.args[0]+": ", tc.args)
		require.Contains(t, stderr, tc.want, tc.args)
		require.Less(t, time.Since(t0), 10*time.Second, "%v is refused at once", tc.args)
	}
}

// TestSimDevicesBounded: the simulator's device count has a documented maximum, and info at that
// maximum (whose peer matrix is quadratic) finishes quickly.
func TestSimDevicesBounded(t *testing.T) {
	t0 := time.Now()
	code, _, stderr := runCmd(t, "info", "--backend", "sim", "--sim-devices", strconv.Itoa(measure.MaxSimDevices), "--json")
	require.Equal(t, 0, code, stderr)
	require.Less(t, time.Since(t0), 20*time.Second)
	_, err := measure.OpenSim(measure.MaxSimDevices + 1)
	require.ErrorIs(t, err, measure.ErrInvalidOption)
}

// TestFlagErrorsAreOneLine: a flag the subcommand does not know, or a bad value, prints one line
// with the subcommand's name and a hint, not the whole usage; -h still prints the flags.
func TestFlagErrorsAreOneLine(t *testing.T) {
	for _, args := range [][]string{{"grow", "--nosuch"}, {"broker", "--workers", "many"}, {"share", "--size", "lots"}} {
		code, _, stderr := runCmd(t, args...)
		require.Equal(t, 2, code, args)
		lines := strings.Split(strings.TrimSpace(stderr), "\n")
		require.Len(t, lines, 1, "%v: %s", args, stderr)
		require.True(t, strings.HasPrefix(lines[0], "vmmdemo "+args[0]+": "), lines[0])
		require.Contains(t, lines[0], "vmmdemo "+args[0]+" -h lists its flags")
		require.NotContains(t, lines[0], "invalid option", "the sentinel's text is not repeated")
	}
	code, _, stderr := runCmd(t, "grow", "-h")
	require.Equal(t, 0, code)
	require.Contains(t, stderr, "usage: vmmdemo grow [flags]")
	require.Contains(t, stderr, "-step")
}

// startVMMDemo runs this test binary as vmmdemo (see TestMain) with TMPDIR set to tmp.
func startVMMDemo(t *testing.T, tmp string, args ...string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(os.Args[0], args...)
	cmd.Env = append(os.Environ(), "TMPDIR="+tmp, "GORACE=atexit_sleep_ms=0")
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	})
	return cmd
}

// TestTempDirRemovedOnSignal: the broker's socket directory is removed when vmmdemo is ended by
// SIGINT or SIGTERM, and the signal still ends it.
func TestTempDirRemovedOnSignal(t *testing.T) {
	for _, sig := range []syscall.Signal{syscall.SIGINT, syscall.SIGTERM} {
		tmp := t.TempDir()
		cmd := startVMMDemo(t, tmp, "broker", "--backend", "sim", "--sim-devices", "1", "--size", "8MiB", "--workers", "1",
			"--max-request", "1MiB", "--bytes", "64GiB", "--rtt-samples", "1")
		pattern := filepath.Join(tmp, "vmmdemo-"+strconv.Itoa(cmd.Process.Pid)+"-*", "broker.sock")
		require.Eventually(t, func() bool {
			m, _ := filepath.Glob(pattern)
			return len(m) == 1
		}, time.Minute, 5*time.Millisecond, "the broker's socket appears")
		require.NoError(t, cmd.Process.Signal(sig))
		err := cmd.Wait()
		var ee *exec.ExitError
		require.ErrorAs(t, err, &ee, sig.String())
		require.Equal(t, sig, ee.Sys().(syscall.WaitStatus).Signal(), "the signal ends the process")
		left, _ := filepath.Glob(filepath.Join(tmp, "vmmdemo-*"))
		require.Empty(t, left, "%v left its directory behind", sig)
	}
}

// TestStaleTempDirRemoved: a directory that a SIGKILLed run left behind is removed by the next run;
// one of a live process is kept.
func TestStaleTempDirRemoved(t *testing.T) {
	tmp := t.TempDir()
	dead := exec.Command(os.Args[0], "-test.run=^$")
	require.NoError(t, dead.Run())
	stale := filepath.Join(tmp, "vmmdemo-"+strconv.Itoa(dead.Process.Pid)+"-123")
	live := filepath.Join(tmp, "vmmdemo-"+strconv.Itoa(os.Getpid())+"-456")
	other := filepath.Join(tmp, "vmmdemo-notapid")
	for _, d := range []string{stale, live, other} {
		require.NoError(t, os.MkdirAll(filepath.Join(d, "sub"), 0o700))
		require.NoError(t, os.WriteFile(filepath.Join(d, "broker.sock"), nil, 0o600))
	}
	cmd := startVMMDemo(t, tmp, "info", "--backend", "sim")
	require.NoError(t, cmd.Wait())
	_, err := os.Stat(stale)
	require.True(t, errors.Is(err, os.ErrNotExist), "the dead run's directory is removed: %v", err)
	require.DirExists(t, live)
	require.DirExists(t, other)
}

// TestFileErrorsNameTheFlag: a file that cannot be read or written is reported with its flag.
func TestFileErrorsNameTheFlag(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "nonexistent")
	code, _, stderr := runCmd(t, "pool", "--backend", "sim", "--trace", missing)
	require.Equal(t, 1, code, stderr)
	require.Contains(t, stderr, "vmmdemo pool: --trace: open "+missing+": no such file or directory")

	result := filepath.Join(t.TempDir(), "grow.json")
	code, out, stderr := runCmd(t, "grow", "--backend", "sim", "--to", "8MiB", "--step", "2MiB", "--json")
	require.Equal(t, 0, code, stderr)
	require.NoError(t, os.WriteFile(result, []byte(out), 0o644))
	code, _, stderr = runCmd(t, "plot", "--in", result, "--out", "/proc/x.svg")
	require.Equal(t, 1, code, stderr)
	require.Contains(t, stderr, "vmmdemo plot: --out /proc/x.svg: ")
	code, _, stderr = runCmd(t, "plot", "--in", missing, "--out", filepath.Join(t.TempDir(), "x.svg"))
	require.Equal(t, 1, code, stderr)
	require.Contains(t, stderr, "vmmdemo plot: --in: open "+missing)
}

// TestSleepFileInTempDir: sleep --mode file without --file keeps its backup in the run's temporary
// directory, so that nothing is left in $TMPDIR after a run or after SIGINT.
func TestSleepFileInTempDir(t *testing.T) {
	tmp := t.TempDir()
	cmd := startVMMDemo(t, tmp, "sleep", "--backend", "sim", "--size", "8MiB", "--mode", "file")
	require.NoError(t, cmd.Wait())
	left, _ := filepath.Glob(filepath.Join(tmp, "*"))
	require.Empty(t, left, "a run leaves nothing behind")

	cmd = startVMMDemo(t, tmp, "sleep", "--backend", "sim", "--size", "1GiB", "--mode", "file")
	inDir := filepath.Join(tmp, "vmmdemo-"+strconv.Itoa(cmd.Process.Pid)+"-*", "vmmdemo-sleep-*.bin")
	outside := filepath.Join(tmp, "vmmdemo-sleep-*.bin")
	require.Eventually(t, func() bool {
		a, _ := filepath.Glob(inDir)
		b, _ := filepath.Glob(outside)
		return len(a)+len(b) > 0
	}, time.Minute, 5*time.Millisecond, "the backup file appears")
	require.NoError(t, cmd.Process.Signal(syscall.SIGINT))
	_ = cmd.Wait()
	left, _ = filepath.Glob(filepath.Join(tmp, "*"))
	require.Empty(t, left, "SIGINT leaves nothing behind")
}

// TestJSONOutputIsOnlyJSON: with --json, stdout holds only JSON documents: the tour's headers go to
// stderr, and xfer --or-skip reports its skip as a JSON object.
func TestJSONOutputIsOnlyJSON(t *testing.T) {
	code, out, stderr := runCmd(t, "xfer", "--backend", "sim", "--sim-devices", "1", "--size", "4MiB", "--or-skip", "--json")
	require.Equal(t, 0, code, stderr)
	var skip map[string]any
	require.NoError(t, json.Unmarshal([]byte(out), &skip), out)
	require.Equal(t, true, skip["skipped"])
	require.Contains(t, skip["reason"], "needs two devices")

	code, out, stderr = runPinnedCmd(t, "tour", "--backend", "sim", "--json")
	require.Equal(t, 0, code, stderr)
	dec := json.NewDecoder(strings.NewReader(out))
	docs := 0
	for {
		var v map[string]any
		err := dec.Decode(&v)
		if errors.Is(err, io.EOF) {
			break
		}
		require.NoError(t, err, "stdout:\n%s", out)
		docs++
	}
	require.GreaterOrEqual(t, docs, 8)
	require.Contains(t, stderr, "== vmmdemo info")
	require.True(t, strings.HasSuffix(strings.TrimSpace(stderr), "tour complete"), stderr)
}

// TestXferWarmupZero: --warmup 0 means no untimed transfers, not the default.
func TestXferWarmupZero(t *testing.T) {
	code, out, stderr := runCmd(t, "xfer", "--backend", "sim", "--size", "8MiB", "--iters", "1", "--warmup", "0", "--json")
	require.Equal(t, 0, code, stderr)
	var res measure.XferResult
	require.NoError(t, json.Unmarshal([]byte(out), &res))
	require.Equal(t, 0, res.Warmup)
	require.True(t, res.Verified)
}
