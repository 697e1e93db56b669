package measure

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/stretchr/testify/require"
)

// newSleepTestRun sets up a Sleep run of one 8 MiB buffer on device 0, with its per-device record,
// without measuring.
func newSleepTestRun(t *testing.T, b *Backend, mode string) *sleepRun {
	t.Helper()
	opts := SleepOptions{Env: Env{Backend: b}, Size: 8 << 20, Devices: []int{0}, Chunk: 4 << 20, SlotSize: 4 << 20, Mode: mode}
	policy, err := opts.check()
	require.NoError(t, err)
	r := &sleepRun{opts: &opts, policy: policy, res: &SleepResult{Verified: true, PtrUnchanged: true,
		PerDevice: []SleepDevice{{PtrUnchanged: true, Verified: true, GraphOK: true}}}}
	require.NoError(t, r.setup())
	return r
}

// TestSleepVerifyIsSticky: a failed check stays failed after a later one passes.
func TestSleepVerifyIsSticky(t *testing.T) {
	b, err := OpenSim(1)
	require.NoError(t, err)
	defer func() { require.NoError(t, b.Close()) }()
	r := newSleepTestRun(t, b, "keep")
	defer func() { require.NoError(t, r.close()) }()
	d, ptr := r.devs[0], r.ptrs[0]
	require.NoError(t, r.verify("first"))
	require.True(t, r.res.PerDevice[0].Verified)
	require.NoError(t, d.Memset(ptr+4<<20, 0, 8))
	require.NoError(t, r.verify("corrupted"))
	require.False(t, r.res.PerDevice[0].Verified)
	require.True(t, r.res.PerDevice[0].GraphOK, "the graph counts the same word")
	require.NoError(t, d.Fill(ptr, r.opts.Size, 0, sleepSeed))
	require.NoError(t, r.verify("repaired"))
	require.False(t, r.res.PerDevice[0].Verified, "sticky")
	require.False(t, r.res.Verified)
	require.Contains(t, r.res.Failure, "corrupted")
}

// TestSleepDiscardChecksEveryByte: a discarded buffer whose middle is not zero fails verification
// (the first and last MiB are zeros).
func TestSleepDiscardChecksEveryByte(t *testing.T) {
	b, err := OpenSim(1)
	require.NoError(t, err)
	defer func() { require.NoError(t, b.Close()) }()
	r := newSleepTestRun(t, b, "discard")
	defer func() { require.NoError(t, r.close()) }()
	d, ptr, size := r.devs[0], r.ptrs[0], r.opts.Size
	require.NoError(t, d.Memset(ptr, 0, size))
	require.NoError(t, d.CopyHtoD(ptr+driver.DevicePtr(size/2), []byte{1}))
	require.NoError(t, r.verify("middle left"))
	require.False(t, r.res.PerDevice[0].Verified)
	require.False(t, r.res.Verified)
	require.NoError(t, d.Memset(ptr, 0, size))
	ok, err := allZero(d, ptr, size)
	require.NoError(t, err)
	require.True(t, ok)
}

// TestSleepTimedSynchronizes: every device of the set is synchronized inside the timed window, and
// the graph's counter is reset on the graph's stream.
func TestSleepTimedSynchronizes(t *testing.T) {
	b, err := OpenSim(2)
	require.NoError(t, err)
	defer func() { require.NoError(t, b.Close()) }()
	r := newSleepTestRun(t, b, "keep")
	defer func() { require.NoError(t, r.close()) }()
	d1, err := b.Sys.Device(1)
	require.NoError(t, err)
	r.devs = append(r.devs, d1)
	before := b.sim.Calls("cuCtxSynchronize")
	_, err = r.timed("nothing", 1, func(context.Context, ...string) error { return nil })
	require.NoError(t, err)
	require.Equal(t, before+2, b.sim.Calls("cuCtxSynchronize"))
	r.devs = r.devs[:1]
	memset, async := b.sim.Calls("cuMemsetD8"), b.sim.Calls("cuMemsetD8Async")
	_, err = r.graphs[0].run()
	require.NoError(t, err)
	require.Equal(t, memset, b.sim.Calls("cuMemsetD8"))
	require.Equal(t, async+1, b.sim.Calls("cuMemsetD8Async"))
}

// TestInStepIsABarrier: no goroutine starts a step before every one finished the last, and a
// step's window runs to the last finish.
func TestInStepIsABarrier(t *testing.T) {
	const n = 3
	var mu sync.Mutex
	starts, ends := map[int][]time.Time{}, map[int][]time.Time{}
	step := func(k int) func(int) error {
		return func(i int) error {
			mu.Lock()
			starts[k] = append(starts[k], time.Now())
			mu.Unlock()
			time.Sleep(time.Duration(1+(i+k)%n) * 5 * time.Millisecond)
			mu.Lock()
			ends[k] = append(ends[k], time.Now())
			mu.Unlock()
			return nil
		}
	}
	win, err := inStep(n, step(0), step(1), step(2))
	require.NoError(t, err)
	for k := range 3 {
		require.Len(t, starts[k], n)
		require.GreaterOrEqual(t, win[k], 0.015)
		if k > 0 {
			for _, s := range starts[k] {
				for _, e := range ends[k-1] {
					require.False(t, s.Before(e), "step %d started before step %d ended", k, k-1)
				}
			}
		}
	}
	ran := false
	_, err = inStep(2, func(int) error { return errors.New("no") }, func(int) error { ran = true; return nil })
	require.Error(t, err)
	require.False(t, ran)
}

func TestRawHostSize(t *testing.T) {
	for _, c := range []struct{ size, piece, want uint64 }{
		{64 << 20, 64 << 20, 64 << 20},
		{3 << 30, 256 << 20, 2 << 30},
		{3 << 30, 3 << 29, 3 << 29},
		{8 << 30, 4 << 30, 4 << 30}, // --slot 4GiB: one piece, not 0
	} {
		require.Equal(t, c.want, rawHostSize(c.size, c.piece), "%+v", c)
	}
}

// TestSleepFileStaging: the raw file side uses the set's staging plan.
func TestSleepFileStaging(t *testing.T) {
	o := SleepOptions{Size: 1 << 30, Chunk: 512 << 20, SlotSize: 256 << 20, FilePart: 128 << 20, IOWorkers: 8, FileBuffers: 1}
	g, per := o.fileStaging()
	require.Equal(t, 4, g, "two 256 MiB slots hold four 128 MiB buffers")
	require.Equal(t, []int{1, 1, 1, 1}, per)
	o = SleepOptions{Size: 8 << 20, Chunk: 4 << 20, SlotSize: 4 << 20, FilePart: 4 << 20, IOWorkers: 3, FileBuffers: 2}
	g, per = o.fileStaging()
	require.Equal(t, 2, g, "two parts")
	require.Equal(t, []int{1, 1}, per)
	o = SleepOptions{Size: 64 << 20, Chunk: 64 << 20, SlotSize: 256 << 20, FilePart: 4 << 20, IOWorkers: 8, FileBuffers: 2}
	g, per = o.fileStaging()
	require.Equal(t, 8, g)
	require.Equal(t, []int{2, 2, 2, 2, 2, 2, 2, 2}, per)
}
