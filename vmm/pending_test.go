package vmm_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/vmm"
)

// The ways to retry the release that failed after UnmapRange unmapped a mapping m of r.
var pendingRetries = map[string]func(r *vmm.Reservation, m *vmm.Mapping) error{
	"Reservation.Close": func(r *vmm.Reservation, _ *vmm.Mapping) error { return r.Close() },
	"Mapping.Close": func(r *vmm.Reservation, m *vmm.Mapping) error {
		if err := m.Close(); err != nil {
			return err
		}
		return r.Close()
	},
}

// A release that failed after UnmapRange unmapped its mapping is retried by the mapping's Close and
// by the reservation's Close, and then nothing is left.
func TestPendingReleaseRetried(t *testing.T) {
	for name, retry := range pendingRetries {
		t.Run(name, func(t *testing.T) {
			testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
				r, m := pendingRelease(t, b)

				require.NoError(t, retry(r, m))
				require.True(t, m.Allocation().Closed())
				require.Empty(t, b.Sys.Orphans())
			}, testutil.SimOnly())
		})
	}
}

// The same when the release failed because a range the System keeps (a failed undo's) still maps
// the allocation, and retrying that range failed too: the retry of the release retries that range
// first, as Mapping.Close and UnmapRange do before they release, and nothing is left.
func TestPendingReleaseRetriesOrphanMappingIt(t *testing.T) {
	for name, retry := range pendingRetries {
		t.Run(name, func(t *testing.T) {
			testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
				r, m := mapFilled(t, b.Device(t, 0), 2*mib, 4)
				orphanMapping(t, b, m.Allocation())
				b.Sim.FailNth("cuMemUnmap", 1, driver.ErrorUnknown) // UnmapRange's retry of the kept range
				err := r.UnmapRange(0, 2*mib)
				require.ErrorIs(t, err, vmm.ErrInUse)
				require.ErrorContains(t, err, "1 mappings still use it")
				require.NotEmpty(t, b.Sys.Orphans())

				require.NoError(t, retry(r, m))
				require.True(t, m.Allocation().Closed())
				require.Empty(t, b.Sys.Orphans())
			}, testutil.SimOnly())
		})
	}
}

// The same when what still maps the allocation is a mapping that a failed undo left in the same
// reservation: Reservation.Close closes that mapping before it retries the release, so one Close
// frees everything.
func TestPendingReleaseAfterOrphanInSameReservation(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		r, err := b.Sys.Reserve(4*mib, vmm.ReserveOptions{})
		require.NoError(t, err)
		m, err := r.MapNew(0, 2*mib, d, vmm.AllocOptions{}, vmm.ReadWrite(d))
		require.NoError(t, err)
		orphanMappingAt(t, b, r, 2*mib, m.Allocation())
		b.Sim.FailNth("cuMemUnmap", 1, driver.ErrorUnknown) // UnmapRange's retry of that mapping
		err = r.UnmapRange(0, 2*mib)
		require.ErrorIs(t, err, vmm.ErrInUse)
		require.ErrorContains(t, err, "1 mappings still use it")

		require.NoError(t, r.Close())
		require.True(t, m.Allocation().Closed())
		require.Empty(t, b.Sys.Orphans())
	}, testutil.SimOnly())
}

// A range kept by the System with a pending release, whose allocation is still mapped by an orphan
// in that same range: retrying the range (here through RetryOrphansMapping) retries the ranges that
// map the allocation, the range itself among them; that inner Close does not start the same retry
// again, and the range is freed.
func TestKeptRangeWithPendingReleaseRetried(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		a, err := d.Allocate(2*mib, vmm.AllocOptions{})
		require.NoError(t, err)
		rw := []vmm.Access{vmm.ReadWrite(d)}
		specs := []vmm.ChunkSpec{
			{Offset: 0, Allocation: a, Own: true, Access: rw},
			{Offset: 2 * mib, Allocation: a, Access: rw},
			{Offset: 4 * mib, Size: 2 * mib, Device: d, Access: rw},
		}
		b.Sim.FailNth("cuMemCreate", 1, driver.ErrorOutOfMemory)
		b.Sim.FailNth("cuMemUnmap", 1, driver.ErrorUnknown) // the undo's unmap of the chunk at 2 MiB
		b.Sim.FailNth("cuMemUnmap", 2, driver.ErrorUnknown) // its retry before chunk 0's release
		b.Sim.FailNth("cuMemUnmap", 4, driver.ErrorUnknown) // its retry before the range's Close retries that release
		b.Sim.FailNth("cuMemUnmap", 5, driver.ErrorUnknown) // its retry as the range is freed
		_, _, err = b.Sys.ReserveChunks(6*mib, vmm.ReserveOptions{}, specs)
		require.ErrorIs(t, err, driver.ErrOutOfMemory)
		require.False(t, a.Closed(), "its release is pending")
		require.NotEmpty(t, b.Sys.Orphans())

		require.NoError(t, b.Sys.RetryOrphansMapping(a))
		require.True(t, a.Closed())
		require.Empty(t, b.Sys.Orphans())
	}, testutil.SimOnly())
}

// pendingRelease maps a filled 2 MiB allocation on device 0 and unmaps it with UnmapRange, whose
// release of the allocation fails: the mapping's release is left pending in r.
func pendingRelease(t *testing.T, b *testutil.Backend) (*vmm.Reservation, *vmm.Mapping) {
	t.Helper()
	r, m := mapFilled(t, b.Device(t, 0), 2*mib, 4)
	b.Sim.FailNth("cuMemRelease", 1, driver.ErrorUnknown)
	require.ErrorIs(t, r.UnmapRange(0, 2*mib), driver.ErrorUnknown)
	require.False(t, m.Allocation().Closed(), "the release failed")
	return r, m
}

