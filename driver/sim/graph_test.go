package sim

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
)

// TestGraphReplaysAtCapturedAddresses captures a memset, a copy and a kernel, then releases the
// memory, maps new memory at the same address and launches: the nodes act on the new memory. Eager,
// so that a replayed kernel's fault is the launch's own.
func TestGraphReplaysAtCapturedAddresses(t *testing.T) {
	s := start(t, Eager())
	bind(t, s, 0)
	m, fill, verify, _ := loadKernels(t, s)
	defer func() { require.NoError(t, s.ModuleUnload(m)) }()
	b := makeBuffer(t, s, deviceProp(0, 0), 1, 2*mib, rw(0))
	st, err := s.StreamCreate(driver.StreamNonBlocking)
	require.NoError(t, err)
	defer func() { require.NoError(t, s.StreamDestroy(st)) }()

	const words = 1024
	cnt := b.base + driver.DevicePtr(mib) // the verify kernel's mismatch counter
	require.NoError(t, s.StreamBeginCapture(st, driver.CaptureModeRelaxed))
	require.NoError(t, s.LaunchKernel(fill, one, one, 0, st, uint64(b.base), words, 0, 7))
	require.NoError(t, s.MemsetD8Async(cnt, 0, 8, st))
	require.NoError(t, s.MemcpyAsync(b.base+driver.DevicePtr(64<<10), b.base, 8*words, st))
	require.NoError(t, s.LaunchKernel(verify, one, one, 0, st, uint64(b.base)+64<<10, words, 0, 7, uint64(cnt)))
	g, err := s.StreamEndCapture(st)
	require.NoError(t, err)
	require.Equal(t, 1, s.Live().Graphs)
	e, err := s.GraphInstantiate(g, 0)
	require.NoError(t, err)
	require.NoError(t, s.GraphDestroy(g))

	// Nothing ran during the capture.
	require.NoError(t, s.MemsetD8(cnt, 0xff, 8))
	require.Equal(t, ^uint64(0), counter(t, s, cnt))

	// New memory at the same address: the graph writes and verifies it.
	require.NoError(t, s.MemUnmap(b.base, b.size))
	require.NoError(t, s.MemRelease(b.chunks[0].h))
	h, err := s.MemCreate(2*mib, deviceProp(0, 0), 0)
	require.NoError(t, err)
	b.chunks[0].h = h
	require.NoError(t, s.MemMap(b.base, 2*mib, 0, h, 0))
	require.NoError(t, s.MemSetAccess(b.base, 2*mib, []driver.AccessDesc{rw(0)}))
	require.NoError(t, s.MemsetD8(b.base, 0, 2*mib))
	require.NoError(t, s.GraphLaunch(e, st))
	require.Equal(t, uint64(0), counter(t, s, cnt))
	var w [8]byte
	require.NoError(t, s.MemcpyDtoH(ptr(w[:]), b.base+driver.DevicePtr(64<<10), 8))
	require.NotEqual(t, [8]byte{}, w, "the copy node ran on the new memory")

	// Unmapped at launch time: the replayed kernel faults.
	require.NoError(t, s.MemUnmap(b.base, b.size))
	require.ErrorIs(t, s.GraphLaunch(e, st), driver.ErrorIllegalAddress)
	require.NoError(t, s.MemMap(b.base, 2*mib, 0, h, 0))
	require.NoError(t, s.GraphExecDestroy(e))
	b.free(t, s)
}

func TestCaptureRules(t *testing.T) {
	s := start(t)
	bind(t, s, 0)
	st, err := s.StreamCreate(driver.StreamNonBlocking)
	require.NoError(t, err)
	defer func() { require.NoError(t, s.StreamDestroy(st)) }()

	require.ErrorIs(t, s.StreamBeginCapture(0, driver.CaptureModeRelaxed), driver.ErrorStreamCaptureUnsupported)
	require.ErrorIs(t, s.StreamBeginCapture(st, 3), driver.ErrorInvalidValue)
	require.ErrorIs(t, s.StreamBeginCapture(12345, driver.CaptureModeRelaxed), driver.ErrorInvalidHandle)
	_, err = s.StreamEndCapture(st)
	require.ErrorIs(t, err, driver.ErrorIllegalState)

	require.NoError(t, s.StreamBeginCapture(st, driver.CaptureModeGlobal))
	require.ErrorIs(t, s.StreamBeginCapture(st, driver.CaptureModeGlobal), driver.ErrorIllegalState)
	require.ErrorIs(t, s.StreamSynchronize(st), driver.ErrorStreamCaptureUnsupported)
	_, err = s.StreamEndCapture(st)
	require.ErrorIs(t, err, driver.ErrorStreamCaptureInvalidated)

	_, err = s.GraphInstantiate(99, 0)
	require.ErrorIs(t, err, driver.ErrorInvalidValue)
	require.ErrorIs(t, s.GraphLaunch(99, st), driver.ErrorInvalidHandle)
	require.ErrorIs(t, s.GraphExecDestroy(99), driver.ErrorInvalidValue)
	require.ErrorIs(t, s.GraphDestroy(99), driver.ErrorInvalidValue)

	// An empty capture is a graph; faults fire on the graph calls.
	require.NoError(t, s.StreamBeginCapture(st, driver.CaptureModeRelaxed))
	g, err := s.StreamEndCapture(st)
	require.NoError(t, err)
	s.FailNth("cuGraphInstantiateWithFlags", 1, driver.ErrorOutOfMemory)
	_, err = s.GraphInstantiate(g, 0)
	require.ErrorIs(t, err, driver.ErrorOutOfMemory)
	e, err := s.GraphInstantiate(g, 0)
	require.NoError(t, err)
	require.NoError(t, s.GraphLaunch(e, st))
	require.NoError(t, s.GraphExecDestroy(e))
	require.NoError(t, s.GraphDestroy(g))
}

