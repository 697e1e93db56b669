package sim

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
)

func TestMemCreateRules(t *testing.T) {
	s := start(t, Devices(2))
	bind(t, s, 0)
	ok := func(size uint64, p *driver.AllocationProp) {
		t.Helper()
		h, err := s.MemCreate(size, p, 0)
		require.NoError(t, err)
		require.NotZero(t, h)
		require.NoError(t, s.MemRelease(h))
	}
	fails := func(code driver.Result, size uint64, p *driver.AllocationProp) {
		t.Helper()
		h, err := s.MemCreate(size, p, 0)
		require.ErrorIs(t, err, code)
		require.Zero(t, h)
	}
	ok(2*mib, deviceProp(0, 0))
	ok(64*mib, deviceProp(1, driver.HandleTypePosixFD))
	ok(2*mib, hostNUMAProp(driver.HandleTypePosixFD)) // measured: HOST_NUMA id 0 with POSIX_FD OK
	ok(2*mib, &driver.AllocationProp{Type: driver.AllocationTypePinned, Location: driver.HostLocation()})

	fails(driver.ErrorInvalidValue, 0, deviceProp(0, 0))
	fails(driver.ErrorInvalidValue, 1*mib, deviceProp(0, 0))
	fails(driver.ErrorInvalidValue, 3*mib, deviceProp(0, 0))
	fails(driver.ErrorInvalidValue, 2*mib, nil)
	fails(driver.ErrorInvalidValue, 2*mib, &driver.AllocationProp{Location: driver.DeviceLocation(0)}) // type 0
	fails(driver.ErrorInvalidDevice, 2*mib, deviceProp(2, 0))
	fails(driver.ErrorInvalidDevice, 2*mib, deviceProp(-1, 0))
	fails(driver.ErrorInvalidValue, 2*mib, &driver.AllocationProp{Type: driver.AllocationTypePinned, Location: driver.HostNUMALocation(1)})
	fails(driver.ErrorInvalidValue, 2*mib, &driver.AllocationProp{Type: driver.AllocationTypePinned,
		Location: driver.Location{Type: driver.LocationHostNUMACurrent}})
	fails(driver.ErrorInvalidValue, 2*mib, &driver.AllocationProp{Type: driver.AllocationTypePinned,
		Location: driver.HostLocation(), RequestedHandleTypes: driver.HandleTypePosixFD})
	fails(driver.ErrorInvalidValue, 2*mib, &driver.AllocationProp{Type: driver.AllocationTypePinned})       // location INVALID
	fails(driver.ErrorInvalidValue, 2*mib, deviceProp(0, 0x40))                                             // unknown bit
	fails(driver.ErrorInvalidValue, 2*mib, deviceProp(0, driver.HandleTypeWin32))                           // not on Linux
	fails(driver.ErrorNotPermitted, 2*mib, deviceProp(0, driver.HandleTypeFabric))                          // measured
	fails(driver.ErrorNotPermitted, 2*mib, deviceProp(0, driver.HandleTypeFabric|driver.HandleTypePosixFD)) // measured
	_, err := s.MemCreate(2*mib, deviceProp(0, 0), 1)
	require.ErrorIs(t, err, driver.ErrorInvalidValue, "flags must be 0")

	// Released twice, or never made: INVALID_VALUE.
	h, err := s.MemCreate(2*mib, deviceProp(0, 0), 0)
	require.NoError(t, err)
	require.NoError(t, s.MemRelease(h))
	require.ErrorIs(t, s.MemRelease(h), driver.ErrorInvalidValue)
	require.ErrorIs(t, s.MemRelease(0), driver.ErrorInvalidValue)
}

func TestHandlesAreUnique(t *testing.T) {
	s := start(t)
	bind(t, s, 0)
	seen := map[driver.MemHandle]bool{}
	var hs []driver.MemHandle
	for range 16 {
		h, err := s.MemCreate(2*mib, deviceProp(0, 0), 0)
		require.NoError(t, err)
		require.NotZero(t, h)
		require.False(t, seen[h])
		seen[h] = true
		hs = append(hs, h)
	}
	require.Equal(t, 16, s.Live().Allocations)
	for _, h := range hs {
		require.NoError(t, s.MemRelease(h))
	}
}

