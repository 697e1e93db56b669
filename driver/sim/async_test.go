package sim

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
)

// TestEventsCompleteWhenTheStreamPassesThem: an event recorded on a held stream is not ready until
// the stream is released; a stream that waits on it inherits the dependency; synchronizing waits.
func TestEventsCompleteWhenTheStreamPassesThem(t *testing.T) {
	s := start(t)
	bind(t, s, 0)
	a, err := s.StreamCreate(driver.StreamNonBlocking)
	require.NoError(t, err)
	b, err := s.StreamCreate(driver.StreamNonBlocking)
	require.NoError(t, err)
	ea, err := s.EventCreate(driver.EventDisableTiming)
	require.NoError(t, err)
	eb, err := s.EventCreate(driver.EventDisableTiming)
	require.NoError(t, err)

	done, err := s.EventQuery(ea)
	require.NoError(t, err)
	require.True(t, done, "an event never recorded is complete")

	require.NoError(t, s.HoldStream(a))
	require.ErrorIs(t, s.HoldStream(a), driver.ErrorInvalidValue)
	require.ErrorIs(t, s.HoldStream(0), driver.ErrorInvalidHandle)
	require.NoError(t, s.EventRecord(ea, a))
	done, err = s.EventQuery(ea)
	require.NoError(t, err)
	require.False(t, done, "recorded on a held stream")

	require.NoError(t, s.StreamWaitEvent(b, ea, 0))
	require.ErrorIs(t, s.StreamWaitEvent(b, ea, 1), driver.ErrorInvalidValue)
	require.NoError(t, s.EventRecord(eb, b))
	done, _ = s.EventQuery(eb)
	require.False(t, done, "b waits for a's event")

	released := make(chan struct{})
	go func() {
		time.Sleep(20 * time.Millisecond)
		close(released)
		_ = s.ReleaseStream(a)
	}()
	require.NoError(t, s.EventSynchronize(eb), "waits until a is released")
	select {
	case <-released:
	default:
		t.Fatal("EventSynchronize returned before the stream was released")
	}
	done, _ = s.EventQuery(ea)
	require.True(t, done)
	require.ErrorIs(t, s.ReleaseStream(a), driver.ErrorInvalidValue)
	_, err = s.EventQuery(12345)
	require.ErrorIs(t, err, driver.ErrorInvalidHandle)

	for _, e := range []driver.Event{ea, eb} {
		require.NoError(t, s.EventDestroy(e))
	}
	for _, st := range []driver.Stream{a, b} {
		require.NoError(t, s.StreamDestroy(st))
	}
}

// TestMemAllocAsyncStreamOrderedReuse: a freed buffer is reused at once on its own stream, on another
// stream only once the free has completed, and the pool releases cached memory at synchronization
// points above its release threshold.
func TestMemAllocAsyncStreamOrderedReuse(t *testing.T) {
	s := start(t, MemoryPerDevice(64*mib))
	bind(t, s, 0)
	a, err := s.StreamCreate(driver.StreamNonBlocking)
	require.NoError(t, err)
	b, err := s.StreamCreate(driver.StreamNonBlocking)
	require.NoError(t, err)
	pool, err := s.DeviceGetDefaultMemPool(0)
	require.NoError(t, err)
	require.NoError(t, s.MemPoolSetAttribute(pool, driver.MemPoolReleaseThreshold, 1<<40))

	p1, err := s.MemAllocAsync(3*mib, a)
	require.NoError(t, err)
	require.NoError(t, s.MemsetD8Async(p1, 7, 3*mib, a))
	free, _, _ := s.MemGetInfo()
	require.Equal(t, 60*mib, free, "rounded to 4 MiB and charged")

	require.NoError(t, s.HoldStream(a))
	require.NoError(t, s.MemFreeAsync(p1, a))
	require.ErrorIs(t, s.MemFreeAsync(p1, a), driver.ErrorInvalidValue, "freed twice")
	p2, err := s.MemAllocAsync(3*mib, b)
	require.NoError(t, err)
	require.NotEqual(t, p1, p2, "the free on a has not completed: b may not reuse it")
	p3, err := s.MemAllocAsync(4*mib, a)
	require.NoError(t, err)
	require.Equal(t, p1, p3, "same stream: reused at once")
	require.NoError(t, s.MemFreeAsync(p3, a))
	require.NoError(t, s.ReleaseStream(a))
	require.NoError(t, s.StreamSynchronize(a))
	p4, err := s.MemAllocAsync(4*mib, b)
	require.NoError(t, err)
	require.Equal(t, p1, p4, "completed free: reused by another stream")

	v, err := s.MemPoolGetAttribute(pool, driver.MemPoolReservedMemHigh)
	require.NoError(t, err)
	require.Equal(t, 8*mib, v)
	v, _ = s.MemPoolGetAttribute(pool, driver.MemPoolUsedMemCurrent)
	require.Equal(t, 8*mib, v)
	require.NoError(t, s.MemFreeAsync(p2, b))
	require.NoError(t, s.MemFreeAsync(p4, b))
	require.NoError(t, s.StreamSynchronize(b))
	require.Equal(t, 2, s.Live().AsyncAllocs, "threshold above the pool: cached")
	require.NoError(t, s.MemPoolSetAttribute(pool, driver.MemPoolReleaseThreshold, 0))
	require.NoError(t, s.StreamSynchronize(b))
	require.Equal(t, 0, s.Live().AsyncAllocs, "threshold 0: released at the synchronization")
	free, _, _ = s.MemGetInfo()
	require.Equal(t, 64*mib, free)

	_, err = s.MemAllocAsync(0, a)
	require.ErrorIs(t, err, driver.ErrorInvalidValue)
	_, err = s.MemAllocAsync(128*mib, a)
	require.ErrorIs(t, err, driver.ErrorOutOfMemory)
	require.ErrorIs(t, s.MemPoolSetAttribute(pool, driver.MemPoolReservedMemCurrent, 1), driver.ErrorInvalidValue)
	require.ErrorIs(t, s.MemPoolTrimTo(12345, 0), driver.ErrorInvalidValue)
	require.NoError(t, s.MemPoolTrimTo(pool, 0))
	for _, st := range []driver.Stream{a, b} {
		require.NoError(t, s.StreamDestroy(st))
	}
}

