package measure

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
)

func TestSleepOnTheSimulator(t *testing.T) {
	b, err := OpenSim(2)
	require.NoError(t, err)
	defer func() { require.NoError(t, b.Close()) }()
	res, err := Sleep(SleepOptions{Env: Env{Backend: b}, Size: 8 << 20, Devices: []int{0, 1}, Chunk: 4 << 20, SlotSize: 4 << 20})
	require.NoError(t, err)
	require.NoError(t, res.Check())
	require.True(t, res.Verified)
	require.True(t, res.PtrUnchanged)
	require.Len(t, res.PerDevice, 2)
	require.Greater(t, res.FreedRatio, 0.99)
	require.Greater(t, res.RawD2HGBps, 0.0)
	require.Greater(t, res.BaselineSleepSeconds, 0.0)
	require.Greater(t, res.AggregateSleepX, 0.0)
	require.Equal(t, 0.25, res.AsleepPauseSeconds)
	require.Greater(t, res.WakeAtOnceSeconds, 0.0)
	require.InDelta(t, res.WakeAtOnceGBps/res.RawH2DGBps, res.WakeAtOnceVsRaw, 1e-9)
	requireWarmRounds(t, res, 5) // the default

	file := t.TempDir() + "/sleep.bin"
	res, err = Sleep(SleepOptions{Env: Env{Backend: b}, Size: 8 << 20, Chunk: 4 << 20, SlotSize: 4 << 20, Mode: "file", File: file, IOWorkers: 3})
	require.NoError(t, err)
	require.NoError(t, res.Check())
	require.Equal(t, 3, res.IOWorkers)
	require.Equal(t, 2, res.IOWorkersUsed, "the set runs two: the buffer has two parts")
	require.Equal(t, 1, res.FileBuffersUsed)
	require.Equal(t, min(res.RawFileReadGBps, res.RawH2DGBps), res.FileWakeLimitGBps)
	require.Equal(t, min(res.RawFileWriteGBps, res.RawD2HGBps), res.FileSleepLimitGBps)
	require.InDelta(t, res.WakeGBps/res.FileWakeLimitGBps, res.WakeVsFileLimit, 1e-9)
	require.InDelta(t, res.SleepGBps/res.FileSleepLimitGBps, res.SleepVsFileLimit, 1e-9)
	require.Greater(t, res.WakeVsFileLimit, 0.0)
	require.Zero(t, res.AsleepPauseSeconds, "file mode's wakes follow an fsync")
	require.Zero(t, res.WakeAtOnceSeconds)
	require.Equal(t, 3, res.Rounds, "the default")
	require.Empty(t, res.SleepVsRawRounds, "file mode's rounds are the file rounds")
	require.Len(t, res.WakeVsRawFileRounds, 3)
	for _, x := range append(res.WakeVsRawFileRounds, res.SleepVsRawFileRounds...) {
		require.Greater(t, x, 0.0)
	}
	wakes := slices.Clone(res.WakeVsRawFileRounds)
	slices.Sort(wakes)
	require.GreaterOrEqual(t, res.WakeVsRawFile, wakes[0]*0.999, "the ratio of the medians lies within the rounds' ratios")
	require.LessOrEqual(t, res.WakeVsRawFile, wakes[2]*1.001)
	require.Equal(t, wakes[1], res.WakeVsRawFileRoundsMedian, "the middle round")
	require.Positive(t, res.WakeFirstCopySeconds)
	require.Less(t, res.WakeFirstCopySeconds, res.WakeSeconds, "each first copy is queued within its wake, so the medians keep that order")
	require.Equal(t, median(res.SleepVsRawFileRounds), res.SleepVsRawFileRoundsMedian)

	for _, o := range []SleepOptions{
		{Size: 0},
		{Size: 3 << 20},
		{Size: 8 << 20, Mode: "later"},
		{Size: 8 << 20, File: "/tmp/x"},
		{Size: 8 << 20, Chunk: 1 << 20},
		{Size: 8 << 20, Devices: []int{7}},
		{Size: 64 << 20, SlotSize: 1},
		{Size: 8 << 20, SlotSize: 3 << 20},
		{Size: 8 << 20, FileRounds: 2},
		{Size: 8 << 20, Mode: "file", FileRounds: -1},
		{Size: 8 << 20, Mode: "file", FileRounds: 51},
		{Size: 8 << 20, Rounds: -1},
		{Size: 8 << 20, Rounds: 51},
		{Size: 8 << 20, Mode: "file", Rounds: 2, FileRounds: 3},
		{Size: 8 << 20, Mode: "file", Prepare: true},
		{Size: 8 << 20, Mode: "discard", Prepare: true},
		{Size: 8 << 20, FirstSleep: "later"},
	} {
		o.Env = Env{Backend: b}
		_, err := Sleep(o)
		require.ErrorIs(t, err, ErrInvalidOption, "%+v", o)
	}
	_, err = Sleep(SleepOptions{Size: 8 << 20})
	require.ErrorIs(t, err, ErrInvalidOption, "no backend")
}

