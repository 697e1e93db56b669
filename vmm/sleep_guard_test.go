package vmm_test

import (
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/vmm"
)

// ReleaseAt refuses what would free memory that something still uses: an address where the
// allocation is not mapped (another allocation's memory would be unmapped), and a held allocation
// (an NCCL registration, say). Each refusal leaves both mappings usable.
func TestReleaseAtRefusesWhatIsInUse(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		res, err := b.Sys.Reserve(4<<20, vmm.ReserveOptions{})
		require.NoError(t, err)
		defer func() { require.NoError(t, res.Close()) }()
		m1, err := res.MapNew(0, 2<<20, d, vmm.AllocOptions{}, vmm.ReadWrite(d))
		require.NoError(t, err)
		defer func() { require.NoError(t, m1.Close()) }()
		m2, err := res.MapNew(2<<20, 2<<20, d, vmm.AllocOptions{}, vmm.ReadWrite(d))
		require.NoError(t, err)
		defer func() { require.NoError(t, m2.Close()) }()
		require.NoError(t, d.Fill(m2.Ptr(), 2<<20, 0, 7))
		rw := []vmm.Access{vmm.ReadWrite(d)}

		err = m1.Allocation().ReleaseAt(m2.Ptr(), rw, false, nil)
		require.ErrorIs(t, err, vmm.ErrInvalidValue)
		require.ErrorContains(t, err, "one mapping, at that address")
		requireFilled(t, d, m2.Ptr(), 2<<20, 7)

		release, err := m2.Allocation().Hold("an NCCL registration")
		require.NoError(t, err)
		err = m2.Allocation().ReleaseAt(m2.Ptr(), rw, false, nil)
		require.ErrorIs(t, err, vmm.ErrInUse)
		require.ErrorContains(t, err, "an NCCL registration")
		require.False(t, m2.Allocation().Asleep())
		requireFilled(t, d, m2.Ptr(), 2<<20, 7)
		release()
	})
}

// An allocation released to sleep cannot be exported or mapped (its memory is gone): ErrAsleep.
// Once the Mapping it slept in is closed, RecreateAt refuses: memory mapped then would belong to no
// Mapping, and the reservation could never be freed.
func TestAsleepAllocationRefusesUse(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d, res, a, m := exportableMapping(t, b)
		ptr, rw := m.Ptr(), []vmm.Access{vmm.ReadWrite(d)}
		require.NoError(t, a.ReleaseAt(ptr, rw, false, nil))

		_, err := a.Export(driver.HandleTypePosixFD)
		require.ErrorIs(t, err, vmm.ErrAsleep)
		_, err = res.MapAccess(2<<20, a, vmm.ReadWrite(d))
		require.ErrorIs(t, err, vmm.ErrAsleep)
		require.ErrorIs(t, a.RecreateAt(ptr+1<<20, rw), vmm.ErrInvalidValue, "not where it sleeps")

		require.NoError(t, m.Close())
		require.ErrorIs(t, a.RecreateAt(ptr, rw), vmm.ErrInvalidValue)
		require.True(t, a.Asleep(), "nothing was mapped")
	})
}

// Close of an allocation racing with a MapAccess of it: either the map wins and Close fails with
// ErrInUse, or Close wins and the map fails with ErrClosed; never both succeed.
func TestCloseRacesMap(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		res, err := b.Sys.Reserve(2<<20, vmm.ReserveOptions{})
		require.NoError(t, err)
		defer func() { require.NoError(t, res.Close()) }()
		for range 500 {
			a, err := d.Allocate(2<<20, vmm.AllocOptions{})
			require.NoError(t, err)
			var m *vmm.Mapping
			var merr, cerr error
			var wg sync.WaitGroup
			wg.Go(func() { m, merr = res.MapAccess(0, a) })
			wg.Go(func() { cerr = a.Close() })
			wg.Wait()
			require.True(t, (merr == nil) != (cerr == nil), "map: %v; close: %v", merr, cerr)
			if merr == nil {
				require.ErrorIs(t, cerr, vmm.ErrInUse)
				require.NoError(t, m.Close())
			} else {
				require.ErrorIs(t, merr, vmm.ErrClosed)
			}
			require.NoError(t, a.Close())
		}
	}, testutil.SimOnly())
}