// orphanInLiveRange leaves in a new range r2, which stays live, a mapping of a on device 0 that a
// failed undo could not unmap (a MapAccess whose cuMemSetAccess fails, and then its cuMemUnmap):
// the System keeps that mapping, not the range.
func orphanInLiveRange(t *testing.T, b *testutil.Backend, a *vmm.Allocation) *vmm.Reservation {
	t.Helper()
	r2, err := b.Sys.Reserve(a.Size(), vmm.ReserveOptions{})
	require.NoError(t, err)
	orphanMappingAt(t, b, r2, 0, a)
	require.Len(t, b.Sys.Orphans(), 1, "the mapping left in r2")
	return r2
}

// orphanMappingAt maps a at off in r for device 0 with a MapAccess whose cuMemSetAccess fails and
// whose undo's cuMemUnmap fails too: the System keeps the mapping.
func orphanMappingAt(t *testing.T, b *testutil.Backend, r *vmm.Reservation, off uint64, a *vmm.Allocation) {
	t.Helper()
	b.Sim.FailNth("cuMemSetAccess", 1, driver.ErrorOutOfMemory)
	b.Sim.FailNth("cuMemUnmap", 1, driver.ErrorUnknown) // the undo's unmap
	_, err := r.MapAccess(off, a, vmm.ReadWrite(b.Device(t, 0)))
	require.ErrorContains(t, err, "kept by the System")
}

// requireOrphanInLiveRangeFreed checks that the mapping orphanInLiveRange left in r2 is gone while
// r2 stayed live, and that r2 then closes.
func requireOrphanInLiveRangeFreed(t *testing.T, b *testutil.Backend, r2 *vmm.Reservation) {
	t.Helper()
	require.Empty(t, b.Sys.Orphans())
	require.Empty(t, r2.Mappings(), "the orphan was unmapped")
	require.NoError(t, r2.Close())
}

// An allocation that a failed undo left mapped in another range, which stays live (the System keeps
// the mapping, not the range), is released by its owner's Close or UnmapRange: the release retries
// the System's orphan mappings of the allocation first, wherever they live, as it does the ranges
// the System keeps.
func TestReleaseRetriesOrphanMappingInLiveRange(t *testing.T) {
	for name, unmap := range unmapWays {
		t.Run(name, func(t *testing.T) {
			testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
				r, m := mapFilled(t, b.Device(t, 0), 2*mib, 4)
				r2 := orphanInLiveRange(t, b, m.Allocation())

				require.NoError(t, unmap(r, m), "unmapped and released")
				require.True(t, m.Allocation().Closed())
				requireOrphanInLiveRangeFreed(t, b, r2)
				require.NoError(t, r.Close())
			}, testutil.SimOnly())
		})
	}
}

// The same for Allocation.Close, once the caller's own mapping (which did not own it) is gone.
func TestAllocationCloseRetriesOrphanMappingInLiveRange(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		a, err := d.Allocate(2*mib, vmm.AllocOptions{})
		require.NoError(t, err)
		r2 := orphanInLiveRange(t, b, a)

		require.NoError(t, a.Close(), "the release retries the orphan mapping first")
		requireOrphanInLiveRangeFreed(t, b, r2)
	}, testutil.SimOnly())
}

// The same for a release left pending by UnmapRange (its cuMemRelease failed) when the allocation is
// then mapped again and that mapping's undo fails: Mapping.Close and Reservation.Close retry the
// orphan mapping before they retry the release.
func TestPendingReleaseRetriesOrphanMappingInLiveRange(t *testing.T) {
	for name, retry := range pendingRetries {
		t.Run(name, func(t *testing.T) {
			testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
				r, m := pendingRelease(t, b)
				r2 := orphanInLiveRange(t, b, m.Allocation())

				require.NoError(t, retry(r, m))
				require.True(t, m.Allocation().Closed())
				requireOrphanInLiveRangeFreed(t, b, r2)
			}, testutil.SimOnly())
		})
	}
}

// An orphan mapping that owns its allocation, whose release a caller's mapping still refuses: the
// retry of that release (RetryOrphansMapping, or its reservation's Close) retries the System's orphan
// mappings of the allocation, the orphan itself among them, and that inner Close does not start the
// same retry again (it would not end).
func TestOwningOrphanMappingRetryEnds(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		r, m := mapFilled(t, d, 2*mib, 4)
		r2, err := b.Sys.Reserve(2*mib, vmm.ReserveOptions{})
		require.NoError(t, err)
		m2, err := r2.MapAccess(0, m.Allocation(), vmm.ReadWrite(d))
		require.NoError(t, err)
		err = vmm.UndoClose(m)
		require.ErrorIs(t, err, vmm.ErrInUse)
		require.ErrorContains(t, err, "kept by the System")

		require.ErrorIs(t, b.Sys.RetryOrphansMapping(m.Allocation()), vmm.ErrInUse, "m2 still maps it")
		require.ErrorIs(t, r.Close(), vmm.ErrInUse, "its pending release is retried, and refused")
		require.NoError(t, m2.Close())
		require.NoError(t, r.Close())
		require.True(t, m.Allocation().Closed())
		require.Empty(t, b.Sys.Orphans())
		require.NoError(t, r2.Close())
	}, testutil.SimOnly())
}
