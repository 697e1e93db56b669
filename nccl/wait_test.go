package nccl_test

import (
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
