package offload_test

import (
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/offload"
	"github.com/cuvmm/cuvmm/vmm"
)

// failUndrainedWake arms the faults of a Wake on one device that can neither drain its copies nor
// synchronize the device.
func failUndrainedWake(s *sim.Sim) {
	for range 1 + vmm.DrainAttempts {
		s.FailNth("cuStreamSynchronize", 1, driver.ErrorUnknown)
	}
	s.FailNth("cuCtxSynchronize", 1, driver.ErrorUnknown)
}

// TestWakeUndrainedOnTwoDevicesHoldsBackupForBoth: a buffer with a chunk on each of two devices,
// whose Wake could synchronize neither, stays busy on both; when the System's retry synchronizes
// only one of them, a close of the buffer holds its backup (the other device's copy still reads
// it) rather than freeing it.
func TestWakeUndrainedOnTwoDevicesHoldsBackupForBoth(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d0, d1 := b.Device(t, 0), b.Device(t, 1)
		res, err := b.Sys.Reserve(4*mib, vmm.ReserveOptions{})
		require.NoError(t, err)
		m0, err := res.MapNew(0, 2*mib, d0, vmm.AllocOptions{}, vmm.ReadWrite(d0))
		require.NoError(t, err)
		m1, err := res.MapNew(2*mib, 2*mib, d1, vmm.AllocOptions{}, vmm.ReadWrite(d1))
		require.NoError(t, err)
		set := newSet(t, b, offload.Options{SlotSize: 4 * mib})
		require.NoError(t, set.Add("s", offload.Mappings(res), offload.Keep, offload.EntryOptions{}))
		require.NoError(t, set.Sleep(bg, "s"))
		backup := set.BackupBytes()

		for range 2 * (1 + vmm.DrainAttempts) { // both devices' waits and drains
			b.Sim.FailNth("cuStreamSynchronize", 1, driver.ErrorUnknown)
		}
		b.Sim.FailNth("cuCtxSynchronize", 1, driver.ErrorUnknown)
		b.Sim.FailNth("cuCtxSynchronize", 1, driver.ErrorUnknown)
		require.ErrorContains(t, set.Wake(bg, "s"), "kept by the System")
		b.Sim.ClearFaults()
		require.ElementsMatch(t, []*vmm.Device{d0, d1}, offload.BusyDevices(set, "s"))

		// The retry runs the orphans in order: the first one's device synchronizes, the second's
		// does not (in either pass).
		orphans := b.Sys.Orphans()
		require.Len(t, orphans, 2)
		synced, other := d0, d1
		if strings.Contains(orphans[0], d1.String()) {
			synced, other = d1, d0
		}
		b.Sim.FailNth("cuCtxSynchronize", 2, driver.ErrorUnknown)
		b.Sim.FailNth("cuCtxSynchronize", 3, driver.ErrorUnknown)
		require.Error(t, b.Sys.RetryOrphans())
		b.Sim.ClearFaults()
		require.Equal(t, []*vmm.Device{other}, offload.BusyDevices(set, "s"), "%s synchronized", synced)

		require.NoError(t, errors.Join(m0.Close(), m1.Close(), res.Close()))
		require.NoError(t, set.Sleep(bg)) // reaps s
		require.NotContains(t, set.Tags(), "s")
		require.Equal(t, backup, set.BackupBytes(), "held (or pooled once %s synchronized), not freed", other)
		require.NoError(t, b.Sys.RetryOrphans())
	}, testutil.Devices(2), testutil.SimOnly())
}

// hookAPI is the simulator with a one-shot hook run after a cuCtxSynchronize that succeeded,
// before the caller sees its result.
type hookAPI struct {
	*sim.Sim
	after atomic.Pointer[func()]
}

func (h *hookAPI) CtxSynchronize() error {
	err := h.Sim.CtxSynchronize()
	if err == nil {
		if f := h.after.Swap(nil); f != nil {
			(*f)()
		}
	}
	return err
}

// TestWakeUndrainedRetryRacingWake: right after the System's retry synchronized the device,
// another Wake that can neither drain nor synchronize starts. It must wait for the retry (which
// holds the set's lock), so that the retry never acts on a synchronization older than the Wake's
// copies: no chunk is released under a queued copy, and the backup those copies read is held, not
// freed, when the buffer is closed.
func TestWakeUndrainedRetryRacingWake(t *testing.T) {
	h := &hookAPI{}
	s, sys, set, closeBuf := newMappedSetOn(t, func(s *sim.Sim) driver.API { h.Sim = s; return h }, "k")
	d, err := sys.Device(0)
	require.NoError(t, err)
	failUndrainedWake(s)
	require.ErrorContains(t, set.Wake(bg, "k"), "kept by the System")
	s.ClearFaults()

	var wakeErr error
	done := make(chan struct{})
	hook := func() { // on the retry's thread: start the Wake, give it time to run if it could
		go func() {
			defer close(done)
			failUndrainedWake(s)
			wakeErr = set.Wake(bg, "k")
		}()
		select {
		case <-done:
		case <-time.After(100 * time.Millisecond):
		}
	}
	h.after.Store(&hook)
	require.NoError(t, sys.RetryOrphans())
	<-done
	s.ClearFaults()
	require.ErrorContains(t, wakeErr, "kept by the System", "the racing Wake left its copy queued")
	require.True(t, set.Asleep("k"))
	require.NoError(t, d.Synchronize(), "no copy left queued into released memory")

	require.NoError(t, closeBuf["k"]())
	delete(closeBuf, "k")
	require.NoError(t, set.Sleep(bg)) // reaps k
	require.NotContains(t, set.Tags(), "k")
	require.Equal(t, uint64(4*mib), set.BackupBytes(), "k's backup is held until the device synchronizes")
	require.NoError(t, sys.RetryOrphans())
}

