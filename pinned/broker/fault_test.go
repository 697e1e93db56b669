package broker

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/vmm"
)

// registerState is a broker serving a region, a worker connected to it, and the worker's buffer of
// three chunks with a hole.
type registerState struct {
	dir    string
	region *pinned.Region
	srv    *Server
	served chan error
	c      *Client
	res    *vmm.Reservation
}

func (s *registerState) close(b *Buffer) error {
	errs := []error{b.Close(), s.c.Close(), s.srv.Close()}
	if s.served != nil {
		errs = append(errs, <-s.served)
		s.served = nil
	}
	errs = append(errs, s.region.Close())
	for _, m := range s.res.Mappings() {
		errs = append(errs, m.Close())
	}
	errs = append(errs, s.res.Close(), os.RemoveAll(s.dir))
	return errors.Join(errs...)
}

// Every fault on either side of Register (the worker's export, the broker's import, reserve, map,
// access), alone or with each failing clean-up call, leaves nothing that no API can free, and the
// broker keeps serving.
func TestRegisterFaultMatrix(t *testing.T) {
	n := testutil.FaultMatrix(t, testutil.FaultCase[*registerState, *Buffer]{
		Name: "broker Register",
		Setup: func(t testing.TB, sys *vmm.System) *registerState {
			dev, err := sys.Device(0)
			require.NoError(t, err)
			s := &registerState{dir: privateDir(t)}
			s.region, err = pinned.New(dev, 4*mib, pinned.Options{})
			require.NoError(t, err)
			s.srv, err = Listen(s.region, filepath.Join(s.dir, "b.sock"), Options{StreamsPerDevice: 1})
			require.NoError(t, err)
			s.served = make(chan error, 1)
			go func() { s.served <- s.srv.Serve() }()
			s.c, err = DialContext(context.Background(), filepath.Join(s.dir, "b.sock"), DialOptions{})
			require.NoError(t, err)
			s.res, err = sys.Reserve(8*mib, vmm.ReserveOptions{})
			require.NoError(t, err)
			for _, off := range []uint64{0, 2 * mib, 6 * mib} {
				_, err := s.res.MapNew(off, 2*mib, dev, vmm.AllocOptions{HandleTypes: driver.HandleTypePosixFD}, vmm.ReadWrite(dev))
				require.NoError(t, err)
			}
			return s
		},
		Op: func(sys *vmm.System, s *registerState) (*Buffer, error) {
			b, err := s.c.Register(context.Background(), ipc.FromReservation(s.res))
			if err != nil {
				// A failed register costs the worker nothing: the connection still serves.
				if perr := s.c.Ping(context.Background()); perr != nil {
					return nil, errors.Join(err, perr)
				}
			}
			return b, err
		},
		Close: func(sys *vmm.System, s *registerState, b *Buffer, _ error) error { return s.close(b) },
		Primary: []string{"cuMemExportToShareableHandle", "cuMemImportFromShareableHandle",
			"cuMemGetAllocationPropertiesFromHandle", "cuMemAddressReserve", "cuMemMap", "cuMemSetAccess"},
	})
	require.Greater(t, n, 20)
}

// A Close whose stream destroy fails reports it, keeps the stream, and frees it on the next Close.
func TestServerCloseRetriesStreams(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		dev := b.Device(t, 0)
		region := newRegion(t, dev, 4*mib, pinned.Options{})
		srv, err := Listen(region, filepath.Join(privateDir(t), "b.sock"), Options{StreamsPerDevice: 2})
		require.NoError(t, err)
		b.Sim.FailNth("cuStreamDestroy", 2, driver.ErrorUnknown)
		b.Sim.FailNth("cuEventDestroy", 1, driver.ErrorUnknown)
		require.Error(t, srv.Close())
		require.Equal(t, 1, b.Sim.Live().Streams)
		require.Equal(t, 1, b.Sim.Live().Events)
		require.NoError(t, srv.Close())
		require.Zero(t, b.Sim.Live().Streams)
		require.Zero(t, b.Sim.Live().Events)
		require.NoError(t, srv.Close())
	}, testutil.SimOnly())
}

// A Listen whose second copy stream or its event cannot be made fails and leaves no stream or event.
func TestListenFailureLeavesNothing(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		dev := b.Device(t, 0)
		region := newRegion(t, dev, 4*mib, pinned.Options{})
		before := b.Sim.Live()
		for _, fn := range []string{"cuStreamCreate", "cuEventCreate"} {
			b.Sim.FailNth(fn, 2, driver.ErrorOutOfMemory)
			_, err := Listen(region, filepath.Join(privateDir(t), "b.sock"), Options{StreamsPerDevice: 2})
			require.ErrorIs(t, err, driver.ErrOutOfMemory, fn)
			b.Sim.ClearFaults()
			require.Equal(t, before.Streams, b.Sim.Live().Streams, fn)
			require.Equal(t, before.Events, b.Sim.Live().Events, fn)
		}
	}, testutil.SimOnly())
}
