package vmm_test

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/vmm"
)

// unmapHook is the simulator with hooks run at the start of each cuMemUnmap and, once, right after
// one succeeds, while the caller of the unmap holds whatever locks it holds then.
type unmapHook struct {
	*sim.Sim
	onUnmap    func()
	afterUnmap func()
}

func (u *unmapHook) MemUnmap(ptr driver.DevicePtr, size uint64) error {
	if f := u.onUnmap; f != nil {
		f()
	}
	err := u.Sim.MemUnmap(ptr, size)
	if f := u.afterUnmap; f != nil && err == nil {
		u.afterUnmap = nil
		f()
	}
	return err
}

// hookedSim opens a System on a simulator whose cuMemUnmap runs u.onUnmap first; the test ends with
// the System closed and nothing left in the simulator.
func hookedSim(t *testing.T) (*unmapHook, *vmm.Device) {
	t.Helper()
	u := &unmapHook{Sim: sim.New()}
	sys, err := vmm.Open(u)
	require.NoError(t, err)
	t.Cleanup(func() {
		require.NoError(t, sys.Close())
		require.True(t, u.Live().Zero(), u.Live().String())
		require.NoError(t, u.Close())
	})
	d, err := sys.Device(0)
	require.NoError(t, err)
	return u, d
}

// holdAsync calls a.Hold on another goroutine, releases what it got at once, and sends Hold's error.
func holdAsync(a *vmm.Allocation) <-chan error {
	done := make(chan error, 1)
	go func() {
		release, err := a.Hold("a test")
		if release != nil {
			release()
		}
		done <- err
	}()
	return done
}

// holdNow is holdAsync waited for: Hold must answer at once, not wait for the unmap to end.
func holdNow(a *vmm.Allocation) error {
	select {
	case err := <-holdAsync(a):
		return err
	case <-time.After(10 * time.Second):
		return errors.New("Hold waited for the unmap")
	}
}

// holdsDuringUnmap makes the next cuMemUnmap call Hold on each of as first; the errors are in order.
func holdsDuringUnmap(u *unmapHook, as ...*vmm.Allocation) *[]error {
	errs := new([]error)
	u.onUnmap = func() {
		u.onUnmap = nil
		for _, a := range as {
			*errs = append(*errs, holdNow(a))
		}
	}
	return errs
}

func requireRefusedAsUnmapping(t *testing.T, errs []error, n int) {
	t.Helper()
	require.Len(t, errs, n, "cuMemUnmap ran the hook")
	for _, err := range errs {
		require.ErrorIs(t, err, vmm.ErrInUse, "a Hold during the unmap")
		require.ErrorContains(t, err, "being unmapped")
	}
}

// A Hold that comes while a mapping of the allocation is being unmapped (between the check for
// holds and cuMemUnmap, or during it) fails with ErrInUse and the unmap goes on: the holder never
// holds memory that is going away. Once the unmap ends, Hold works again while the allocation
// lives, and fails with ErrClosed once the unmap closed it.
func TestHoldDuringUnmapFails(t *testing.T) {
	t.Run("Mapping.Close, mapped elsewhere too", func(t *testing.T) {
		u, d := hookedSim(t)
		a, err := d.Allocate(2*mib, vmm.AllocOptions{})
		require.NoError(t, err)
		r, err := d.System().Reserve(4*mib, vmm.ReserveOptions{})
		require.NoError(t, err)
		m1, err := r.MapAccess(0, a, vmm.ReadWrite(d))
		require.NoError(t, err)
		m2, err := r.MapAccess(2*mib, a, vmm.ReadWrite(d))
		require.NoError(t, err)

		errs := holdsDuringUnmap(u, a)
		require.NoError(t, m1.Close())
		requireRefusedAsUnmapping(t, *errs, 1)

		release, err := a.Hold("a test")
		require.NoError(t, err, "the unmap ended; a is still mapped at m2")
		require.ErrorIs(t, m2.Close(), vmm.ErrInUse)
		release()
		require.NoError(t, m2.Close())
		require.NoError(t, a.Close())
		require.NoError(t, r.Close())
	})
	t.Run("Mapping.Close of an owned allocation", func(t *testing.T) {
		u, d := hookedSim(t)
		r, m := mapFilled(t, d, 2*mib, 1)

		errs := holdsDuringUnmap(u, m.Allocation())
		require.NoError(t, m.Close())
		requireRefusedAsUnmapping(t, *errs, 1)
		require.ErrorIs(t, holdNow(m.Allocation()), vmm.ErrClosed)
		require.NoError(t, r.Close())
	})
	t.Run("UnmapRange", func(t *testing.T) {
		u, d := hookedSim(t)
		r, err := d.System().Reserve(4*mib, vmm.ReserveOptions{})
		require.NoError(t, err)
		m1, err := r.MapNew(0, 2*mib, d, vmm.AllocOptions{}, vmm.ReadWrite(d))
		require.NoError(t, err)
		m2, err := r.MapNew(2*mib, 2*mib, d, vmm.AllocOptions{}, vmm.ReadWrite(d))
		require.NoError(t, err)

		errs := holdsDuringUnmap(u, m1.Allocation(), m2.Allocation())
		require.NoError(t, r.UnmapRange(0, 4*mib))
		requireRefusedAsUnmapping(t, *errs, 2)
		require.ErrorIs(t, holdNow(m1.Allocation()), vmm.ErrClosed)
		require.ErrorIs(t, holdNow(m2.Allocation()), vmm.ErrClosed)
		require.NoError(t, r.Close())
	})
	t.Run("a failed unmap", func(t *testing.T) {
		u, d := hookedSim(t)
		r, m := mapFilled(t, d, 2*mib, 1)

		u.FailNth("cuMemUnmap", 1, driver.ErrorUnknown)
		errs := holdsDuringUnmap(u, m.Allocation())
		require.ErrorIs(t, m.Close(), driver.ErrorUnknown)
		requireRefusedAsUnmapping(t, *errs, 1)

		release, err := m.Allocation().Hold("a test")
		require.NoError(t, err, "the unmap failed and ended: the memory is still mapped")
		require.ErrorIs(t, m.Close(), vmm.ErrInUse)
		release()
		require.NoError(t, m.Close())
		require.NoError(t, r.Close())
	})
	// ReleaseAt checks for holds and unmaps under the allocation's lock, which Hold takes: a Hold
	// that comes meanwhile waits, then finds the allocation asleep.
	t.Run("ReleaseAt", func(t *testing.T) {
		u, d := hookedSim(t)
		r, m := mapFilled(t, d, 2*mib, 1)

		var held <-chan error
		u.onUnmap = func() {
			u.onUnmap = nil
			held = holdAsync(m.Allocation())
		}
		require.NoError(t, m.Allocation().ReleaseAt(m.Ptr(), []vmm.Access{vmm.ReadWrite(d)}, false, nil))
		require.NotNil(t, held, "cuMemUnmap ran the hook")
		require.ErrorIs(t, <-held, vmm.ErrAsleep)
		require.NoError(t, m.Close())
		require.NoError(t, r.Close())
	})
}
