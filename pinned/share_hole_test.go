package pinned_test

import (
	"encoding/binary"
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/vmm"
)

// Receive refuses a host-NUMA region whose chunks leave part of [0, size) unmapped: Bytes covers the
// whole size, and the receiver's first touch of a hole would kill it. Nothing is imported and every
// received descriptor is closed.
func TestReceiveHostNUMARefusesChunksWithHole(t *testing.T) {
	for name, keep := range map[string][]int{
		"hole at the end":    {0},
		"hole in the middle": {0, 2},
		"hole at the start":  {1, 2},
	} {
		t.Run(name, func(t *testing.T) {
			testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
				d := b.Device(t, 0)
				if !pinned.SupportsHostNUMA(d) {
					t.Skip("the simulated device has no host NUMA node")
				}
				send, recv := testutil.SocketPair(t)
				const size = 6 * mib
				src, err := pinned.New(d, size, pinned.Options{Kind: pinned.HostNUMA, ChunkSize: 2 * mib})
				require.NoError(t, err)
				defer func() { require.NoError(t, src.Close()) }()
				e, err := ipc.Export(src)
				require.NoError(t, err)
				defer e.Close()
				require.Len(t, e.Desc.Chunks, 3)
				holey := &ipc.Exported{Desc: e.Desc}
				holey.Desc.Chunks = nil
				for _, i := range keep {
					holey.Desc.Chunks = append(holey.Desc.Chunks, e.Desc.Chunks[i])
					holey.Files = append(holey.Files, e.Files[i])
				}
				hdr := make([]byte, 16)
				binary.LittleEndian.PutUint32(hdr, uint32(pinned.HostNUMA))
				binary.LittleEndian.PutUint64(hdr[8:], size)
				require.NoError(t, ipc.WriteMessage(send, pinned.KindRegion, hdr, nil))
				require.NoError(t, ipc.Send(send, holey))

				imports := b.Sim.Calls("cuMemImportFromShareableHandle")
				fds := openFDs(t)
				r, err := pinned.Receive(recv, d, pinned.OpenOptions{Grant: []*vmm.Device{d}})
				if r != nil {
					require.NoError(t, r.Close())
				}
				require.ErrorIs(t, err, ipc.ErrProtocol)
				require.Contains(t, err.Error(), "hole")
				require.Equal(t, imports, b.Sim.Calls("cuMemImportFromShareableHandle"), "a chunk was imported")
				require.Equal(t, fds, openFDs(t), "a received descriptor was left open")
			}, testutil.SimOnly())
		})
	}
}

// openFDs counts this process's open file descriptors.
func openFDs(t *testing.T) int {
	ents, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	return len(ents)
}
