package sim

import (
	"runtime"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
)

// TestObjectsOfAnotherContext: a kernel launch, an event record and an elapsed time mixing objects of
// two contexts fail with CUDA_ERROR_INVALID_HANDLE, as on the driver; cuStreamWaitEvent across
// devices is allowed (cross-device dependencies).
func TestObjectsOfAnotherContext(t *testing.T) {
	s := start(t, Devices(2))
	c1, err := s.DevicePrimaryCtxRetain(1)
	require.NoError(t, err)
	defer func() { require.NoError(t, s.DevicePrimaryCtxRelease(1)) }()
	c0 := bind(t, s, 0)
	st0, err := s.StreamCreate(0)
	require.NoError(t, err)
	e0, err := s.EventCreate(0)
	require.NoError(t, err)
	m0, _, _, _ := loadKernels(t, s)

	require.NoError(t, s.CtxSetCurrent(c1))
	st1, err := s.StreamCreate(0)
	require.NoError(t, err)
	e1, err := s.EventCreate(0)
	require.NoError(t, err)
	m1, fill1, _, _ := loadKernels(t, s)
	buf, err := s.MemAlloc(2 * mib) // on device 1
	require.NoError(t, err)

	// Kernels: the stream must be the function's context's.
	require.ErrorIs(t, s.LaunchKernel(fill1, one, one, 0, st0, uint64(buf), 1, 0, 1), driver.ErrorInvalidHandle,
		"a stream of device 0's context")
	require.NoError(t, s.LaunchKernel(fill1, one, one, 0, st1, uint64(buf), 1, 0, 1))
	require.NoError(t, s.LaunchKernel(fill1, one, one, 0, 0, uint64(buf), 1, 0, 1), "the current context's legacy stream")

	// Graphs replay on a stream of their own context only.
	require.NoError(t, s.StreamBeginCapture(st1, driver.CaptureModeRelaxed))
	require.NoError(t, s.LaunchKernel(fill1, one, one, 0, st1, uint64(buf), 1, 0, 1))
	g, err := s.StreamEndCapture(st1)
	require.NoError(t, err)
	ge, err := s.GraphInstantiate(g, 0)
	require.NoError(t, err)
	require.ErrorIs(t, s.GraphLaunch(ge, st0), driver.ErrorInvalidHandle)
	require.NoError(t, s.GraphLaunch(ge, st1))
	require.NoError(t, s.GraphExecDestroy(ge))
	require.NoError(t, s.GraphDestroy(g))

	// Event records: event and stream of the same context.
	require.ErrorIs(t, s.EventRecord(e0, st1), driver.ErrorInvalidHandle)
	require.ErrorIs(t, s.EventRecord(e1, st0), driver.ErrorInvalidHandle)
	require.ErrorIs(t, s.EventRecord(e0, 0), driver.ErrorInvalidHandle, "the legacy stream is device 1's here")
	require.NoError(t, s.EventRecord(e1, st1))
	require.NoError(t, s.EventRecord(e1, 0))

	// Cross-device waits are allowed.
	require.NoError(t, s.StreamWaitEvent(st1, e0, 0))

	require.NoError(t, s.CtxSetCurrent(c0))
	require.NoError(t, s.EventRecord(e0, st0))
	require.NoError(t, s.EventRecord(e0, 0))
	require.NoError(t, s.StreamWaitEvent(st0, e1, 0))
	require.NoError(t, s.StreamWaitEvent(0, e1, 0))
	_, err = s.EventElapsedTime(e0, e1)
	require.ErrorIs(t, err, driver.ErrorInvalidHandle, "events of two contexts")
	_, err = s.EventElapsedTime(e1, e0)
	require.ErrorIs(t, err, driver.ErrorInvalidHandle)
	_, err = s.EventElapsedTime(e0, e0)
	require.NoError(t, err)
	require.NoError(t, s.StreamDestroy(st0))
	require.NoError(t, s.EventDestroy(e0))
	require.NoError(t, s.ModuleUnload(m0))

	require.NoError(t, s.CtxSetCurrent(c1))
	require.NoError(t, s.StreamDestroy(st1))
	require.NoError(t, s.EventDestroy(e1))
	require.NoError(t, s.ModuleUnload(m1))
	require.NoError(t, s.MemFree(buf))
	require.NoError(t, s.CtxSetCurrent(c0))
}

