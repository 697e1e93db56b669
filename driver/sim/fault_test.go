package sim

import (
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
)

func TestFailNth(t *testing.T) {
	s := start(t)
	bind(t, s, 0)
	res, err := s.MemAddressReserve(8*mib, 0, 0, 0)
	require.NoError(t, err)
	h, err := s.MemCreate(2*mib, deviceProp(0, driver.HandleTypePosixFD), 0)
	require.NoError(t, err)

	// The second cuMemMap from now fails, with no side effect.
	s.FailNth("cuMemMap", 2, driver.ErrorOutOfMemory)
	before := s.Calls("cuMemMap")
	require.NoError(t, s.MemMap(res, 2*mib, 0, h, 0))
	require.ErrorIs(t, s.MemMap(res+2*driver.DevicePtr(mib), 2*mib, 0, h, 0), driver.ErrorOutOfMemory)
	require.Equal(t, 1, s.Live().Mappings)
	require.NoError(t, s.MemMap(res+2*driver.DevicePtr(mib), 2*mib, 0, h, 0), "only that call")
	require.Equal(t, before+3, s.Calls("cuMemMap"), "failed calls count too")

	// Several armed at once, on different functions; versioned names are accepted.
	s.FailNth("cuMemSetAccess", 1, driver.ErrorInvalidValue)
	s.FailNth("cuMemcpyHtoD_v2", 1, driver.ErrorUnknown)
	s.FailNth("cuMemExportToShareableHandle", 1, driver.ErrorNotPermitted)
	s.FailNth("cuMemImportFromShareableHandle", 1, driver.ErrorInvalidHandle)
	require.ErrorIs(t, s.MemSetAccess(res, 4*mib, []driver.AccessDesc{rw(0)}), driver.ErrorInvalidValue)
	f, err := s.MemGetAccess(driver.DeviceLocation(0), res)
	require.NoError(t, err)
	require.Equal(t, driver.AccessNone, f, "the failed call changed nothing")
	require.NoError(t, s.MemSetAccess(res, 4*mib, []driver.AccessDesc{rw(0)}))
	buf := make([]byte, 16)
	require.ErrorIs(t, s.MemcpyHtoD(res, ptr(buf), 16), driver.ErrorUnknown)
	require.NoError(t, s.MemcpyHtoD(res, ptr(buf), 16))
	_, err = s.MemExportToShareableHandle(h, driver.HandleTypePosixFD, 0)
	require.ErrorIs(t, err, driver.ErrorNotPermitted)
	fd, err := s.MemExportToShareableHandle(h, driver.HandleTypePosixFD, 0)
	require.NoError(t, err)
	_, err = s.MemImportFromShareableHandle(fd, driver.HandleTypePosixFD)
	require.ErrorIs(t, err, driver.ErrorInvalidHandle)
	require.NoError(t, unix.Close(fd))

	// A failing cuMemCreate creates nothing; ClearFaults disarms.
	s.FailNth("cuMemCreate", 1, driver.ErrorOutOfMemory)
	_, err = s.MemCreate(2*mib, deviceProp(0, 0), 0)
	require.ErrorIs(t, err, driver.ErrorOutOfMemory)
	require.Equal(t, 1, s.Live().Allocations)
	s.FailNth("cuMemCreate", 1, driver.ErrorOutOfMemory)
	s.FailNth("cuMemUnmap", 3, driver.ErrorOutOfMemory)
	s.ClearFaults()
	h2, err := s.MemCreate(2*mib, deviceProp(0, 0), 0)
	require.NoError(t, err)
	require.NoError(t, s.MemRelease(h2))

	// Faults come before everything, even the context check.
	s.FailNth("cuCtxSynchronize", 1, driver.ErrorUnknown)
	require.ErrorIs(t, s.CtxSynchronize(), driver.ErrorUnknown)

	require.NoError(t, s.MemUnmap(res, 8*mib))
	require.NoError(t, s.MemRelease(h))
	require.NoError(t, s.MemAddressFree(res, 8*mib))
}

func TestFailNthRejectsUnknownNames(t *testing.T) {
	s := start(t)
	require.Panics(t, func() { s.FailNth("cuMemCreat", 1, driver.ErrorOutOfMemory) })
	require.Panics(t, func() { s.FailNth("MemCreate", 1, driver.ErrorOutOfMemory) })
	require.Panics(t, func() { s.FailNth("cuMemCreate", 0, driver.ErrorOutOfMemory) })
	require.Panics(t, func() { s.FailNth("cuMemCreate", 1, driver.Success) })
	require.Panics(t, func() { s.Calls("cuNothing") })
	require.Equal(t, 0, s.Calls("cuMemCreate"))
}

func TestLiveAndClose(t *testing.T) {
	before := openFDs(t)
	s := New(Devices(2))
	require.NoError(t, s.Init(0))
	require.True(t, s.Live().Zero())
	require.Equal(t, "none", s.Live().String())
	bind(t, s, 0)

	b := makeBuffer(t, s, hostNUMAProp(driver.HandleTypePosixFD), 2, 2*mib, rw(0), hostAccess(driver.AccessReadWrite))
	_, err := s.MemCreate(2*mib, deviceProp(1, 0), 0)
	require.NoError(t, err)
	_, err = s.MemAlloc(100)
	require.NoError(t, err)
	_, err = s.MemHostAlloc(100, 0)
	require.NoError(t, err)
	region := hostRegion(t, 4096)
	require.NoError(t, s.MemHostRegister(ptr(region), 4096, 0))
	_, err = s.StreamCreate(0)
	require.NoError(t, err)
	_, err = s.EventCreate(0)
	require.NoError(t, err)
	_, err = s.ModuleLoadData([]byte(".version 9.0\n.target sm_90\n"))
	require.NoError(t, err)

	l := s.Live()
	require.Equal(t, Live{Contexts: 1, Allocations: 3, Reservations: 1, Mappings: 2, HostRegistrations: 1, HostAllocs: 1,
		LegacyAllocs: 1, Streams: 1, Events: 1, Modules: 1}, l)
	require.False(t, l.Zero())
	require.Equal(t, "contexts=1 allocations=3 reservations=1 mappings=2 host-registrations=1 host-allocs=1 "+
		"legacy-allocs=1 streams=1 events=1 modules=1", l.String())
	require.Greater(t, openFDs(t), before)

	// Close frees it all, the host view included.
	require.NoError(t, s.Close())
	require.True(t, s.Live().Zero(), s.Live().String())
	require.Equal(t, before, openFDs(t))
	require.True(t, faults(b.base))
	_, err = s.MemAlloc(100)
	require.ErrorIs(t, err, driver.ErrorDeinitialized)
}

// A copy to or from address 0 is an error, not a crash of the simulator.
func TestCopyNullPointer(t *testing.T) {
	s := start(t)
	bind(t, s, 0)
	buf := make([]byte, 8)
	require.ErrorIs(t, s.MemcpyHtoD(0, unsafe.Pointer(&buf[0]), 8), driver.ErrInvalidValue)
	require.ErrorIs(t, s.MemcpyDtoH(unsafe.Pointer(&buf[0]), 0, 8), driver.ErrInvalidValue)
}
