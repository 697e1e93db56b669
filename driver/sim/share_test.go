package sim

import (
	"os"
	"os/exec"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
)

func TestExportRules(t *testing.T) {
	s := start(t)
	bind(t, s, 0)
	h, err := s.MemCreate(2*mib, deviceProp(0, 0), 0)
	require.NoError(t, err)
	_, err = s.MemExportToShareableHandle(h, driver.HandleTypePosixFD, 0)
	require.ErrorIs(t, err, driver.ErrorInvalidValue, "POSIX_FD not requested at create (measured)")
	require.NoError(t, s.MemRelease(h))

	h, err = s.MemCreate(2*mib, deviceProp(0, driver.HandleTypePosixFD), 0)
	require.NoError(t, err)
	for _, typ := range []driver.HandleType{driver.HandleTypeNone, driver.HandleTypeWin32, driver.HandleTypeFabric} {
		_, err = s.MemExportToShareableHandle(h, typ, 0)
		require.ErrorIs(t, err, driver.ErrorInvalidValue, "type %v", typ)
	}
	fd, err := s.MemExportToShareableHandle(h, driver.HandleTypePosixFD, 0)
	require.NoError(t, err)
	flags, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0)
	require.NoError(t, err)
	require.NotZero(t, flags&unix.FD_CLOEXEC, "close-on-exec")
	require.NoError(t, unix.Close(fd))
	require.NoError(t, s.MemRelease(h))
	_, err = s.MemExportToShareableHandle(h, driver.HandleTypePosixFD, 0)
	require.ErrorIs(t, err, driver.ErrorInvalidValue, "released")
}

func TestImportInProcess(t *testing.T) {
	before := openFDs(t)
	s := start(t, MemoryPerDevice(256*mib))
	bind(t, s, 0)
	b := makeBuffer(t, s, deviceProp(0, driver.HandleTypePosixFD), 1, 32*mib, rw(0))
	src := pattern(int(b.size), 5)
	require.NoError(t, s.MemcpyHtoD(b.base, ptr(src), b.size))
	fd, err := s.MemExportToShareableHandle(b.chunks[0].h, driver.HandleTypePosixFD, 0)
	require.NoError(t, err)

	// Another simulator in this process (think: another process) imports it: the same bytes, and no
	// device memory charged to the importer.
	imp := start(t, MemoryPerDevice(256*mib))
	bind(t, imp, 0)
	h, err := imp.MemImportFromShareableHandle(fd, driver.HandleTypePosixFD)
	require.NoError(t, err)
	require.NoError(t, unix.Close(fd), "the caller keeps its FD")
	free, total, err := imp.MemGetInfo()
	require.NoError(t, err)
	require.Equal(t, total, free, "the exporter pays")
	prop, err := imp.MemGetAllocationPropertiesFromHandle(h)
	require.NoError(t, err)
	require.Equal(t, *deviceProp(0, driver.HandleTypeNone), prop, "the exporter's, without handle types (measured)")
	va, err := imp.MemAddressReserve(32*mib, 0, 0, 0)
	require.NoError(t, err)
	require.NoError(t, imp.MemMap(va, 32*mib, 0, h, 0))
	require.NoError(t, imp.MemSetAccess(va, 32*mib, []driver.AccessDesc{rw(0)}))
	got := make([]byte, b.size)
	require.NoError(t, imp.MemcpyDtoH(ptr(got), va, b.size))
	require.Equal(t, src, got)
	require.NoError(t, imp.MemsetD8(va, 0x11, 1))
	one := []byte{0}
	require.NoError(t, s.MemcpyDtoH(ptr(one), b.base, 1))
	require.Equal(t, byte(0x11), one[0], "the exporter sees the importer's write")

	// Importing into the exporting simulator itself yields a handle of the same allocation, which,
	// as on the driver (measured), reports no handle types and cannot be exported again; the
	// exporter's own handle still can.
	fd2, err := s.MemExportToShareableHandle(b.chunks[0].h, driver.HandleTypePosixFD, 0)
	require.NoError(t, err)
	h2, err := s.MemImportFromShareableHandle(fd2, driver.HandleTypePosixFD)
	require.NoError(t, err)
	require.NoError(t, unix.Close(fd2))
	require.Equal(t, 1, s.Live().Allocations)
	prop, err = s.MemGetAllocationPropertiesFromHandle(h2)
	require.NoError(t, err)
	require.Equal(t, driver.HandleTypeNone, prop.RequestedHandleTypes)
	_, err = s.MemExportToShareableHandle(h2, driver.HandleTypePosixFD, 0)
	require.ErrorIs(t, err, driver.ErrorInvalidValue, "an in-process import exported again")
	fd3, err := s.MemExportToShareableHandle(b.chunks[0].h, driver.HandleTypePosixFD, 0)
	require.NoError(t, err)
	require.NoError(t, unix.Close(fd3))
	require.NoError(t, s.MemRelease(h2))

	require.NoError(t, imp.MemUnmap(va, 32*mib))
	require.NoError(t, imp.MemRelease(h))
	require.NoError(t, imp.MemAddressFree(va, 32*mib))
	b.free(t, s)
	require.Equal(t, before, openFDs(t), "no descriptor leaked")
}