// TestPeerKernelsNeedPeerAccessToMemAlloc: cuMemAlloc and cuMemAllocAsync memory is reachable from
// another device by copies (UVA), but a kernel or a memset there needs peer access
// (cuCtxEnablePeerAccess, cuMemPoolSetAccess), which is never enabled. Eager, so that each kernel's
// error is its launch's (TestDeferredKernelFaultsAtSynchronize has the deferred form).
func TestPeerKernelsNeedPeerAccessToMemAlloc(t *testing.T) {
	s := start(t, Devices(2), Eager())
	c1, err := s.DevicePrimaryCtxRetain(1)
	require.NoError(t, err)
	defer func() { require.NoError(t, s.DevicePrimaryCtxRelease(1)) }()
	c0 := bind(t, s, 0)
	m0, fill0, _, _ := loadKernels(t, s)
	p, err := s.MemAlloc(2 * mib)
	require.NoError(t, err)
	q, err := s.MemAllocAsync(2*mib, 0)
	require.NoError(t, err)
	for _, b := range []driver.DevicePtr{p, q} {
		require.NoError(t, s.LaunchKernel(fill0, one, one, 0, 0, uint64(b), 2*mib/8, 0, 1), "its own device")
		require.NoError(t, s.MemsetD8(b, 0, 16))
	}

	require.NoError(t, s.CtxSetCurrent(c1))
	m1, fill1, verify1, read1 := loadKernels(t, s)
	cnt, err := s.MemAlloc(8) // on device 1
	require.NoError(t, err)
	require.NoError(t, s.MemsetD8(cnt, 0, 8))
	src := pattern(64, 3)
	got := make([]byte, 64)
	for _, b := range []driver.DevicePtr{p, q} {
		require.ErrorIs(t, s.LaunchKernel(fill1, one, one, 0, 0, uint64(b), 1, 0, 1), driver.ErrorIllegalAddress, "peer write")
		require.ErrorIs(t, s.LaunchKernel(verify1, one, one, 0, 0, uint64(b), 1, 0, 1, uint64(cnt)), driver.ErrorIllegalAddress, "peer read")
		require.ErrorIs(t, s.LaunchKernel(read1, one, one, 0, 0, uint64(b), 2, uint64(cnt)), driver.ErrorIllegalAddress, "peer read")
		require.ErrorIs(t, s.MemsetD8(b, 1, 16), driver.ErrorInvalidValue)
		require.ErrorIs(t, s.MemsetD32(b, 1, 4), driver.ErrorInvalidValue)
		require.ErrorIs(t, s.MemsetD8Async(b, 1, 16, 0), driver.ErrorInvalidValue)
		// Copies between devices work without peer access.
		require.NoError(t, s.MemcpyHtoD(b, ptr(src), 64))
		require.NoError(t, s.MemcpyDtoH(ptr(got), b, 64))
		require.Equal(t, src, got)
		require.NoError(t, s.MemcpyDtoD(cnt, b, 8))
		require.NoError(t, s.MemcpyAsync(b, cnt, 8, 0))
	}
	require.NoError(t, s.MemFree(cnt))
	require.NoError(t, s.ModuleUnload(m1))

	require.NoError(t, s.CtxSetCurrent(c0))
	require.NoError(t, s.MemFreeAsync(q, 0))
	require.NoError(t, s.MemFree(p))
	pool, err := s.DeviceGetDefaultMemPool(0)
	require.NoError(t, err)
	require.NoError(t, s.MemPoolTrimTo(pool, 0))
	require.NoError(t, s.ModuleUnload(m0))
}

