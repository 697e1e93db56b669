package broker

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/vmm"
)

// claimedLen describes a buffer as longer than its chunks: ipc.Export sends Len as the descriptor's
// size.
type claimedLen struct {
	vmm.Chunked
	n uint64
}

func (c claimedLen) Len() uint64 { return c.n }

// A descriptor may not claim address space past its last chunk: the broker would reserve all of it
// (up to 64 TiB per register), and a few workers would exhaust its address space. The worker's
// connection stays usable.
func TestRegisterRefusesSizePastLastChunk(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		ctx, dev, srv, path := serveDevice0(t, b, Options{})
		c := dial(t, path)
		small := newDevBuffer(t, dev, 1, 2*mib)
		reserves := b.Sim.Calls("cuMemAddressReserve")
		for _, size := range []uint64{64 << 40, 4 * mib} {
			_, err := c.Register(ctx, claimedLen{small, size})
			require.ErrorIs(t, err, ErrOutOfRange, "a descriptor of %d bytes whose chunk ends at 2 MiB", size)
			require.ErrorContains(t, err, "past a buffer's last chunk")
		}
		require.Equal(t, reserves, b.Sim.Calls("cuMemAddressReserve"), "the broker reserved address space for a refused buffer")
		require.Zero(t, srv.Stats().Buffers)
		rb, err := c.Register(ctx, small)
		require.NoError(t, err, "the connection is still usable")
		require.NoError(t, c.Copy(ctx, Request{Buffer: rb.ID(), Dir: ToDevice, Length: 4096}))
		require.NoError(t, rb.Close())
	}, testutil.SimOnly())
}

// Options.MaxRegisteredBytes caps the address space of one worker's buffers, holes included; an
// unregister gives it back, and other workers have their own.
func TestRegisterCapsAddressSpacePerWorker(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		ctx, dev, _, path := serveDevice0(t, b, Options{MaxRegisteredBytes: 8 * mib})
		c, other := dial(t, path), dial(t, path)
		sparse := newDevBuffer(t, dev, 2, 2*mib, 0) // 6 MiB of address space, 4 MiB of memory
		small := newDevBuffer(t, dev, 1, 2*mib)
		rs, err := c.Register(ctx, sparse)
		require.NoError(t, err)
		r1, err := c.Register(ctx, small)
		require.NoError(t, err)
		_, err = c.Register(ctx, small)
		require.ErrorIs(t, err, ErrLimit)
		require.ErrorContains(t, err, "MaxRegisteredBytes")
		ro, err := other.Register(ctx, sparse)
		require.NoError(t, err, "another worker's buffers counted against this one")
		require.NoError(t, rs.Close())
		r2, err := c.Register(ctx, small)
		require.NoError(t, err, "an unregister did not give the address space back")
		for _, rb := range []*Buffer{r1, r2, ro} {
			require.NoError(t, rb.Close())
		}
	}, testutil.SimOnly())
}

// The default cap refuses a sparse buffer whose chunks span more than 1 TiB of address space.
func TestRegisterDefaultAddressSpaceCap(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		ctx, dev, _, path := serveDevice0(t, b, Options{})
		c := dial(t, path)
		res, err := dev.System().Reserve(DefaultMaxRegisteredBytes+2*mib, vmm.ReserveOptions{})
		require.NoError(t, err)
		defer func() { require.NoError(t, res.Close()) }()
		for _, off := range []uint64{0, DefaultMaxRegisteredBytes} {
			m, err := res.MapNew(off, 2*mib, dev, vmm.AllocOptions{HandleTypes: driver.HandleTypePosixFD}, vmm.ReadWrite(dev))
			require.NoError(t, err)
			defer func() { require.NoError(t, m.Close()) }()
		}
		_, err = c.Register(ctx, ipc.FromReservation(res))
		require.ErrorIs(t, err, ErrLimit)
	}, testutil.SimOnly())
}

// A worker that asks for the region and does not read it holds up only itself: Share writes
// without the region's lock, so an honest worker's region and copies go on.
func TestRegionHogDoesNotStallOtherWorkers(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		ctx, dev, _, path := serveDevice0(t, b, Options{WriteTimeout: 3 * time.Second})
		good := dial(t, path)
		gb, err := good.Register(ctx, newDevBuffer(t, dev, 1, 2*mib))
		require.NoError(t, err)
		for range 3 {
			hog := rawConn(t, path, true)
			go func() {
				for i := uint64(2); ; i++ {
					if ipc.WriteMessage(hog, KindRequest, encodeReq(request{op: OpRegion, id: i}), nil) != nil {
						return
					}
				}
			}()
		}
		time.Sleep(300 * time.Millisecond) // the hogs' sockets fill up
		regionDone := make(chan error, 1)
		go func() {
			r, err := good.Region(ctx, dev, pinned.OpenOptions{})
			if r != nil {
				r.Close()
			}
			regionDone <- err
		}()
		time.Sleep(50 * time.Millisecond)
		t0 := time.Now()
		cerr := good.Copy(ctx, Request{Buffer: gb.ID(), Dir: ToDevice, Length: 4096})
		took := time.Since(t0)
		require.NoError(t, <-regionDone)
		require.NoError(t, cerr)
		require.Less(t, took, time.Second, "the honest worker's 4 KiB copy waited on workers that do not read")
		require.NoError(t, gb.Close())
	}, testutil.SimOnly())
}
