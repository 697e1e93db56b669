package offload_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/offload"
	"github.com/cuvmm/cuvmm/vmm"
)

// failWaitAndDrain fails the next wait for a copy stream and the drain that follows it, so that
// copies may still be queued when the call gives up.
func failWaitAndDrain(b *testutil.Backend) {
	b.Sim.FailNth("cuStreamSynchronize", 1, driver.ErrorUnknown) // the wait
	failDrain(b)
}

// failDrain fails every synchronization of the next drain. Faults due on the same call fire on
// consecutive calls, so each one armed fails one more attempt.
func failDrain(b *testutil.Backend) {
	for range vmm.DrainAttempts {
		b.Sim.FailNth("cuStreamSynchronize", 1, driver.ErrorUnknown)
	}
}

// TestSaveUndrainedSlotStaysOutOfPool: a Save whose wait, drain and device synchronization all
// fail holds its staging slot out of the pool until the device synchronizes (the set's next call),
// so the copy still queued into it cannot overwrite a later sleep's backup.
func TestSaveUndrainedSlotStaysOutOfPool(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		f := newTwoDeviceFixture(t, b)
		failWaitAndDrain(b)
		b.Sim.FailNth("cuCtxSynchronize", 2, driver.ErrorUnknown) // after the drain (the 1st: Save's wait for v's work)
		err := f.set.Save(bg, &bytes.Buffer{}, "v")
		require.ErrorIs(t, err, driver.ErrorUnknown)
		require.ErrorContains(t, err, "held out of the pool")
		require.Equal(t, f.set.BackupBytes(), f.set.Stats().BackupBytes, "Stats counts the held slot, as BackupBytes")
		b.Sim.ClearFaults()
		f.requireSlotsQuiet(t) // k's backup must survive
	}, testutil.Devices(2), testutil.SimOnly())
}

// TestRestoreUndrainedSlotsStayOutOfPool: a Restore whose wait and drain both fail holds its slots
// out of the pool until the device synchronizes, so no copy still queued from them writes one
// buffer's bytes into another.
func TestRestoreUndrainedSlotsStayOutOfPool(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		f := newTwoDeviceFixture(t, b)
		var ck bytes.Buffer
		require.NoError(t, f.set.Save(bg, &ck, "v"))
		failWaitAndDrain(b)
		b.Sim.FailNth("cuCtxSynchronize", 2, driver.ErrorUnknown) // Restore's last try to synchronize (the 1st: its wait for v's work)
		err := f.set.Restore(bg, bytes.NewReader(ck.Bytes()))
		require.ErrorIs(t, err, driver.ErrorUnknown)
		require.ErrorContains(t, err, "synchronizing device 1")
		require.ErrorContains(t, err, "held out of the pool")
		b.Sim.ClearFaults()
		f.requireSlotsQuiet(t) // v must not receive k's bytes
	}, testutil.Devices(2), testutil.SimOnly())
}

// TestRestoreUndrainedSynchronizesDevice: a Restore whose wait and drain both fail synchronizes the
// device once more before it returns, so no copy is left writing the checkpoint's bytes into the
// buffers, its slots go back to the pool, and the error says so.
func TestRestoreUndrainedSynchronizesDevice(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		f := newTwoDeviceFixture(t, b)
		var ck bytes.Buffer
		require.NoError(t, f.set.Save(bg, &ck, "v"))
		require.NoError(t, f.d1.Fill(f.v.Ptr(), 4*mib, 0, 83))
		failWaitAndDrain(b)
		err := f.set.Restore(bg, bytes.NewReader(ck.Bytes()))
		require.ErrorIs(t, err, driver.ErrorUnknown)
		require.ErrorContains(t, err, "was synchronized, so no copy is left queued")
		require.ErrorContains(t, err, "could not be drained after 3 attempts", "the drain's own failure is reported")
		require.NotErrorIs(t, err, vmm.ErrNotDrained, "nothing is left queued, so the error must not say so")
		require.NotContains(t, err.Error(), "held out of the pool")
		b.Sim.ClearFaults()
		requirePattern(t, f.d1, f.v.Ptr(), 4*mib, 82)
		f.requireSlotsQuiet(t)
	}, testutil.Devices(2), testutil.SimOnly())
}