// TestImportedMemoryIsNotExportable: imported memory reports no requested handle types and cannot be
// exported again (docs/driver-facts.md §5), in device and host-NUMA memory alike.
func TestImportedMemoryIsNotExportable(t *testing.T) {
	s := start(t)
	bind(t, s, 0)
	imp := start(t)
	bind(t, imp, 0)
	for _, prop := range []*driver.AllocationProp{deviceProp(0, driver.HandleTypePosixFD), hostNUMAProp(driver.HandleTypePosixFD)} {
		h, err := s.MemCreate(2*mib, prop, 0)
		require.NoError(t, err)
		fd, err := s.MemExportToShareableHandle(h, driver.HandleTypePosixFD, 0)
		require.NoError(t, err)
		ih, err := imp.MemImportFromShareableHandle(fd, driver.HandleTypePosixFD)
		require.NoError(t, err)
		require.NoError(t, unix.Close(fd))

		got, err := imp.MemGetAllocationPropertiesFromHandle(ih)
		require.NoError(t, err)
		want := *prop
		want.RequestedHandleTypes = driver.HandleTypeNone
		require.Equal(t, want, got, "the exporter's properties without handle types")
		_, err = imp.MemExportToShareableHandle(ih, driver.HandleTypePosixFD, 0)
		require.ErrorIs(t, err, driver.ErrorInvalidValue, "exporting imported memory again")

		// A handle retained from a mapping of the import is the same allocation: not exportable either.
		va, err := imp.MemAddressReserve(2*mib, 0, 0, 0)
		require.NoError(t, err)
		require.NoError(t, imp.MemMap(va, 2*mib, 0, ih, 0))
		rh, err := imp.MemRetainAllocationHandle(va)
		require.NoError(t, err)
		_, err = imp.MemExportToShareableHandle(rh, driver.HandleTypePosixFD, 0)
		require.ErrorIs(t, err, driver.ErrorInvalidValue, "retained from an imported mapping")
		require.NoError(t, imp.MemRelease(rh))
		require.NoError(t, imp.MemUnmap(va, 2*mib))
		require.NoError(t, imp.MemAddressFree(va, 2*mib))
		require.NoError(t, imp.MemRelease(ih))

		// The exporter's own handle stays exportable.
		fd, err = s.MemExportToShareableHandle(h, driver.HandleTypePosixFD, 0)
		require.NoError(t, err)
		require.NoError(t, unix.Close(fd))
		require.NoError(t, s.MemRelease(h))
	}
}

