package sim

import (
	"encoding/binary"
	"runtime"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
)

func TestCopiesAcrossChunks(t *testing.T) {
	s := start(t)
	bind(t, s, 0)
	a := makeBuffer(t, s, deviceProp(0, 0), 4, 2*mib, rw(0))
	b := makeBuffer(t, s, hostNUMAProp(0), 2, 4*mib, rw(0))
	st, err := s.StreamCreate(driver.StreamNonBlocking)
	require.NoError(t, err)

	// From 1 MiB before the end of chunk 0 to 1 MiB into chunk 3: crosses three chunk boundaries.
	off := driver.DevicePtr(mib)
	n := 6 * mib
	src := pattern(int(n), 2)
	require.NoError(t, s.MemcpyHtoDAsync(a.base+off, ptr(src), n, st))
	require.NoError(t, s.StreamSynchronize(st))
	// Device to device, into another buffer's chunk boundary, then back to the host.
	require.NoError(t, s.MemcpyDtoD(b.base+off, a.base+off, n))
	require.NoError(t, s.MemcpyAsync(a.base, b.base+off, n, 0))
	require.NoError(t, s.StreamSynchronize(0)) // st is non-blocking: it does not wait for the legacy stream
	got := make([]byte, n)
	require.NoError(t, s.MemcpyDtoHAsync(ptr(got), a.base, n, st))
	require.NoError(t, s.StreamSynchronize(st))
	require.Equal(t, src, got)
	// cuMemcpy infers the direction (unified addressing).
	got2 := make([]byte, n)
	require.NoError(t, s.Memcpy(driver.DevicePtr(uintptr(ptr(got2))), b.base+off, n))
	require.Equal(t, src, got2)
	require.NoError(t, s.Memcpy(a.base, driver.DevicePtr(uintptr(ptr(got2))), 16))
	// Zero bytes is a success.
	require.NoError(t, s.MemcpyDtoD(a.base, b.base, 0))

	require.ErrorIs(t, s.MemcpyAsync(a.base, b.base, 16, 0xbad0), driver.ErrorInvalidHandle)
	require.NoError(t, s.StreamDestroy(st))
	a.free(t, s)
	b.free(t, s)
}

func TestCopyAccessRules(t *testing.T) {
	s := start(t, Devices(2))
	bind(t, s, 0)
	buf := makeBuffer(t, s, deviceProp(0, 0), 2, 2*mib)
	host := make([]byte, 4*mib)
	M := driver.DevicePtr(mib)

	require.ErrorIs(t, s.MemcpyHtoD(buf.base, ptr(host), 16), driver.ErrorInvalidValue, "no access")
	require.NoError(t, s.MemSetAccess(buf.base, 2*mib, []driver.AccessDesc{rw(0)}))
	require.NoError(t, s.MemcpyHtoD(buf.base, ptr(host), 16))
	require.ErrorIs(t, s.MemcpyHtoD(buf.base+M, ptr(host), 2*mib), driver.ErrorInvalidValue, "runs into a chunk without access")
	require.NoError(t, s.MemSetAccess(buf.base+2*M, 2*mib, []driver.AccessDesc{ro(0)}))
	require.ErrorIs(t, s.MemcpyHtoD(buf.base+M, ptr(host), 2*mib), driver.ErrorInvalidValue, "read-only destination")
	require.NoError(t, s.MemcpyDtoH(ptr(host), buf.base+M, 2*mib), "read-only source is fine")
	require.ErrorIs(t, s.MemcpyDtoH(ptr(host), buf.base+3*M, 2*mib), driver.ErrorInvalidValue, "runs past the mapping")
	require.ErrorIs(t, s.MemcpyDtoH(ptr(host), buf.base-4096, 8192), driver.ErrorInvalidValue, "starts before the reservation")

	// A host address that is not mapped is an error, not a crash.
	hole, err := mmap(0, uintptr(mib), unix.PROT_NONE, reserveFlags, -1, 0)
	require.NoError(t, err)
	defer munmap(hole, mib)
	require.ErrorIs(t, s.MemcpyDtoH(addrPtr(hole), buf.base, 16), driver.ErrorInvalidValue)
	require.ErrorIs(t, s.MemcpyHtoD(buf.base, addrPtr(hole), 16), driver.ErrorInvalidValue)

	// Another simulator's device address is not this one's memory, nor readable host memory.
	other := start(t)
	bind(t, other, 0)
	ob := makeBuffer(t, other, deviceProp(0, 0), 1, 2*mib, rw(0))
	require.ErrorIs(t, s.MemcpyDtoD(buf.base, ob.base, 16), driver.ErrorInvalidValue)
	ob.free(t, other)
	buf.free(t, s)
}

