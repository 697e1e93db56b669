package vmm_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/vmm"
)

// TestReleaseRecreate puts one mapped allocation to sleep and wakes it at the same address: the
// access description survives, the memory goes back to the driver, and the Mapping and Allocation
// values stay usable.
func TestReleaseRecreate(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		res, err := b.Sys.Reserve(4<<20, vmm.ReserveOptions{})
		require.NoError(t, err)
		defer func() { require.NoError(t, res.Close()) }()
		m, err := res.MapNew(0, 4<<20, d, vmm.AllocOptions{HandleTypes: driver.HandleTypePosixFD}, vmm.ReadWrite(d))
		require.NoError(t, err)
		a := m.Allocation()
		acc, err := a.AccessAt(m.Ptr())
		require.NoError(t, err)
		require.Equal(t, []vmm.Access{vmm.ReadWrite(d)}, acc)
		require.NoError(t, d.Fill(m.Ptr(), 4<<20, 0, 5))
		closed := 0

		require.NoError(t, a.ReleaseAt(m.Ptr(), acc, false, func() { closed++ }))
		require.True(t, a.Asleep())
		require.ErrorIs(t, a.ReleaseAt(m.Ptr(), acc, false, nil), vmm.ErrAsleep, "twice")
		gone, err := a.AccessAt(m.Ptr())
		require.True(t, err != nil || len(gone) == 0, "nothing mapped there while asleep: %v %v", gone, err)
		p, err := a.QueryProperties()
		require.NoError(t, err)
		require.Equal(t, a.Properties(), p, "the properties are known while asleep")

		require.NoError(t, a.RecreateAt(m.Ptr(), acc))
		require.False(t, a.Asleep())
		require.ErrorIs(t, a.RecreateAt(m.Ptr(), acc), vmm.ErrInvalidValue, "awake")
		require.NoError(t, d.Fill(m.Ptr(), 4<<20, 0, 6), "the device may write the new memory")
		got, err := a.AccessAt(m.Ptr())
		require.NoError(t, err)
		require.Equal(t, acc, got)

		// Exported: refused unless forced. Closed while asleep: the callback runs once, nothing leaks.
		f, err := a.Export(driver.HandleTypePosixFD)
		require.NoError(t, err)
		require.NoError(t, f.Close())
		require.True(t, a.Exported())
		require.ErrorIs(t, a.ReleaseAt(m.Ptr(), acc, false, nil), vmm.ErrExported)
		require.NoError(t, a.ReleaseAt(m.Ptr(), acc, true, func() { closed++ }))
		require.NoError(t, m.Close())
		require.Equal(t, 1, closed)
		require.ErrorIs(t, a.RecreateAt(m.Ptr(), acc), vmm.ErrClosed)
	})
}

// TestReleaseRefused: memory mapped twice, or not owned here, is not released.
func TestReleaseRefused(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		a, err := d.Allocate(2<<20, vmm.AllocOptions{})
		require.NoError(t, err)
		defer func() { require.NoError(t, a.Close()) }()
		require.ErrorIs(t, a.ReleaseAt(0, nil, false, nil), vmm.ErrInvalidValue, "not mapped")
		res, err := b.Sys.Reserve(4<<20, vmm.ReserveOptions{})
		require.NoError(t, err)
		defer func() { require.NoError(t, res.Close()) }()
		m1, err := res.MapAccess(0, a, vmm.ReadWrite(d))
		require.NoError(t, err)
		defer func() { require.NoError(t, m1.Close()) }()
		m2, err := res.MapAccess(2<<20, a, vmm.ReadWrite(d))
		require.NoError(t, err)
		defer func() { require.NoError(t, m2.Close()) }()
		err = a.ReleaseAt(m1.Ptr(), nil, false, nil)
		require.ErrorIs(t, err, vmm.ErrInvalidValue)
		require.ErrorContains(t, err, "2 mappings")
		require.False(t, a.Asleep())
	})
}
