package pinned_test

import (
	"encoding/binary"
	"net"
	"os"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/internal/memfd"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/pinned"
)

// A shared-memory region's memfd is sealed against resizing before it is shared, and Receive
// refuses one that is not: its sender could truncate it under the receiver's mapping.
func TestSharedMemoryIsSealed(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		conn, other := socketPair(t)
		defer conn.Close()
		pc, err := net.FileConn(other)
		require.NoError(t, err)
		require.NoError(t, other.Close())
		peer := pc.(*net.UnixConn)
		defer peer.Close()

		r, err := pinned.New(d, 64<<10, pinned.Options{Kind: pinned.SharedMemory})
		require.NoError(t, err)
		require.NoError(t, r.Share(peer))
		_, _, files, err := ipc.ReadMessage(conn)
		require.NoError(t, err)
		require.Len(t, files, 1)
		require.NoError(t, memfd.CheckSealed(files[0], 64<<10))
		require.ErrorIs(t, unix.Ftruncate(int(files[0].Fd()), 0), unix.EPERM)
		require.NoError(t, files[0].Close())
		require.NoError(t, r.Close())

		fd, err := unix.MemfdCreate("unsealed", unix.MFD_CLOEXEC)
		require.NoError(t, err)
		f := os.NewFile(uintptr(fd), "unsealed")
		defer f.Close()
		require.NoError(t, unix.Ftruncate(fd, 64<<10))
		hdr := make([]byte, 16)
		binary.LittleEndian.PutUint32(hdr, uint32(pinned.SharedMemory))
		binary.LittleEndian.PutUint64(hdr[8:], 64<<10)
		require.NoError(t, ipc.WriteMessage(peer, pinned.KindRegion, hdr, []*os.File{f}))
		_, err = pinned.Receive(conn, nil, pinned.OpenOptions{})
		require.ErrorIs(t, err, memfd.ErrNotSealed)
		require.ErrorIs(t, err, ipc.ErrProtocol)
	}, testutil.SimOnly())
}
