package ipc_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/vmm"
)

// A growable buffer whose Len ends inside a chunk is shared whole: the receiver maps its capacity
// (Cap) and learns its length in use (Len).
func TestExportGrowbufPartialLen(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		dev := b.Device(t, 0)
		buf, err := growbuf.New(dev, growbuf.Options{MaxSize: 64 << 20, Chunk: growbuf.FixedChunks(4 << 20), HandleTypes: driver.HandleTypePosixFD})
		require.NoError(t, err)
		defer func() { require.NoError(t, buf.Close()) }()
		require.NoError(t, buf.Grow(9<<20))
		require.Equal(t, uint64(12<<20), buf.Cap())
		require.NoError(t, dev.Fill(buf.Ptr(), buf.Cap(), 0, 77))

		e, err := ipc.Export(buf)
		require.NoError(t, err)
		require.Equal(t, buf.Cap(), e.Desc.Size)
		require.Len(t, e.Desc.Chunks, 3)
		a, c := testutil.SocketPair(t)
		require.NoError(t, ipc.Send(a, e))
		require.NoError(t, e.Close())
		r, err := ipc.Receive(c)
		require.NoError(t, err)
		got, err := ipc.Open(dev, r, vmm.ReadWrite(dev))
		require.NoError(t, r.Close())
		require.NoError(t, err)
		require.Equal(t, uint64(9<<20), got.Len(), "the exporter's length in use")
		require.Equal(t, uint64(12<<20), got.Cap(), "the mapped capacity")
		bad, err := dev.Verify(got.Ptr(), got.Cap(), 0, 77)
		require.NoError(t, err)
		require.Zero(t, bad)
		require.NoError(t, got.Close())
	})
}
