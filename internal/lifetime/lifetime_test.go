package lifetime

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestOwner(t *testing.T) {
	var parent, a, b Owner
	a.Init(&parent, "allocation")
	b.Init(&parent, "reservation")
	require.Equal(t, 2, parent.Children())
	require.Equal(t, "1 allocation(s), 1 reservation(s)", parent.Remaining())
	err := parent.Close("parent", nil)
	require.ErrorIs(t, err, ErrInUse)
	require.ErrorContains(t, err, "parent: still owns 1 allocation(s), 1 reservation(s)")

	fail := errors.New("boom")
	require.ErrorIs(t, a.Close("a", func() error { return fail }), fail)
	require.False(t, a.IsClosed(), "a failed free leaves the owner open")
	require.NoError(t, a.Close("a", func() error { return nil }))
	require.True(t, a.IsClosed())
	require.NoError(t, a.Close("a", func() error { return fail }), "closed: nothing to do")
	require.Equal(t, "1 reservation(s)", parent.Remaining())

	b.Lock()
	require.False(t, b.Closed())
	b.MarkClosed()
	b.MarkClosed()
	b.Unlock()
	require.Zero(t, parent.Children())
	require.Empty(t, parent.Remaining())

	var c Owner
	c.Init(&parent, "stream")
	require.True(t, c.Shut(), "the first Shut closes an open owner")
	require.False(t, c.Shut(), "a second finds it closed")
	require.True(t, c.IsClosed())
	require.Zero(t, parent.Children(), "a shut owner is no child any more")
	require.NoError(t, parent.Close("parent", nil))
}

// TestTrackNeedsAKind: tracking an owner that Init did not name panics, in every build: its leak
// report could not say what leaked.
func TestTrackNeedsAKind(t *testing.T) {
	type thing struct{ own Owner }
	x := &thing{}
	require.PanicsWithValue(t, "lifetime: Track of an owner with no kind (call Init first)", func() { Track(x, &x.own) })
	x.own.Init(nil, "thing")
	require.NotPanics(t, func() { Track(x, &x.own) })
	x.own.Lock()
	x.own.MarkClosed()
	x.own.Unlock()
}

// Close waits for the calls counted by Begin before it frees; while it waits, Begin refuses, and
// calls on one owner overlap (Begin holds no lock). A failed free leaves the owner open to Begin.
func TestCloseWaitsForCalls(t *testing.T) {
	var o Owner
	require.True(t, o.Begin())
	require.True(t, o.Begin(), "calls overlap")
	o.End()
	freed := make(chan struct{})
	closed := make(chan error)
	go func() {
		closed <- o.Close("object", func() error { close(freed); return nil })
	}()
	eventuallyRefusesCalls(t, &o)
	select {
	case <-freed:
		t.Fatal("freed while a call was in progress")
	case <-time.After(20 * time.Millisecond):
	}
	o.End()
	require.NoError(t, <-closed)
	require.False(t, o.Begin(), "closed")
	require.NoError(t, o.Close("object", nil))

	var p Owner
	require.True(t, p.Begin())
	go func() { time.Sleep(10 * time.Millisecond); p.End() }()
	require.Error(t, p.Close("object", func() error { return errors.New("boom") }))
	require.True(t, p.Begin(), "a failed free leaves the owner open")
	p.End()
	require.NoError(t, p.Close("object", nil))
}

// A Close that is woken while calls are still in progress (as when another Close, woken first,
// cleared closing and then failed to free) refuses new calls again while it goes on waiting,
// instead of admitting them for as long as it waits.
func TestWaitingCloseRefusesCallsAfterAnotherCloseFailed(t *testing.T) {
	var o Owner
	require.True(t, o.Begin())
	done := make(chan struct{})
	go func() {
		o.mu.Lock()
		o.waitCalls()
		o.mu.Unlock()
		close(done)
	}()
	eventuallyRefusesCalls(t, &o)
	o.mu.Lock()
	o.closing = false // what a Close that woke first and failed to free leaves
	o.idle.Broadcast()
	o.mu.Unlock()
	require.Eventually(t, func() bool {
		o.mu.Lock()
		defer o.mu.Unlock()
		return o.closing
	}, time.Second, time.Millisecond, "the waiting Close refuses new calls again")
	o.End()
	<-done
}

// eventuallyRefusesCalls waits until o's Begin refuses, as it does while a Close waits for the calls
// in progress, ending any call it admitted meanwhile.
func eventuallyRefusesCalls(t *testing.T, o *Owner) {
	require.Eventually(t, func() bool {
		if o.Begin() {
			o.End()
			return false
		}
		return true
	}, 5*time.Second, time.Millisecond, "Begin refuses while Close waits")
}
