package memfd

import (
	"os"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

func TestCreateIsSealed(t *testing.T) {
	f, err := Create("cuvmm-test", 1<<20)
	require.NoError(t, err)
	defer f.Close()
	require.NoError(t, CheckSealed(f, 1<<20))
	require.True(t, IsMemfd(int(f.Fd())))
	require.ErrorIs(t, unix.Ftruncate(int(f.Fd()), 4096), unix.EPERM, "shrink must be refused")
	require.ErrorIs(t, unix.Ftruncate(int(f.Fd()), 2<<20), unix.EPERM, "grow must be refused")
	_, err = unix.FcntlInt(f.Fd(), unix.F_ADD_SEALS, unix.F_SEAL_WRITE)
	require.ErrorIs(t, err, unix.EPERM, "the seals themselves are sealed")
	flags, err := unix.FcntlInt(f.Fd(), unix.F_GETFD, 0)
	require.NoError(t, err)
	require.NotZero(t, flags&unix.FD_CLOEXEC)
	err = CheckSealed(f, 4096)
	require.ErrorIs(t, err, ErrSize)
	require.Contains(t, err.Error(), "1048576 bytes")
}

func TestCheckSealedRefuses(t *testing.T) {
	fd, err := unix.MemfdCreate("unsealed", unix.MFD_CLOEXEC)
	require.NoError(t, err)
	f := os.NewFile(uintptr(fd), "unsealed")
	defer f.Close()
	require.NoError(t, unix.Ftruncate(fd, 4096))
	err = CheckSealed(f, 4096)
	require.ErrorIs(t, err, ErrNotSealed)
	require.Contains(t, err.Error(), "missing")

	fd2, err := unix.MemfdCreate("partly", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	require.NoError(t, err)
	g := os.NewFile(uintptr(fd2), "partly")
	defer g.Close()
	require.NoError(t, unix.Ftruncate(fd2, 4096))
	_, err = unix.FcntlInt(g.Fd(), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK)
	require.NoError(t, err)
	err = CheckSealed(g, 4096)
	require.ErrorIs(t, err, ErrNotSealed)
	require.Contains(t, err.Error(), "grow")

	p, w, err := os.Pipe()
	require.NoError(t, err)
	defer p.Close()
	defer w.Close()
	require.ErrorIs(t, CheckSealed(p, 0), ErrNotMemfd)
	require.False(t, IsMemfd(int(p.Fd())))
	require.ErrorIs(t, CheckSealed(nil, 0), ErrNotMemfd)
	_, err = Create("neg", -1)
	require.ErrorIs(t, err, unix.EINVAL)
	require.Equal(t, "none", SealNames(0))
}