// Export, Handle and MapAccess read the handle that ReleaseAt and RecreateAt change: under the race
// detector, running them at once finds no race, and every export either succeeds or says asleep.
func TestHandleReadersRaceSleep(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d, _, a, m := exportableMapping(t, b)
		defer func() { require.NoError(t, m.Close()) }()
		var wg sync.WaitGroup
		wg.Go(func() {
			for range 300 {
				if a.ReleaseAt(m.Ptr(), nil, true, nil) == nil {
					require.NoError(t, a.RecreateAt(m.Ptr(), []vmm.Access{vmm.ReadWrite(d)}))
				}
			}
		})
		wg.Go(func() {
			for range 300 {
				f, err := a.Export(driver.HandleTypePosixFD)
				if err != nil {
					require.ErrorIs(t, err, vmm.ErrAsleep)
					continue
				}
				require.NoError(t, f.Close())
				_ = a.Handle()
			}
		})
		wg.Wait()
	}, testutil.SimOnly())
}

// requireFilled checks that [ptr, ptr+size) still holds the pattern of seed.
func requireFilled(t *testing.T, d *vmm.Device, ptr driver.DevicePtr, size, seed uint64) {
	t.Helper()
	bad, err := d.Verify(ptr, size, 0, seed)
	require.NoError(t, err)
	require.Zero(t, bad, "words changed")
}

// exportableMapping is an exportable 2 MiB allocation mapped at the start of a 4 MiB reservation;
// the allocation and the reservation are closed at the end of the test (the mapping is the test's).
func exportableMapping(t *testing.T, b *testutil.Backend) (*vmm.Device, *vmm.Reservation, *vmm.Allocation, *vmm.Mapping) {
	t.Helper()
	d := b.Device(t, 0)
	res, err := b.Sys.Reserve(4<<20, vmm.ReserveOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, res.Close()) })
	a, err := d.Allocate(2<<20, vmm.AllocOptions{HandleTypes: driver.HandleTypePosixFD})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, a.Close()) })
	m, err := res.MapAccess(0, a, vmm.ReadWrite(d))
	require.NoError(t, err)
	return d, res, a, m
}

// recreateFailing puts an exportable mapping's allocation to sleep, then wakes it with
// cuMemSetAccess and then (undoing) the call undo failing once, and returns what RecreateAt
// returned. The mapping is closed when the test ends.
func recreateFailing(t *testing.T, b *testutil.Backend, undo string) (*vmm.Device, *vmm.Allocation, *vmm.Mapping, []vmm.Access, error) {
	t.Helper()
	d, _, a, m := exportableMapping(t, b)
	t.Cleanup(func() { require.NoError(t, m.Close()) })
	rw := []vmm.Access{vmm.ReadWrite(d)}
	require.NoError(t, a.ReleaseAt(m.Ptr(), rw, false, nil))
	b.Sim.FailNth("cuMemSetAccess", 1, driver.ErrorUnknown)
	b.Sim.FailNth(undo, 1, driver.ErrorUnknown)
	err := a.RecreateAt(m.Ptr(), rw)
	b.Sim.ClearFaults()
	return d, a, m, rw, err
}

// When RecreateAt cannot grant access and cannot unmap either, the new memory stays mapped and is
// not released under the mapping: the allocation is awake (the error says so), ReleaseAt puts it
// back to sleep, and a later RecreateAt works.
func TestRecreateWhoseUndoFailsStaysMapped(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d, a, m, rw, err := recreateFailing(t, b, "cuMemUnmap")
		require.ErrorIs(t, err, driver.ErrorUnknown)
		require.ErrorContains(t, err, "mapped, but without the access asked")
		require.False(t, a.Asleep())
		require.NoError(t, a.ReleaseAt(m.Ptr(), rw, false, nil))
		require.NoError(t, a.RecreateAt(m.Ptr(), rw))
		require.NoError(t, d.Fill(m.Ptr(), 2<<20, 0, 9))
		requireFilled(t, d, m.Ptr(), 2<<20, 9)
	}, testutil.SimOnly())
}

