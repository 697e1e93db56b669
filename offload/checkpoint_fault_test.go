package offload_test

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/offload"
	"github.com/cuvmm/cuvmm/vmm"
)

// TestSaveFailureLeavesNoCopyIntoPooledSlot: a Save whose wait for a copy fails returns its staging
// slot to the pool only once the copy is done, so a later sleep's backup in that slot stays intact.
func TestSaveFailureLeavesNoCopyIntoPooledSlot(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		f := newTwoDeviceFixture(t, b)
		b.Sim.FailNth("cuStreamSynchronize", 1, driver.ErrorUnknown)
		require.ErrorIs(t, f.set.Save(bg, &bytes.Buffer{}, "v"), driver.ErrorUnknown)
		b.Sim.ClearFaults()
		f.requireSlotsQuiet(t)
	}, testutil.Devices(2), testutil.SimOnly())
}

// TestRestoreFailureLeavesNoCopyFromPooledSlot: a Restore whose final wait fails returns its slots
// to the pool only once their copies are done, so none later writes another buffer's bytes.
func TestRestoreFailureLeavesNoCopyFromPooledSlot(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		f := newTwoDeviceFixture(t, b)
		var ck bytes.Buffer
		require.NoError(t, f.set.Save(bg, &ck, "v"))
		b.Sim.FailNth("cuStreamSynchronize", 1, driver.ErrorUnknown)
		require.ErrorIs(t, f.set.Restore(bg, bytes.NewReader(ck.Bytes())), driver.ErrorUnknown)
		b.Sim.ClearFaults()
		f.requireSlotsQuiet(t)
	}, testutil.Devices(2), testutil.SimOnly())
}

// TestLoadFailureWhoseCleanupFailsLeavesNothing: when mapping a chunk fails and freeing the new
// reservation fails too, the reservation goes to the System, whose Close frees it.
func TestLoadFailureWhoseCleanupFailsLeavesNothing(t *testing.T) {
	ck := saveTwoBuffers(t)
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		b.Sim.FailNth("cuMemMap", 1, driver.ErrorOutOfMemory)
		b.Sim.FailNth("cuMemAddressFree", 1, driver.ErrorUnknown)
		_, bufs, err := offload.Load(bg, b.Sys, bytes.NewReader(ck), offload.Options{SlotSize: 2 * mib})
		b.Sim.ClearFaults()
		require.ErrorIs(t, err, driver.ErrOutOfMemory)
		require.ErrorContains(t, err, "kept by the System")
		require.Nil(t, bufs)
		require.NoError(t, b.Sys.Close(), "everything Load made is released or handed to the System")
	}, testutil.SimOnly())
}

// twoDeviceFixture is a set of two Keep buffers, k (pattern 81) on device 0 and v (82) on device 1,
// with slots of the buffers' size, so that a slot one call takes from the pool is the next one's.
type twoDeviceFixture struct {
	set    *offload.Set
	k, v   *growbuf.Buffer
	d0, d1 *vmm.Device
}

func newTwoDeviceFixture(t *testing.T, b *testutil.Backend) *twoDeviceFixture {
	f := &twoDeviceFixture{d0: b.Device(t, 0), d1: b.Device(t, 1)}
	f.k = newBuf(t, f.d0, 4*mib, 2*mib, 81, nil)
	f.v = newBuf(t, f.d1, 4*mib, 2*mib, 82, nil)
	// The fault counts of the tests using it follow the pinned first sleep, which FirstSleepAuto
	// would not take with two devices open.
	f.set = newSet(t, b, offload.Options{SlotSize: 4 * mib, FirstSleep: offload.FirstSleepPin})
	require.NoError(t, f.set.Add("k", f.k, offload.Keep, offload.EntryOptions{}))
	require.NoError(t, f.set.Add("v", f.v, offload.Keep, offload.EntryOptions{}))
	return f
}

