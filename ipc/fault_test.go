package ipc_test

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/vmm"
)

// openState is an exported buffer of four chunks with a hole (two runs for cuMemSetAccess), and its
// files as a receiver holds them.
type openState struct {
	res *vmm.Reservation
	exp *ipc.Exported
	r   *ipc.Received
}

// Every fault in Open, alone or with each failing clean-up call (unmap, release, address free),
// leaves nothing that no API can free: what Open could not undo is retried by System.Close.
func TestOpenFaultMatrix(t *testing.T) {
	n := testutil.FaultMatrix(t, testutil.FaultCase[openState, *ipc.Buffer]{
		Name: "ipc Open",
		Setup: func(t testing.TB, sys *vmm.System) openState {
			dev, err := sys.Device(0)
			require.NoError(t, err)
			res, err := sys.Reserve(10*mib, vmm.ReserveOptions{})
			require.NoError(t, err)
			for _, off := range []uint64{0, 2 * mib, 6 * mib, 8 * mib} {
				_, err := res.MapNew(off, 2*mib, dev, vmm.AllocOptions{HandleTypes: driver.HandleTypePosixFD}, vmm.ReadWrite(dev))
				require.NoError(t, err)
			}
			exp, err := ipc.Export(ipc.FromReservation(res))
			require.NoError(t, err)
			return openState{res: res, exp: exp, r: &ipc.Received{Desc: exp.Desc, Files: exp.Files}}
		},
		Op: func(sys *vmm.System, s openState) (*ipc.Buffer, error) {
			dev, err := sys.Device(0)
			if err != nil {
				return nil, err
			}
			return ipc.Open(dev, s.r, vmm.ReadWrite(dev))
		},
		Close: func(sys *vmm.System, s openState, b *ipc.Buffer, _ error) error {
			errs := []error{b.Close(), s.exp.Close()}
			for _, m := range s.res.Mappings() {
				errs = append(errs, m.Close())
			}
			return errors.Join(append(errs, s.res.Close())...)
		},
	})
	require.Greater(t, n, 20)
}

// A Buffer whose Close fails keeps what it could not close and frees it on the next Close; Close
// never reports success while it still holds something.
func TestBufferCloseRetries(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		dev := b.Device(t, 0)
		src := newBuffer(t, dev, 3, 2*mib, driver.Location{}, 0)
		r := exportSendReceive(t, src)
		base := b.Sim.Live()
		for fn, n := range map[string]int{"cuMemUnmap": 2, "cuMemRelease": 2, "cuMemAddressFree": 1} {
			buf, err := ipc.Open(dev, r)
			require.NoError(t, err)
			b.Sim.FailNth(fn, n, driver.ErrorUnknown)
			require.Error(t, buf.Close(), fn)
			b.Sim.ClearFaults()
			if fn != "cuMemRelease" { // an import of memory of this simulator is a handle, not an object Live counts
				require.NotEqual(t, base, b.Sim.Live(), "%s: something is still held", fn)
			}
			require.NoError(t, buf.Close(), fn)
			require.Equal(t, base, b.Sim.Live(), fn)
			require.NoError(t, buf.Close(), "idempotent")
		}
	}, testutil.SimOnly())
}
