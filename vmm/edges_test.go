package vmm_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/vmm"
)

// UnmapRange over an allocation mapped twice in the range releases it through its owning mapping,
// whichever comes first.
func TestUnmapRangeOverAnAllocationMappedTwice(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		r, err := b.Sys.Reserve(4*mib, vmm.ReserveOptions{})
		require.NoError(t, err)
		defer func() { require.NoError(t, r.Close()) }()
		m, err := r.MapNew(0, 2*mib, d, vmm.AllocOptions{}, vmm.ReadWrite(d))
		require.NoError(t, err)
		_, err = r.MapAccess(2*mib, m.Allocation(), vmm.ReadWrite(d))
		require.NoError(t, err)
		require.NoError(t, r.UnmapRange(0, 4*mib))
		require.True(t, m.Allocation().Closed(), "released by its owning mapping")
		require.Empty(t, r.Mappings())
	})
}

// AccessAt keeps the CPU's access to memory at the HOST location, as to host-NUMA memory, so that a
// release and recreate keep it.
func TestAccessAtKeepsTheHostsAccessToHostMemory(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		r, err := b.Sys.Reserve(2*mib, vmm.ReserveOptions{})
		require.NoError(t, err)
		defer func() { require.NoError(t, r.Close()) }()
		m, err := r.MapNew(0, 2*mib, d, vmm.AllocOptions{Location: driver.HostLocation()}, vmm.ReadWrite(d), vmm.HostReadWrite())
		require.NoError(t, err)
		defer func() { require.NoError(t, m.Close()) }()
		acc, err := m.Allocation().AccessAt(m.Ptr())
		require.NoError(t, err)
		require.Contains(t, acc, vmm.HostReadWrite())
		require.NoError(t, m.Allocation().ReleaseAt(m.Ptr(), acc, false, nil))
		require.NoError(t, m.Allocation().RecreateAt(m.Ptr(), acc))
		f, err := m.Access(driver.HostLocation())
		require.NoError(t, err)
		require.Equal(t, driver.AccessReadWrite, f)
	}, testutil.SimOnly())
}

// RequireHint without a hint is refused at once, not after reserving somewhere.
func TestRequireHintWithoutAHint(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		_, err := b.Sys.Reserve(2*mib, vmm.ReserveOptions{RequireHint: true})
		require.ErrorIs(t, err, vmm.ErrInvalidValue)
		require.ErrorContains(t, err, "RequireHint without a hint")
	})
}

// The statistics forget every mapping an unmap covers, also past a sleeping chunk, which has no
// entry of its own.
func TestStatsForgetMappingsPastASleepingChunk(t *testing.T) {
	_, sys, d := ownSim(t)
	r, err := sys.Reserve(4*mib, vmm.ReserveOptions{})
	require.NoError(t, err)
	m0, err := r.MapNew(0, 2*mib, d, vmm.AllocOptions{}, vmm.ReadWrite(d))
	require.NoError(t, err)
	_, err = r.MapNew(2*mib, 2*mib, d, vmm.AllocOptions{}, vmm.ReadWrite(d))
	require.NoError(t, err)
	acc, err := m0.Allocation().AccessAt(m0.Ptr())
	require.NoError(t, err)
	require.NoError(t, m0.Allocation().ReleaseAt(m0.Ptr(), acc, false, nil))
	require.NoError(t, r.UnmapRange(0, 4*mib))
	require.NoError(t, r.Close())
	ds := sys.Stats().Devices[0]
	require.Zero(t, ds.MappedBytes)
	require.Zero(t, ds.Live.Mappings)
	require.NoError(t, sys.Close())
}

