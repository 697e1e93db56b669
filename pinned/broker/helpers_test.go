package broker

import (
	"context"
	"io"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/kernels"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/internal/unixsock"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/vmm"
)

const mib = 1 << 20

func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// newRegion makes a pinned region closed at the end of the test (after the server, which is made
// later and so closed first).
func newRegion(t testing.TB, dev *vmm.Device, size uint64, opts pinned.Options) *pinned.Region {
	t.Helper()
	r, err := pinned.New(dev, size, opts)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, r.Close()) })
	return r
}

// serveDevice0 starts a broker (startServer) over a 4 MiB region of device 0 with opts, and gives
// the test's context, the device, the server and its socket.
func serveDevice0(t testing.TB, b *testutil.Backend, opts Options) (context.Context, *vmm.Device, *Server, string) {
	t.Helper()
	ctx := testCtx(t) // cancelled after the server closes, as when a test makes it first
	dev := b.Device(t, 0)
	srv, path := startServer(t, newRegion(t, dev, 4*mib, pinned.Options{}), opts)
	return ctx, dev, srv, path
}

// startServer runs a broker on a socket in a private temporary directory; it is closed at the end
// of the test and Serve must then return nil.
func startServer(t testing.TB, region *pinned.Region, opts Options) (*Server, string) {
	t.Helper()
	return startServerWith(t, region, opts, nil)
}

// startServerWith is startServer with a hook that adjusts the server before it serves.
func startServerWith(t testing.TB, region *pinned.Region, opts Options, hook func(*Server)) (*Server, string) {
	t.Helper()
	path := filepath.Join(privateDir(t), "broker.sock")
	if opts.Logf == nil {
		opts.Logf = t.Logf
	}
	srv, err := Listen(region, path, opts)
	require.NoError(t, err)
	if hook != nil {
		hook(srv)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve() }()
	t.Cleanup(func() {
		require.NoError(t, srv.Close())
		require.NoError(t, <-served)
		require.Zero(t, srv.Stats().Buffers, "buffers left registered after Close")
	})
	return srv, path
}

// dial connects a client closed at the end of the test.
func dial(t testing.TB, path string) *Client {
	t.Helper()
	c, err := DialContext(testCtx(t), path, DialOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, c.Close()) })
	return c
}

// devBuffer is device memory made with vmm directly: one reservation, one exportable allocation per
// chunk, with a hole of one chunk after each chunk listed in gaps.
type devBuffer struct {
	res *vmm.Reservation
	vmm.Chunked
}

func newDevBuffer(t testing.TB, dev *vmm.Device, chunks int, chunkSize uint64, gaps ...int) *devBuffer {
	t.Helper()
	gapAfter := map[int]bool{}
	for _, g := range gaps {
		gapAfter[g] = true
	}
	res, err := dev.System().Reserve(uint64(chunks+len(gaps))*chunkSize, vmm.ReserveOptions{})
	require.NoError(t, err)
	off := uint64(0)
	for i := 0; i < chunks; i++ {
		_, err := res.MapNew(off, chunkSize, dev, vmm.AllocOptions{HandleTypes: driver.HandleTypePosixFD}, vmm.ReadWrite(dev))
		require.NoError(t, err)
		off += chunkSize
		if gapAfter[i] {
			off += chunkSize
		}
	}
	b := &devBuffer{res: res, Chunked: ipc.FromReservation(res)}
	t.Cleanup(func() {
		for _, m := range res.Mappings() {
			require.NoError(t, m.Close())
		}
		require.NoError(t, res.Close())
	})
	return b
}

func words(b []byte) []uint64 { return unsafe.Slice((*uint64)(unsafe.Pointer(&b[0])), len(b)/8) }

// fillHost writes the pattern of seed over b, whose first byte is at patternOff in the pattern.
func fillHost(b []byte, patternOff, seed uint64) {
	w := words(b)
	for i := range w {
		w[i] = kernels.Pattern(patternOff/8+uint64(i), seed)
	}
}

// badHost counts the words of b that differ from the pattern.
func badHost(b []byte, patternOff, seed uint64) int {
	n := 0
	for i, v := range words(b) {
		if v != kernels.Pattern(patternOff/8+uint64(i), seed) {
			n++
		}
	}
	return n
}

func requireDevicePattern(t testing.TB, dev *vmm.Device, ptr driver.DevicePtr, n, patternOff, seed uint64) {
	t.Helper()
	bad, err := dev.Verify(ptr, n, patternOff, seed)
	require.NoError(t, err)
	require.Zero(t, bad, "%d words differ from seed %d's pattern on the device", bad, seed)
}