func TestFabric(t *testing.T) {
	s := start(t)
	bind(t, s, 0)
	h, err := s.MemCreate(2*mib, deviceProp(0, driver.HandleTypePosixFD), 0)
	require.NoError(t, err)
	_, err = s.MemExportToFabricHandle(h, 0)
	require.ErrorIs(t, err, driver.ErrorNotPermitted)
	require.NoError(t, s.MemRelease(h))

	f := start(t, EnableFabric())
	bind(t, f, 0)
	h, err = f.MemCreate(2*mib, deviceProp(0, driver.HandleTypeFabric|driver.HandleTypePosixFD), 0)
	require.NoError(t, err)
	fh, err := f.MemExportToFabricHandle(h, 0)
	require.NoError(t, err)
	require.NotEqual(t, driver.FabricHandle{}, fh)
	require.NoError(t, f.MemRelease(h))
	h, err = f.MemCreate(2*mib, deviceProp(0, driver.HandleTypePosixFD), 0)
	require.NoError(t, err)
	_, err = f.MemExportToFabricHandle(h, 0)
	require.ErrorIs(t, err, driver.ErrorInvalidValue, "not created with FABRIC")
	require.NoError(t, f.MemRelease(h))
}

func TestOutOfMemory(t *testing.T) {
	s := start(t, Devices(2), MemoryPerDevice(64*mib))
	bind(t, s, 0)
	h, err := s.MemCreate(64*mib, deviceProp(0, 0), 0)
	require.NoError(t, err)
	_, err = s.MemCreate(2*mib, deviceProp(0, 0), 0)
	require.ErrorIs(t, err, driver.ErrorOutOfMemory)
	require.ErrorIs(t, err, driver.ErrOutOfMemory)
	_, err = s.MemAlloc(1)
	require.ErrorIs(t, err, driver.ErrorOutOfMemory)
	free, total, err := s.MemGetInfo()
	require.NoError(t, err)
	require.Equal(t, uint64(0), free)
	require.Equal(t, 64*mib, total)

	// Device 1 is separate; host-NUMA memory takes no device memory.
	h1, err := s.MemCreate(64*mib, deviceProp(1, 0), 0)
	require.NoError(t, err)
	hn, err := s.MemCreate(256*mib, hostNUMAProp(0), 0)
	require.NoError(t, err)

	require.NoError(t, s.MemRelease(h))
	free, _, _ = s.MemGetInfo()
	require.Equal(t, 64*mib, free)
	for _, x := range []driver.MemHandle{h1, hn} {
		require.NoError(t, s.MemRelease(x))
	}
}

func TestContextMemory(t *testing.T) {
	s := start(t, Devices(2), ContextMemory(524*mib))
	ctx1, err := s.DevicePrimaryCtxRetain(1)
	require.NoError(t, err)
	bind(t, s, 0)
	free0, total, err := s.MemGetInfo()
	require.NoError(t, err)
	require.Equal(t, total-524*mib, free0)
	require.NoError(t, s.CtxSetCurrent(ctx1))
	free1, _, _ := s.MemGetInfo()
	require.Equal(t, total-524*mib, free1)
	require.NoError(t, s.DevicePrimaryCtxRelease(1))
	_, _, err = s.MemGetInfo()
	require.ErrorIs(t, err, driver.ErrorInvalidContext)
}

func TestReleaseWhileMapped(t *testing.T) {
	s := start(t, MemoryPerDevice(64*mib))
	bind(t, s, 0)
	b := makeBuffer(t, s, deviceProp(0, 0), 1, 32*mib, rw(0))
	src := pattern(int(32*mib), 3)
	require.NoError(t, s.MemcpyHtoD(b.base, ptr(src), 32*mib))

	// Released while mapped: OK, the memory stays valid and counted until the last unmap (measured).
	require.NoError(t, s.MemRelease(b.chunks[0].h))
	dst := make([]byte, 32*mib)
	require.NoError(t, s.MemcpyDtoH(ptr(dst), b.base, 32*mib))
	require.Equal(t, src, dst)
	free, _, _ := s.MemGetInfo()
	require.Equal(t, 32*mib, free)
	require.Equal(t, 1, s.Live().Allocations)
	_, err := s.MemGetAllocationPropertiesFromHandle(b.chunks[0].h)
	require.ErrorIs(t, err, driver.ErrorInvalidValue, "the handle itself is gone")

	require.NoError(t, s.MemUnmap(b.base, b.size))
	free, _, _ = s.MemGetInfo()
	require.Equal(t, 64*mib, free)
	require.Equal(t, 0, s.Live().Allocations)
	require.NoError(t, s.MemAddressFree(b.base, b.size))
}

