package vmm_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/vmm"
)

// TestStreamDrain: Drain returns nil when the first synchronization works, the failed attempts'
// errors (without ErrNotDrained) when a later one works, and ErrNotDrained with every attempt's
// error when none does; fewer than one attempt means one.
func TestStreamDrain(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		s, err := b.Device(t, 0).CreateStream(vmm.StreamOptions{NonBlocking: true})
		require.NoError(t, err)
		defer func() { require.NoError(t, s.Close()) }()
		require.NoError(t, s.Drain(3))

		b.Sim.FailNth("cuStreamSynchronize", 1, driver.ErrorUnknown)
		err = s.Drain(3)
		require.ErrorIs(t, err, driver.ErrorUnknown)
		require.NotErrorIs(t, err, vmm.ErrNotDrained)
		require.ErrorContains(t, err, "drained on attempt 2")

		for range 3 {
			b.Sim.FailNth("cuStreamSynchronize", 1, driver.ErrorIllegalAddress)
		}
		err = s.Drain(3)
		require.ErrorIs(t, err, vmm.ErrNotDrained)
		require.ErrorIs(t, err, driver.ErrorIllegalAddress)
		require.ErrorContains(t, err, "after 3 attempts")
		require.NoError(t, s.Drain(3), "the faults are spent")

		b.Sim.FailNth("cuStreamSynchronize", 1, driver.ErrorUnknown)
		require.ErrorIs(t, s.Drain(0), vmm.ErrNotDrained)
	}, testutil.SimOnly())
}

// The nil stream (the legacy default stream) has no device to synchronize through: Synchronize and
// Drain refuse it with ErrInvalidValue instead of crashing.
func TestNilStreamSynchronize(t *testing.T) {
	var s *vmm.Stream
	require.ErrorIs(t, s.Synchronize(), vmm.ErrInvalidValue)
	require.ErrorIs(t, s.Drain(2), vmm.ErrInvalidValue)
}

// A closed stream cannot be drained: cuStreamDestroy lets the work queued on it run on, and nothing
// can wait for that stream any more. Drain says both: ErrNotDrained, so that callers keep the memory
// that work may use (offload's drain returns nil for any other error), and ErrClosed, for why.
func TestDrainClosedStream(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		s, err := b.Device(t, 0).CreateStream(vmm.StreamOptions{})
		require.NoError(t, err)
		require.NoError(t, s.Close())
		err = s.Drain(vmm.DrainAttempts)
		require.ErrorIs(t, err, vmm.ErrNotDrained)
		require.ErrorIs(t, err, vmm.ErrClosed)
	})
}
