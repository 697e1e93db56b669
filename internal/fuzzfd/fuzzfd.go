// Package fuzzfd makes descriptors of every kind a peer could pass over a Unix socket, for the fuzz
// targets of the descriptor-passing paths: a memfd (sealed or not, of a size that may lie), a pipe,
// a socket, /dev/null and a directory.
package fuzzfd

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/internal/memfd"
)

// Kinds is the number of kinds Make chooses among.
const Kinds = 7

// Make returns one file per byte of kinds (at most max), each of kind b%Kinds; they are closed at
// the end of the test. A memfd named like a simulator allocation is among them, so that receivers
// reach their import and seal checks.
func Make(t testing.TB, kinds []byte, max int) []*os.File {
	t.Helper()
	if len(kinds) > max {
		kinds = kinds[:max]
	}
	files := make([]*os.File, 0, len(kinds))
	for _, k := range kinds {
		f, err := make1(t, int(k)%Kinds)
		if err != nil {
			t.Fatalf("fuzzfd: kind %d: %v", k, err)
		}
		files = append(files, f)
		t.Cleanup(func() { f.Close() })
	}
	return files
}

// simName is the name the simulator gives a 2 MiB device-0 allocation with a POSIX FD handle.
const simName = "cuvmm-sim loc=device:0 size=2097152 types=1 comp=0 rdma=0 usage=0"

func make1(t testing.TB, kind int) (*os.File, error) {
	switch kind {
	case 0: // sealed, the right size: what a simulator exports
		return memfd.Create(simName, 2<<20)
	case 1: // unsealed, the right size
		return rawMemfd(simName, 2<<20)
	case 2: // a memfd whose size disagrees with its name
		return rawMemfd(simName, 4096)
	case 3:
		r, w, err := os.Pipe()
		if err == nil {
			w.Close()
		}
		return r, err
	case 4:
		fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return nil, err
		}
		unix.Close(fds[1])
		return os.NewFile(uintptr(fds[0]), "socket"), nil
	case 5:
		return os.Open(os.DevNull)
	default:
		return os.Open(filepath.Dir(os.Args[0]))
	}
}

func rawMemfd(name string, size int64) (*os.File, error) {
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC)
	if err != nil {
		return nil, err
	}
	if err := unix.Ftruncate(fd, size); err != nil {
		unix.Close(fd)
		return nil, err
	}
	return os.NewFile(uintptr(fd), "memfd:"+name), nil
}

// Send writes data to conn in up to three pieces (cut at cuts), the files riding as SCM_RIGHTS with
// the first piece, then half-closes conn's write side.
func Send(conn *net.UnixConn, data []byte, files []*os.File, cut uint16) error {
	fds := make([]int, len(files))
	for i, f := range files {
		fds[i] = int(f.Fd())
	}
	first := data
	var rest []byte
	if len(data) > 0 {
		n := int(cut) % (len(data) + 1)
		first, rest = data[:n], data[n:]
	}
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
		if len(first) == 0 {
			first, rest = data[:min(1, len(data))], data[min(1, len(data)):]
		}
	}
	if len(first) > 0 || len(oob) > 0 {
		if len(first) == 0 {
			first = []byte{0} // descriptors need at least one byte to ride on
		}
		if _, _, err := conn.WriteMsgUnix(first, oob, nil); err != nil {
			return fmt.Errorf("sendmsg: %w", err)
		}
	}
	runtime.KeepAlive(files)
	if len(rest) > 0 {
		if _, err := conn.Write(rest); err != nil {
			return err
		}
	}
	return conn.CloseWrite()
}

// OpenFDs counts this process's open descriptors. Call Settle before the first of two counts that
// must agree.
func OpenFDs(t testing.TB) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// Settle runs the garbage collector and waits for the finalizers it queued, so that an os.File that
// earlier code dropped without Close is closed now, not in the middle of the next count of open
// descriptors (which then looked like one too few). It gives up waiting after a second.
func Settle() {
	for range 2 { // an object may be found unreachable only in the cycle after its referrer's
		type sentinel struct {
			p   *byte
			pad [16]byte
		}
		done := make(chan struct{})
		s := &sentinel{}
		runtime.SetFinalizer(s, func(*sentinel) { close(done) })
		s = nil
		runtime.GC()
		select {
		case <-done: // finalizers run one after another, and this one was queued last
		case <-time.After(time.Second):
		}
	}
}
