package sim

import (
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
)

// hostRegion maps size bytes of anonymous host memory for the test.
func hostRegion(t *testing.T, size uint64) []byte {
	t.Helper()
	b, err := unix.Mmap(-1, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	require.NoError(t, err)
	t.Cleanup(func() { _ = unix.Munmap(b) })
	return b
}

func TestHostRegister(t *testing.T) {
	s := start(t)
	bind(t, s, 0)
	region := hostRegion(t, 8*mib)
	p := ptr(region)

	require.ErrorIs(t, s.MemHostRegister(nil, 4096, 0), driver.ErrorInvalidValue)
	require.ErrorIs(t, s.MemHostRegister(p, 0, 0), driver.ErrorInvalidValue)
	require.ErrorIs(t, s.MemHostRegister(p, 4096, 0x100), driver.ErrorInvalidValue, "unknown flag")

	require.NoError(t, s.MemHostRegister(p, 4*mib, driver.HostRegisterPortable))
	require.ErrorIs(t, s.MemHostRegister(p, 4*mib, 0), driver.ErrorHostMemoryAlreadyRegistered, "same range twice (measured)")
	require.ErrorIs(t, s.MemHostRegister(unsafe.Add(p, 2*mib), 4*mib, 0), driver.ErrorHostMemoryAlreadyRegistered, "overlap")
	require.NoError(t, s.MemHostRegister(unsafe.Add(p, 4*mib), 4*mib, driver.HostRegisterReadOnly))
	require.Equal(t, 2, s.Live().HostRegistrations)

	dp, err := s.MemHostGetDevicePointer(unsafe.Add(p, 100), 0)
	require.NoError(t, err)
	require.Equal(t, driver.DevicePtr(uintptr(unsafe.Add(p, 100))), dp, "the host pointer itself")
	_, err = s.MemHostGetDevicePointer(unsafe.Add(p, 100), 1)
	require.ErrorIs(t, err, driver.ErrorInvalidValue)
	other := make([]byte, 64)
	_, err = s.MemHostGetDevicePointer(ptr(other), 0)
	require.ErrorIs(t, err, driver.ErrorInvalidValue, "not registered")

	// The device may read a READ_ONLY registration but not write it.
	b := makeBuffer(t, s, deviceProp(0, 0), 1, 2*mib, rw(0))
	ro := unsafe.Add(p, 4*mib)
	copy(region[4*mib:], pattern(4096, 8))
	require.NoError(t, s.MemcpyHtoD(b.base, ro, 4096))
	require.ErrorIs(t, s.MemcpyDtoH(ro, b.base, 4096), driver.ErrorInvalidValue)
	require.ErrorIs(t, s.MemsetD8(driver.DevicePtr(uintptr(ro)), 1, 16), driver.ErrorInvalidValue)
	require.NoError(t, s.MemsetD8(driver.DevicePtr(uintptr(p)), 7, 16), "writable registration")
	require.Equal(t, byte(7), region[15])
	require.Equal(t, pattern(4096, 8), region[4*mib:4*mib+4096])
	require.ErrorIs(t, s.MemHostRegister(addrPtr(uintptr(b.base)), 2*mib, 0), driver.ErrorInvalidValue, "a device address")
	b.free(t, s)

	require.ErrorIs(t, s.MemHostUnregister(unsafe.Add(p, 4096)), driver.ErrorHostMemoryNotRegistered, "not the start")
	require.NoError(t, s.MemHostUnregister(p))
	require.ErrorIs(t, s.MemHostUnregister(p), driver.ErrorHostMemoryNotRegistered, "twice (measured)")
	require.NoError(t, s.MemHostUnregister(ro))

	// Memory that is not mapped cannot be registered.
	hole, err := mmap(0, uintptr(4*mib), unix.PROT_NONE, reserveFlags, -1, 0)
	require.NoError(t, err)
	require.NoError(t, munmap(hole, 4*mib))
	require.ErrorIs(t, s.MemHostRegister(addrPtr(hole), 4*mib, 0), driver.ErrorInvalidValue)
}

// TestHostRegisterReadOnlyMapping: memory mapped without write permission can be registered only
// with READ_ONLY; without it the driver answers CUDA_ERROR_INVALID_VALUE (docs/driver-facts.md §5).
func TestHostRegisterReadOnlyMapping(t *testing.T) {
	s := start(t)
	bind(t, s, 0)
	mem, err := unix.Mmap(-1, 0, int(4*mib), unix.PROT_READ, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	require.NoError(t, err)
	t.Cleanup(func() { _ = unix.Munmap(mem) })
	p := ptr(mem)
	require.ErrorIs(t, s.MemHostRegister(p, 4*mib, driver.HostRegisterPortable), driver.ErrorInvalidValue)
	require.ErrorIs(t, s.MemHostRegister(unsafe.Add(p, 100), 4096, 0), driver.ErrorInvalidValue, "a piece of it")
	require.Zero(t, s.Live().HostRegistrations)
	require.NoError(t, s.MemHostRegister(p, 4*mib, driver.HostRegisterReadOnly))
	require.NoError(t, s.MemHostUnregister(p))

	// A range whose second half is read-only: refused as a whole, its writable half accepted.
	region := hostRegion(t, 4*mib)
	require.NoError(t, unix.Mprotect(region[2*mib:], unix.PROT_READ))
	q := ptr(region)
	require.ErrorIs(t, s.MemHostRegister(q, 4*mib, 0), driver.ErrorInvalidValue)
	require.ErrorIs(t, s.MemHostRegister(unsafe.Add(q, 2*mib-4096), 8192, 0), driver.ErrorInvalidValue, "straddling")
	require.NoError(t, s.MemHostRegister(q, 2*mib, 0))
	require.NoError(t, s.MemHostUnregister(q))
	require.NoError(t, s.MemHostRegister(q, 4*mib, driver.HostRegisterReadOnly))
	require.NoError(t, s.MemHostUnregister(q))
}

func TestHostAlloc(t *testing.T) {
	s := start(t)
	bind(t, s, 0)
	_, err := s.MemHostAlloc(0, 0)
	require.ErrorIs(t, err, driver.ErrorInvalidValue)
	_, err = s.MemHostAlloc(4096, 0x80)
	require.ErrorIs(t, err, driver.ErrorInvalidValue)
	p, err := s.MemHostAlloc(3*mib+5, driver.HostAllocPortable|driver.HostAllocDeviceMap)
	require.NoError(t, err)
	require.Zero(t, uintptr(p)%4096, "page aligned")
	host := unsafe.Slice((*byte)(p), 3*mib+5)
	copy(host, pattern(len(host), 4))
	dp, err := s.MemHostGetDevicePointer(unsafe.Add(p, 3*mib), 0)
	require.NoError(t, err)
	require.Equal(t, driver.DevicePtr(uintptr(p)+uintptr(3*mib)), dp)
	require.ErrorIs(t, s.MemHostRegister(p, 4096, 0), driver.ErrorHostMemoryAlreadyRegistered)
	require.ErrorIs(t, s.MemHostUnregister(p), driver.ErrorHostMemoryNotRegistered, "not a registration")
	require.NoError(t, s.MemsetD8(driver.DevicePtr(uintptr(p)), 0xee, 8))
	require.Equal(t, byte(0xee), host[7])
	require.Equal(t, 1, s.Live().HostAllocs)

	require.ErrorIs(t, s.MemFreeHost(unsafe.Add(p, 4096)), driver.ErrorInvalidValue)
	require.NoError(t, s.MemFreeHost(p))
	require.ErrorIs(t, s.MemFreeHost(p), driver.ErrorInvalidValue)
}

func TestLegacyAlloc(t *testing.T) {
	s := start(t, Devices(2), MemoryPerDevice(64*mib), PeerAccess(0, 1, false))
	ctx1, err := s.DevicePrimaryCtxRetain(1)
	require.NoError(t, err)
	defer func() { require.NoError(t, s.DevicePrimaryCtxRelease(1)) }()
	ctx0 := bind(t, s, 0)
	_, err = s.MemAlloc(0)
	require.ErrorIs(t, err, driver.ErrorInvalidValue)
	p, err := s.MemAlloc(3 * mib)
	require.NoError(t, err)
	free, _, _ := s.MemGetInfo()
	require.Equal(t, 60*mib, free, "rounded to the granularity and counted")
	require.Equal(t, 1, s.Live().LegacyAllocs)
	require.Equal(t, 0, s.Live().Allocations, "not a VMM allocation")
	require.Equal(t, 0, s.Live().Reservations)

	src := pattern(int(3*mib), 6)
	require.NoError(t, s.MemcpyHtoD(p, ptr(src), 3*mib))
	got := make([]byte, 3*mib)
	require.NoError(t, s.MemcpyDtoH(ptr(got), p, 3*mib))
	require.Equal(t, src, got)

	// Invisible to the VMM calls.
	_, err = s.MemRetainAllocationHandle(p)
	require.ErrorIs(t, err, driver.ErrorInvalidValue)
	require.ErrorIs(t, s.MemUnmap(p, 4*mib), driver.ErrorInvalidValue)
	require.ErrorIs(t, s.MemAddressFree(p, 4*mib), driver.ErrorInvalidValue)
	require.ErrorIs(t, s.MemSetAccess(p, 4*mib, []driver.AccessDesc{rw(0)}), driver.ErrorInvalidValue)
	fd, err := s.MemGetHandleForAddressRange(p, 4*mib, driver.RangeHandleTypeDMABufFD, 0)
	require.NoError(t, err, "dma-buf of cuMemAlloc memory")
	require.NoError(t, unix.Close(fd))

	// Device 1 cannot access device 0 here, so it cannot read the buffer.
	require.NoError(t, s.CtxSetCurrent(ctx1))
	require.ErrorIs(t, s.MemcpyDtoH(ptr(got), p, 16), driver.ErrorInvalidValue)
	require.NoError(t, s.CtxSetCurrent(ctx0))

	require.ErrorIs(t, s.MemFree(p+4096), driver.ErrorInvalidValue)
	require.NoError(t, s.MemFree(p))
	require.ErrorIs(t, s.MemFree(p), driver.ErrorInvalidValue)
	free, _, _ = s.MemGetInfo()
	require.Equal(t, 64*mib, free)
}
