package sim

import (
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/memfd"
)

// An exported allocation is sealed: the process it goes to cannot resize it under the exporter.
func TestExportedMemfdIsSealed(t *testing.T) {
	s := start(t)
	bind(t, s, 0)
	h, err := s.MemCreate(2*mib, deviceProp(0, driver.HandleTypePosixFD), 0)
	require.NoError(t, err)
	fd, err := s.MemExportToShareableHandle(h, driver.HandleTypePosixFD, 0)
	require.NoError(t, err)
	require.NoError(t, memfd.CheckSealedFD(fd, 2*mib))
	require.ErrorIs(t, unix.Ftruncate(fd, 4096), unix.EPERM)
	require.NoError(t, unix.Close(fd))
	require.NoError(t, s.MemRelease(h))
}

// A file that looks like an allocation but is not sealed (a hostile peer made it) and is truncated
// after the import makes copies and fills fail with INVALID_VALUE, never SIGBUS.
func TestTruncatedImportFailsCopies(t *testing.T) {
	s := start(t)
	bind(t, s, 0)
	fd, err := unix.MemfdCreate(memfdName(*deviceProp(0, driver.HandleTypePosixFD), 2*mib), unix.MFD_CLOEXEC)
	require.NoError(t, err)
	defer unix.Close(fd)
	require.NoError(t, unix.Ftruncate(fd, int64(2*mib)))
	h, err := s.MemImportFromShareableHandle(fd, driver.HandleTypePosixFD)
	require.NoError(t, err)
	va, err := s.MemAddressReserve(2*mib, 0, 0, 0)
	require.NoError(t, err)
	require.NoError(t, s.MemMap(va, 2*mib, 0, h, 0))
	require.NoError(t, s.MemSetAccess(va, 2*mib, []driver.AccessDesc{rw(0)}))
	buf := pattern(int(2*mib), 3)
	require.NoError(t, s.MemcpyHtoD(va, ptr(buf), 2*mib))

	require.NoError(t, unix.Ftruncate(fd, 0), "the hostile peer truncates its file")
	require.ErrorIs(t, s.MemcpyHtoD(va, ptr(buf), 2*mib), driver.ErrorInvalidValue)
	require.ErrorIs(t, s.MemcpyDtoH(ptr(buf), va, 2*mib), driver.ErrorInvalidValue)
	require.ErrorIs(t, s.MemsetD8(va, 1, 2*mib), driver.ErrorInvalidValue)

	require.NoError(t, s.MemUnmap(va, 2*mib))
	require.NoError(t, s.MemAddressFree(va, 2*mib))
	require.NoError(t, s.MemRelease(h))
}