// eventually polls cond for up to 20 s.
func eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// privateDir is a 0700 directory of this uid for sockets (t.TempDir's mode follows the umask).
func privateDir(t testing.TB) string {
	t.Helper()
	d, err := os.MkdirTemp("", "broker")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(d) })
	return d
}

// rawConn connects to the broker without the client, optionally past the hello.
func rawConn(t *testing.T, path string, hello bool) *net.UnixConn {
	t.Helper()
	conn, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: path, Net: "unix"})
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	require.NoError(t, conn.SetDeadline(time.Now().Add(time.Minute)))
	if hello {
		require.NoError(t, ipc.WriteMessage(conn, KindRequest, encodeReq(request{op: OpHello, id: 1}), nil))
		resp, err := rawResponse(conn)
		require.NoError(t, err)
		require.Equal(t, OpHello, resp.op)
		require.Equal(t, StatusOK, resp.status)
	}
	return conn
}

// rawResponse reads one response from a raw connection (rawConn), as the client would, so that
// tests that speak the protocol by hand can check the broker's answers.
func rawResponse(conn *net.UnixConn) (response, error) {
	return readResponse(unixsock.NewConn(conn, unix.Ucred{}))
}

// rawRegister registers buf through a raw connection and returns its id.
func rawRegister(t *testing.T, conn *net.UnixConn, buf vmm.Chunked) uint32 {
	t.Helper()
	exp, err := ipc.Export(buf)
	require.NoError(t, err)
	defer exp.Close()
	require.NoError(t, ipc.WriteMessage(conn, KindRequest, encodeReq(request{op: OpRegister, id: 2}), nil))
	require.NoError(t, ipc.Send(conn, exp))
	resp, err := rawResponse(conn)
	require.NoError(t, err)
	require.Equal(t, StatusOK, resp.status, resp.text)
	return resp.buffer
}

// sendCopy sends a copy request of 4 KiB to the device through a raw connection.
func sendCopy(t *testing.T, conn *net.UnixConn, id uint64, buffer uint32) {
	t.Helper()
	require.NoError(t, ipc.WriteMessage(conn, KindRequest, encodeReq(request{op: OpCopy, id: id, buffer: buffer, dir: ToDevice, length: 4096}), nil))
}

// pingWithoutReading sends pings with ids from id on, never reading the answers, until a write fails
// or takes 3 s.
func pingWithoutReading(conn *net.UnixConn, id uint64) { requestWithoutReading(conn, OpPing, id) }

// requestWithoutReading sends requests of op with ids from id on, never reading the answers, until
// a write fails or takes 3 s.
func requestWithoutReading(conn *net.UnixConn, op uint16, id uint64) {
	for ; ; id++ {
		_ = conn.SetWriteDeadline(time.Now().Add(3 * time.Second))
		if ipc.WriteMessage(conn, KindRequest, encodeReq(request{op: op, id: id}), nil) != nil {
			return
		}
	}
}

// connEnd reads conn until the broker ends it (EOF, or a reset when requests were left unread).
func connEnd(conn *net.UnixConn) error {
	_, err := io.Copy(io.Discard, conn)
	if peerClosed(err) {
		return nil
	}
	return err
}

// endOf reads conn until the broker ends it (connEnd) on its own goroutine.
func endOf(conn *net.UnixConn) <-chan error {
	ended := make(chan error, 1)
	go func() { ended <- connEnd(conn) }()
	return ended
}

// requireEnds waits up to 10 s for the connection's end that ended reports.
func requireEnds(t *testing.T, ended <-chan error, what string) {
	t.Helper()
	select {
	case err := <-ended:
		require.NoError(t, err, what)
	case <-time.After(10 * time.Second):
		t.Fatalf("%s did not end", what)
	}
}

// queueHeld sends req through c and waits until its copy is queued on the lane's stream, which
// holdStream holds: the copy stays in flight until the stream is released.
func (l oneLane) queueHeld(t *testing.T, b *testutil.Backend, c *Client, req Request) *Completion {
	t.Helper()
	fn := "cuMemcpyDtoHAsync"
	if req.Dir == ToDevice {
		fn = "cuMemcpyHtoDAsync"
	}
	queued := b.Sim.Calls(fn)
	done, err := c.CopyAsync(req)
	require.NoError(t, err)
	eventually(t, "the copy to be queued on the stream", func() bool { return b.Sim.Calls(fn) == queued+1 })
	return done
}

// onlyWorker is the server's one connection.
func (l oneLane) onlyWorker(t *testing.T) *worker {
	t.Helper()
	l.srv.own.Lock()
	defer l.srv.own.Unlock()
	require.Len(t, l.srv.workers, 1)
	for w := range l.srv.workers {
		return w
	}
	return nil
}
