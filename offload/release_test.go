package offload_test

import (
	"bytes"
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/offload"
	"github.com/cuvmm/cuvmm/vmm"
)

// TestSleepReleaseFailsOnTwoDevices: whichever release fails, on either device, the chunks
// released before it, on both devices, are recreated and restored: both buffers are awake, the
// kept one intact, the devices' free memory is what it was before the sleep, and a later sleep and
// wake succeed.
func TestSleepReleaseFailsOnTwoDevices(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d0, d1 := b.Device(t, 0), b.Device(t, 1)
		a, c := newBuf(t, d0, 4*mib, 2*mib, 43, nil), newBuf(t, d1, 4*mib, 2*mib, 44, nil)
		set := newSet(t, b, offload.Options{SlotSize: 2 * mib})
		require.NoError(t, set.Add("a", a, offload.Keep, offload.EntryOptions{}))
		require.NoError(t, set.Add("c", c, offload.Discard, offload.EntryOptions{}))
		require.NoError(t, set.Sleep(bg)) // the set's streams and backup slots are made
		require.NoError(t, set.Wake(bg))
		free0, free1 := free(t, d0), free(t, d1)
		for n := 1; n <= 4; n++ { // two chunks on each device
			b.Sim.FailNth("cuMemRelease", n, driver.ErrorOutOfMemory)
			require.ErrorIs(t, set.Sleep(bg), driver.ErrOutOfMemory, "release %d", n)
			b.Sim.ClearFaults()
			require.False(t, set.Asleep("a"), "release %d", n)
			require.False(t, set.Asleep("c"), "release %d", n)
			requirePattern(t, d0, a.Ptr(), 4*mib, 43)
			require.Equal(t, free0, free(t, d0), "release %d", n)
			require.Equal(t, free1, free(t, d1), "release %d", n)
		}
		require.NoError(t, set.Sleep(bg), "a sleep after the failed ones")
		require.NoError(t, set.Wake(bg))
		requirePattern(t, d0, a.Ptr(), 4*mib, 43)
	}, testutil.Devices(2), testutil.SimOnly())
}

// TestSleepReleasesEachChunkOnceCopied: a Keep chunk's memory goes back to the driver as soon as
// its copy out is done, while the chunks after it are still being copied, not once every copy is
// done: when the last chunk's copy is counted, the three before it are released already.
func TestSleepReleasesEachChunkOnceCopied(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		var atEnd uint64
		var atEndErr error
		var d *vmm.Device
		d, buf, set := keptWithProgress(t, b, 45, func(done, total uint64) {
			if done == total { // on the set's goroutine: no require here
				atEndErr = d.Synchronize()
				if atEndErr == nil {
					atEnd, _, atEndErr = d.MemInfo()
				}
			}
		})
		before := free(t, d)
		require.NoError(t, set.Sleep(bg))
		require.NoError(t, atEndErr)
		require.GreaterOrEqual(t, atEnd, before+20*mib, "free when the last copy was done: %d MiB more than before the sleep", (int64(atEnd)-int64(before))/mib)
		require.NoError(t, set.Wake(bg))
		requirePattern(t, d, buf.Ptr(), 32*mib, 45)
	})
}

// TestSleepCancelledAfterReleasesRestoresThem: a Sleep cancelled once some chunks are released
// (their copies were done) recreates them and restores their content: the buffer is awake and
// intact and the device's free memory is what it was.
func TestSleepCancelledAfterReleasesRestoresThem(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		ctx, cancel := context.WithCancel(bg)
		d, buf, set := keptWithProgress(t, b, 46, func(done, total uint64) {
			if done >= 24*mib { // chunks 0 and 1 are released by now
				cancel()
			}
		})
		before := free(t, d)
		require.NoError(t, set.Prepare(bg)) // the backup pinned beforehand: its page tables are not the sleep's
		pinnedCost := before - free(t, d)
		calls := func() int { return 0 }
		if b.IsSim() {
			calls = func() int { return b.Sim.Calls("cuMemCreate") }
		}
		creates := calls()
		require.ErrorIs(t, set.Sleep(ctx), context.Canceled)
		require.False(t, set.Asleep("w"))
		if b.IsSim() {
			require.Equal(t, 2, calls()-creates, "the two released chunks recreated")
		}
		requireFreeAbout(t, b, before-pinnedCost, free(t, d), "every chunk mapped again")
		requirePattern(t, d, buf.Ptr(), 32*mib, 46)
		require.NoError(t, set.Sleep(bg), "a cancelled sleep can be retried")
		require.NoError(t, set.Wake(bg))
		requirePattern(t, d, buf.Ptr(), 32*mib, 46)
	})
}

