package vmm_test

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/vmm"
)

// Every fault in MapNew, alone or with a failing clean-up call, leaves nothing that no API can free.
func TestMapNewFaultMatrix(t *testing.T) {
	testutil.FaultMatrix(t, testutil.FaultCase[*vmm.Reservation, *vmm.Mapping]{
		Name: "vmm MapNew",
		Setup: func(t testing.TB, sys *vmm.System) *vmm.Reservation {
			r, err := sys.Reserve(8*mib, vmm.ReserveOptions{})
			require.NoError(t, err)
			return r
		},
		Op: func(sys *vmm.System, r *vmm.Reservation) (*vmm.Mapping, error) {
			d, err := sys.Device(0)
			if err != nil {
				return nil, err
			}
			return r.MapNew(2*mib, 4*mib, d, vmm.AllocOptions{}, vmm.ReadWrite(d))
		},
		Close: func(sys *vmm.System, r *vmm.Reservation, m *vmm.Mapping, _ error) error {
			return errors.Join(m.Close(), r.Close())
		},
	})
}

// MapAccess of an existing allocation: the same guarantee.
func TestMapAccessFaultMatrix(t *testing.T) {
	type state struct {
		r *vmm.Reservation
		a *vmm.Allocation
	}
	testutil.FaultMatrix(t, testutil.FaultCase[state, *vmm.Mapping]{
		Name: "vmm MapAccess",
		Setup: func(t testing.TB, sys *vmm.System) state {
			r, err := sys.Reserve(8*mib, vmm.ReserveOptions{})
			require.NoError(t, err)
			d, err := sys.Device(0)
			require.NoError(t, err)
			a, err := d.Allocate(2*mib, vmm.AllocOptions{})
			require.NoError(t, err)
			return state{r, a}
		},
		Op: func(sys *vmm.System, s state) (*vmm.Mapping, error) {
			d, _ := sys.Device(0)
			return s.r.MapAccess(0, s.a, vmm.ReadWrite(d))
		},
		Close: func(sys *vmm.System, s state, m *vmm.Mapping, _ error) error {
			return errors.Join(m.Close(), s.a.Close(), s.r.Close())
		},
	})
}

// Reserve, granted and refused at its hint (RequireHint): a misplaced range that cannot be freed
// stays with the System, which frees it in Close.
func TestReserveFaultMatrix(t *testing.T) {
	type state struct{ first, blocker *vmm.Reservation }
	testutil.FaultMatrix(t, testutil.FaultCase[state, *vmm.Reservation]{
		Name: "vmm Reserve at a taken hint with RequireHint",
		Setup: func(t testing.TB, sys *vmm.System) state {
			first, err := sys.Reserve(64*mib, vmm.ReserveOptions{}) // under 32 MiB its end is refused anyway
			require.NoError(t, err)
			blocker, err := sys.Reserve(2*mib, vmm.ReserveOptions{Hint: first.End(), RequireHint: true})
			require.NoError(t, err)
			return state{first, blocker}
		},
		Op: func(sys *vmm.System, s state) (*vmm.Reservation, error) {
			r, err := sys.Reserve(4*mib, vmm.ReserveOptions{Hint: s.first.End(), RequireHint: true})
			if errors.Is(err, vmm.ErrHintNotGranted) && len(sys.Orphans()) == 0 {
				return nil, nil // the expected refusal
			}
			return r, err
		},
		Close: func(sys *vmm.System, s state, r *vmm.Reservation, _ error) error {
			return errors.Join(r.Close(), s.blocker.Close(), s.first.Close())
		},
	})
	testutil.FaultMatrix(t, testutil.FaultCase[*vmm.Reservation, *vmm.Reservation]{
		Name: "vmm Reserve at a free hint",
		Setup: func(t testing.TB, sys *vmm.System) *vmm.Reservation {
			first, err := sys.Reserve(64*mib, vmm.ReserveOptions{}) // the end of a smaller one is refused
			require.NoError(t, err)
			return first
		},
		Op: func(sys *vmm.System, first *vmm.Reservation) (*vmm.Reservation, error) {
			return sys.Reserve(4*mib, vmm.ReserveOptions{Hint: first.End(), RequireHint: true})
		},
		Close: func(sys *vmm.System, first, r *vmm.Reservation, _ error) error {
			return errors.Join(r.Close(), first.Close())
		},
	})
}

// Reserve with RequireHint, refused at its hint, cannot free the misplaced range: the range is not
// lost but kept by the System, which frees it in RetryOrphans (or Close).
func TestReserveHintFreeFails(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		first, err := b.Sys.Reserve(64*mib, vmm.ReserveOptions{}) // under 32 MiB its end is refused anyway
		require.NoError(t, err)
		blocker, err := b.Sys.Reserve(2*mib, vmm.ReserveOptions{Hint: first.End(), RequireHint: true})
		require.NoError(t, err)
		b.Sim.FailNth("cuMemAddressFree", 1, driver.ErrorUnknown)
		_, err = b.Sys.Reserve(4*mib, vmm.ReserveOptions{Hint: first.End(), RequireHint: true})
		require.ErrorIs(t, err, vmm.ErrHintNotGranted)
		require.ErrorContains(t, err, "kept by the System")
		require.Len(t, b.Sys.Orphans(), 1)
		require.Equal(t, 3, b.Sim.Live().Reservations, "the misplaced range is still reserved, and owned")
		require.NoError(t, b.Sys.RetryOrphans())
		require.Equal(t, 2, b.Sim.Live().Reservations)
		require.NoError(t, blocker.Close())
		require.NoError(t, first.Close())
	}, testutil.SimOnly())
}
