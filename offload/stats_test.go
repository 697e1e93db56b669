package offload_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/offload"
)

// Stats follows the buffers and counts the sleeps and wakes that did something, failed ones apart.
func TestStatsFollowSleepAndWake(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		weights := newBuf(t, d, 8*mib, 2*mib, 3, nil)
		kv := newBuf(t, d, 4*mib, 2*mib, 0, nil)
		set := newSet(t, b, offload.Options{SlotSize: 4 * mib})
		require.NoError(t, set.Add("weights", weights, offload.Keep, offload.EntryOptions{}))
		require.NoError(t, set.Add("kv", kv, offload.Discard, offload.EntryOptions{}))
		st := set.Stats()
		require.Equal(t, []offload.BufferStats{{Tag: "weights", Policy: offload.Keep, Bytes: 8 * mib}, {Tag: "kv", Policy: offload.Discard, Bytes: 4 * mib}}, st.Buffers)

		require.NoError(t, set.Sleep(bg, "weights"))
		require.NoError(t, set.Sleep(bg, "weights"), "already asleep: not counted")
		st = set.Stats()
		require.Equal(t, uint64(1), st.Sleeps)
		require.Equal(t, uint64(8*mib), st.SleptBytes)
		require.Equal(t, uint64(8*mib), st.AsleepBytes)
		require.True(t, st.Buffers[0].Asleep)
		require.False(t, st.Buffers[1].Asleep)
		require.GreaterOrEqual(t, st.BackupBytes, uint64(8*mib), "the backup")
		require.Positive(t, st.LastSleep)
		require.Equal(t, st.LastSleep, st.SleepTime)
		steps := st.LastSleepSteps
		require.Positive(t, steps.Copy, "the copy out, Keep chunks released on the way")
		require.LessOrEqual(t, steps.Wait+steps.Copy+steps.Release, st.LastSleep, "steps %+v", steps)

		require.NoError(t, set.Sleep(bg))
		require.Positive(t, set.Stats().LastSleepSteps.Release, "the discarded buffer's release, after the copies")
		require.NoError(t, set.Wake(bg))
		st = set.Stats()
		require.Equal(t, uint64(2), st.Sleeps)
		require.Equal(t, uint64(12*mib), st.SleptBytes)
		require.Equal(t, uint64(1), st.Wakes)
		require.Equal(t, uint64(12*mib), st.WokenBytes)
		require.Zero(t, st.AsleepBytes)
		require.Equal(t, st.PooledBytes, st.BackupBytes, "no backup left: only the pooled slots")
		require.NoError(t, set.TrimPool())
		require.Zero(t, set.Stats().BackupBytes)
		requirePattern(t, d, weights.Ptr(), 8*mib, 3)
		require.NoError(t, set.Close())
		st = set.Stats()
		require.Empty(t, st.Buffers, "a closed set holds no buffer")
		require.Equal(t, uint64(2), st.Sleeps, "the counts stay")
	})
}

// A failed call counts as a failure and its time, not as a sleep or a wake.
func TestStatsCountFailures(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		buf := newBuf(t, d, 4*mib, 2*mib, 5, nil)
		set := newSet(t, b, offload.Options{SlotSize: 4 * mib})
		require.NoError(t, set.Add("w", buf, offload.Keep, offload.EntryOptions{}))
		ctx, cancel := context.WithCancel(bg)
		cancel()
		require.ErrorIs(t, set.Sleep(ctx), context.Canceled)
		require.NoError(t, set.Sleep(bg))
		b.Sim.FailNth("cuMemCreate", 1, driver.ErrorOutOfMemory)
		err := set.Wake(bg)
		require.True(t, errors.Is(err, driver.ErrOutOfMemory), "%v", err)
		b.Sim.ClearFaults()
		st := set.Stats()
		require.Equal(t, uint64(1), st.SleepFailures)
		require.Equal(t, uint64(1), st.Sleeps)
		require.Equal(t, uint64(1), st.WakeFailures)
		require.Zero(t, st.Wakes)
		require.Zero(t, st.WokenBytes)
		require.Greater(t, st.SleepTime, st.LastSleep, "the failed sleep's time counts too")
		require.Positive(t, st.LastSleepSteps.Copy, "the successful sleep's steps")
		require.Equal(t, uint64(4*mib), st.AsleepBytes, "still asleep")
		require.NoError(t, set.Wake(bg))
		require.Equal(t, uint64(1), set.Stats().Wakes)
	}, testutil.SimOnly())
}

// Stats answers while a Sleep is in progress (from its progress callback, which runs with the set
// busy), with the state before it.
func TestStatsDoNotWaitForASleep(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		buf := newBuf(t, d, 4*mib, 2*mib, 5, nil)
		var during []offload.Stats
		var set *offload.Set
		set = newSet(t, b, offload.Options{SlotSize: 2 * mib, Progress: func(done, total uint64) {
			got := make(chan offload.Stats, 1)
			go func() { got <- set.Stats() }()
			select {
			case st := <-got:
				during = append(during, st)
			case <-time.After(5 * time.Second):
				t.Error("Stats waited for the Sleep")
			}
		}})
		require.NoError(t, set.Add("w", buf, offload.Keep, offload.EntryOptions{}))
		require.NoError(t, set.Sleep(bg))
		require.NotEmpty(t, during)
		require.False(t, during[0].Buffers[0].Asleep)
		require.Zero(t, during[0].Sleeps)
		require.True(t, set.Stats().Buffers[0].Asleep)
		require.NoError(t, set.Wake(bg))
	}, testutil.SimOnly())
}
