// Package memfd makes memory files that are safe to hand to another process, and checks the ones
// that arrive from one.
//
// A process that maps a file another process can truncate dies with SIGBUS on its next access past
// the new end. A memfd sealed against shrinking and growing (F_SEAL_SHRINK, F_SEAL_GROW) keeps its
// size for its whole life, whoever holds a descriptor of it, and F_SEAL_SEAL keeps the seals from
// being changed. Create makes such a file; CheckSealed is what a receiver runs on a memfd before
// mapping it.
package memfd

import (
	"errors"
	"fmt"
	"os"
	"strconv"

	"golang.org/x/sys/unix"
)

// Seals is the set Create applies and CheckSealed requires: the size is fixed and the seals too.
const Seals = unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_SEAL

var (
	// ErrNotSealed: a memory file that lacks a seal of Seals (another process could change its size
	// under a mapping of it).
	ErrNotSealed = errors.New("memfd: not sealed against resizing")
	// ErrSize: a memory file whose size is not the size its sender announced.
	ErrSize = errors.New("memfd: wrong size")
	// ErrNotMemfd: a file that is not a memory file (F_GET_SEALS is refused on it).
	ErrNotMemfd = errors.New("memfd: not a memory file")
)

// CreateFD makes a close-on-exec memfd of size bytes (memfd_create with MFD_CLOEXEC and
// MFD_ALLOW_SEALING, ftruncate) and seals it with Seals, so that no holder of a descriptor can
// shrink or grow it. The memory is sparse: it is taken only where written. The descriptor is the
// caller's.
func CreateFD(name string, size int64) (int, error) {
	if size < 0 {
		return -1, fmt.Errorf("memfd: create %q: negative size %d: %w", name, size, unix.EINVAL)
	}
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return -1, fmt.Errorf("memfd: memfd_create %q: %w", name, err)
	}
	if err := unix.Ftruncate(fd, size); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("memfd: ftruncate %q to %d bytes: %w", name, size, err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, Seals); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("memfd: seal %q (F_ADD_SEALS): %w", name, err)
	}
	return fd, nil
}

// Create is CreateFD returning an *os.File named "memfd:"+name.
func Create(name string, size int64) (*os.File, error) {
	fd, err := CreateFD(name, size)
	if err != nil {
		return nil, err
	}
	return os.NewFile(uintptr(fd), "memfd:"+name), nil
}

// SealsOf reads fd's seals (F_GET_SEALS). A file that cannot carry seals (not a memfd or a shmem
// file) gives an error wrapping ErrNotMemfd.
func SealsOf(fd int) (int, error) {
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil {
		if errors.Is(err, unix.EINVAL) {
			return 0, fmt.Errorf("%w: F_GET_SEALS: %w", ErrNotMemfd, err)
		}
		return 0, fmt.Errorf("memfd: F_GET_SEALS: %w", err)
	}
	return seals, nil
}

// IsMemfd reports whether fd is a memfd (its /proc/self/fd link reads "/memfd:NAME"): the kind of
// file CheckSealed must pass before it is mapped. The real driver's POSIX FD handles are not memfds.
func IsMemfd(fd int) bool {
	buf := make([]byte, 16)
	n, err := unix.Readlink("/proc/self/fd/"+strconv.Itoa(fd), buf)
	return err == nil && n >= len("/memfd:") && string(buf[:len("/memfd:")]) == "/memfd:"
}

// CheckSealed refuses a memory file that another holder could resize or whose size is not size:
// it must carry every seal of Seals (an error wrapping ErrNotSealed names the missing ones) and hold
// exactly size bytes (ErrSize). A file that takes no seals gives ErrNotMemfd.
func CheckSealed(f *os.File, size uint64) error {
	if f == nil {
		return fmt.Errorf("memfd: check seals: nil file: %w", ErrNotMemfd)
	}
	rc, err := f.SyscallConn()
	if err != nil {
		return fmt.Errorf("memfd: check seals of %s: %w", f.Name(), err)
	}
	var cerr error
	if err := rc.Control(func(fd uintptr) { cerr = checkFD(int(fd), size) }); err != nil {
		return fmt.Errorf("memfd: check seals of %s: %w", f.Name(), err)
	}
	if cerr != nil {
		return fmt.Errorf("memfd: %s: %w", f.Name(), cerr)
	}
	return nil
}

// CheckSealedFD is CheckSealed on a raw descriptor.
func CheckSealedFD(fd int, size uint64) error { return checkFD(fd, size) }

func checkFD(fd int, size uint64) error {
	seals, err := SealsOf(fd)
	if err != nil {
		return err
	}
	if missing := Seals &^ seals; missing != 0 {
		return fmt.Errorf("%w: seals %s, missing %s (the sender must seal it against shrink, grow and further sealing)", ErrNotSealed, SealNames(seals), SealNames(missing))
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fmt.Errorf("memfd: fstat: %w", err)
	}
	if st.Size < 0 || uint64(st.Size) != size {
		return fmt.Errorf("%w: the file holds %d bytes, %d were announced", ErrSize, st.Size, size)
	}
	return nil
}

// SealNames spells a seal set, e.g. "shrink|grow|seal"; none is "none".
func SealNames(seals int) string {
	names := []struct {
		bit  int
		name string
	}{{unix.F_SEAL_SEAL, "seal"}, {unix.F_SEAL_SHRINK, "shrink"}, {unix.F_SEAL_GROW, "grow"},
		{unix.F_SEAL_WRITE, "write"}, {unix.F_SEAL_FUTURE_WRITE, "future-write"}}
	out := ""
	for _, n := range names {
		if seals&n.bit != 0 {
			if out != "" {
				out += "|"
			}
			out += n.name
		}
	}
	if out == "" {
		return "none"
	}
	return out
}
