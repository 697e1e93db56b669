package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// refused runs args on the simulator and checks that they are refused as a bad command line: exit
// status 2, nothing on stdout, and one line on stderr naming the subcommand and containing want.
func refused(t *testing.T, want string, args ...string) {
	t.Helper()
	code, out, stderr := runPinnedCmd(t, append(args, "--backend", "sim")...)
	require.Equal(t, 2, code, "%v: %s", args, stderr)
	require.Empty(t, out, args)
	lines := strings.Split(strings.TrimSuffix(stderr, "\n"), "\n")
	require.Len(t, lines, 1, "%v: one line: %s", args, stderr)
	require.True(t, strings.HasPrefix(lines[0], "vmmdemo "+args[0]+": "), "%v: %s", args, stderr)
	require.Contains(t, lines[0], want, args)
}

// TestShareSizeZeroSaysWhy: share --size 0 is refused with what the flag wants, not its value alone.
func TestShareSizeZeroSaysWhy(t *testing.T) {
	refused(t, "--size 0: want a size above 0", "share", "--size", "0")
}

// TestPinnedModeListedTwice: a mode given twice in --modes is refused (it ran twice, printing the
// same mode's figures twice), as pool refuses an allocator listed twice.
func TestPinnedModeListedTwice(t *testing.T) {
	refused(t, `--modes: "naive" is listed twice`, "pinned", "--size", "8MiB", "--procs", "1", "--modes", "naive,shared,naive")
}

// TestZeroSizesRefused: a size flag given as 0 is refused, as bandwidth's and broker's are, rather
// than run silently with the flag's default (pool --memory 0 ran against the device's whole free
// memory while --memory 1 was refused).
func TestZeroSizesRefused(t *testing.T) {
	for _, args := range [][]string{
		{"pool", "--synthetic", "serving", "--memory", "0"},
		{"grow", "--to", "8MiB", "--step", "2MiB", "--chunk", "0"},
		{"sleep", "--size", "8MiB", "--chunk", "0"},
		{"sleep", "--size", "8MiB", "--slot", "0"},
		{"sleep", "--size", "8MiB", "--mode", "file", "--file-part", "0"},
		{"xfer", "--size", "8MiB", "--block", "0"},
	} {
		name := args[len(args)-2]
		refused(t, name+" 0: want a size above 0 (leave the flag out for its default)", args...)
	}
}

// TestPoolVerifyEveryBelowOne: --verify-every 0 or below is refused; it ran with the default 16.
func TestPoolVerifyEveryBelowOne(t *testing.T) {
	for _, n := range []string{"0", "-1"} {
		refused(t, "--verify-every "+n+": want at least 1", "pool", "--synthetic", "serving", "--memory", "256MiB", "--verify-every", n)
	}
}

// TestTempDirErrorNamed: when the run's temporary directory cannot be made (TMPDIR missing), the
// error says so and names TMPDIR; sleep does not blame --file, which was not given.
func TestTempDirErrorNamed(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "missing")
	t.Setenv("TMPDIR", missing)
	for _, args := range [][]string{
		{"sleep", "--size", "8MiB", "--mode", "file"},
		{"broker", "--size", "8MiB", "--workers", "1", "--max-request", "1MiB", "--rtt-samples", "1"},
	} {
		code, out, stderr := runPinnedCmd(t, append(args, "--backend", "sim", "--sim-devices", "1")...)
		require.Equal(t, 1, code, "%v: %s", args, stderr)
		require.Empty(t, out, args)
		require.Equal(t, 1, strings.Count(stderr, "\n"), "%v: one line: %s", args, stderr)
		require.Contains(t, stderr, "vmmdemo "+args[0]+": temporary directory in "+missing+" (TMPDIR): ", args)
	}
}

