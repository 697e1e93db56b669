package lifetime

import (
	"errors"
	"sync/atomic"
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

// A Close whose free fails while another Close waits for the same calls leaves Begin refusing until
// that other Close is done: a call admitted then would be one the other Close, which means to free,
// has to wait for, and may start after it has.
func TestWaitingCloseRefusesCallsAfterAnotherCloseFailed(t *testing.T) {
	var o Owner
	require.True(t, o.Begin())
	var frees atomic.Int32
	free := func() error {
		if frees.Add(1) == 1 {
			return errors.New("boom")
		}
		return nil
	}
	admitted := make(chan bool, 2)
	for range 2 {
		go func() {
			// Begin right after the failed Close, before the other Close has woken.
			failed := o.Close("object", free) != nil
			ok := failed && o.Begin()
			if ok {
				o.End()
			}
			admitted <- ok
		}()
	}
	eventuallyWaitingCloses(t, &o, 2)
	o.End()
	for range 2 {
		require.False(t, <-admitted, "Begin admitted a call after a failed Close while another Close waited")
	}
	require.Equal(t, int32(2), frees.Load(), "one free failed, the other Close's succeeded")
	require.True(t, o.IsClosed())
}

// eventuallyWaitingCloses waits until n Closes wait for the calls in progress.
func eventuallyWaitingCloses(t *testing.T, o *Owner, n int) {
	require.Eventually(t, func() bool {
		o.mu.Lock()
		defer o.mu.Unlock()
		return o.closers >= n
	}, 5*time.Second, time.Millisecond, "%d Closes wait for the calls in progress", n)
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
