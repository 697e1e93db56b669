package nccl_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/nccl"
)

// TestWaitPollsEvery50Microseconds: past its first spinning millisecond, Wait pauses about 50 µs
// between polls, even in a process that has nothing else to do, where a Go timer of under a
// millisecond sleeps a whole millisecond or more (the runtime's poller waits in milliseconds).
func TestWaitPollsEvery50Microseconds(t *testing.T) {
	var pauses []time.Duration
	for range 21 {
		start := time.Now()
		nccl.PauseAfter(time.Second)
		pauses = append(pauses, time.Since(start))
	}
	p := medianOf(pauses)
	t.Logf("pause after the spin: %v (median of %d)", p, len(pauses))
	require.GreaterOrEqual(t, p, 50*time.Microsecond)
	require.Less(t, p, 300*time.Microsecond, "Wait would see work that ends after its spin up to %v late", p)
}