// TestElapsedTimeNotReady: cuEventElapsedTime of an event whose record has not completed (a held
// stream) is CUDA_ERROR_NOT_READY, as in the driver; once the stream is released it answers.
func TestElapsedTimeNotReady(t *testing.T) {
	s := start(t)
	bind(t, s, 0)
	st, err := s.StreamCreate(driver.StreamNonBlocking)
	require.NoError(t, err)
	a, err := s.EventCreate(driver.EventDefault)
	require.NoError(t, err)
	b, err := s.EventCreate(driver.EventDefault)
	require.NoError(t, err)
	require.NoError(t, s.EventRecord(a, st))
	require.NoError(t, s.HoldStream(st))
	require.NoError(t, s.EventRecord(b, st))
	_, err = s.EventElapsedTime(a, b)
	require.ErrorIs(t, err, driver.ErrorNotReady, "end not complete")
	_, err = s.EventElapsedTime(b, a)
	require.ErrorIs(t, err, driver.ErrorNotReady, "start not complete")
	require.NoError(t, s.ReleaseStream(st))
	ms, err := s.EventElapsedTime(a, b)
	require.NoError(t, err)
	require.GreaterOrEqual(t, ms, float32(0))
	for _, e := range []driver.Event{a, b} {
		require.NoError(t, s.EventDestroy(e))
	}
	require.NoError(t, s.StreamDestroy(st))
}

// TestMemAllocAsyncUsesTheStreamsDevice: cuMemAllocAsync allocates from the pool of the stream's
// device, which for a stream of another context is not the current context's device.
func TestMemAllocAsyncUsesTheStreamsDevice(t *testing.T) {
	s := start(t, Devices(2))
	c1, err := s.DevicePrimaryCtxRetain(1)
	require.NoError(t, err)
	defer func() { require.NoError(t, s.DevicePrimaryCtxRelease(1)) }()
	c0 := bind(t, s, 0)
	require.NoError(t, s.CtxSetCurrent(c1))
	st1, err := s.StreamCreate(driver.StreamNonBlocking)
	require.NoError(t, err)
	require.NoError(t, s.CtxSetCurrent(c0))
	reserved := func(dev driver.Device) uint64 {
		t.Helper()
		pool, err := s.DeviceGetDefaultMemPool(dev)
		require.NoError(t, err)
		v, err := s.MemPoolGetAttribute(pool, driver.MemPoolReservedMemCurrent)
		require.NoError(t, err)
		return v
	}

	p, err := s.MemAllocAsync(2*mib, st1)
	require.NoError(t, err)
	require.Equal(t, uint64(0), reserved(0))
	require.Equal(t, 2*mib, reserved(1), "device 1's pool")
	require.NoError(t, s.MemFreeAsync(p, st1))
	require.NoError(t, s.StreamSynchronize(st1))

	require.NoError(t, s.CtxSetCurrent(c1))
	require.NoError(t, s.CtxSynchronize()) // releases what the pool caches above its threshold
	require.NoError(t, s.StreamDestroy(st1))
	require.Equal(t, uint64(0), reserved(1))
	require.NoError(t, s.CtxSetCurrent(c0))
}
