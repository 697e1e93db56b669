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

// TestWaitPausesBrieflyJustPastTheSpin: just past its first spinning millisecond, Wait pauses
// about 60 µs between polls (a sixteenth of the time waited), even in a process that has nothing
// else to do, where a Go timer of under a millisecond sleeps a whole millisecond or more (the
// runtime's poller waits in milliseconds).
func TestWaitPausesBrieflyJustPastTheSpin(t *testing.T) {
	p := medianPause(time.Millisecond)
	t.Logf("pause after the spin: %v", p)
	require.GreaterOrEqual(t, p, 50*time.Microsecond)
	require.Less(t, p, 300*time.Microsecond, "Wait would see work that ends after its spin up to %v late", p)
}

// TestLongWaitsPollAboutOnceAMillisecond: the pause grows with the time waited, a sixteenth of it,
// up to a millisecond, so that a long wait (a receive waiting for its peer) does not poll 10,000
// times a second for as long as it lasts.
func TestLongWaitsPollAboutOnceAMillisecond(t *testing.T) {
	mid := medianPause(8 * time.Millisecond)
	long := medianPause(time.Minute)
	t.Logf("pause after 8 ms: %v; after a minute: %v", mid, long)
	require.GreaterOrEqual(t, mid, 500*time.Microsecond)
	require.Less(t, mid, 900*time.Microsecond, "after 8 ms Wait would see the end %v late", mid)
	require.GreaterOrEqual(t, long, time.Millisecond, "a long wait polls more often than once a millisecond")
	require.Less(t, long, 3*time.Millisecond, "a long wait would see the end %v late", long)
}

// medianPause is the median of 21 pauses after waiting for elapsed.
func medianPause(elapsed time.Duration) time.Duration {
	var pauses []time.Duration
	for range 21 {
		start := time.Now()
		nccl.PauseAfter(elapsed)
		pauses = append(pauses, time.Since(start))
	}
	return medianOf(pauses)
}

// TestRunPollsWithWaitsPauses: a group that NCCL is still queueing when ncclGroupEnd returns
// (ncclInProgress; the simulator queues each group on a thread of its own) is polled with Wait's
// pauses, which TestWaitPausesBrieflyJustPastTheSpin times, not with Go timers that sleep a whole
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