// When RecreateAt cannot grant access to the memory it made and cannot release it either, the memory
// is kept, unmapped: the allocation stays asleep, the next RecreateAt maps that memory, and nothing
// is left behind once everything is closed (the simulator's leak check).
func TestRecreateWhoseReleaseFailsKeepsMemory(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d, a, m, rw, err := recreateFailing(t, b, "cuMemRelease")
		require.ErrorIs(t, err, driver.ErrorUnknown)
		require.True(t, a.Asleep())
		creates := b.Sim.Calls("cuMemCreate")
		require.NoError(t, a.RecreateAt(m.Ptr(), rw))
		require.Equal(t, creates, b.Sim.Calls("cuMemCreate"), "the kept memory is mapped, none is made")
		require.NoError(t, d.Fill(m.Ptr(), 2<<20, 0, 6))
		requireFilled(t, d, m.Ptr(), 2<<20, 6)
	}, testutil.SimOnly())
}

// When ReleaseAt cannot release the memory and cannot map it again either, the memory is kept,
// unmapped, with its content: the allocation is asleep (the error says so), RecreateAt maps that
// same memory with its content, and Close releases it if it is closed while asleep.
func TestReleaseWhoseUndoFailsKeepsMemory(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d, _, a, m := exportableMapping(t, b)
		rw := []vmm.Access{vmm.ReadWrite(d)}
		require.NoError(t, d.Fill(m.Ptr(), 2<<20, 0, 4))
		releaseFailingTwice := func() error {
			b.Sim.FailNth("cuMemRelease", 1, driver.ErrorUnknown)
			b.Sim.FailNth("cuMemMap", 1, driver.ErrorUnknown)
			defer b.Sim.ClearFaults()
			return a.ReleaseAt(m.Ptr(), rw, false, nil)
		}
		err := releaseFailingTwice()
		require.ErrorIs(t, err, driver.ErrorUnknown)
		require.ErrorContains(t, err, "asleep with its memory kept")
		require.True(t, a.Asleep())
		require.ErrorIs(t, a.ReleaseAt(m.Ptr(), rw, false, nil), vmm.ErrAsleep)

		b.Sim.FailNth("cuMemMap", 1, driver.ErrorUnknown)
		require.ErrorIs(t, a.RecreateAt(m.Ptr(), rw), driver.ErrorUnknown)
		b.Sim.ClearFaults()
		require.True(t, a.Asleep(), "a failed map keeps it asleep, memory and all")
		require.NoError(t, a.RecreateAt(m.Ptr(), rw))
		requireFilled(t, d, m.Ptr(), 2<<20, 4)

		// Closed while asleep with its memory kept: the memory is released (the simulator's leak
		// check at the end of the test fails otherwise).
		require.Error(t, releaseFailingTwice())
		require.NoError(t, m.Close())
		b.Sim.FailNth("cuMemRelease", 1, driver.ErrorUnknown)
		require.ErrorIs(t, a.Close(), driver.ErrorUnknown)
		b.Sim.ClearFaults()
		require.NoError(t, a.Close())
	}, testutil.SimOnly())
}

// The same when the release fails and the memory maps again but cannot get its access back: it is
// unmapped again and kept, asleep, and RecreateAt gives it back with its content and access.
func TestReleaseWhoseAccessUndoFailsKeepsMemory(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d, _, a, m := exportableMapping(t, b)
		defer func() { require.NoError(t, m.Close()) }()
		rw := []vmm.Access{vmm.ReadWrite(d)}
		require.NoError(t, d.Fill(m.Ptr(), 2<<20, 0, 6))
		b.Sim.FailNth("cuMemRelease", 1, driver.ErrorUnknown)
		b.Sim.FailNth("cuMemSetAccess", 1, driver.ErrorUnknown)
		err := a.ReleaseAt(m.Ptr(), rw, false, nil)
		b.Sim.ClearFaults()
		require.ErrorIs(t, err, driver.ErrorUnknown)
		require.ErrorContains(t, err, "asleep with its memory kept")
		require.True(t, a.Asleep())
		require.NoError(t, a.RecreateAt(m.Ptr(), rw))
		requireFilled(t, d, m.Ptr(), 2<<20, 6)
	}, testutil.SimOnly())
}