// requireWarmRounds checks the warm figures of a keep or discard run of rounds rounds: each round's
// ratios, their medians, and the ratios of the medians within the rounds' spread.
func requireWarmRounds(t *testing.T, res *SleepResult, rounds int) {
	t.Helper()
	require.Equal(t, rounds, res.Rounds)
	require.Len(t, res.SleepVsRawRounds, rounds)
	require.Len(t, res.WakeVsRawRounds, rounds)
	for _, x := range append(slices.Clone(res.SleepVsRawRounds), res.WakeVsRawRounds...) {
		require.Positive(t, x)
	}
	require.Equal(t, median(res.SleepVsRawRounds), res.SleepVsRawRoundsMedian)
	require.Equal(t, median(res.WakeVsRawRounds), res.WakeVsRawRoundsMedian)
	require.Positive(t, res.SleepCopySeconds, "the warm sleeps' copy step")
	require.Less(t, res.SleepCopySeconds+res.SleepReleaseSeconds, res.SleepSeconds*1.5, "the steps of a sleep that took %v s", res.SleepSeconds)
	for _, c := range []struct {
		ratio  float64
		rounds []float64
	}{{res.SleepVsRaw, res.SleepVsRawRounds}, {res.WakeVsRaw, res.WakeVsRawRounds}} {
		// With an odd number of rounds, some round is at or below both medians' sides: the ratio
		// of the medians lies within the rounds' ratios.
		require.GreaterOrEqual(t, c.ratio, slices.Min(c.rounds)*0.999)
		require.LessOrEqual(t, c.ratio, slices.Max(c.rounds)*1.001)
	}
	for _, d := range res.PerDevice {
		require.Positive(t, d.RawD2HGBps)
		require.Positive(t, d.RawH2DGBps)
	}
}

// TestSleepRounds: keep and discard time Rounds warm rounds, each against raw copies that leave
// the set's buffers alone (every wake still verifies); --file-rounds is Rounds' older name in file
// mode.
func TestSleepRounds(t *testing.T) {
	b, err := OpenSim(2)
	require.NoError(t, err)
	defer func() { require.NoError(t, b.Close()) }()
	for _, mode := range []string{"keep", "discard"} {
		res, err := Sleep(SleepOptions{Env: Env{Backend: b}, Size: 8 << 20, Devices: []int{0, 1}, Chunk: 4 << 20, SlotSize: 4 << 20, Mode: mode, Rounds: 5})
		require.NoError(t, err, mode)
		require.NoError(t, res.Check(), mode)
		requireWarmRounds(t, res, 5)
		var text bytes.Buffer
		res.Text(&text)
		require.Contains(t, text.String(), "each of 5 rounds", mode)
	}
	res, err := Sleep(SleepOptions{Env: Env{Backend: b}, Size: 8 << 20, Chunk: 4 << 20, SlotSize: 4 << 20, Mode: "file", FileRounds: 2})
	require.NoError(t, err)
	require.Equal(t, 2, res.Rounds)
	require.Len(t, res.WakeVsRawFileRounds, 2)
	require.Positive(t, res.SleepCopySeconds, "the file rounds' sleeps: the copy step writes the file")
	var text bytes.Buffer
	res.Text(&text)
	require.Contains(t, text.String(), "a sleep's steps")
}

// In file mode a run wakes the set only where a figure needs it: the first wake, the one after
// TrimPool, and each round's (each wake creates the buffer's two chunks again).
func TestSleepFileWakes(t *testing.T) {
	b, err := OpenSim(1)
	require.NoError(t, err)
	defer func() { require.NoError(t, b.Close()) }()
	for _, rounds := range []int{1, 3} {
		before := b.sim.Calls("cuMemCreate")
		res, err := Sleep(SleepOptions{Env: Env{Backend: b}, Size: 8 << 20, Chunk: 4 << 20, SlotSize: 4 << 20, Mode: "file", Rounds: rounds})
		require.NoError(t, err)
		require.True(t, res.Verified)
		wakes := 2 + rounds
		require.Equal(t, 2+2*wakes, b.sim.Calls("cuMemCreate")-before, "the buffer's chunks, then %d wakes of them", wakes)
	}
}

// A raw copy that fails in a warm round, with the set asleep, fails the run by name and leaves the
// simulator holding what a good run leaves.
func TestSleepRoundFails(t *testing.T) {
	requireSleepFailsClean(t, false, "cuMemcpyHtoD", 2, "raw copies") // the second round's raw copy in
}

// requireSleepFailsClean runs Sleep on one simulated device (with Prepare as asked) once, then
// again with the nth call of fn failing out of memory: the second run fails with an error that
// wraps driver.ErrOutOfMemory and names phase, and leaves the simulator holding what the good run
// left.
func requireSleepFailsClean(t *testing.T, prepare bool, fn string, nth int, phase string) {
	t.Helper()
	b, err := OpenSim(1)
	require.NoError(t, err)
	defer func() { require.NoError(t, b.Close()) }()
	opts := SleepOptions{Env: Env{Backend: b}, Size: 8 << 20, Chunk: 4 << 20, SlotSize: 4 << 20, Prepare: prepare}
	_, err = Sleep(opts)
	require.NoError(t, err)
	good := b.sim.Live()
	b.sim.FailNth(fn, nth, driver.ErrorOutOfMemory)
	_, err = Sleep(opts)
	require.ErrorIs(t, err, driver.ErrOutOfMemory)
	require.ErrorContains(t, err, phase)
	require.Equal(t, good, b.sim.Live(), "after the failed run: %s", b.sim.Live())
}

