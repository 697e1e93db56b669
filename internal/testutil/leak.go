package testutil

import (
	"fmt"
	"os"
	"runtime"
	"testing"
	"time"

	"github.com/cuvmm/cuvmm/internal/lifetime"
)

// Main runs a package's tests (call it from TestMain: os.Exit(testutil.Main(m))). In builds with the
// cuvmmleak tag it then collects garbage until the clean-ups have run and fails the run when any
// owner (allocation, reservation, mapping, buffer, region, ...) became unreachable without Close,
// printing where each was created.
func Main(m *testing.M) int {
	code := m.Run()
	if !lifetime.Enabled {
		return code
	}
	for i := 0; i < 5; i++ {
		runtime.GC()
		time.Sleep(20 * time.Millisecond)
	}
	if leaks := lifetime.Leaks(); len(leaks) > 0 {
		fmt.Fprintf(os.Stderr, "cuvmmleak: %d objects were never closed (reported above)\n", len(leaks))
		return 1
	}
	fmt.Fprintln(os.Stderr, "cuvmmleak: no leaks")
	return code
}
