package offload_test

import (
	"bytes"
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/offload"
)

// TestStagedSleep: a staged first sleep releases the memory and keeps the content, with chunks
// spread over several slots and slots over several ring pieces; the next sleep, with the backup
// pooled, stages nothing; a checkpoint saved right after a staged sleep holds the content.
func TestStagedSleep(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		big := newBuf(t, d, 96*mib, 32*mib, 61, nil)
		small := newBuf(t, d, 6*mib, 2*mib, 62, nil)
		set := newSet(t, b, offload.Options{SlotSize: 64 * mib, FirstSleep: offload.FirstSleepStage})
		require.NoError(t, set.Add("big", big, offload.Keep, offload.EntryOptions{}))
		require.NoError(t, set.Add("small", small, offload.Keep, offload.EntryOptions{}))
		ptr := big.Ptr()
		before := free(t, d)
		require.NoError(t, set.Sleep(bg))
		require.Equal(t, uint64(102*mib), set.Stats().LastSleepSteps.StagedBytes)
		require.GreaterOrEqual(t, free(t, d)+2*mib, before+102*mib-4*mib, "the memory is released")
		var ck bytes.Buffer
		require.NoError(t, set.Save(bg, &ck), "a staged backup can be saved while it registers")
		require.NoError(t, set.Wake(bg))
		require.Equal(t, ptr, big.Ptr())
		requirePattern(t, d, big.Ptr(), 96*mib, 61)
		requirePattern(t, d, small.Ptr(), 6*mib, 62)

		require.NoError(t, set.Sleep(bg))
		require.Zero(t, set.Stats().LastSleepSteps.StagedBytes, "the pool holds the slots now")
		require.NoError(t, set.Wake(bg))
		require.NoError(t, d.Fill(big.Ptr(), 96*mib, 0, 1))
		require.NoError(t, set.Restore(bg, bytes.NewReader(ck.Bytes())))
		requirePattern(t, d, big.Ptr(), 96*mib, 61)
		requirePattern(t, d, small.Ptr(), 6*mib, 62)
	})
}

// TestStagedSleepCancelled: a staged sleep cancelled mid-copy leaves the buffer awake and intact,
// and a retry sleeps.
func TestStagedSleepCancelled(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		buf := newBuf(t, d, 16*mib, 2*mib, 63, nil)
		ctx, cancel := context.WithCancel(bg)
		set := newSet(t, b, offload.Options{SlotSize: 4 * mib, FirstSleep: offload.FirstSleepStage,
			Progress: func(done, total uint64) { cancel() }})
		require.NoError(t, set.Add("w", buf, offload.Keep, offload.EntryOptions{}))
		require.ErrorIs(t, set.Sleep(ctx), context.Canceled)
		require.False(t, set.Asleep("w"))
		requirePattern(t, d, buf.Ptr(), 16*mib, 63)
		require.NoError(t, set.Sleep(bg))
		require.NoError(t, set.Wake(bg))
		requirePattern(t, d, buf.Ptr(), 16*mib, 63)
	})
}

// TestStagedBackupFailsToRegister: the background registration of a staged backup fails (out of host
// memory to pin); Wake retries it, fails with ErrOutOfMemory and stays asleep with the backup; a
// later Wake restores everything.
func TestStagedBackupFailsToRegister(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		buf := newBuf(t, d, 4*mib, 4*mib, 64, nil)
		set := newSet(t, b, offload.Options{SlotSize: 4 * mib, FirstSleep: offload.FirstSleepStage})
		require.NoError(t, set.Add("w", buf, offload.Keep, offload.EntryOptions{}))
		// One chunk, one slot, one ring piece: the ring is registered first, then the slot in the background,
		// then again by the Wake.
		b.Sim.FailNth("cuMemHostRegister", 2, driver.ErrorOutOfMemory)
		b.Sim.FailNth("cuMemHostRegister", 3, driver.ErrorOutOfMemory)
		require.NoError(t, set.Sleep(bg))
		err := set.Wake(bg)
		b.Sim.ClearFaults()
		require.ErrorIs(t, err, driver.ErrOutOfMemory)
		require.ErrorContains(t, err, "pin a 4 MiB backup slot")
		require.True(t, set.Asleep("w"))
		require.NoError(t, set.Wake(bg))
		requirePattern(t, d, buf.Ptr(), 4*mib, 64)
	}, testutil.SimOnly())
}

// TestFirstSleepAutoStagesWithSeveralDevices: FirstSleepAuto pins while the System has one device
// open and stages once it has two.
func TestFirstSleepAutoStagesWithSeveralDevices(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		buf := newBuf(t, d, 4*mib, 2*mib, 65, nil)
		set := newSet(t, b, offload.Options{SlotSize: 4 * mib})
		require.NoError(t, set.Add("w", buf, offload.Keep, offload.EntryOptions{}))
		if len(b.Sys.OpenedDevices()) == 1 {
			require.NoError(t, set.Sleep(bg))
			require.Zero(t, set.Stats().LastSleepSteps.StagedBytes)
			require.NoError(t, set.Wake(bg))
			require.NoError(t, set.TrimPool())
		}
		b.Device(t, 1)
		require.NoError(t, set.Sleep(bg))
		require.Equal(t, uint64(4*mib), set.Stats().LastSleepSteps.StagedBytes)
		require.NoError(t, set.Wake(bg))
		requirePattern(t, d, buf.Ptr(), 4*mib, 65)
	}, testutil.Devices(2))
}

// TestStagedSleepKeepsWarmSlots: a staged sleep whose ring borrows pooled slots (of another buffer,
// whose slot size is the ring's piece size) pools them again, so that buffer's next sleep is warm.
func TestStagedSleepKeepsWarmSlots(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		small := newBuf(t, d, 32*mib, 32*mib, 66, nil)
		big := newBuf(t, d, 64*mib, 32*mib, 67, nil)
		set := newSet(t, b, offload.Options{SlotSize: 256 * mib, FirstSleep: offload.FirstSleepStage})
		require.NoError(t, set.Add("small", small, offload.Keep, offload.EntryOptions{}))
		require.NoError(t, set.Add("big", big, offload.Keep, offload.EntryOptions{}))
		require.NoError(t, set.Sleep(bg, "small"))
		require.NoError(t, set.Wake(bg, "small"))
		require.Equal(t, uint64(32*mib), set.Stats().PooledBytes, "small's backup slot, pooled")
		require.NoError(t, set.Sleep(bg, "big"))
		require.Equal(t, uint64(64*mib), set.Stats().LastSleepSteps.StagedBytes)
		require.Equal(t, uint64(32*mib), set.Stats().PooledBytes, "the ring gave small's slot back")
		require.NoError(t, set.Sleep(bg, "small"))
		require.Zero(t, set.Stats().LastSleepSteps.StagedBytes, "small's sleep is warm")
		require.NoError(t, set.Wake(bg))
		requirePattern(t, d, small.Ptr(), 32*mib, 66)
		requirePattern(t, d, big.Ptr(), 64*mib, 67)
	})
}
