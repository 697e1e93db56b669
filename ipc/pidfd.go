package ipc

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// Errors of the pidfd path. Each wraps the errno as well, so errors.Is(err, unix.EPERM) also holds.
var (
	// ErrPidfdUnsupported: the kernel has no pidfd_open or pidfd_getfd (ENOSYS: Linux 5.6 or newer
	// is needed), or a seccomp filter hides them.
	ErrPidfdUnsupported = errors.New("ipc: pidfd_open/pidfd_getfd not available (kernel older than Linux 5.6, or a seccomp filter)")
	// ErrNoProcess: no process with that pid in this PID namespace (ESRCH); it may have exited, or
	// live in another PID namespace.
	ErrNoProcess = errors.New("ipc: no such process in this PID namespace")
	// ErrPtrace: the kernel refused ptrace access to the process (EPERM): pidfd_getfd needs
	// PTRACE_MODE_ATTACH_REALCREDS, so the peer must run as the same uid (or this process needs
	// CAP_SYS_PTRACE) and, with Yama's kernel.yama.ptrace_scope=1, be a descendant of this process or
	// have named it with prctl(PR_SET_PTRACER).
	ErrPtrace = errors.New("ipc: ptrace permission denied (pidfd_getfd needs the same uid or CAP_SYS_PTRACE and, with kernel.yama.ptrace_scope=1, a descendant or PR_SET_PTRACER)")
	// ErrRemoteFD: the descriptor number is not open in that process (EBADF).
	ErrRemoteFD = errors.New("ipc: the descriptor is not open in that process")
)

// pidfdError turns an errno of pidfd_open or pidfd_getfd into an error naming the failed condition.
func pidfdError(call string, err error) error {
	var sentinel error
	switch {
	case errors.Is(err, unix.ENOSYS):
		sentinel = ErrPidfdUnsupported
	case errors.Is(err, unix.ESRCH):
		sentinel = ErrNoProcess
	case errors.Is(err, unix.EPERM), errors.Is(err, unix.EACCES):
		sentinel = ErrPtrace
	case errors.Is(err, unix.EBADF):
		sentinel = ErrRemoteFD
	default:
		return fmt.Errorf("ipc: %s: %w", call, err)
	}
	return fmt.Errorf("%w: %s: %w", sentinel, call, err)
}

// GetFD duplicates descriptor fd of process pid into this process (pidfd_open, then pidfd_getfd).
// The new file is close-on-exec and the caller's. Requirements: Linux 5.6+, the same PID namespace,
// and ptrace permission over pid. Failures wrap ErrPidfdUnsupported (ENOSYS), ErrNoProcess (ESRCH),
// ErrPtrace (EPERM) or ErrRemoteFD (EBADF).
func GetFD(pid, fd int) (*os.File, error) {
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return nil, pidfdError(fmt.Sprintf("pidfd_open(%d)", pid), err)
	}
	defer unix.Close(pidfd)
	return getFD(pidfd, pid, fd)
}

func getFD(pidfd, pid, fd int) (*os.File, error) {
	if fd < 0 {
		return nil, pidfdError(fmt.Sprintf("pidfd_getfd(pid %d, fd %d)", pid, fd), unix.EBADF)
	}
	nfd, err := unix.PidfdGetfd(pidfd, fd, 0)
	if err != nil {
		return nil, pidfdError(fmt.Sprintf("pidfd_getfd(pid %d, fd %d)", pid, fd), err)
	}
	return os.NewFile(uintptr(nfd), fmt.Sprintf("ipc-pid%d-fd%d", pid, fd)), nil
}

// ReceiveFromPID is Receive for a peer that publishes its buffer as a descriptor and one descriptor
// number per chunk (for example the numbers of its Exported.Files, see Exported.FDs) instead of
// sending them over a socket: every chunk's descriptor is taken with pidfd_getfd. desc is validated
// and must list one chunk per number. On error every descriptor already taken is closed.
func ReceiveFromPID(pid int, fds []int, desc Descriptor) (*Received, error) {
	if err := desc.Validate(); err != nil {
		return nil, fmt.Errorf("ipc: receive from pid %d: %w", pid, err)
	}
	if len(fds) != len(desc.Chunks) {
		return nil, fmt.Errorf("ipc: receive from pid %d: %s: %d descriptor numbers for %d chunks: %w", pid, &desc, len(fds), len(desc.Chunks), ErrProtocol)
	}
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return nil, fmt.Errorf("ipc: receive from pid %d: %w", pid, pidfdError(fmt.Sprintf("pidfd_open(%d)", pid), err))
	}
	defer unix.Close(pidfd)
	r := &Received{Desc: desc, Files: make([]*os.File, 0, len(fds))}
	for i, fd := range fds {
		f, err := getFD(pidfd, pid, fd)
		if err != nil {
			_ = r.Close()
			return nil, fmt.Errorf("ipc: receive from pid %d: chunk %d: %w", pid, i, err)
		}
		r.Files = append(r.Files, f)
	}
	return r, nil
}

// FDs are the descriptor numbers of e's files in this process, for a peer that takes them with
// ReceiveFromPID. They are valid while e is open. A nil e has none.
func (e *Exported) FDs() []int {
	if e == nil {
		return nil
	}
	out := make([]int, len(e.Files))
	for i, f := range e.Files {
		out[i] = int(f.Fd())
	}
	return out
}
