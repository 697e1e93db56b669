package sim

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
)

func TestStreams(t *testing.T) {
	s := start(t)
	bind(t, s, 0)
	st, err := s.StreamCreate(driver.StreamDefault)
	require.NoError(t, err)
	require.NotZero(t, st)
	_, err = s.StreamCreate(8)
	require.ErrorIs(t, err, driver.ErrorInvalidValue)
	require.NoError(t, s.StreamSynchronize(st))
	require.NoError(t, s.StreamSynchronize(0), "the legacy default stream")
	require.Equal(t, 1, s.Live().Streams)
	require.NoError(t, s.StreamDestroy(st))
	require.ErrorIs(t, s.StreamDestroy(st), driver.ErrorInvalidHandle)
	require.ErrorIs(t, s.StreamSynchronize(st), driver.ErrorInvalidHandle)
	require.ErrorIs(t, s.StreamSynchronize(12345), driver.ErrorInvalidHandle)
}

func TestEvents(t *testing.T) {
	s := start(t)
	bind(t, s, 0)
	a, err := s.EventCreate(driver.EventDefault)
	require.NoError(t, err)
	b, err := s.EventCreate(driver.EventBlockingSync)
	require.NoError(t, err)
	nt, err := s.EventCreate(driver.EventDisableTiming)
	require.NoError(t, err)
	_, err = s.EventCreate(4) // INTERPROCESS without DISABLE_TIMING
	require.ErrorIs(t, err, driver.ErrorInvalidValue)

	_, err = s.EventElapsedTime(a, b)
	require.ErrorIs(t, err, driver.ErrorInvalidHandle, "not recorded")
	require.NoError(t, s.EventRecord(a, 0))
	time.Sleep(20 * time.Millisecond)
	require.NoError(t, s.EventRecord(b, 0))
	require.NoError(t, s.EventRecord(nt, 0))
	require.NoError(t, s.EventSynchronize(b))
	ms, err := s.EventElapsedTime(a, b)
	require.NoError(t, err)
	require.GreaterOrEqual(t, ms, float32(19))
	require.Less(t, ms, float32(5000))
	_, err = s.EventElapsedTime(a, nt)
	require.ErrorIs(t, err, driver.ErrorInvalidHandle, "DISABLE_TIMING")
	require.ErrorIs(t, s.EventRecord(a, 999), driver.ErrorInvalidHandle, "unknown stream")

	for _, e := range []driver.Event{a, b, nt} {
		require.NoError(t, s.EventDestroy(e))
	}
	require.ErrorIs(t, s.EventDestroy(a), driver.ErrorInvalidHandle)
	require.ErrorIs(t, s.EventSynchronize(a), driver.ErrorInvalidHandle)
	require.ErrorIs(t, s.EventRecord(a, 0), driver.ErrorInvalidHandle)
}

// With ReuseHandles a destroyed stream's or event's value names the next one made, as the driver's
// may: a stale handle then reaches the new object instead of being refused. Without it, it is refused.
func TestReuseHandles(t *testing.T) {
	s := start(t, ReuseHandles())
	bind(t, s, 0)
	st, err := s.StreamCreate(driver.StreamDefault)
	require.NoError(t, err)
	require.NoError(t, s.StreamDestroy(st))
	require.ErrorIs(t, s.StreamSynchronize(st), driver.ErrorInvalidHandle, "not made again yet")
	next, err := s.StreamCreate(driver.StreamNonBlocking)
	require.NoError(t, err)
	require.Equal(t, st, next)
	require.NoError(t, s.StreamSynchronize(st), "the stale handle names the new stream")
	require.NoError(t, s.StreamDestroy(next))

	e, err := s.EventCreate(driver.EventDisableTiming)
	require.NoError(t, err)
	require.NoError(t, s.EventDestroy(e))
	again, err := s.EventCreate(driver.EventDefault)
	require.NoError(t, err)
	require.Equal(t, e, again)
	require.NoError(t, s.EventRecord(e, 0), "the stale handle names the new event")
	require.NoError(t, s.EventDestroy(again))

	plain := start(t)
	bind(t, plain, 0)
	a, err := plain.StreamCreate(driver.StreamDefault)
	require.NoError(t, err)
	require.NoError(t, plain.StreamDestroy(a))
	b, err := plain.StreamCreate(driver.StreamDefault)
	require.NoError(t, err)
	require.NotEqual(t, a, b, "by default every handle is new")
	require.ErrorIs(t, plain.StreamSynchronize(a), driver.ErrorInvalidHandle)
	require.NoError(t, plain.StreamDestroy(b))
}

// A stream destroyed while work queued on it still waits (a held stream) never gives its value
// again: it still names that work's queue, which a new stream must not join.
func TestReuseHandlesKeepsQueuedStream(t *testing.T) {
	s := start(t, ReuseHandles(), DeferWork())
	bind(t, s, 0)
	st, err := s.StreamCreate(driver.StreamDefault)
	require.NoError(t, err)
	ptr, err := s.MemAlloc(4096)
	require.NoError(t, err)
	require.NoError(t, s.HoldStream(st))
	require.NoError(t, s.MemsetD8Async(ptr, 7, 4096, st))
	require.NoError(t, s.StreamDestroy(st))
	next, err := s.StreamCreate(driver.StreamDefault)
	require.NoError(t, err)
	require.NotEqual(t, st, next)
	require.NoError(t, s.ReleaseStream(st))
	require.NoError(t, s.CtxSynchronize())
	require.NoError(t, s.MemFree(ptr))
	require.NoError(t, s.StreamDestroy(next))
}