// TestReleaseFreesContextMemory: destroying a primary context (its last release) frees its cuMemAlloc
// and cuMemAllocAsync memory, live or cached in the pool; the pointers are invalid afterwards. Another
// device's memory and VMM allocations stay.
func TestReleaseFreesContextMemory(t *testing.T) {
	s := start(t, Devices(2), MemoryPerDevice(64*mib))
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	c1, err := s.DevicePrimaryCtxRetain(1)
	require.NoError(t, err)
	defer func() { require.NoError(t, s.DevicePrimaryCtxRelease(1)) }()
	require.NoError(t, s.CtxSetCurrent(c1))
	other, err := s.MemAlloc(2 * mib) // on device 1
	require.NoError(t, err)

	c0, err := s.DevicePrimaryCtxRetain(0)
	require.NoError(t, err)
	require.NoError(t, s.CtxSetCurrent(c0))
	p, err := s.MemAlloc(2 * mib)
	require.NoError(t, err)
	q, err := s.MemAllocAsync(2*mib, 0)
	require.NoError(t, err)
	cached, err := s.MemAllocAsync(4*mib, 0)
	require.NoError(t, err)
	require.NoError(t, s.MemFreeAsync(cached, 0))
	h, err := s.MemCreate(2*mib, deviceProp(0, 0), 0)
	require.NoError(t, err)
	free, _, err := s.MemGetInfo()
	require.NoError(t, err)
	require.Equal(t, 54*mib, free)
	l := s.Live()
	require.Equal(t, 2, l.LegacyAllocs)
	require.Equal(t, 2, l.AsyncAllocs)

	require.NoError(t, s.DevicePrimaryCtxRelease(0))
	l = s.Live()
	require.Equal(t, 1, l.LegacyAllocs, "device 1's buffer stays")
	require.Zero(t, l.AsyncAllocs)
	require.Equal(t, 1, l.Allocations, "cuMemCreate memory belongs to the process")

	require.NoError(t, s.CtxSetCurrent(c1))
	src := pattern(64, 9)
	for _, b := range []driver.DevicePtr{p, q} {
		require.ErrorIs(t, s.MemcpyHtoD(b, ptr(src), 64), driver.ErrorInvalidValue, "freed with its context")
		require.ErrorIs(t, s.MemcpyDtoD(other, b, 64), driver.ErrorInvalidValue)
	}
	require.NoError(t, s.MemcpyHtoD(other, ptr(src), 64))
	require.NoError(t, s.MemFree(other))

	// A new context of device 0 does not know the old pointers, and the memory is free again.
	c0, err = s.DevicePrimaryCtxRetain(0)
	require.NoError(t, err)
	require.NoError(t, s.CtxSetCurrent(c0))
	require.ErrorIs(t, s.MemFree(p), driver.ErrorInvalidValue)
	require.ErrorIs(t, s.MemFreeAsync(q, 0), driver.ErrorInvalidValue)
	free, _, err = s.MemGetInfo()
	require.NoError(t, err)
	require.Equal(t, 62*mib, free, "only the cuMemCreate allocation is left")
	pool, err := s.DeviceGetDefaultMemPool(0)
	require.NoError(t, err)
	for _, a := range []driver.MemPoolAttribute{driver.MemPoolReservedMemCurrent, driver.MemPoolUsedMemCurrent} {
		v, err := s.MemPoolGetAttribute(pool, a)
		require.NoError(t, err)
		require.Zero(t, v)
	}
	q, err = s.MemAllocAsync(2*mib, 0)
	require.NoError(t, err, "the pool works again")
	require.NoError(t, s.MemFreeAsync(q, 0))
	require.NoError(t, s.MemPoolTrimTo(pool, 0))
	require.NoError(t, s.MemRelease(h))
	require.NoError(t, s.CtxSetCurrent(0))
	require.NoError(t, s.DevicePrimaryCtxRelease(0))
}
