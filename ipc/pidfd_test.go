package ipc_test

import (
	"errors"
	"fmt"
	"os"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/ipc"
)

// requirePidfd skips when this kernel (or a seccomp filter) has no pidfd_getfd, with the reason.
func requirePidfd(t *testing.T) {
	t.Helper()
	r, w := pipe(t)
	f, err := ipc.GetFD(os.Getpid(), int(r.Fd()))
	if errors.Is(err, ipc.ErrPidfdUnsupported) || errors.Is(err, ipc.ErrPtrace) {
		t.Skipf("the pidfd path is not available here: %v", err)
	}
	require.NoError(t, err)
	require.NoError(t, f.Close())
	_ = w
}

func TestGetFD(t *testing.T) {
	requirePidfd(t)
	before := testutil.OpenFDs(t)
	r, w, err := os.Pipe()
	require.NoError(t, err)
	f, err := ipc.GetFD(os.Getpid(), int(w.Fd()))
	require.NoError(t, err)
	require.True(t, isCloexec(t, f), "pidfd_getfd gives close-on-exec descriptors")
	require.True(t, sameInode(t, w, f))
	require.NoError(t, f.Close())

	// The descriptor is not open in that process.
	_, err = ipc.GetFD(os.Getpid(), 1<<20)
	require.ErrorIs(t, err, ipc.ErrRemoteFD)
	require.ErrorIs(t, err, unix.EBADF)
	require.ErrorContains(t, err, "not open in that process")
	_, err = ipc.GetFD(os.Getpid(), -1)
	require.ErrorIs(t, err, ipc.ErrRemoteFD)

	// No such process: pids stay below pid_max, whose largest value is 1<<22.
	_, err = ipc.GetFD(1<<22+1, 0)
	require.ErrorIs(t, err, ipc.ErrNoProcess)
	require.ErrorIs(t, err, unix.ESRCH)
	require.ErrorContains(t, err, fmt.Sprintf("pidfd_open(%d)", 1<<22+1))

	// ReceiveFromPID: a count that disagrees with the chunk table, and a bad number mid-way, close
	// everything taken.
	desc := sampleDescriptor()
	_, err = ipc.ReceiveFromPID(os.Getpid(), []int{int(r.Fd())}, desc)
	require.ErrorIs(t, err, ipc.ErrProtocol)
	_, err = ipc.ReceiveFromPID(os.Getpid(), []int{int(r.Fd()), int(w.Fd()), 1 << 20}, desc)
	require.ErrorIs(t, err, ipc.ErrRemoteFD)
	require.ErrorContains(t, err, "chunk 2")
	require.NoError(t, r.Close())
	require.NoError(t, w.Close())
	require.Equal(t, before, testutil.OpenFDs(t))
}

// Each errno names its condition.
func TestPidfdErrors(t *testing.T) {
	for _, tc := range []struct {
		errno    unix.Errno
		sentinel error
		contains string
	}{
		{unix.ENOSYS, ipc.ErrPidfdUnsupported, "Linux 5.6"},
		{unix.ESRCH, ipc.ErrNoProcess, "PID namespace"},
		{unix.EPERM, ipc.ErrPtrace, "ptrace_scope"},
		{unix.EBADF, ipc.ErrRemoteFD, "not open"},
	} {
		err := ipc.PidfdError("pidfd_getfd(pid 7, fd 9)", tc.errno)
		require.ErrorIs(t, err, tc.sentinel)
		require.ErrorIs(t, err, tc.errno)
		require.ErrorContains(t, err, tc.contains)
		require.ErrorContains(t, err, "pidfd_getfd(pid 7, fd 9)")
	}
	err := ipc.PidfdError("pidfd_open(7)", unix.EMFILE)
	require.ErrorIs(t, err, unix.EMFILE)
}
