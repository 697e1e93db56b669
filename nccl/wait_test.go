package nccl_test

import (
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
// first millisecond) and for longer work (polled every 50 µs). Rounds of the same all-reduces
// alternate between the two waits; on the GPU the medians must stay within 10 % and 200 µs.
func TestWaitSeesTheEndAsSynchronizeDoes(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		c, buf, s := soloWithStream(t, b)
		defer func() { require.NoError(t, s.Close()) }()
		ctx := deadline(t, time.Minute)
		count, rounds := uint64(2*mib/4), 15
		if b.IsSim() { // the simulator's copies are slow: the check of the figures is the GPU's
			count, rounds = 16, 3
		}
		for _, ops := range []int{1, 64, 512} {
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
			t.Logf("%d all-reduces of %d floats: Wait %v, Synchronize %v (medians of %d)", ops, count, w, y, rounds)
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

// TestWaitSeesLongWorkEndWithinItsPoll: once Wait's first spinning millisecond is over, it polls
// every 50 µs, so work that ends later is seen within about that: the lag between the work's end
// (a held stream released) and Wait's return stays far below a millisecond, which a Go timer of
// under a millisecond, rounded up to one by the runtime when idle, would not give.
func TestWaitSeesLongWorkEndWithinItsPoll(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		c := ranks(t, b, library(t, b), 1)[0]
		s, err := b.Device(t, 0).NewStream(true)
		require.NoError(t, err)
		defer func() { require.NoError(t, s.Close()) }()
		var lags []time.Duration
		for i := range 15 { // the work ends at 2 ms and later, a fifteenth of a millisecond apart
			require.NoError(t, b.Sim.HoldStream(s.Handle()))
			released := make(chan time.Time, 1)
			go func() {
				time.Sleep(2*time.Millisecond + time.Duration(i)*time.Millisecond/15)
				at := time.Now()
				require.NoError(t, b.Sim.ReleaseStream(s.Handle()))
				released <- at
			}()
			require.NoError(t, c.Wait(deadline(t, 10*time.Second), s))
			lags = append(lags, time.Since(<-released))
		}
		lag := medianOf(lags)
		t.Logf("Wait returned %v (median of %d) after the work ended", lag, len(lags))
		require.Less(t, lag, 400*time.Microsecond, "Wait saw work that ended after its spin late")
	}, testutil.SimOnly())
}