// TestSleepUndrainedHoldsSlotsItsPinningCopiedInto: a first Sleep whose copy into a slot the
// pinning goroutine queued fails half-way, and whose drain and device synchronization fail too,
// holds that slot (never taken into the backup) out of the pool until the device synchronizes, so
// the copy still queued into it cannot overwrite a later sleep's backup.
func TestSleepUndrainedHoldsSlotsItsPinningCopiedInto(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		f := newTwoDeviceFixture(t, b)
		b.Sim.FailNth("cuMemcpyAsync", 2, driver.ErrorUnknown) // v's second chunk, queued by the pinning goroutine
		failDrain(b)
		b.Sim.FailNth("cuCtxSynchronize", 2, driver.ErrorUnknown) // after the drain (the first waits for v's work)
		err := f.set.Sleep(bg, "v")
		require.ErrorIs(t, err, driver.ErrorUnknown)
		require.ErrorContains(t, err, "held out of the pool")
		b.Sim.ClearFaults()
		require.False(t, f.set.Asleep("v"))
		f.requireSlotsQuiet(t) // k's backup must not receive v's bytes
	}, testutil.Devices(2), testutil.SimOnly())
}

// TestWakeUndrainedSynchronizesBeforeUndo: a Wake whose wait and drain both fail synchronizes the
// device before it releases the chunks it recreated, so no copy is left writing unmapped memory;
// the buffer stays asleep with its backup and wakes later.
func TestWakeUndrainedSynchronizesBeforeUndo(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		f := newTwoDeviceFixture(t, b)
		require.NoError(t, f.set.Sleep(bg, "k"))
		failWaitAndDrain(b)
		err := f.set.Wake(bg, "k")
		require.ErrorIs(t, err, driver.ErrorUnknown)
		require.ErrorContains(t, err, "no copy is left queued")
		b.Sim.ClearFaults()
		require.True(t, f.set.Asleep("k"))
		require.NoError(t, f.d0.Synchronize(), "no copy left queued into released memory")
		require.NoError(t, f.set.Wake(bg, "k"))
		requirePattern(t, f.d0, f.k.Ptr(), 4*mib, 81)
	}, testutil.Devices(2), testutil.SimOnly())
}

// TestWakeUndrainedHandsChunksToSystem: when the device cannot be synchronized either, the failed
// Wake leaves the chunks a copy may still write mapped and hands them to the System, whose
// RetryOrphans synchronizes the device, then releases them again; the buffer stays asleep with its
// backup intact, and wakes later.
func TestWakeUndrainedHandsChunksToSystem(t *testing.T) {
	for _, retryFirst := range []bool{true, false} {
		t.Run(map[bool]string{true: "retry then wake", false: "wake then retry"}[retryFirst], func(t *testing.T) {
			testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
				f := newTwoDeviceFixture(t, b)
				require.NoError(t, f.set.Sleep(bg, "k"))
				backup := f.set.BackupBytes()
				failWaitAndDrain(b)
				b.Sim.FailNth("cuCtxSynchronize", 1, driver.ErrorUnknown)
				err := f.set.Wake(bg, "k")
				require.ErrorIs(t, err, driver.ErrorUnknown)
				require.ErrorContains(t, err, "kept by the System")
				b.Sim.ClearFaults()
				require.True(t, f.set.Asleep("k"))
				require.Equal(t, backup, f.set.BackupBytes(), "the backup stays")
				require.Len(t, b.Sys.Orphans(), 2, "k's two chunks")
				require.NoError(t, f.d0.Synchronize(), "no copy left queued into released memory")
				if retryFirst {
					require.NoError(t, b.Sys.RetryOrphans())
					require.Empty(t, b.Sys.Orphans())
				}
				require.NoError(t, f.set.Wake(bg, "k"))
				requirePattern(t, f.d0, f.k.Ptr(), 4*mib, 81)
				require.NoError(t, b.Sys.RetryOrphans())
				require.Empty(t, b.Sys.Orphans())
				requirePattern(t, f.d0, f.k.Ptr(), 4*mib, 81)
			}, testutil.Devices(2), testutil.SimOnly())
		})
	}
}

