package vmm_test

import (
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/vmm"
)

// reuse makes the simulator give a destroyed stream's or event's value to the next one made, as the
// driver may, so that a call that reaches a closed object's handle acts on its successor.
var reuse = testutil.SimOptions(sim.ReuseHandles())

// Synchronize in a loop racing the stream's Close, and a new stream (which takes the closed one's
// handle) beginning a capture right after: every Synchronize either happens before the Close or
// fails with ErrClosed; none reaches the new stream, where it would invalidate the capture.
func TestStreamSynchronizeRacesClose(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		for range 1000 {
			s, err := d.CreateStream(vmm.StreamOptions{})
			require.NoError(t, err)
			var next *vmm.Stream
			var cerr, nerr error
			serr := callWhileClosing(s.Synchronize, func() {
				if cerr = s.Close(); cerr == nil {
					if next, nerr = d.CreateStream(vmm.StreamOptions{}); nerr == nil {
						nerr = next.BeginCapture()
					}
				}
			})
			require.NoError(t, cerr)
			require.NoError(t, nerr)
			g, gerr := next.EndCapture()
			if gerr == nil {
				require.NoError(t, g.Close())
			}
			require.NoError(t, next.Close())
			require.NoError(t, gerr, "a synchronize of the closed stream reached its successor")
			require.ErrorIs(t, serr, vmm.ErrClosed)
		}
	}, testutil.SimOnly(), reuse)
}

// Record and Query in a loop racing the event's Close, and a new event (which takes the closed one's
// handle) made right after: each call either happens before the Close or fails with ErrClosed; no
// Record reaches the new event, which stays never recorded (complete) although the stream recorded
// on is held.
func TestEventRecordRacesClose(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		st, err := d.CreateStream(vmm.StreamOptions{})
		require.NoError(t, err)
		defer func() { require.NoError(t, st.Close()) }()
		require.NoError(t, b.Sim.HoldStream(st.Handle()))
		defer func() { require.NoError(t, b.Sim.ReleaseStream(st.Handle())) }()
		for range 1000 {
			e, err := d.NewEvent(false)
			require.NoError(t, err)
			var next *vmm.Event
			var cerr, nerr error
			recordAndQuery := func() error {
				if err := e.Record(st); err != nil {
					return err
				}
				_, err := e.Query()
				return err
			}
			rerr := callWhileClosing(recordAndQuery, func() {
				if cerr = e.Close(); cerr == nil {
					next, nerr = d.NewEvent(false)
				}
			})
			require.NoError(t, cerr)
			require.NoError(t, nerr)
			done, qerr := next.Query()
			require.NoError(t, next.Close())
			require.NoError(t, qerr)
			require.True(t, done, "a record of the closed event reached its successor")
			require.ErrorIs(t, rerr, vmm.ErrClosed)
		}
	}, testutil.SimOnly(), reuse)
}

// callWhileClosing runs call in a loop until it fails and, once call has run once, closeThen beside
// it (a Close, then a new object that may take the closed one's handle); it returns call's error.
func callWhileClosing(call func() error, closeThen func()) error {
	var err error
	var wg sync.WaitGroup
	running := make(chan struct{})
	wg.Go(func() {
		for n := 0; err == nil; n++ {
			if n == 1 {
				close(running)
			}
			err = call()
		}
	})
	wg.Go(func() {
		<-running
		closeThen()
	})
	wg.Wait()
	return err
}

// Close waits for a Synchronize in progress on another goroutine, which waits for the stream's work
// (here a held stream), and then destroys the stream; both succeed.
func TestStreamCloseWaitsForSynchronize(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		s, err := b.Device(t, 0).CreateStream(vmm.StreamOptions{})
		require.NoError(t, err)
		require.NoError(t, b.Sim.HoldStream(s.Handle()))
		synced := make(chan error)
		go func() { synced <- s.Synchronize() }()
		time.Sleep(20 * time.Millisecond) // let Synchronize begin
		closed := testutil.StillWaiting(t, 50*time.Millisecond, "Close, while a Synchronize was waiting,", s.Close)
		require.NoError(t, b.Sim.ReleaseStream(s.Handle()))
		require.NoError(t, <-synced)
		require.NoError(t, <-closed)
		require.ErrorIs(t, s.Synchronize(), vmm.ErrClosed)
	}, testutil.SimOnly())
}

// A hold keeps Close waiting until it is released (once, however often release is called), and a
// closed stream refuses a hold; the legacy stream needs none.
func TestStreamHold(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		s, err := b.Device(t, 0).CreateStream(vmm.StreamOptions{})
		require.NoError(t, err)
		release, err := s.Hold()
		require.NoError(t, err)
		closed := testutil.StillWaiting(t, 50*time.Millisecond, "Close, while the stream was held,", s.Close)
		_, err = s.Hold()
		require.ErrorIs(t, err, vmm.ErrClosed, "a hold while Close waits")
		release()
		release()
		require.NoError(t, <-closed)
		_, err = s.Hold()
		require.ErrorIs(t, err, vmm.ErrClosed)
		var legacy *vmm.Stream
		release, err = legacy.Hold()
		require.NoError(t, err)
		release()
	})
}
