package offload

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// TestStagingPlan checks how File staging is sized: perWorker buffers of part bytes per goroutine
// (here 4 of 2 MiB), within two slots, never more buffers than parts.
func TestStagingPlan(t *testing.T) {
	const mib = 1 << 20
	for _, c := range []struct {
		size                  uint64
		workers, jobs         int
		slots, bufs, workers2 int
	}{
		{256 * mib, 8, 4096, 1, 32, 8},
		{256 * mib, 64, 4096, 2, 256, 64},
		{256 * mib, 100, 4096, 2, 256, 100},
		{4 * mib, 3, 12, 2, 4, 3},
		{4 * mib, 8, 2, 1, 2, 2},
		{2 * mib, 8, 1, 1, 1, 1},
		{256 * mib, 0, 10, 1, 1, 1},
	} {
		slots, bufs, workers := stagingPlan(c.size, 2*mib, c.workers, 4, c.jobs)
		require.Equal(t, [3]int{c.slots, c.bufs, c.workers2}, [3]int{slots, bufs, workers}, "%+v", c)
	}
}