// requireSlotsQuiet sleeps and wakes k through the pool's slots, with v overwritten (pattern 83)
// meanwhile and every device synchronized: no copy a failed call left queued on a pooled slot may
// change k's backup or v.
func (f *twoDeviceFixture) requireSlotsQuiet(t *testing.T) {
	t.Helper()
	require.NoError(t, f.set.Sleep(bg, "k"))
	require.NoError(t, f.d1.Fill(f.v.Ptr(), 4*mib, 0, 83))
	require.NoError(t, f.d0.Synchronize())
	require.NoError(t, f.d1.Synchronize())
	require.NoError(t, f.set.Wake(bg, "k"))
	requirePattern(t, f.d0, f.k.Ptr(), 4*mib, 81)
	requirePattern(t, f.d1, f.v.Ptr(), 4*mib, 83)
}

// checkpointScopes are the tags the matrices below save and restore: one buffer, and all.
var checkpointScopes = [][]string{{"v"}, nil}

func scopeName(tags []string) string {
	if len(tags) == 0 {
		return "all"
	}
	return strings.Join(tags, ",")
}

// TestSaveFaultMatrix fails each driver call of a Save, one at a time, over two devices: the Save
// fails with the driver's error or succeeds, changes no buffer, can be retried, and leaves no copy
// queued into a slot it gave back to the pool.
func TestSaveFaultMatrix(t *testing.T) {
	for _, tags := range checkpointScopes {
		var counts map[string]int
		testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
			f := newTwoDeviceFixture(t, b)
			counts = callsOf(b.Sim, func() { require.NoError(t, f.set.Save(bg, &bytes.Buffer{}, tags...)) })
		}, testutil.Devices(2), testutil.SimOnly())
		require.NotEmpty(t, counts)
		for fn, n := range counts {
			for i := 1; i <= n; i++ {
				t.Run(fmt.Sprintf("%s/%s#%d", scopeName(tags), fn, i), func(t *testing.T) {
					testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
						f := newTwoDeviceFixture(t, b)
						b.Sim.FailNth(fn, i, driver.ErrorUnknown)
						err := f.set.Save(bg, &bytes.Buffer{}, tags...)
						b.Sim.ClearFaults()
						if err != nil {
							require.ErrorIs(t, err, driver.ErrorUnknown)
						}
						requirePattern(t, f.d1, f.v.Ptr(), 4*mib, 82)
						f.requireSlotsQuiet(t) // before anything else queues on the streams
						require.NoError(t, f.set.Save(bg, &bytes.Buffer{}, tags...), "a failed save can be retried")
					}, testutil.Devices(2), testutil.SimOnly())
				})
			}
		}
	}
}

// TestRestoreFaultMatrix fails each driver call of a Restore, one at a time, over two devices: the
// Restore fails with the driver's error or succeeds, can be retried, and leaves no copy queued from
// a slot it gave back to the pool.
func TestRestoreFaultMatrix(t *testing.T) {
	for _, tags := range checkpointScopes {
		var counts map[string]int
		var ck bytes.Buffer
		testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
			f := newTwoDeviceFixture(t, b)
			require.NoError(t, f.set.Save(bg, &ck, tags...))
			counts = callsOf(b.Sim, func() { require.NoError(t, f.set.Restore(bg, bytes.NewReader(ck.Bytes()))) })
		}, testutil.Devices(2), testutil.SimOnly())
		require.NotEmpty(t, counts)
		for fn, n := range counts {
			for i := 1; i <= n; i++ {
				t.Run(fmt.Sprintf("%s/%s#%d", scopeName(tags), fn, i), func(t *testing.T) {
					testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
						f := newTwoDeviceFixture(t, b)
						require.NoError(t, f.d1.Fill(f.v.Ptr(), 4*mib, 0, 84))
						b.Sim.FailNth(fn, i, driver.ErrorUnknown)
						err := f.set.Restore(bg, bytes.NewReader(ck.Bytes()))
						b.Sim.ClearFaults()
						if err != nil {
							require.ErrorIs(t, err, driver.ErrorUnknown)
						} else {
							requirePattern(t, f.d1, f.v.Ptr(), 4*mib, 82)
						}
						f.requireSlotsQuiet(t) // before anything else queues on the streams
						require.NoError(t, f.set.Restore(bg, bytes.NewReader(ck.Bytes())), "a failed restore can be retried")
						requirePattern(t, f.d1, f.v.Ptr(), 4*mib, 82)
					}, testutil.Devices(2), testutil.SimOnly())
				})
			}
		}
	}
}

