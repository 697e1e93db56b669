package offload

import (
	"runtime"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestPopulateWorkers: the populating goroutines of the feeds running at once take the cores their
// registering goroutines leave, at least one each.
func TestPopulateWorkers(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(16))
	require.Equal(t, 14, populateWorkers(1))
	require.Equal(t, 14, populateWorkers(0), "no count is one feed")
	require.Equal(t, 6, populateWorkers(2))
	runtime.GOMAXPROCS(32)
	require.Equal(t, 14, populateWorkers(2))
	runtime.GOMAXPROCS(2)
	require.Equal(t, 1, populateWorkers(1))
	require.Equal(t, 1, populateWorkers(4))
}