func TestRetainAllocationHandle(t *testing.T) {
	s := start(t)
	bind(t, s, 0)
	b := makeBuffer(t, s, deviceProp(0, driver.HandleTypePosixFD), 2, 4*mib, rw(0))
	h2, err := s.MemRetainAllocationHandle(b.base + 4*driver.DevicePtr(mib) + 12345)
	require.NoError(t, err)
	require.NotEqual(t, b.chunks[1].h, h2, "a new handle value")
	p, err := s.MemGetAllocationPropertiesFromHandle(h2)
	require.NoError(t, err)
	require.Equal(t, *deviceProp(0, driver.HandleTypePosixFD), p)
	require.Equal(t, 2, s.Live().Allocations, "the same allocation")
	// Map the retained handle elsewhere: same bytes.
	va2, err := s.MemAddressReserve(4*mib, 0, 0, 0)
	require.NoError(t, err)
	require.NoError(t, s.MemMap(va2, 4*mib, 0, h2, 0))
	require.NoError(t, s.MemSetAccess(va2, 4*mib, []driver.AccessDesc{rw(0)}))
	require.NoError(t, s.MemsetD8(b.chunks[1].va, 0x5a, 4*mib))
	got := make([]byte, 4)
	require.NoError(t, s.MemcpyDtoH(ptr(got), va2+100, 4))
	require.Equal(t, []byte{0x5a, 0x5a, 0x5a, 0x5a}, got)
	require.NoError(t, s.MemUnmap(va2, 4*mib))
	require.NoError(t, s.MemAddressFree(va2, 4*mib))
	require.NoError(t, s.MemRelease(h2), "the retained handle must be released too")

	_, err = s.MemRetainAllocationHandle(b.base + driver.DevicePtr(b.size))
	require.ErrorIs(t, err, driver.ErrorInvalidValue)
	_, err = s.MemRetainAllocationHandle(0x1000)
	require.ErrorIs(t, err, driver.ErrorInvalidValue)
	b.free(t, s)
}

func TestPropertiesAndGranularity(t *testing.T) {
	s := start(t, Devices(2))
	bind(t, s, 0)
	prop := &driver.AllocationProp{
		Type: driver.AllocationTypePinned, RequestedHandleTypes: driver.HandleTypePosixFD,
		Location: driver.DeviceLocation(1), Compression: driver.CompressionGeneric, GPUDirectRDMACapable: true, Usage: 0,
	}
	h, err := s.MemCreate(8*mib, prop, 0)
	require.NoError(t, err)
	got, err := s.MemGetAllocationPropertiesFromHandle(h)
	require.NoError(t, err)
	require.Equal(t, *prop, got, "compression GENERIC is granted (measured)")
	require.NoError(t, s.MemRelease(h))
	_, err = s.MemGetAllocationPropertiesFromHandle(h)
	require.ErrorIs(t, err, driver.ErrorInvalidValue)

	for _, opt := range []driver.GranularityOption{driver.GranularityMinimum, driver.GranularityRecommended} {
		for _, p := range []*driver.AllocationProp{deviceProp(0, 0), deviceProp(1, 0), hostNUMAProp(0)} {
			g, err := s.MemGetAllocationGranularity(p, opt)
			require.NoError(t, err)
			require.Equal(t, 2*mib, g)
		}
	}
	_, err = s.MemGetAllocationGranularity(deviceProp(5, 0), 0)
	require.ErrorIs(t, err, driver.ErrorInvalidDevice)
	_, err = s.MemGetAllocationGranularity(deviceProp(0, 0), 7)
	require.ErrorIs(t, err, driver.ErrorInvalidValue)

	g := start(t, Granularity(64*1024))
	bind(t, g, 0)
	v, err := g.MemGetAllocationGranularity(deviceProp(0, 0), 0)
	require.NoError(t, err)
	require.Equal(t, uint64(64*1024), v)
	h, err = g.MemCreate(64*1024, deviceProp(0, 0), 0)
	require.NoError(t, err)
	require.NoError(t, g.MemRelease(h))
}