func TestImportRejects(t *testing.T) {
	s := start(t, Devices(2))
	bind(t, s, 0)
	var p [2]int
	require.NoError(t, unix.Pipe2(p[:], unix.O_CLOEXEC))
	defer unix.Close(p[0])
	defer unix.Close(p[1])
	_, err := s.MemImportFromShareableHandle(p[0], driver.HandleTypePosixFD)
	require.ErrorIs(t, err, driver.ErrorInvalidValue, "a pipe")
	_, err = s.MemImportFromShareableHandle(987654, driver.HandleTypePosixFD)
	require.ErrorIs(t, err, driver.ErrorInvalidValue, "not open")
	other, err := unix.MemfdCreate("something-else", unix.MFD_CLOEXEC)
	require.NoError(t, err)
	defer unix.Close(other)
	_, err = s.MemImportFromShareableHandle(other, driver.HandleTypePosixFD)
	require.ErrorIs(t, err, driver.ErrorInvalidValue, "a memfd that is not a simulator allocation")

	h, err := s.MemCreate(2*mib, deviceProp(1, driver.HandleTypePosixFD), 0)
	require.NoError(t, err)
	fd, err := s.MemExportToShareableHandle(h, driver.HandleTypePosixFD, 0)
	require.NoError(t, err)
	defer unix.Close(fd)
	_, err = s.MemImportFromShareableHandle(fd, driver.HandleTypeFabric)
	require.ErrorIs(t, err, driver.ErrorInvalidValue)

	// Device 1's memory cannot be imported where there is no device 1.
	one := start(t, Devices(1))
	bind(t, one, 0)
	_, err = one.MemImportFromShareableHandle(fd, driver.HandleTypePosixFD)
	require.ErrorIs(t, err, driver.ErrorInvalidDevice)
	require.NoError(t, s.MemRelease(h))

	// A dma-buf FD is not an allocation handle.
	b := makeBuffer(t, s, deviceProp(0, 0), 1, 2*mib, rw(0))
	dfd, err := s.MemGetHandleForAddressRange(b.base, b.size, driver.RangeHandleTypeDMABufFD, 0)
	require.NoError(t, err)
	_, err = s.MemImportFromShareableHandle(dfd, driver.HandleTypePosixFD)
	require.ErrorIs(t, err, driver.ErrorInvalidValue)
	require.NoError(t, unix.Close(dfd))
	b.free(t, s)
}

func TestDMABuf(t *testing.T) {
	s := start(t)
	bind(t, s, 0)
	b := makeBuffer(t, s, deviceProp(0, 0), 3, 2*mib, rw(0))
	M := driver.DevicePtr(mib)
	for _, c := range []struct {
		off  driver.DevicePtr
		size uint64
	}{{0, 6 * mib}, {M, 4 * mib}, {4096, 8192}} {
		fd, err := s.MemGetHandleForAddressRange(b.base+c.off, c.size, driver.RangeHandleTypeDMABufFD, 0)
		require.NoError(t, err)
		end, err := unix.Seek(fd, 0, 2)
		require.NoError(t, err)
		require.Equal(t, int64(c.size), end, "an FD whose size is the range size (measured)")
		require.NoError(t, unix.Close(fd))
	}
	_, err := s.MemGetHandleForAddressRange(b.base, 8*mib, driver.RangeHandleTypeDMABufFD, 0)
	require.ErrorIs(t, err, driver.ErrorInvalidValue, "not fully mapped")
	_, err = s.MemGetHandleForAddressRange(b.base, 6*mib, 2, 0)
	require.ErrorIs(t, err, driver.ErrorInvalidValue, "type")
	_, err = s.MemGetHandleForAddressRange(b.base+1, 4096, driver.RangeHandleTypeDMABufFD, 0)
	require.ErrorIs(t, err, driver.ErrorInvalidValue, "unaligned")
	b.free(t, s)
}

const childEnv = "CUVMM_SIM_CHILD"