// TestLoadUndrainedFreesNothingUnderQueuedCopy: a Load whose wait and drain both fail synchronizes
// the device before it frees the staging slot and the buffer a copy may still be queued into, so
// no copy is left reading freed host memory or writing unmapped addresses.
func TestLoadUndrainedFreesNothingUnderQueuedCopy(t *testing.T) {
	ck := saveTwoBuffers(t)
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		failWaitAndDrain(b)
		_, bufs, err := offload.Load(bg, b.Sys, bytes.NewReader(ck), offload.Options{SlotSize: 2 * mib})
		b.Sim.ClearFaults()
		require.ErrorIs(t, err, driver.ErrorUnknown)
		require.ErrorContains(t, err, "was synchronized, so no copy is left queued")
		require.NotContains(t, err.Error(), "held out of the pool")
		require.Nil(t, bufs)
		require.NoError(t, b.Device(t, 0).Synchronize(), "no copy left queued from a freed slot")
		require.Empty(t, b.Sys.Orphans(), "the device synchronized at once: everything was freed")
	}, testutil.SimOnly())
}

// TestLoadUndrainedHandsSlotAndBufferToSystem: when the device cannot be synchronized either, the
// failed Load hands the slot and the buffer to the System, whose RetryOrphans synchronizes the
// device before it frees them.
func TestLoadUndrainedHandsSlotAndBufferToSystem(t *testing.T) {
	ck := saveTwoBuffers(t)
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		failWaitAndDrain(b)
		b.Sim.FailNth("cuCtxSynchronize", 1, driver.ErrorUnknown) // after the drain
		b.Sim.FailNth("cuCtxSynchronize", 1, driver.ErrorUnknown) // Set.Close, before pooling the slot
		_, bufs, err := offload.Load(bg, b.Sys, bytes.NewReader(ck), offload.Options{SlotSize: 2 * mib})
		b.Sim.ClearFaults()
		require.ErrorIs(t, err, driver.ErrorUnknown)
		require.ErrorContains(t, err, "kept by the System")
		require.Nil(t, bufs)
		require.Len(t, b.Sys.Orphans(), 2, "the slot and the buffer")
		require.NoError(t, b.Device(t, 0).Synchronize(), "no copy left queued from a freed slot")
		require.NoError(t, b.Sys.RetryOrphans())
		require.Empty(t, b.Sys.Orphans())
	}, testutil.SimOnly())
}

// TestLoadCleanupUnregisterFailsTwiceHandsSlotToSystem: a failed Load whose pooled slot fails to be
// unregistered on both tries (closeRetry) hands the slot to the System, so that System.Close still
// succeeds (testutil.Run's cleanup checks it) instead of failing on a host registration no API owns.
func TestLoadCleanupUnregisterFailsTwiceHandsSlotToSystem(t *testing.T) {
	bad := bytes.Clone(saveTwoBuffers(t))
	bad[len(bad)-5] ^= 0xff
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		b.Sim.FailNth("cuMemHostUnregister", 1, driver.ErrorUnknown)
		b.Sim.FailNth("cuMemHostUnregister", 1, driver.ErrorUnknown)
		_, _, err := offload.Load(bg, b.Sys, bytes.NewReader(bad), offload.Options{SlotSize: 2 * mib})
		b.Sim.ClearFaults()
		require.ErrorIs(t, err, offload.ErrBadCheckpoint)
		require.ErrorContains(t, err, "kept by the System")
	}, testutil.SimOnly())
}

