package offload_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/offload"
)

// TestSleepReleaseFailsOnTwoDevices: whichever release fails, on either device, the chunks
// released before it, on both devices, are recreated and restored: both buffers are awake, the
// kept one intact, the devices' free memory is what it was before the sleep, and a later sleep and
// wake succeed.
func TestSleepReleaseFailsOnTwoDevices(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d0, d1 := b.Device(t, 0), b.Device(t, 1)
		a, c := newBuf(t, d0, 4*mib, 2*mib, 43, nil), newBuf(t, d1, 4*mib, 2*mib, 44, nil)
		set := newSet(t, b, offload.Options{SlotSize: 2 * mib})
		require.NoError(t, set.Add("a", a, offload.Keep, offload.EntryOptions{}))
		require.NoError(t, set.Add("c", c, offload.Discard, offload.EntryOptions{}))
		require.NoError(t, set.Sleep(bg)) // the set's streams and backup slots are made
		require.NoError(t, set.Wake(bg))
		free0, free1 := free(t, d0), free(t, d1)
		for n := 1; n <= 4; n++ { // two chunks on each device
			b.Sim.FailNth("cuMemRelease", n, driver.ErrorOutOfMemory)
			require.ErrorIs(t, set.Sleep(bg), driver.ErrOutOfMemory, "release %d", n)
			b.Sim.ClearFaults()
			require.False(t, set.Asleep("a"), "release %d", n)
			require.False(t, set.Asleep("c"), "release %d", n)
			requirePattern(t, d0, a.Ptr(), 4*mib, 43)
			require.Equal(t, free0, free(t, d0), "release %d", n)
			require.Equal(t, free1, free(t, d1), "release %d", n)
		}
		require.NoError(t, set.Sleep(bg), "a sleep after the failed ones")
		require.NoError(t, set.Wake(bg))
		requirePattern(t, d0, a.Ptr(), 4*mib, 43)
	}, testutil.Devices(2), testutil.SimOnly())
}
