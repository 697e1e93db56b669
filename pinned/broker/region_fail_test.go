package broker

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/vmm"
)

// A region the broker cannot share (its export fails) is answered as a failure before anything is
// sent: the worker's connection and buffers stay.
func TestRegionTheBrokerCannotShare(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		ctx, dev, _, path := serveDevice0(t, b, Options{})
		c := dial(t, path)
		rb, err := c.Register(ctx, newDevBuffer(t, dev, 1, 2*mib))
		require.NoError(t, err)
		b.Sim.FailNth("cuMemExportToShareableHandle", 1, driver.ErrorOutOfMemory)
		_, err = c.Region(ctx, dev, pinned.OpenOptions{})
		require.ErrorIs(t, err, ErrInternal)
		require.NotErrorIs(t, err, ErrBrokerGone)
		require.NoError(t, c.Ping(ctx))
		require.NoError(t, c.Copy(ctx, Request{Buffer: rb.ID(), Dir: ToDevice, Length: 4096}))
	}, testutil.SimOnly())
}

// A region that arrives whole but cannot be opened here (read-only registration, which this device
// lacks) fails that call alone: the connection goes on.
func TestRegionThatCannotBeOpenedHere(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		ctx := testCtx(t)
		dev := b.Device(t, 0)
		_, path := startServer(t, newRegion(t, dev, 4*mib, pinned.Options{Kind: pinned.SharedMemory}), Options{})
		c := dial(t, path)
		_, err := c.Region(ctx, dev, pinned.OpenOptions{Grant: []*vmm.Device{dev}, ReadOnly: true})
		require.ErrorIs(t, err, driver.ErrNotSupported)
		require.NotErrorIs(t, err, ErrBrokerGone)
		require.NoError(t, c.Ping(ctx))
	}, testutil.SimOnly(), testutil.SimOptions(sim.Attribute(0, driver.AttrReadOnlyHostRegisterSupported, 0)))
}
