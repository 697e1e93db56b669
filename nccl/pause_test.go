package nccl_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/internal/testutil"
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

// TestRunSeesItsGroupQueuedWithinItsPoll: a group that NCCL is still queueing when ncclGroupEnd
// returns (ncclInProgress; the simulator's groups always are) is polled with Wait's pauses, so a
// small operation returns within about a poll, not after a Go timer's millisecond.
func TestRunSeesItsGroupQueuedWithinItsPoll(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		c, buf, s := soloWithStream(t, b)
		defer func() { require.NoError(t, s.Close()) }()
		ctx := deadline(t, time.Minute)
		var runs []time.Duration
		for range 31 {
			start := time.Now()
			require.NoError(t, c.AllReduce(ctx, buf.Ptr(), buf.Ptr(), 16, nccl.Float32, nccl.Sum, s))
			runs = append(runs, time.Since(start))
		}
		r := medianOf(runs)
		t.Logf("an all-reduce of 16 floats returned in %v (median of %d)", r, len(runs))
		require.Less(t, r, 500*time.Microsecond, "Run polled its group late")
	}, testutil.SimOnly())
}