// A wake (RecreateAt) of a sleeping allocation while its mapping is being closed is refused with
// ErrInUse; it would map memory that no Mapping owns, and the reservation could never be freed.
func TestRecreateWhileTheMappingCloses(t *testing.T) {
	u, d := hookedSim(t)
	r, err := d.System().Reserve(2*mib, vmm.ReserveOptions{})
	require.NoError(t, err)
	m, err := r.MapNew(0, 2*mib, d, vmm.AllocOptions{}, vmm.ReadWrite(d))
	require.NoError(t, err)
	a, acc := m.Allocation(), []vmm.Access{vmm.ReadWrite(d)}
	require.NoError(t, a.ReleaseAt(m.Ptr(), acc, false, nil))
	var recreated error
	u.afterUnmap = func() {
		done := make(chan error)
		go func() { done <- a.RecreateAt(m.Ptr(), acc) }()
		recreated = <-done
	}
	require.NoError(t, m.Close())
	require.ErrorIs(t, recreated, vmm.ErrInUse)
	require.ErrorIs(t, a.RecreateAt(m.Ptr(), acc), vmm.ErrClosed, "after the Close the allocation is gone")
	require.NoError(t, r.Close())
}

// A System.Close that will fail (a stream is still open) fails at once, without waiting for that
// stream's Synchronize, and without making other calls wait behind it.
func TestCloseWhileAStreamSynchronizesFailsAtOnce(t *testing.T) {
	s, sys, d := ownSim(t)
	st, err := d.NewStream(true)
	require.NoError(t, err)
	require.NoError(t, s.HoldStream(st.Handle()))
	synced := make(chan error, 1)
	go func() { synced <- st.Synchronize() }()
	time.Sleep(50 * time.Millisecond) // the Synchronize waits
	closed := make(chan error, 1)
	go func() { closed <- sys.Close() }()
	select {
	case err := <-closed:
		require.ErrorIs(t, err, vmm.ErrInUse)
		require.ErrorContains(t, err, "stream")
	case <-time.After(2 * time.Second):
		require.NoError(t, s.ReleaseStream(st.Handle()))
		<-closed
		t.Fatal("Close waited for the Synchronize")
	}
	_, _, err = d.MemInfo()
	require.NoError(t, err, "other calls go on")
	require.NoError(t, s.ReleaseStream(st.Handle()))
	require.NoError(t, <-synced)
	require.NoError(t, st.Close())
	require.NoError(t, sys.Close())
}

// Calls on a nil System or Device are errors, as their siblings' are, never panics.
func TestNilSystemAndDevice(t *testing.T) {
	var sys *vmm.System
	_, err := sys.Devices()
	require.ErrorIs(t, err, vmm.ErrClosed)
	_, err = sys.Reserve(2*mib, vmm.ReserveOptions{})
	require.ErrorIs(t, err, vmm.ErrClosed)
	var d *vmm.Device
	_, err = d.CreateStream(vmm.StreamOptions{})
	require.ErrorIs(t, err, vmm.ErrInvalidValue)
	_, err = d.NewEvent(false)
	require.ErrorIs(t, err, vmm.ErrInvalidValue)
	_, err = d.NewBlockingEvent()
	require.ErrorIs(t, err, vmm.ErrInvalidValue)
	_, err = d.AllocPlain(4096)
	require.ErrorIs(t, err, vmm.ErrInvalidValue)
	_, err = d.DeviceGranularity()
	require.ErrorIs(t, err, vmm.ErrInvalidValue)
}

// A closed System keeps nothing to retry: Keep tries the clean-up at once and says whether it failed.
func TestKeepOnAClosedSystem(t *testing.T) {
	_, sys, _ := ownSim(t)
	require.NoError(t, sys.Close())
	tried := 0
	require.NoError(t, sys.Keep("a thing", func() error { tried++; return nil }))
	err := sys.Keep("another", func() error { tried++; return vmm.ErrInUse })
	require.ErrorIs(t, err, vmm.ErrInUse)
	require.ErrorContains(t, err, "nothing retries it")
	require.Equal(t, 2, tried)
	require.Empty(t, sys.Orphans())
}
