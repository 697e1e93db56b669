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