// TestCrossProcess passes a device allocation and a host-NUMA allocation to a child process (this test
// binary again, running TestHelperChild); the child's own simulator imports both, checks the parent's
// bytes and writes its own, which the parent then sees.
func TestCrossProcess(t *testing.T) {
	s := start(t)
	bind(t, s, 0)
	dev := makeBuffer(t, s, deviceProp(0, driver.HandleTypePosixFD), 1, 4*mib, rw(0))
	host := makeBuffer(t, s, hostNUMAProp(driver.HandleTypePosixFD), 1, 2*mib, rw(0), hostAccess(driver.AccessReadWrite))
	require.NoError(t, s.MemcpyHtoD(dev.base, ptr(pattern(int(2*mib), 1)), 2*mib))
	copy(unsafe.Slice((*byte)(at(host.base)), mib), pattern(int(mib), 2))

	var files []*os.File
	for _, b := range []*buffer{dev, host} {
		fd, err := s.MemExportToShareableHandle(b.chunks[0].h, driver.HandleTypePosixFD, 0)
		require.NoError(t, err)
		f := os.NewFile(uintptr(fd), "allocation")
		defer f.Close()
		files = append(files, f)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperChild$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), childEnv+"=1")
	cmd.ExtraFiles = files // fds 3 and 4 in the child
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "child:\n%s", out)
	require.Contains(t, string(out), "--- PASS: TestHelperChild")

	got := make([]byte, 2*mib)
	require.NoError(t, s.MemcpyDtoH(ptr(got), dev.base+driver.DevicePtr(2*mib), 2*mib))
	require.Equal(t, pattern(int(2*mib), 3), got, "the child's device writes")
	require.Equal(t, pattern(int(mib), 4), unsafe.Slice((*byte)(at(host.base+driver.DevicePtr(mib))), mib),
		"the child's CPU writes, read through our own virtual address")
	dev.free(t, s)
	host.free(t, s)
}

// TestHelperChild is the child half of TestCrossProcess; it does nothing in a normal run.
func TestHelperChild(t *testing.T) {
	if os.Getenv(childEnv) != "1" {
		t.Skip("child of TestCrossProcess")
	}
	s := start(t)
	bind(t, s, 0)
	imp := func(fd int) (driver.MemHandle, driver.DevicePtr, uint64) {
		h, err := s.MemImportFromShareableHandle(fd, driver.HandleTypePosixFD)
		require.NoError(t, err)
		p, err := s.MemGetAllocationPropertiesFromHandle(h)
		require.NoError(t, err)
		var st unix.Stat_t
		require.NoError(t, unix.Fstat(fd, &st))
		size := uint64(st.Size)
		va, err := s.MemAddressReserve(size, 0, 0, 0)
		require.NoError(t, err)
		require.NoError(t, s.MemMap(va, size, 0, h, 0))
		acc := []driver.AccessDesc{rw(0)}
		if p.Location.Type == driver.LocationHostNUMA {
			acc = append(acc, hostAccess(driver.AccessReadWrite))
		}
		require.NoError(t, s.MemSetAccess(va, size, acc))
		return h, va, size
	}
	dh, dva, dsize := imp(3)
	hh, hva, hsize := imp(4)
	require.Equal(t, 4*mib, dsize)
	require.Equal(t, 2*mib, hsize)

	got := make([]byte, 2*mib)
	require.NoError(t, s.MemcpyDtoH(ptr(got), dva, 2*mib))
	require.Equal(t, pattern(int(2*mib), 1), got, "the parent's device bytes")
	require.NoError(t, s.MemcpyHtoD(dva+driver.DevicePtr(2*mib), ptr(pattern(int(2*mib), 3)), 2*mib))

	require.Equal(t, pattern(int(mib), 2), unsafe.Slice((*byte)(at(hva)), mib), "the parent's host bytes via our VA")
	copy(unsafe.Slice((*byte)(at(hva+driver.DevicePtr(mib))), mib), pattern(int(mib), 4))

	for _, x := range []struct {
		h    driver.MemHandle
		va   driver.DevicePtr
		size uint64
	}{{dh, dva, dsize}, {hh, hva, hsize}} {
		require.NoError(t, s.MemUnmap(x.va, x.size))
		require.NoError(t, s.MemRelease(x.h))
		require.NoError(t, s.MemAddressFree(x.va, x.size))
	}
}