// loaded is what Load returns.
type loaded struct {
	set  *offload.Set
	bufs []*offload.Restored
}

// TestLoadFaultMatrix: every fault in Load, alone or with each failing clean-up call (unmap,
// release, address free, unregister, stream destroy), leaves nothing that no API can free: what
// Load could not undo is freed by System.Close.
func TestLoadFaultMatrix(t *testing.T) {
	ck := saveTwoBuffers(t) // on a simulator of its own, so that every run starts alike
	n := testutil.FaultMatrix(t, testutil.FaultCase[[]byte, loaded]{
		Name:  "offload Load",
		Setup: func(testing.TB, *vmm.System) []byte { return ck },
		Op: func(sys *vmm.System, ck []byte) (loaded, error) {
			set, bufs, err := offload.Load(bg, sys, bytes.NewReader(ck), offload.Options{SlotSize: 2 * mib})
			if err == nil && len(bufs) != 2 {
				err = fmt.Errorf("loaded %d buffers, want 2", len(bufs))
			}
			return loaded{set, bufs}, err
		},
		Close: func(_ *vmm.System, _ []byte, l loaded, _ error) error {
			errs := []error{l.set.Close()}
			for _, b := range l.bufs {
				errs = append(errs, b.Close())
			}
			return errors.Join(errs...)
		},
	})
	require.Greater(t, n, 20)
}

// saveTwoBuffers returns a checkpoint of two Keep buffers: "a" of two chunks (pattern 91) and "b"
// of one (92), made on a simulator of their own.
func saveTwoBuffers(t *testing.T) []byte {
	s := sim.New()
	defer func() { require.NoError(t, s.Close()) }()
	sys, err := vmm.Open(s)
	require.NoError(t, err)
	defer func() { require.NoError(t, sys.Close()) }()
	var ck bytes.Buffer
	set := offload.NewSet(sys, offload.Options{SlotSize: 2 * mib})
	d, err := sys.Device(0)
	require.NoError(t, err)
	for i, tag := range []string{"a", "b"} {
		buf, err := newOwnedBuf(d, uint64(4-2*i)*mib, 2*mib, uint64(91+i))
		require.NoError(t, err)
		defer func() { require.NoError(t, buf.Close()) }()
		require.NoError(t, set.Add(tag, buf, offload.Keep, offload.EntryOptions{}))
	}
	require.NoError(t, set.Save(bg, &ck))
	require.NoError(t, set.Close())
	return ck.Bytes()
}

// TestLoadFailureLeavesNoCopyFromFreedSlot: a Load whose wait for a copy fails waits for the copy
// before it frees the staging slot, so no copy later reads freed host memory (which the simulator
// reports as an illegal address at the next synchronization).
func TestLoadFailureLeavesNoCopyFromFreedSlot(t *testing.T) {
	ck := saveTwoBuffers(t)
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		b.Sim.FailNth("cuStreamSynchronize", 1, driver.ErrorUnknown)
		_, bufs, err := offload.Load(bg, b.Sys, bytes.NewReader(ck), offload.Options{SlotSize: 2 * mib})
		b.Sim.ClearFaults()
		require.ErrorIs(t, err, driver.ErrorUnknown)
		require.Nil(t, bufs)
		require.NoError(t, b.Device(t, 0).Synchronize(), "no copy ran from a freed slot")
	}, testutil.SimOnly())
}
