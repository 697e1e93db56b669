package nccl_test

import (
	"runtime"
	"sync/atomic"
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

// TestRunPollsWithWaitsPauses: a group that NCCL is still queueing when ncclGroupEnd returns
// (ncclInProgress; the simulator queues each group on a thread of its own) is polled with Wait's
// pauses, which TestWaitPollsEvery50Microseconds times, not with Go timers that sleep a whole
// millisecond in an idle process: over 31 small operations, some are polled more than once, each
// time through pause.
func TestRunPollsWithWaitsPauses(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		c, buf, s := soloWithStream(t, b)
		defer func() { require.NoError(t, s.Close()) }()
		var pauses atomic.Int64
		defer nccl.SetPause(func(time.Duration) { pauses.Add(1); runtime.Gosched() })()
		ctx := deadline(t, time.Minute)
		for range 31 {
			require.NoError(t, c.AllReduce(ctx, buf.Ptr(), buf.Ptr(), 16, nccl.Float32, nccl.Sum, s))
		}
		t.Logf("%d pauses over 31 all-reduces", pauses.Load())
		require.Positive(t, pauses.Load(), "Run polled its group without Wait's pauses")
	}, testutil.SimOnly())
}