// newMappedSet is a set on a one-device simulator holding, for each tag, a reservation with one
// 4 MiB mapping (Mappings), filled and asleep. The test's cleanup closes everything left in
// closeBuf, the set and the System, and checks that nothing leaked.
func newMappedSet(t *testing.T, tags ...string) (s *sim.Sim, sys *vmm.System, set *offload.Set, closeBuf map[string]func() error) {
	return newMappedSetOn(t, func(s *sim.Sim) driver.API { return s }, tags...)
}

// newMappedSetOn is newMappedSet with the System opened on api(s), a wrapper of the simulator.
func newMappedSetOn(t *testing.T, api func(*sim.Sim) driver.API, tags ...string) (s *sim.Sim, sys *vmm.System, set *offload.Set, closeBuf map[string]func() error) {
	s = sim.New()
	sys, err := vmm.Open(api(s))
	require.NoError(t, err)
	d, err := sys.Device(0)
	require.NoError(t, err)
	set = offload.NewSet(sys, offload.Options{SlotSize: 4 * mib})
	closeBuf = map[string]func() error{}
	for _, tag := range tags {
		res, err := sys.Reserve(4*mib, vmm.ReserveOptions{})
		require.NoError(t, err)
		m, err := res.MapNew(0, 4*mib, d, vmm.AllocOptions{}, vmm.ReadWrite(d))
		require.NoError(t, err)
		require.NoError(t, d.Fill(res.Ptr(), 4*mib, 0, 81))
		require.NoError(t, set.Add(tag, offload.Mappings(res), offload.Keep, offload.EntryOptions{}))
		closeBuf[tag] = func() error { return errors.Join(m.Close(), res.Close()) }
	}
	require.NoError(t, set.Sleep(bg))
	t.Cleanup(func() {
		s.ClearFaults()
		require.NoError(t, set.Wake(bg))
		require.NoError(t, set.Close())
		for _, c := range closeBuf {
			require.NoError(t, c())
		}
		require.NoError(t, sys.RetryOrphans())
		require.NoError(t, sys.Close())
		require.True(t, s.Live().Zero(), "simulator objects leaked: %s", s.Live())
		require.NoError(t, s.Close())
	})
	return s, sys, set, closeBuf
}

// TestWakeUndrainedBusyOnlyWhereCopiesRan: a failed Wake that stopped at its first buffer marks
// busy only that one (no copy into the second was queued), and once the System's retry
// synchronized the device, closing the second buffer frees its backup.
func TestWakeUndrainedBusyOnlyWhereCopiesRan(t *testing.T) {
	s, sys, set, closeBuf := newMappedSet(t, "a", "b")
	failUndrainedWake(s)
	require.ErrorContains(t, set.Wake(bg), "kept by the System")
	s.ClearFaults()
	require.Len(t, sys.Orphans(), 1, "only a's chunk was recreated")
	require.Empty(t, offload.BusyDevices(set, "b"))
	require.NoError(t, sys.RetryOrphans())
	require.Empty(t, offload.BusyDevices(set, "a"), "the retry synchronized the device")

	require.NoError(t, closeBuf["b"]())
	delete(closeBuf, "b")
	require.NoError(t, set.Sleep(bg)) // reaps b
	require.NotContains(t, set.Tags(), "b")
	require.Equal(t, uint64(4*mib), set.BackupBytes(), "b's backup freed when b was closed")
}

// TestWakeUndrainedThenSynchronizedClearsBusy: a later Wake that cannot drain its stream but does
// synchronize the device (under the set's lock) takes the device off busy, so closing the buffer
// frees its backup.
func TestWakeUndrainedThenSynchronizedClearsBusy(t *testing.T) {
	s, sys, set, closeBuf := newMappedSet(t, "k")
	failUndrainedWake(s)
	require.ErrorContains(t, set.Wake(bg, "k"), "kept by the System")
	s.ClearFaults()
	for range 1 + vmm.DrainAttempts {
		s.FailNth("cuStreamSynchronize", 1, driver.ErrorUnknown)
	}
	require.ErrorContains(t, set.Wake(bg, "k"), "the devices were synchronized")
	s.ClearFaults()
	require.True(t, set.Asleep("k"))
	require.Empty(t, offload.BusyDevices(set, "k"))

	require.NoError(t, closeBuf["k"]())
	delete(closeBuf, "k")
	require.NoError(t, set.Sleep(bg)) // reaps k
	require.NotContains(t, set.Tags(), "k")
	require.Zero(t, set.BackupBytes(), "k's backup freed when k was closed")
	require.NoError(t, sys.RetryOrphans())
}