// TestTrimPoolUnregisterFailsTwiceHandsSlotToSystem: the same for TrimPool on a live set.
func TestTrimPoolUnregisterFailsTwiceHandsSlotToSystem(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		f := newTwoDeviceFixture(t, b)
		require.NoError(t, f.set.Sleep(bg, "k"))
		require.NoError(t, f.set.Wake(bg, "k"))
		require.NotZero(t, f.set.BackupBytes())
		b.Sim.FailNth("cuMemHostUnregister", 1, driver.ErrorUnknown)
		b.Sim.FailNth("cuMemHostUnregister", 1, driver.ErrorUnknown)
		err := f.set.TrimPool()
		b.Sim.ClearFaults()
		require.ErrorIs(t, err, driver.ErrorUnknown)
		require.ErrorContains(t, err, "kept by the System")
		require.Zero(t, f.set.BackupBytes())
		require.NotEmpty(t, b.Sys.Orphans())
	}, testutil.Devices(2), testutil.SimOnly())
}

// TestLoadRefusesOverlappingChunksAndDuplicateTags: readHeader refuses chunks that overlap within an
// entry and a tag used by two entries with ErrBadCheckpoint, before any memory is made.
func TestLoadRefusesOverlappingChunksAndDuplicateTags(t *testing.T) {
	ck := saveTwoBuffers(t) // "a": chunks at 0 and 2 MiB; "b": one chunk
	entry := func(h map[string]any, i int) map[string]any { return h["entries"].([]any)[i].(map[string]any) }
	chunk1 := func(h map[string]any) map[string]any { return entry(h, 0)["chunks"].([]any)[1].(map[string]any) }
	for name, tc := range map[string]struct {
		edit func(map[string]any)
		want string
	}{
		"overlapping chunks": {func(h map[string]any) { chunk1(h)["offset"] = json.Number("0"); entry(h, 0)["len"] = json.Number("0") }, `entry "a"`},
		"duplicate tags":     {func(h map[string]any) { entry(h, 1)["tag"] = "a" }, `tag "a"`},
	} {
		t.Run(name, func(t *testing.T) {
			testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
				_, _, err := offload.Load(bg, b.Sys, bytes.NewReader(rewriteHeader(t, ck, tc.edit)), offload.Options{SlotSize: 2 * mib})
				require.ErrorIs(t, err, offload.ErrBadCheckpoint)
				require.ErrorContains(t, err, tc.want)
				require.Zero(t, b.Sim.Calls("cuMemCreate"), "refused before anything is made")
			}, testutil.SimOnly())
		})
	}
}

// TestSaveDrainedOnRetryPoolsSlot: a Save whose wait fails and whose drain succeeds only on a
// later attempt puts its slot straight back in the pool: the stream is empty, so nothing is held.
func TestSaveDrainedOnRetryPoolsSlot(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		f := newTwoDeviceFixture(t, b)
		require.NoError(t, f.set.Save(bg, &bytes.Buffer{}, "v")) // pins the slot
		pooled := f.set.Stats().PooledBytes
		require.NotZero(t, pooled)
		b.Sim.FailNth("cuStreamSynchronize", 1, driver.ErrorUnknown) // the wait
		b.Sim.FailNth("cuStreamSynchronize", 1, driver.ErrorUnknown) // the drain's first attempt
		err := f.set.Save(bg, &bytes.Buffer{}, "v")
		require.ErrorIs(t, err, driver.ErrorUnknown)
		require.NotContains(t, err.Error(), "held out of the pool")
		require.Equal(t, pooled, f.set.Stats().PooledBytes, "the slot is pooled again at once")
		b.Sim.ClearFaults()
		f.requireSlotsQuiet(t)
	}, testutil.Devices(2), testutil.SimOnly())
}

