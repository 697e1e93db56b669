package sim

import (
	"fmt"
	"os"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/internal/memfd"
)

// currentThread identifies the calling OS thread: the driver's current context is per thread, so the
// simulator keys it the same way (callers lock their goroutine to the thread with
// runtime.LockOSThread).
func currentThread() int { return unix.Gettid() }

// mmap is the raw system call: unix.Mmap cannot place a mapping at an address, which reservations,
// hints and host views at a virtual address need.
func mmap(addr, length uintptr, prot, flags, fd int, off int64) (uintptr, error) {
	r, _, e := unix.Syscall6(unix.SYS_MMAP, addr, length, uintptr(prot), uintptr(flags), uintptr(fd), uintptr(off))
	if e != 0 {
		return 0, e
	}
	return r, nil
}

func munmap(addr uintptr, length uint64) error {
	if length == 0 {
		return nil
	}
	if _, _, e := unix.Syscall(unix.SYS_MUNMAP, addr, uintptr(length), 0); e != 0 {
		return fmt.Errorf("munmap %#x+%d: %w", addr, length, e)
	}
	return nil
}

// reserveFlags make an inaccessible range that takes no memory: the simulator's virtual address
// space, and what a range returns to when host access is revoked or a mapping is unmapped.
const reserveFlags = unix.MAP_PRIVATE | unix.MAP_ANONYMOUS | unix.MAP_NORESERVE

// protectNone turns [addr, addr+length) back into inaccessible reserved space.
func protectNone(addr uintptr, length uint64) error {
	_, err := mmap(addr, uintptr(length), unix.PROT_NONE, reserveFlags|unix.MAP_FIXED, -1, 0)
	return err
}

// mapFileAt maps fd at addr (replacing what is there) with prot: host access to host-NUMA memory
// through its virtual address.
func mapFileAt(addr uintptr, length uint64, prot, fd int) error {
	_, err := mmap(addr, uintptr(length), prot, unix.MAP_SHARED|unix.MAP_FIXED, fd, 0)
	return err
}

// mapped reports whether every page of [addr, addr+length) is mapped in this process (mincore fails
// with ENOMEM on a hole), which is what the driver checks before pinning host memory.
func mapped(addr uintptr, length uint64) bool {
	page := uintptr(unix.Getpagesize())
	start := addr &^ (page - 1)
	end := (addr + uintptr(length) + page - 1) &^ (page - 1)
	var vec [4096]byte
	for start < end {
		n := min((end-start)/page, uintptr(len(vec)))
		_, _, e := unix.Syscall(unix.SYS_MINCORE, start, n*page, uintptr(unsafe.Pointer(&vec[0])))
		if e != 0 {
			return false
		}
		start += n * page
	}
	return true
}

// writable reports whether every page of [addr, addr+length) lies in a mapping of this process with
// write permission, from /proc/self/maps (whose lines are sorted by address).
func writable(addr uintptr, length uint64) bool {
	page := uint64(unix.Getpagesize())
	start := uint64(addr) &^ (page - 1)
	end := (uint64(addr) + length + page - 1) &^ (page - 1)
	b, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		return false
	}
	for line := range strings.Lines(string(b)) {
		rng, rest, _ := strings.Cut(line, " ")
		lo, hi, ok := strings.Cut(rng, "-")
		if !ok {
			continue
		}
		from, err1 := strconv.ParseUint(lo, 16, 64)
		to, err2 := strconv.ParseUint(hi, 16, 64)
		if err1 != nil || err2 != nil || to <= start {
			continue
		}
		if from > start || len(rest) < 2 || rest[1] != 'w' {
			return false // a hole, or a mapping without write permission
		}
		start = to
		if start >= end {
			return true
		}
	}
	return false
}

// addrPtr turns an address into a pointer. The memory the simulator reaches this way is either not Go
// memory (mmaps) or host memory a caller passed as an address; reading the pointer out of a variable
// keeps the compiler's checkptr instrumentation (on under -race) from rejecting a pointer made from
// an integer.
func addrPtr(a uintptr) unsafe.Pointer { return *(*unsafe.Pointer)(unsafe.Pointer(&a)) }

// hostBytes is [addr, addr+n) as a byte slice.
func hostBytes(addr uintptr, n uint64) []byte {
	if n == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(addrPtr(addr)), n)
}

// words views b (8-byte aligned, length a multiple of 8) as 64-bit words.
func words(b []byte) []uint64 {
	if len(b) < 8 {
		return nil
	}
	return unsafe.Slice((*uint64)(unsafe.Pointer(&b[0])), len(b)/8)
}

// guard runs f and turns a memory fault inside it into ok=false instead of a crash: a caller may pass
// a host address that is not readable or writable, and the driver answers an error for that.
func guard(f func()) (ok bool) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			if e, isErr := r.(runtime.Error); isErr {
				if _, isFault := e.(interface{ Addr() uintptr }); isFault {
					ok = false
					return
				}
			}
			panic(r)
		}
	}()
	f()
	return true
}

// memfdPrefix starts the name of every memfd that backs a simulated allocation; an importer
// recognizes a simulator handle by it (readlink of /proc/self/fd/N gives "/memfd:" + name).
const memfdPrefix = "cuvmm-sim "

// newMemfd makes a close-on-exec memfd of size bytes (sparse: it takes memory only where written).
// It is sealed against shrinking and growing: the exported descriptor goes to other processes, and
// none of them may resize memory this one has mapped.
func newMemfd(name string, size uint64) (int, error) {
	return memfd.CreateFD(name, int64(size))
}