// TestCaptureChecksArguments: a copy queued on a capturing stream has its contexts checked as when it
// runs at once (the driver refuses them when it is called, not when the graph runs).
func TestCaptureChecksArguments(t *testing.T) {
	s := start(t, Devices(2))
	c1, err := s.DevicePrimaryCtxRetain(1)
	require.NoError(t, err)
	defer func() { require.NoError(t, s.DevicePrimaryCtxRelease(1)) }()
	c0 := bind(t, s, 0)
	b := makeBuffer(t, s, deviceProp(0, 0), 1, 2*mib, rw(0), rw(1))
	st, err := s.StreamCreate(driver.StreamNonBlocking)
	require.NoError(t, err)
	defer func() { require.NoError(t, s.StreamDestroy(st)) }()

	require.NoError(t, s.StreamBeginCapture(st, driver.CaptureModeRelaxed))
	require.ErrorIs(t, s.MemcpyPeerAsync(b.base, 999, b.base+4096, c1, 16, st), driver.ErrorInvalidContext)
	require.ErrorIs(t, s.MemcpyPeerAsync(b.base, c0, b.base+4096, 999, 16, st), driver.ErrorInvalidContext)
	if g, err := s.StreamEndCapture(st); err == nil {
		require.NoError(t, s.GraphDestroy(g))
	}
	b.free(t, s)
}

// TestCtxSynchronizeDuringCapture: synchronizing a context while one of its streams captures is
// invalid in every capture mode (the context's work includes the capture):
// CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, and the capture is invalidated. A capture in another
// context does not matter.
func TestCtxSynchronizeDuringCapture(t *testing.T) {
	s := start(t, Devices(2))
	c1, err := s.DevicePrimaryCtxRetain(1)
	require.NoError(t, err)
	defer func() { require.NoError(t, s.DevicePrimaryCtxRelease(1)) }()
	c0 := bind(t, s, 0)
	st, err := s.StreamCreate(driver.StreamNonBlocking)
	require.NoError(t, err)
	defer func() { require.NoError(t, s.StreamDestroy(st)) }()

	require.NoError(t, s.StreamBeginCapture(st, driver.CaptureModeRelaxed))
	require.NoError(t, s.CtxSetCurrent(c1))
	require.NoError(t, s.CtxSynchronize(), "device 1 has no capturing stream")
	require.NoError(t, s.CtxSetCurrent(c0))
	require.ErrorIs(t, s.CtxSynchronize(), driver.ErrorStreamCaptureUnsupported)
	_, err = s.StreamEndCapture(st)
	require.ErrorIs(t, err, driver.ErrorStreamCaptureInvalidated)
	require.NoError(t, s.CtxSynchronize(), "no capture left")
}

// TestInvalidatedCaptureRefusesWork: once a capture is invalidated (here by synchronizing its
// stream), work queued on the stream is refused with CUDA_ERROR_STREAM_CAPTURE_INVALIDATED until the
// capture is ended, instead of being recorded into a graph that will never exist.
func TestInvalidatedCaptureRefusesWork(t *testing.T) {
	s := start(t)
	bind(t, s, 0)
	m, fill, _, _ := loadKernels(t, s)
	defer func() { require.NoError(t, s.ModuleUnload(m)) }()
	b := makeBuffer(t, s, deviceProp(0, 0), 1, 2*mib, rw(0))
	st, err := s.StreamCreate(driver.StreamNonBlocking)
	require.NoError(t, err)
	defer func() { require.NoError(t, s.StreamDestroy(st)) }()
	e, err := s.GraphInstantiate(emptyGraph(t, s, st), 0)
	require.NoError(t, err)
	defer func() { require.NoError(t, s.GraphExecDestroy(e)) }()

	require.NoError(t, s.StreamBeginCapture(st, driver.CaptureModeRelaxed))
	require.NoError(t, s.MemsetD8Async(b.base, 1, 8, st), "recorded")
	require.ErrorIs(t, s.StreamSynchronize(st), driver.ErrorStreamCaptureUnsupported)
	require.ErrorIs(t, s.MemsetD8Async(b.base, 1, 8, st), driver.ErrorStreamCaptureInvalidated)
	require.ErrorIs(t, s.MemcpyAsync(b.base, b.base+4096, 8, st), driver.ErrorStreamCaptureInvalidated)
	require.ErrorIs(t, s.LaunchKernel(fill, one, one, 0, st, uint64(b.base), 1, 0, 1), driver.ErrorStreamCaptureInvalidated)
	require.ErrorIs(t, s.GraphLaunch(e, st), driver.ErrorStreamCaptureInvalidated)
	_, err = s.StreamEndCapture(st)
	require.ErrorIs(t, err, driver.ErrorStreamCaptureInvalidated)

	// Ended, the stream runs work again.
	require.NoError(t, s.MemsetD8Async(b.base, 1, 8, st))
	require.NoError(t, s.StreamSynchronize(st))
	b.free(t, s)
}