// wakeUndrainedBusy sleeps a 4 MiB, two-chunk buffer k, then fails a Wake's wait, its drain and the
// device's synchronization, so that both chunks stay mapped for the System to release again.
func wakeUndrainedBusy(t *testing.T, b *testutil.Backend) (*vmm.Device, *growbuf.Buffer, *offload.Set) {
	d := b.Device(t, 0)
	k, err := newOwnedBuf(d, 4*mib, 2*mib, 81)
	require.NoError(t, err)
	set := newSet(t, b, offload.Options{SlotSize: 4 * mib})
	require.NoError(t, set.Add("k", k, offload.Keep, offload.EntryOptions{}))
	require.NoError(t, set.Sleep(bg, "k"))
	failWaitAndDrain(b)
	b.Sim.FailNth("cuCtxSynchronize", 1, driver.ErrorUnknown)
	require.ErrorContains(t, set.Wake(bg, "k"), "kept by the System")
	b.Sim.ClearFaults()
	require.True(t, set.Asleep("k"))
	return d, k, set
}

// TestWakeUndrainedThenBufferClosed: a buffer closed while a failed Wake's chunks wait for the
// System is dropped from the set, and the System's retry, finding the chunks closed, succeeds.
func TestWakeUndrainedThenBufferClosed(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d, k, set := wakeUndrainedBusy(t, b)
		require.NoError(t, d.Synchronize(), "the queued copies run")
		require.NoError(t, k.Close())
		require.NoError(t, b.Sys.RetryOrphans())
		require.Empty(t, b.Sys.Orphans())
		require.NotContains(t, set.Tags(), "k")
		require.Zero(t, set.BackupBytes(), "the closed buffer's backup is freed")
	}, testutil.SimOnly())
}

// TestWakeUndrainedThenBufferClosedWakeSparesNewBuffer: a Wake of such a closed buffer restores
// nothing into the buffer that took its addresses.
func TestWakeUndrainedThenBufferClosedWakeSparesNewBuffer(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d, k, set := wakeUndrainedBusy(t, b)
		require.NoError(t, d.Synchronize())
		old := k.Ptr()
		require.NoError(t, k.Close())
		other := newBuf(t, d, 4*mib, 2*mib, 90, nil)
		require.Equal(t, old, other.Ptr(), "the new buffer reuses the closed one's addresses")
		require.Error(t, set.Wake(bg, "k"), "k was closed: dropped from the set")
		require.NoError(t, d.Synchronize())
		requirePattern(t, d, other.Ptr(), 4*mib, 90)
		require.NoError(t, b.Sys.RetryOrphans())
		require.Empty(t, b.Sys.Orphans())
	}, testutil.SimOnly())
}

// TestWakeUndrainedClosedAfterRetryFreesBackup: once the System has synchronized the device and
// released the chunks, no copy reads the backup, so closing the buffer frees it.
func TestWakeUndrainedClosedAfterRetryFreesBackup(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		_, k, set := wakeUndrainedBusy(t, b)
		require.NoError(t, b.Sys.RetryOrphans())
		require.Empty(t, b.Sys.Orphans())
		require.True(t, set.Asleep("k"))
		require.NoError(t, k.Close())
		require.NotContains(t, set.Tags(), "k")
		require.Zero(t, set.BackupBytes(), "the closed buffer's backup is freed")
	}, testutil.SimOnly())
}

