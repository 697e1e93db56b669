package ipc_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/vmm"
)

// An opened buffer owns its chunk table: changing the Received it came from, or the Descriptor it
// returns, changes nothing of it. Once closed it has no address, length or capacity.
func TestOpenedBufferOwnsItsLayout(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		dev := b.Device(t, 0)
		r := exportSendReceive(t, newBuffer(t, dev, 2, 2*mib, driver.Location{}, 7))
		buf, err := ipc.Open(dev, r, vmm.ReadWrite(dev))
		require.NoError(t, err)
		require.NoError(t, r.Close())
		r.Desc.Chunks[1].Offset = 6 * mib
		d := buf.Descriptor()
		d.Chunks[1].Offset = 0
		require.Equal(t, uint64(2*mib), buf.Chunks()[1].Offset)
		require.Equal(t, uint64(2*mib), buf.Descriptor().Chunks[1].Offset)
		require.NoError(t, buf.SetAccess(vmm.ReadWrite(dev)))

		require.NoError(t, buf.Close())
		require.Zero(t, buf.Ptr(), "the freed range may be another reservation's")
		require.Zero(t, buf.Len())
		require.Zero(t, buf.Cap())
		require.Empty(t, buf.Chunks())
	})
}

// A SetAccess that fails on a later run of chunks gives the runs before it their access back: the
// buffer keeps one access throughout.
func TestSetAccessFailureKeepsOneAccess(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		dev := b.Device(t, 0)
		src := newBuffer(t, dev, 2, 2*mib, driver.Location{}, 7, 0) // a hole after chunk 0: two runs
		buf, err := ipc.Open(dev, exportSendReceive(t, src))
		require.NoError(t, err)
		defer func() { require.NoError(t, buf.Close()) }()
		b.Sim.FailNth("cuMemSetAccess", 2, driver.ErrorOutOfMemory)
		err = buf.SetAccess(vmm.ReadOnly(dev))
		require.ErrorIs(t, err, driver.ErrOutOfMemory)
		require.ErrorContains(t, err, "chunk 1 of 2")
		b.Sim.ClearFaults()
		for _, c := range buf.Chunks() {
			require.NoError(t, dev.Fill(buf.Ptr()+driver.DevicePtr(c.Offset), 2*mib, 0, 9), "chunk at %#x still read-write", c.Offset)
		}
	}, testutil.SimOnly())
}

// Republish serves a grown buffer's new layout under its name, with no moment where a fetch fails;
// a closed server refuses Republish and Unpublish with ErrClosed.
func TestRepublishAfterGrowth(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		dev := b.Device(t, 0)
		g, err := growbuf.New(dev, growbuf.Options{MaxSize: 64 * mib, Chunk: growbuf.FixedChunks(2 * mib), HandleTypes: driver.HandleTypePosixFD})
		require.NoError(t, err)
		defer func() { require.NoError(t, g.Close()) }()
		require.NoError(t, g.Grow(2*mib))
		s := serve(t, ipc.ServerOptions{})
		require.NoError(t, s.Publish("w", g))
		require.NoError(t, g.Grow(6*mib))
		require.ErrorIs(t, s.Publish("w", g), ipc.ErrExists)
		require.NoError(t, s.Republish("w", g))
		c, err := ipc.Dial(s.Path())
		require.NoError(t, err)
		defer func() { require.NoError(t, c.Close()) }()
		r, err := c.Fetch("w")
		require.NoError(t, err)
		require.Equal(t, uint64(6*mib), r.Desc.Len)
		require.NoError(t, r.Close())
		require.NoError(t, s.Republish("new", g), "a name not yet published is published")
		require.ElementsMatch(t, []string{"w", "new"}, s.Names())

		require.NoError(t, s.Close())
		require.ErrorIs(t, s.Republish("w", g), ipc.ErrClosed)
		require.ErrorIs(t, s.Unpublish("w"), ipc.ErrClosed)
	})
}

// nil inputs are errors or empty, never panics.
func TestNilReservationAndExported(t *testing.T) {
	_, err := ipc.Export(ipc.FromReservation(nil))
	require.ErrorIs(t, err, vmm.ErrInvalidValue)
	var e *ipc.Exported
	require.Nil(t, e.FDs())
}