// emptyGraph captures nothing on st and returns the graph, destroyed when the test ends.
func emptyGraph(t *testing.T, s *Sim, st driver.Stream) driver.Graph {
	t.Helper()
	require.NoError(t, s.StreamBeginCapture(st, driver.CaptureModeRelaxed))
	g, err := s.StreamEndCapture(st)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, s.GraphDestroy(g)) })
	return g
}

// TestLegacyStreamDuringBlockingCapture: while a stream made without NON_BLOCKING captures, the
// legacy stream of its context, which would wait for it, may not be used, nor may synchronous calls
// that run on it: CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, and the capture is invalidated. A non-blocking
// capturing stream, or a capture in another context, does not matter.
func TestLegacyStreamDuringBlockingCapture(t *testing.T) {
	s := start(t, Devices(2))
	c1, err := s.DevicePrimaryCtxRetain(1)
	require.NoError(t, err)
	defer func() { require.NoError(t, s.DevicePrimaryCtxRelease(1)) }()
	c0 := bind(t, s, 0)
	m, fill, _, _ := loadKernels(t, s)
	defer func() { require.NoError(t, s.ModuleUnload(m)) }()
	b := makeBuffer(t, s, deviceProp(0, 0), 1, 2*mib, rw(0))
	host := make([]byte, 64)
	blocking, err := s.StreamCreate(driver.StreamDefault)
	require.NoError(t, err)
	defer func() { require.NoError(t, s.StreamDestroy(blocking)) }()
	nonBlocking, err := s.StreamCreate(driver.StreamNonBlocking)
	require.NoError(t, err)
	defer func() { require.NoError(t, s.StreamDestroy(nonBlocking)) }()
	ev, err := s.EventCreate(0)
	require.NoError(t, err)
	defer func() { require.NoError(t, s.EventDestroy(ev)) }()

	for name, use := range map[string]func() error{
		"cuMemcpyHtoD":               func() error { return s.MemcpyHtoD(b.base, ptr(host), 64) },
		"cuMemsetD8":                 func() error { return s.MemsetD8(b.base, 0, 64) },
		"cuMemsetD8Async legacy":     func() error { return s.MemsetD8Async(b.base, 0, 64, 0) },
		"cuMemcpyAsync legacy":       func() error { return s.MemcpyAsync(b.base, b.base+64, 64, driver.Stream(1)) },
		"cuLaunchKernel legacy":      func() error { return s.LaunchKernel(fill, one, one, 0, 0, uint64(b.base), 1, 0, 1) },
		"cuEventRecord legacy":       func() error { return s.EventRecord(ev, 0) },
		"cuStreamSynchronize legacy": func() error { return s.StreamSynchronize(0) },
		"cuStreamWaitEvent legacy":   func() error { return s.StreamWaitEvent(0, ev, 0) },
	} {
		require.NoError(t, s.StreamBeginCapture(blocking, driver.CaptureModeRelaxed))
		require.ErrorIs(t, use(), driver.ErrorStreamCaptureImplicit, name)
		_, err := s.StreamEndCapture(blocking)
		require.ErrorIs(t, err, driver.ErrorStreamCaptureInvalidated, name)

		require.NoError(t, s.StreamBeginCapture(nonBlocking, driver.CaptureModeRelaxed))
		require.NoError(t, use(), "%s while a non-blocking stream captures", name)
		g, err := s.StreamEndCapture(nonBlocking)
		require.NoError(t, err, name)
		require.NoError(t, s.GraphDestroy(g))
	}

	// A blocking capture on device 1 leaves device 0's legacy stream alone.
	require.NoError(t, s.CtxSetCurrent(c1))
	st1, err := s.StreamCreate(driver.StreamDefault)
	require.NoError(t, err)
	require.NoError(t, s.StreamBeginCapture(st1, driver.CaptureModeRelaxed))
	require.NoError(t, s.CtxSetCurrent(c0))
	require.NoError(t, s.MemsetD8(b.base, 0, 64))
	require.NoError(t, s.CtxSetCurrent(c1))
	g, err := s.StreamEndCapture(st1)
	require.NoError(t, err)
	require.NoError(t, s.GraphDestroy(g))
	require.NoError(t, s.StreamDestroy(st1))
	require.NoError(t, s.CtxSetCurrent(c0))
	require.NoError(t, s.CtxSynchronize())
	b.free(t, s)
}