func TestPeerCopies(t *testing.T) {
	s := start(t, Devices(2))
	c1, err := s.DevicePrimaryCtxRetain(1)
	require.NoError(t, err)
	defer func() { require.NoError(t, s.DevicePrimaryCtxRelease(1)) }()
	c0 := bind(t, s, 0)
	a := makeBuffer(t, s, deviceProp(0, 0), 1, 2*mib, rw(0), ro(1))
	b := makeBuffer(t, s, deviceProp(1, 0), 1, 2*mib, rw(1))
	src := pattern(int(2*mib), 7)
	require.NoError(t, s.MemcpyHtoD(a.base, ptr(src), 2*mib))

	// Device 1 may read device 0's memory (READ) but not write it: memset fails INVALID_VALUE (measured).
	require.NoError(t, s.CtxSetCurrent(c1))
	got := make([]byte, 2*mib)
	require.NoError(t, s.MemcpyDtoH(ptr(got), a.base, 2*mib))
	require.Equal(t, src, got)
	require.ErrorIs(t, s.MemsetD8(a.base, 1, 16), driver.ErrorInvalidValue)
	require.ErrorIs(t, s.MemsetD8Async(a.base, 1, 16, 0), driver.ErrorInvalidValue)
	require.NoError(t, s.MemcpyDtoD(b.base, a.base, 2*mib))

	// cuMemcpyPeerAsync: each context identifies the device on its side.
	require.NoError(t, s.CtxSetCurrent(c0))
	require.NoError(t, s.MemsetD8(a.base, 0, 2*mib))
	require.NoError(t, s.MemcpyPeerAsync(a.base, c0, b.base, c1, 2*mib, 0))
	require.NoError(t, s.MemcpyDtoH(ptr(got), a.base, 2*mib))
	require.Equal(t, src, got)
	require.ErrorIs(t, s.MemcpyPeerAsync(b.base, c0, a.base, c1, 16, 0), driver.ErrorInvalidValue,
		"device 0 has no access to device 1's buffer")
	require.ErrorIs(t, s.MemcpyPeerAsync(a.base, 999, b.base, c1, 16, 0), driver.ErrorInvalidContext)
	a.free(t, s)
	b.free(t, s)
}

func TestMemset(t *testing.T) {
	s := start(t)
	bind(t, s, 0)
	b := makeBuffer(t, s, deviceProp(0, 0), 2, 2*mib, rw(0))
	M := driver.DevicePtr(mib)
	require.NoError(t, s.MemsetD32(b.base+M, 0x01020304, mib/2)) // 2 MiB across the chunk boundary
	require.NoError(t, s.MemsetD8(b.base+M-1, 0xff, 1))
	got := make([]byte, 2*mib+8)
	require.NoError(t, s.MemcpyDtoH(ptr(got), b.base+M-4, uint64(len(got))))
	require.Equal(t, []byte{0, 0, 0, 0xff}, got[:4])
	for i := 4; i < len(got)-4; i += 4 {
		if binary.NativeEndian.Uint32(got[i:]) != 0x01020304 {
			t.Fatalf("word at %d: %x", i, got[i:i+4])
		}
	}
	require.Equal(t, []byte{0, 0, 0, 0}, got[len(got)-4:])
	require.ErrorIs(t, s.MemsetD32(b.base+2, 1, 1), driver.ErrorInvalidValue, "unaligned")
	require.ErrorIs(t, s.MemsetD8(b.base+3*M, 1, 2*mib), driver.ErrorInvalidValue, "past the mapping")
	pageable := make([]byte, 64)
	require.ErrorIs(t, s.MemsetD8(driver.DevicePtr(uintptr(ptr(pageable))), 1, 64), driver.ErrorInvalidValue,
		"pageable host memory")
	require.NoError(t, s.MemsetD8(b.base, 1, 0))
	b.free(t, s)
}

// TestConcurrentUse exercises the whole life cycle from several goroutines at once (run with -race).
func TestConcurrentUse(t *testing.T) {
	s := start(t, Devices(2), MemoryPerDevice(4*gib))
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			dev := driver.Device(g % 2)
			ctx, err := s.DevicePrimaryCtxRetain(dev)
			if err != nil {
				errs <- err
				return
			}
			defer s.DevicePrimaryCtxRelease(dev)
			if err := s.CtxSetCurrent(ctx); err != nil {
				errs <- err
				return
			}
			defer s.CtxSetCurrent(0)
			src := pattern(int(4*mib), byte(g))
			got := make([]byte, 4*mib)
			for range 20 {
				err := func() error {
					h, err := s.MemCreate(4*mib, deviceProp(int(dev), 0), 0)
					if err != nil {
						return err
					}
					defer s.MemRelease(h)
					va, err := s.MemAddressReserve(4*mib, 0, 0, 0)
					if err != nil {
						return err
					}
					defer s.MemAddressFree(va, 4*mib)
					if err := s.MemMap(va, 4*mib, 0, h, 0); err != nil {
						return err
					}
					defer s.MemUnmap(va, 4*mib)
					if err := s.MemSetAccess(va, 4*mib, []driver.AccessDesc{rw(int(dev))}); err != nil {
						return err
					}
					if err := s.MemcpyHtoD(va, ptr(src), 4*mib); err != nil {
						return err
					}
					if err := s.MemcpyDtoH(ptr(got), va, 4*mib); err != nil {
						return err
					}
					if _, _, err := s.MemGetInfo(); err != nil {
						return err
					}
					if string(got) != string(src) {
						return driver.ErrorUnknown
					}
					return nil
				}()
				if err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
}