// TestBadCountNamesTheFlag: a count or size out of range is refused naming that flag and its value,
// not with a sentence listing every flag that has a bound (broker --depth 0 named five flags).
func TestBadCountNamesTheFlag(t *testing.T) {
	for _, tc := range []struct {
		want string
		args []string
	}{
		{"--size 0: want a size above 0", []string{"broker", "--size", "0"}},
		{"--workers 0: want at least 1", []string{"broker", "--size", "8MiB", "--workers", "0"}},
		{"--depth 0: want at least 1", []string{"broker", "--size", "8MiB", "--depth", "0"}},
		{"--streams -1: want at least 1", []string{"broker", "--size", "8MiB", "--streams", "-1"}},
		{"--rtt-samples 0: want at least 1", []string{"broker", "--size", "8MiB", "--rtt-samples", "0"}},
		{"--size 0: want a size above 0", []string{"pinned", "--size", "0"}},
		{"--procs 0: want at least 1", []string{"pinned", "--size", "8MiB", "--procs", "0"}},
		{"--builds 0: want at least 1", []string{"stripe", "--size", "8MiB", "--builds", "0"}},
		{"--reads -3: want at least 1", []string{"stripe", "--size", "8MiB", "--reads", "-3"}},
		{"--iters -1: want at least 0", []string{"bandwidth", "--iters", "-1"}},
		{"--staging-buffers 1: want at least 2", []string{"bandwidth", "--staging-buffers", "1"}},
		{"--to 0: want a size above 0", []string{"grow", "--to", "0"}},
		{"--step 0: want a size above 0", []string{"grow", "--step", "0"}},
	} {
		refused(t, tc.want, tc.args...)
	}
}

// TestSleepFilePartsNamedApart: a bad --file-buffers or --file-part is refused naming that flag
// alone (a bad --file-buffers reported "--file-part 0 B" too, a flag not given).
func TestSleepFilePartsNamedApart(t *testing.T) {
	base := []string{"sleep", "--size", "8MiB", "--mode", "file"}
	for _, tc := range []struct {
		args      []string
		want, not string
	}{
		{[]string{"--file-buffers", "-1"}, "--file-buffers -1: want 1 to 64", "--file-part"},
		{[]string{"--file-buffers", "65"}, "--file-buffers 65: want 1 to 64", "--file-part"},
		{[]string{"--file-part", "1KiB"}, "--file-part 1 KiB: want a multiple of 4 KiB up to the slot and the buffer (8 MiB)", "--file-buffers"},
		{[]string{"--file-part", "16MiB"}, "--file-part 16 MiB: want a multiple of 4 KiB up to the slot and the buffer (8 MiB)", "--file-buffers"},
	} {
		args := append(append([]string{}, base...), tc.args...)
		refused(t, tc.want, args...)
		_, _, stderr := runPinnedCmd(t, append(args, "--backend", "sim")...)
		require.NotContains(t, stderr, tc.not, args)
	}
}

// TestPeerScriptMissingRefusedFirst: pool --peer torch and xfer --peer torch refuse a peer script
// that is not there before measuring anything (pool ran every allocator, then reported Python's
// "can't open file"; the working directory here, the package's, has no scripts/).
func TestPeerScriptMissingRefusedFirst(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "peer.py")
	refused(t, "the PyTorch peer script scripts/peers/torch_pool.py was not found",
		"pool", "--synthetic", "serving", "--memory", "256MiB", "--cache-iters", "10", "--peer", "torch")
	refused(t, "--peer-script "+missing+": ", "pool", "--synthetic", "serving", "--memory", "256MiB", "--cache-iters", "10",
		"--peer", "torch", "--peer-script", missing)
	refused(t, "--peer-script "+missing+": ", "xfer", "--size", "8MiB", "--peer", "torch", "--peer-script", missing)
}

// TestPeerPythonMissingRefusedFirst: a --python that cannot be run is refused before measuring
// (xfer and pool ran everything, then failed to start it).
func TestPeerPythonMissingRefusedFirst(t *testing.T) {
	script := filepath.Join(t.TempDir(), "peer.py")
	require.NoError(t, os.WriteFile(script, nil, 0o644))
	missing := filepath.Join(t.TempDir(), "python3")
	refused(t, "--python "+missing+": ", "xfer", "--size", "8MiB", "--peer", "torch", "--peer-script", script, "--python", missing)
	refused(t, "--python "+missing+": ", "pool", "--synthetic", "serving", "--memory", "256MiB", "--cache-iters", "10",
		"--peer", "torch", "--peer-script", script, "--python", missing)
}

// TestNoSubcommandUsageOnStderr: vmmdemo without a subcommand fails (status 2) with the usage on
// stderr, as for an unknown one, leaving stdout empty; help asked for goes to stdout, status 0.
func TestNoSubcommandUsageOnStderr(t *testing.T) {
	code, out, stderr := runCmd(t)
	require.Equal(t, 2, code)
	require.Empty(t, out)
	require.Contains(t, stderr, "usage: vmmdemo <subcommand> [flags]")
	for _, h := range []string{"help", "-h", "--help"} {
		code, out, stderr = runCmd(t, h)
		require.Equal(t, 0, code, h)
		require.Contains(t, out, "usage: vmmdemo <subcommand> [flags]", h)
		require.Empty(t, stderr, h)
	}
}