// TestSleepCopyFailsAfterAReleaseAndItsUndoFails: a copy fails once a chunk is released, and
// recreating that chunk runs out of memory, so the buffer stays asleep with its content kept; the
// chunks after the failed copy are still mapped, and the Wake that finishes the undo must not
// overwrite them with the slots whose copies never ran (the pool's old bytes).
func TestSleepCopyFailsAfterAReleaseAndItsUndoFails(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d, buf, set := keptWithProgress(t, b, 47, nil)
		require.NoError(t, set.Prepare(bg))                      // pooled slots: the sleep queues every copy itself
		b.Sim.FailNth("cuMemcpyAsync", 3, driver.ErrorUnknown)   // slot 2's copy, once chunk 0 is released
		b.Sim.FailNth("cuMemCreate", 1, driver.ErrorOutOfMemory) // the undo's recreation of chunk 0
		err := set.Sleep(bg)
		b.Sim.ClearFaults()
		require.ErrorIs(t, err, driver.ErrorUnknown)
		require.ErrorIs(t, err, driver.ErrOutOfMemory)
		require.True(t, set.Asleep("w"), "asleep with its content kept, for Wake to restore")
		require.NoError(t, set.Wake(bg))
		requirePattern(t, d, buf.Ptr(), 32*mib, 47)
	}, testutil.SimOnly())
}

// TestWakeAfterAFailedCopyUndoFailsKeepsTheChunksNeverReleased: after a sleep whose copy failed
// once chunk 0 was released, and whose undo failed too, chunks 1-3 were never released and have no
// complete backup: their content is only in the chunks. A Wake that then fails must not release
// them with the chunks it recreated, and the Wake after it must leave them as they are.
func TestWakeAfterAFailedCopyUndoFailsKeepsTheChunksNeverReleased(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d, buf, set := keptWithProgress(t, b, 48, nil)
		require.NoError(t, set.Prepare(bg))
		b.Sim.FailNth("cuMemcpyAsync", 3, driver.ErrorUnknown)
		b.Sim.FailNth("cuMemCreate", 1, driver.ErrorOutOfMemory)
		require.Error(t, set.Sleep(bg))
		b.Sim.ClearFaults()
		require.True(t, set.Asleep("w"))
		require.Equal(t, uint64(8*mib), set.Stats().AsleepBytes, "only chunk 0 was given back")
		var ck bytes.Buffer
		require.NoError(t, set.Save(bg, &ck), "the chunks never released are saved from the GPU")
		b.Sim.FailNth("cuStreamSynchronize", 1, driver.ErrorUnknown)
		require.Error(t, set.Wake(bg), "the wake's wait fails")
		b.Sim.ClearFaults()
		require.True(t, set.Asleep("w"), "still asleep, for the next Wake")
		require.NoError(t, set.Wake(bg))
		requirePattern(t, d, buf.Ptr(), 32*mib, 48)
		require.NoError(t, d.Fill(buf.Ptr(), 32*mib, 0, 49)) // overwritten, then restored from the checkpoint
		require.NoError(t, set.Restore(bg, bytes.NewReader(ck.Bytes())))
		requirePattern(t, d, buf.Ptr(), 32*mib, 48)
	}, testutil.SimOnly())
}
