package nccl_test

import (
	"runtime"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/nccl"
)

// TestWaitAfterAbortLeavesTheStreamFree: Wait on a stream whose work never ends (an aborted kernel
// that does not stop: a held stream) returns after its bounded wait with nothing of its own still
// running on the stream, whether the context ended or Abort was called, so the stream's Close does
// not wait for a synchronization that would never return.
func TestWaitAfterAbortLeavesTheStreamFree(t *testing.T) {
	defer nccl.SetAbortWait(50 * time.Millisecond)()
	for _, how := range []string{"context", "Abort"} {
		t.Run(how, func(t *testing.T) {
			testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
				c := ranks(t, b, library(t, b), 1)[0]
				s, err := b.Device(t, 0).NewStream(true)
				require.NoError(t, err)
				require.NoError(t, b.Sim.HoldStream(s.Handle()))
				ctx := deadline(t, 10*time.Second)
				if how == "context" {
					ctx = deadline(t, 30*time.Millisecond)
				} else {
					time.AfterFunc(30*time.Millisecond, func() { _ = c.Abort() })
				}
				err = c.Wait(ctx, s)
				require.ErrorIs(t, err, nccl.ErrAborted)
				require.ErrorContains(t, err, "still busy")

				closed := make(chan error, 1)
				go func() { closed <- s.Close() }()
				select {
				case err := <-closed:
					require.NoError(t, err) // destroying the stream ended its hold
				case <-time.After(5 * time.Second):
					require.NoError(t, b.Sim.ReleaseStream(s.Handle())) // lets the test end
					require.NoError(t, <-closed)
					t.Fatal("the stream's Close waited for a synchronization that Wait left running")
				}
			}, testutil.SimOnly())
		})
	}
}

// TestWaitSeesTheEndAsSynchronizeDoes: Wait polls an event instead of blocking in the driver, so it
// must see work end about as soon as cuStreamSynchronize does, for short work (within its spinning
// first millisecond) and for longer work (polled after sleeps of a sixteenth of the time waited, up
// to 1 ms). Rounds of the same all-reduces alternate between the two waits; on the GPU the medians
// must stay within 10 % and 200 µs.
func TestWaitSeesTheEndAsSynchronizeDoes(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		c, buf, s := soloWithStream(t, b)
		defer func() { require.NoError(t, s.Close()) }()
		ctx := deadline(t, time.Minute)
		count, rounds := uint64(2*mib/4), 15
		if b.IsSim() { // the simulator's copies are slow: the check of the figures is the GPU's
			count, rounds = 16, 3
		}
		for _, ops := range []int{1, 64, 512, 4096} {
			round := func(wait func() error) time.Duration {
				start := time.Now()
				for range ops {
					require.NoError(t, c.AllReduce(ctx, buf.Ptr(), buf.Ptr(), count, nccl.Float32, nccl.Sum, s))
				}
				require.NoError(t, wait())
				return time.Since(start)
			}
			var waits, syncs []time.Duration
			for range rounds {
				waits = append(waits, round(func() error { return c.Wait(ctx, s) }))
				syncs = append(syncs, round(s.Synchronize))
			}
			w, y := medianOf(waits), medianOf(syncs)
			t.Logf("%d all-reduces of %d floats: Wait %v, Synchronize %v (medians of %d; each round in order: %v and %v)",
				ops, count, w, y, rounds, waits, syncs)
			if !b.IsSim() {
				require.LessOrEqual(t, w, y+y/10+200*time.Microsecond, "%d all-reduces: Wait saw the end late", ops)
			}
		}
	})
}

func medianOf(d []time.Duration) time.Duration {
	d = slices.Clone(d)
	slices.Sort(d)
	return d[len(d)/2]
}

// TestWaitPollsLongWorkWithPause: work that outlasts Wait's spinning first millisecond is polled
// with pause (whose speed TestWaitPausesBrieflyJustPastTheSpin checks) until it ends: here the stream
// is released on the third pause past the spin, and Wait then returns without error.
func TestWaitPollsLongWorkWithPause(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		c := ranks(t, b, library(t, b), 1)[0]
		s, err := b.Device(t, 0).NewStream(true)
		require.NoError(t, err)
		defer func() { require.NoError(t, s.Close()) }()
		require.NoError(t, b.Sim.HoldStream(s.Handle()))
		var late int
		defer nccl.SetPause(func(elapsed time.Duration) {
			if elapsed >= time.Millisecond {
				if late++; late == 3 {
					require.NoError(t, b.Sim.ReleaseStream(s.Handle()))
				}
			}
			runtime.Gosched()
		})()
		require.NoError(t, c.Wait(deadline(t, 10*time.Second), s))
		require.Equal(t, 3, late, "Wait returned before the work ended, or kept polling after")
	}, testutil.SimOnly())
}