// TestSleepReleaseUndoUndrainedKeepsBackup: a Sleep whose release fails, and whose undo (a wake)
// can neither drain its copies nor synchronize the device, keeps the buffer asleep with its
// backup: the undo's copies still read it, so it must not go back to the pool.
func TestSleepReleaseUndoUndrainedKeepsBackup(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		f := newTwoDeviceFixture(t, b)
		b.Sim.FailNth("cuMemRelease", 2, driver.ErrorUnknown) // k's chunk 1: undone, still mapped
		// After the backup's wait and the drain that follows the failed release (chunk 1 is
		// released as soon as its copy is done, in the backup's pipeline): the undo wake's wait
		// and every attempt of its drain.
		for n := range 1 + vmm.DrainAttempts {
			b.Sim.FailNth("cuStreamSynchronize", 3+n, driver.ErrorUnknown)
		}
		b.Sim.FailNth("cuCtxSynchronize", 2, driver.ErrorUnknown) // resleepBusy's synchronize
		err := f.set.Sleep(bg, "k")
		b.Sim.ClearFaults()
		require.ErrorIs(t, err, driver.ErrorUnknown)
		require.ErrorContains(t, err, "kept by the System")
		require.True(t, f.set.Asleep("k"), "asleep with its backup, for Wake to finish")
		var ck bytes.Buffer
		require.NoError(t, f.set.Save(bg, &ck, "v")) // a pooled slot, if any, is reused now
		require.NoError(t, f.d0.Synchronize())       // the undo's queued copies run now
		require.NoError(t, b.Sys.RetryOrphans())
		require.NoError(t, f.set.Wake(bg, "k"))
		requirePattern(t, f.d0, f.k.Ptr(), 4*mib, 81)
	}, testutil.Devices(2), testutil.SimOnly())
}

// TestUndrainedCopyOutSynchronizesDevice: a Sleep (to the backup or to a file) or a Save whose
// wait and drain both fail synchronizes the device before it returns, as Restore, Wake and Load
// do, so that no copy it queued is left reading the buffer: the caller may unmap the buffer's
// memory at once (a reservation's mappings do not wait for queued work, as growbuf does), and no
// copy then reads unmapped addresses. Nothing is held out of the pool: no copy is left to use a slot.
func TestUndrainedCopyOutSynchronizesDevice(t *testing.T) {
	failPartWaitAndDrain := func(b *testutil.Backend) {
		b.Sim.FailNth("cuEventSynchronize", 1, driver.ErrorUnknown) // the wait for the first part
		failDrain(b)
	}
	for name, tc := range map[string]struct {
		policy offload.Policy
		fail   func(*testutil.Backend)
		call   func(*offload.Set) error
		first  offload.FirstSleep
	}{
		"sleep":         {offload.Keep, failWaitAndDrain, func(s *offload.Set) error { return s.Sleep(bg, "m") }, offload.FirstSleepPin},
		"staged sleep":  {offload.Keep, failPartWaitAndDrain, func(s *offload.Set) error { return s.Sleep(bg, "m") }, offload.FirstSleepStage},
		"sleep to file": {offload.File, failPartWaitAndDrain, func(s *offload.Set) error { return s.Sleep(bg, "m") }, 0},
		"save":          {offload.Keep, failWaitAndDrain, func(s *offload.Set) error { return s.Save(bg, &bytes.Buffer{}, "m") }, 0},
	} {
		t.Run(name, func(t *testing.T) {
			testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
				d := b.Device(t, 0)
				res, err := b.Sys.Reserve(4*mib, vmm.ReserveOptions{})
				require.NoError(t, err)
				m, err := res.MapNew(0, 4*mib, d, vmm.AllocOptions{}, vmm.ReadWrite(d))
				require.NoError(t, err)
				t.Cleanup(func() { require.NoError(t, errors.Join(m.Close(), res.Close())) })
				set := newSet(t, b, offload.Options{SlotSize: 4 * mib, FirstSleep: tc.first})
				file, err := os.CreateTemp(t.TempDir(), "m")
				require.NoError(t, err)
				t.Cleanup(func() { file.Close() })
				require.NoError(t, set.Add("m", offload.Mappings(res), tc.policy, offload.EntryOptions{File: file}))
				tc.fail(b)
				err = tc.call(set)
				b.Sim.ClearFaults()
				require.ErrorIs(t, err, driver.ErrorUnknown)
				require.ErrorContains(t, err, "was synchronized, so no copy is left queued")
				require.NotContains(t, err.Error(), "held out of the pool")
				require.False(t, set.Asleep("m"))
				require.NoError(t, errors.Join(m.Close(), res.Close()))
				require.NoError(t, d.Synchronize(), "no copy left queued from unmapped memory")
			}, testutil.SimOnly())
		})
	}
}
