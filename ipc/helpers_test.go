package ipc_test

import (
	"net"
	"os"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/kernels"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/vmm"
)

const mib = 1 << 20

// fileConn turns a socket descriptor into a *net.UnixConn (taking it over).
func fileConn(t testing.TB, fd int) *net.UnixConn {
	t.Helper()
	f := os.NewFile(uintptr(fd), "socket")
	c, err := net.FileConn(f)
	require.NoError(t, f.Close())
	require.NoError(t, err)
	return c.(*net.UnixConn)
}

// pipe is a pipe closed at the end of the test: a descriptor that is not a CUDA handle.
func pipe(t testing.TB) (r, w *os.File) {
	t.Helper()
	r, w, err := os.Pipe()
	require.NoError(t, err)
	t.Cleanup(func() { r.Close(); w.Close() })
	return r, w
}

// testBuffer is a buffer made with vmm directly: one reservation, one MapNew per chunk.
type testBuffer struct {
	res *vmm.Reservation
	vmm.Chunked
}

// newBuffer maps chunks allocations of chunkSize at loc (the zero location: the device's memory),
// back to back unless gapAfter[i] leaves a hole after chunk i, grants dev read-write access (and the
// CPU too for host memory), and fills the buffer's pattern with seed when seed is not 0.
func newBuffer(t testing.TB, dev *vmm.Device, chunks int, chunkSize uint64, loc driver.Location, seed uint64, gaps ...int) *testBuffer {
	t.Helper()
	gapAfter := map[int]bool{}
	for _, g := range gaps {
		gapAfter[g] = true
	}
	total := uint64(chunks+len(gaps)) * chunkSize
	res, err := dev.System().Reserve(total, vmm.ReserveOptions{})
	require.NoError(t, err)
	access := []vmm.Access{vmm.ReadWrite(dev)}
	if loc.Type == driver.LocationHostNUMA {
		access = append(access, vmm.HostReadWrite())
	}
	off := uint64(0)
	for i := 0; i < chunks; i++ {
		_, err := res.MapNew(off, chunkSize, dev, vmm.AllocOptions{Location: loc, HandleTypes: driver.HandleTypePosixFD}, access...)
		require.NoError(t, err)
		off += chunkSize
		if gapAfter[i] {
			off += chunkSize
		}
	}
	tb := &testBuffer{res: res}
	tb.Chunked = ipc.FromReservation(res)
	if seed != 0 {
		for _, c := range tb.Chunks() {
			require.NoError(t, dev.Fill(res.Ptr()+driver.DevicePtr(c.Offset), c.Allocation.Size(), c.Offset, seed))
		}
	}
	t.Cleanup(func() { tb.Close(t) })
	return tb
}

// Close unmaps, releases and frees the test buffer (idempotent).
func (b *testBuffer) Close(t testing.TB) {
	for _, m := range b.res.Mappings() {
		require.NoError(t, m.Close())
	}
	require.NoError(t, b.res.Close())
}

// verifyChunks checks seed's pattern over every chunk of buf (holes are skipped) on dev.
func verifyChunks(t testing.TB, dev *vmm.Device, buf vmm.Chunked, seed uint64) {
	t.Helper()
	for _, c := range buf.Chunks() {
		bad, err := dev.Verify(buf.Ptr()+driver.DevicePtr(c.Offset), c.Allocation.Size(), c.Offset, seed)
		require.NoError(t, err)
		require.Zero(t, bad, "chunk at offset %#x: %d words differ from seed %d's pattern", c.Offset, bad, seed)
	}
}

// fillChunks writes seed's pattern over every chunk of buf on dev.
func fillChunks(t testing.TB, dev *vmm.Device, buf vmm.Chunked, seed uint64) {
	t.Helper()
	for _, c := range buf.Chunks() {
		require.NoError(t, dev.Fill(buf.Ptr()+driver.DevicePtr(c.Offset), c.Allocation.Size(), c.Offset, seed))
	}
}

// hostWord reads the 8-byte word at addr through the CPU (host-NUMA memory with host access). The
// pointer is read out of a variable so that checkptr does not reject a pointer made from an integer.
func hostWord(addr driver.DevicePtr) uint64 {
	a := uintptr(addr)
	p := *(*unsafe.Pointer)(unsafe.Pointer(&a))
	return *(*uint64)(p)
}

func expectWord(w, seed uint64) uint64 { return kernels.Pattern(w, seed) }

// isCloexec reports whether f has FD_CLOEXEC set.
func isCloexec(t testing.TB, f *os.File) bool {
	t.Helper()
	flags, err := unix.FcntlInt(f.Fd(), unix.F_GETFD, 0)
	require.NoError(t, err)
	return flags&unix.FD_CLOEXEC != 0
}

// sameFile reports whether two files are the same open object's inode.
func sameInode(t testing.TB, a, b *os.File) bool {
	t.Helper()
	var sa, sb unix.Stat_t
	require.NoError(t, unix.Fstat(int(a.Fd()), &sa))
	require.NoError(t, unix.Fstat(int(b.Fd()), &sb))
	return sa.Ino == sb.Ino && sa.Dev == sb.Dev
}

// privateDir is a 0700 directory of this uid for sockets (t.TempDir's mode follows the umask).
func privateDir(t testing.TB) string {
	t.Helper()
	d, err := os.MkdirTemp("", "ipc")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(d) })
	return d
}
