package sim

import (
	"errors"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
)

// Deferred (the default), an async copy from pinned memory moves its bytes when its stream is
// synchronized, as on a GPU: a source changed before then is what arrives. Eager, it moves at once.
func TestDeferredWorkMovesDataAtSynchronize(t *testing.T) {
	for _, deferred := range []bool{false, true} {
		opts := []Option{Eager()}
		if deferred {
			opts = []Option{DeferWork()}
		}
		s := start(t, opts...)
		bind(t, s, 0)
		host, err := unix.Mmap(-1, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		require.NoError(t, err)
		p := unsafe.Pointer(&host[0])
		require.NoError(t, s.MemHostRegister(p, 4096, 0))
		dev, err := s.MemAlloc(4096)
		require.NoError(t, err)
		st, err := s.StreamCreate(driver.StreamNonBlocking)
		require.NoError(t, err)

		host[0] = 1
		require.NoError(t, s.MemcpyHtoDAsync(dev, p, 4096, st))
		host[0] = 2 // too early: the copy may not have read it yet
		require.NoError(t, s.StreamSynchronize(st))
		out := make([]byte, 4096)
		require.NoError(t, s.MemcpyDtoH(unsafe.Pointer(&out[0]), dev, 4096))
		want := byte(1)
		if deferred {
			want = 2
		}
		require.Equal(t, want, out[0], "deferred %v", deferred)

		require.NoError(t, s.StreamDestroy(st))
		require.NoError(t, s.MemFree(dev))
		require.NoError(t, s.MemHostUnregister(p))
		require.NoError(t, unix.Munmap(host))
	}
}

// Deferred (the default), a launch is checked for its arguments only; what the kernel or a copy does
// wrong when it runs is reported by the next synchronize, as the driver reports asynchronous
// errors, and the context stays usable: a kernel past the end of its memory, a write to a read-only
// chunk, a custom kernel that fails, and a copy whose source was unmapped before its stream ran.
func TestDeferredKernelFaultsAtSynchronize(t *testing.T) {
	s := start(t, DeferWork())
	bind(t, s, 0)
	m, fill, verify, _ := loadKernels(t, s)
	b := makeBuffer(t, s, deviceProp(0, 0), 2, 2*mib, rw(0))
	st, err := s.StreamCreate(driver.StreamNonBlocking)
	require.NoError(t, err)
	base, words := uint64(b.base), b.size/8

	require.ErrorIs(t, s.LaunchKernel(fill, one, one, 0, st, base, words, 0), driver.ErrorInvalidValue, "arguments: at once")
	require.NoError(t, s.LaunchKernel(fill, one, one, 0, st, base+b.size-8, 2, 0, 0), "past the end: launched")
	require.ErrorIs(t, s.StreamSynchronize(st), driver.ErrorIllegalAddress)
	require.NoError(t, s.StreamSynchronize(st), "reported once")

	require.NoError(t, s.MemSetAccess(b.chunks[1].va, 2*mib, []driver.AccessDesc{ro(0)}))
	require.NoError(t, s.LaunchKernel(fill, one, one, 0, st, base, words, 0, 3), "read-only chunk: launched")
	require.ErrorIs(t, s.CtxSynchronize(), driver.ErrorIllegalAddress)
	require.NoError(t, s.MemSetAccess(b.chunks[1].va, 2*mib, []driver.AccessDesc{rw(0)}))

	// Usable afterwards: fill and verify the whole buffer.
	cnt, err := s.MemAlloc(8)
	require.NoError(t, err)
	require.NoError(t, s.MemsetD8Async(cnt, 0, 8, st))
	require.NoError(t, s.LaunchKernel(fill, one, one, 0, st, base, words, 0, 5))
	require.NoError(t, s.LaunchKernel(verify, one, one, 0, st, base, words, 0, 5, uint64(cnt)))
	require.NoError(t, s.StreamSynchronize(st))
	require.Zero(t, counter(t, s, cnt))

	// A copy queued, then its source unmapped before the stream ran it.
	require.NoError(t, s.HoldStream(st))
	require.NoError(t, s.MemcpyAsync(cnt, b.chunks[0].va, 8, st))
	require.NoError(t, s.MemUnmap(b.base, b.size))
	require.NoError(t, s.ReleaseStream(st))
	require.ErrorIs(t, s.StreamSynchronize(st), driver.ErrorIllegalAddress)
	for _, c := range b.chunks {
		require.NoError(t, s.MemMap(c.va, c.size, 0, c.h, 0))
	}
	require.NoError(t, s.MemSetAccess(b.base, b.size, []driver.AccessDesc{rw(0)}))

	require.NoError(t, s.MemFree(cnt))
	require.NoError(t, s.StreamDestroy(st))
	require.NoError(t, s.ModuleUnload(m))
	b.free(t, s)
}

// A custom kernel's own failure, deferred, is the next synchronize's error.
func TestDeferredCustomKernelFailsAtSynchronize(t *testing.T) {
	fail := func(k *KernelCall) error { return errors.New("no") }
	s := start(t, Kernel("fail", fail), DeferWork())
	bind(t, s, 0)
	m, err := s.ModuleLoadData([]byte(".version 9.0\n.target sm_90\n.visible .entry fail()\n{ ret; }\n"))
	require.NoError(t, err)
	f, err := s.ModuleGetFunction(m, "fail")
	require.NoError(t, err)
	require.NoError(t, s.LaunchKernel(f, one, one, 0, 0))
	require.ErrorIs(t, s.CtxSynchronize(), driver.ErrorLaunchFailed)
	require.NoError(t, s.CtxSynchronize())
	require.NoError(t, s.ModuleUnload(m))
}

// The per-thread default stream (CU_STREAM_PER_THREAD, 2) is a blocking stream: it and the legacy
// stream wait for each other's earlier work, as for a stream made without NON_BLOCKING.
func TestPerThreadStreamSynchronizesWithLegacy(t *testing.T) {
	s := start(t, DeferWork())
	bind(t, s, 0)
	const n = 4096
	in, err := s.MemHostAlloc(n, 0)
	require.NoError(t, err)
	out, err := s.MemHostAlloc(n, 0)
	require.NoError(t, err)
	dev, err := s.MemAlloc(n)
	require.NoError(t, err)
	const perThread = driver.Stream(2)

	*(*byte)(in) = 1
	require.NoError(t, s.MemcpyHtoDAsync(dev, in, n, 0))
	require.NoError(t, s.MemcpyDtoHAsync(out, dev, n, perThread))
	require.NoError(t, s.StreamSynchronize(perThread))
	require.Equal(t, byte(1), *(*byte)(out), "the per-thread stream waits for the legacy stream")

	require.NoError(t, s.MemsetD8Async(dev, 7, n, perThread))
	require.NoError(t, s.MemcpyDtoHAsync(out, dev, n, 0))
	require.NoError(t, s.StreamSynchronize(0))
	require.Equal(t, byte(7), *(*byte)(out), "the legacy stream waits for the per-thread stream")

	require.NoError(t, s.MemFree(dev))
	require.NoError(t, s.MemFreeHost(out))
	require.NoError(t, s.MemFreeHost(in))
}

// A copy to or from pageable memory on a blocking stream comes after the legacy stream's earlier
// work (implicit synchronization), and one on the legacy stream after the blocking streams' work,
// like any work queued there: the driver stages it in stream order.
func TestPageableCopyAfterImplicitlySynchronizedWork(t *testing.T) {
	s := start(t, DeferWork())
	bind(t, s, 0)
	const n = 4096
	dev, err := s.MemAlloc(n)
	require.NoError(t, err)
	blocking, err := s.StreamCreate(driver.StreamDefault)
	require.NoError(t, err)
	out := make([]byte, n) // pageable

	require.NoError(t, s.MemsetD8Async(dev, 7, n, 0))
	require.NoError(t, s.MemcpyDtoHAsync(ptr(out), dev, n, blocking))
	require.Equal(t, byte(7), out[0], "the blocking stream's copy waits for the legacy stream's fill")

	require.NoError(t, s.MemsetD8Async(dev, 9, n, blocking))
	require.NoError(t, s.MemcpyDtoHAsync(ptr(out), dev, n, 0))
	require.Equal(t, byte(9), out[0], "the legacy stream's copy waits for the blocking stream's fill")

	require.NoError(t, s.StreamDestroy(blocking))
	require.NoError(t, s.MemFree(dev))
}
