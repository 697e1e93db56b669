package broker

import (
	"os"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/memfd"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/internal/unixsock"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/pinned"
)

// rawRegionFiles asks the broker for its region over a raw connection, as a hostile worker would,
// and keeps every descriptor that arrives instead of mapping them.
func rawRegionFiles(t *testing.T, path string, kind pinned.Kind) []*os.File {
	t.Helper()
	conn := rawConn(t, path, true)
	require.NoError(t, ipc.WriteMessage(conn, KindRequest, encodeReq(request{op: OpRegion, id: 2}), nil))
	resp, err := rawResponse(conn)
	require.NoError(t, err)
	require.Equal(t, StatusOK, resp.status, resp.text)
	k, _, files, err := ipc.ReadMessage(conn)
	require.NoError(t, err)
	require.Equal(t, pinned.KindRegion, k)
	if kind == pinned.HostNUMA {
		rcv, err := ipc.Receive(conn)
		require.NoError(t, err)
		files = append(files, rcv.Files...)
	}
	t.Cleanup(func() { _ = unixsock.CloseFiles(files) })
	require.NotEmpty(t, files)
	return files
}

// A worker truncating any memfd it shares with the broker (its registered buffer's chunks, the
// host-NUMA region's chunks, the shared-memory region's file) is refused by the seals, and the
// broker keeps copying for everyone.
func TestWorkerCannotTruncateSharedMemfds(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		ctx := testCtx(t)
		dev := b.Device(t, 0)
		for _, kind := range []pinned.Kind{pinned.HostNUMA, pinned.SharedMemory} {
			region := newRegion(t, dev, 4*mib, pinned.Options{Kind: kind})
			_, path := startServer(t, region, Options{StreamsPerDevice: 1})
			good := dial(t, path)
			gb, err := good.Register(ctx, newDevBuffer(t, dev, 1, 2*mib))
			require.NoError(t, err)

			// The registered buffer: the worker still holds its exported files.
			mine := newDevBuffer(t, dev, 2, 2*mib)
			exp, err := ipc.Export(mine)
			require.NoError(t, err)
			files := append([]*os.File{}, exp.Files...)
			files = append(files, rawRegionFiles(t, path, kind)...)
			for i, f := range files {
				require.ErrorIs(t, unix.Ftruncate(int(f.Fd()), 0), unix.EPERM, "%s region: file %d", kind, i)
				require.ErrorIs(t, unix.Ftruncate(int(f.Fd()), 1<<30), unix.EPERM, "%s region: file %d", kind, i)
			}
			require.NoError(t, exp.Close())
			require.NoError(t, good.Copy(ctx, Request{Buffer: gb.ID(), Dir: ToDevice, Length: 2 * mib}))
			require.NoError(t, good.Copy(ctx, Request{Buffer: gb.ID(), Dir: ToHost, Length: 2 * mib}))
		}
	}, testutil.SimOnly())
}

// A worker that registers a memfd it could still resize (made to look like the simulator's) loses
// its connection; the broker maps nothing of it and keeps serving the others.
func TestUnsealedRegisterDropsTheWorker(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		ctx, dev, srv, path := serveDevice0(t, b, Options{StreamsPerDevice: 1})
		good := dial(t, path)
		gb, err := good.Register(ctx, newDevBuffer(t, dev, 1, 2*mib))
		require.NoError(t, err)

		fd, err := unix.MemfdCreate("cuvmm-sim loc=device:0 size=2097152 types=1 comp=0 rdma=0 usage=0", unix.MFD_CLOEXEC)
		require.NoError(t, err)
		fake := os.NewFile(uintptr(fd), "fake")
		defer fake.Close()
		require.NoError(t, unix.Ftruncate(fd, 2*mib))
		conn := rawConn(t, path, true)
		require.NoError(t, ipc.WriteMessage(conn, KindRequest, encodeReq(request{op: OpRegister, id: 2}), nil))
		exp := &ipc.Exported{Desc: ipc.Descriptor{Size: 2 * mib, Chunks: []ipc.ChunkDesc{{Size: 2 * mib,
			Location: driver.DeviceLocation(0), HandleType: driver.HandleTypePosixFD}}}, Files: []*os.File{fake}}
		require.NoError(t, ipc.Send(conn, exp))
		rc := unixsock.NewConn(conn, unix.Ucred{})
		resp, err := readResponse(rc)
		require.NoError(t, err)
		require.Equal(t, StatusProtocol, resp.status)
		require.Contains(t, resp.text, memfd.ErrNotSealed.Error())
		_, err = readResponse(rc)
		require.Error(t, err, "the broker hung up")
		eventually(t, "the worker to be dropped", func() bool { return srv.Stats().Workers == 1 })
		require.Equal(t, 1, srv.Stats().Buffers)
		require.NoError(t, good.Copy(ctx, Request{Buffer: gb.ID(), Dir: ToDevice, Length: 2 * mib}))
	}, testutil.SimOnly())
}
