package measure

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
)

// A graph capture that fails at any step releases the stream, counter and graph made before it,
// so that closing the system after the failed Sleep finds nothing left.
func TestSleepGraphCaptureFailureReleasesEverything(t *testing.T) {
	for _, f := range []struct {
		fn  string
		nth int
	}{
		{"cuStreamCreate", 2}, {"cuMemAlloc", 2}, {"cuStreamBeginCapture", 1}, {"cuLaunchKernel", 2},
		{"cuStreamEndCapture", 1}, {"cuGraphInstantiateWithFlags", 1},
	} {
		t.Run(f.fn, func(t *testing.T) {
			b, err := OpenSim(1)
			require.NoError(t, err)
			defer b.sim.Close()
			b.sim.FailNth(f.fn, f.nth, driver.ErrorOutOfMemory)
			_, err = Sleep(SleepOptions{Env: Env{Backend: b}, Size: 8 << 20, Chunk: 4 << 20, SlotSize: 4 << 20, Rounds: 1})
			require.ErrorContains(t, err, "capture a graph")
			require.NoError(t, b.Sys.Close(), "everything the failed Sleep made is released")
		})
	}
}