// With Prepare the backup is pinned before the first sleep, and timed: on one device the first sleep
// compared with the usual backup is Prepare's time and the sleep's together; on two, the first
// device's cold sleep after TrimPool, as without it.
func TestSleepPrepare(t *testing.T) {
	b, err := OpenSim(2)
	require.NoError(t, err)
	defer func() { require.NoError(t, b.Close()) }()
	res, err := Sleep(SleepOptions{Env: Env{Backend: b}, Size: 8 << 20, Chunk: 4 << 20, SlotSize: 4 << 20, Prepare: true})
	require.NoError(t, err)
	require.NoError(t, res.Check())
	require.True(t, res.Verified)
	require.Positive(t, res.PrepareSeconds)
	require.Equal(t, res.PrepareSeconds+res.FirstSleepSeconds, res.FirstSleepOneSeconds)
	require.InDelta(t, res.BaselineSleepSeconds/res.FirstSleepOneSeconds, res.FirstSleepSpeedup, 1e-9)
	var text bytes.Buffer
	res.Text(&text)
	require.Contains(t, text.String(), fmt.Sprintf("after Set.Prepare pinned the backup in %.3f s", res.PrepareSeconds))

	res, err = Sleep(SleepOptions{Env: Env{Backend: b}, Size: 8 << 20, Devices: []int{0, 1}, Chunk: 4 << 20, SlotSize: 4 << 20, Prepare: true})
	require.NoError(t, err)
	require.True(t, res.Verified)
	require.Positive(t, res.PrepareSeconds)
	require.NotEqual(t, res.PrepareSeconds+res.FirstSleepSeconds, res.FirstSleepOneSeconds, "measured alone after TrimPool")
}

// A Prepare that cannot pin fails the run by name and leaves the simulator holding what a good run
// leaves (the device's context, kernels, stream and their scratch buffer, until the backend closes):
// no allocation, mapping or registration more.
func TestSleepPrepareFails(t *testing.T) {
	requireSleepFailsClean(t, true, "cuMemHostRegister", 1, "prepare")
}

// TestSleepFileInTempDir: --mode file without a File keeps its backup in Env.TempDir's directory
// and removes it.
func TestSleepFileInTempDir(t *testing.T) {
	b, err := OpenSim(1)
	require.NoError(t, err)
	defer func() { require.NoError(t, b.Close()) }()
	dir := t.TempDir()
	res, err := Sleep(SleepOptions{Env: Env{Backend: b, TempDir: func() (string, error) { return dir, nil }}, Size: 8 << 20,
		Chunk: 4 << 20, SlotSize: 4 << 20, Mode: "file"})
	require.NoError(t, err)
	require.NoError(t, res.Check())
	require.Equal(t, dir, filepath.Dir(res.File))
	left, _ := os.ReadDir(dir)
	require.Empty(t, left, "the backup file is removed")
}

// TestSleepFirstSleep: with two devices the first sleeps stage by default and pin when asked, and
// the result says which.
func TestSleepFirstSleep(t *testing.T) {
	b, err := OpenSim(2)
	require.NoError(t, err)
	defer func() { require.NoError(t, b.Close()) }()
	opts := SleepOptions{Env: Env{Backend: b}, Size: 8 << 20, Devices: []int{0, 1}, Chunk: 4 << 20, SlotSize: 4 << 20, Rounds: 1}
	res, err := Sleep(opts)
	require.NoError(t, err)
	require.NoError(t, res.Check())
	require.Equal(t, "auto", res.FirstSleep)
	require.Equal(t, uint64(16<<20), res.FirstSleepStagedBytes)
	require.Equal(t, uint64(8<<20), res.FirstSleepOneStagedBytes)

	opts.FirstSleep = "pin"
	res, err = Sleep(opts)
	require.NoError(t, err)
	require.NoError(t, res.Check())
	require.Equal(t, "pin", res.FirstSleep)
	require.Zero(t, res.FirstSleepStagedBytes)
	require.Zero(t, res.FirstSleepOneStagedBytes)
}

// A staged first sleep says so in the text, where a pinned one says it pinned on the way.
func TestSleepTextSaysHowTheFirstSleepWent(t *testing.T) {
	var text bytes.Buffer
	(&SleepResult{Mode: "keep", FirstSleepStagedBytes: 1}).Text(&text)
	require.Contains(t, text.String(), "staged through a pinned ring")
	text.Reset()
	(&SleepResult{Mode: "keep"}).Text(&text)
	require.Contains(t, text.String(), "pinning on the way")
}
