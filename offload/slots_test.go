package offload_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/offload"
	"github.com/cuvmm/cuvmm/vmm"
)

// A buffer that grows between sleeps does not leave a pinned slot of every size it had: the pool
// keeps only the sizes its buffers use now.
func TestGrowingBufferDoesNotPileUpSlots(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		// Reserved for all its growth: a reservation under 32 MiB cannot be extended in place.
		kv := newBuf(t, d, 2*mib, 2*mib, 3, &growbuf.Options{MaxSize: 32 * mib})
		set := newSet(t, b, offload.Options{SlotSize: 64 * mib})
		require.NoError(t, set.Add("kv", kv, offload.Keep, offload.EntryOptions{}))
		for range 8 {
			require.NoError(t, set.Sleep(bg))
			require.Equal(t, kv.Len(), set.BackupBytes(), "the backup, and no slot of an older size")
			require.NoError(t, set.Wake(bg))
			require.NoError(t, kv.Grow(kv.Len()+2*mib))
		}
		require.LessOrEqual(t, set.BackupBytes(), uint64(16*mib))
	}, testutil.SimOnly())
}

// Prepare pins what a Sleep of buffers on two devices takes, when both need slots of one size:
// the first Sleep then pins nothing more.
func TestPrepareCoversEveryDevice(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d0, d1 := b.Device(t, 0), b.Device(t, 1)
		a := newBuf(t, d0, 8*mib, 4*mib, 1, nil)
		c := newBuf(t, d1, 8*mib, 4*mib, 2, nil)
		set := newSet(t, b, offload.Options{SlotSize: 8 * mib})
		require.NoError(t, set.Add("a", a, offload.Keep, offload.EntryOptions{}))
		require.NoError(t, set.Add("c", c, offload.Keep, offload.EntryOptions{}))
		require.NoError(t, set.Prepare(bg))
		prepared := set.BackupBytes()
		registered := b.Sim.Calls("cuMemHostRegister")
		require.NoError(t, set.Sleep(bg))
		require.Equal(t, uint64(16*mib), prepared)
		require.Equal(t, prepared, set.BackupBytes())
		require.Equal(t, registered, b.Sim.Calls("cuMemHostRegister"), "the Sleep pinned nothing")
		require.NoError(t, set.Wake(bg))
		requirePattern(t, d0, a.Ptr(), 8*mib, 1)
		requirePattern(t, d1, c.Ptr(), 8*mib, 2)
	}, testutil.SimOnly(), testutil.Devices(2))
}

// nilChunk is a buffer whose chunks lose their allocation once added: Prepare and Sleep refuse it
// with ErrInvalidValue.
type nilChunk struct {
	vmm.Chunked
	broken bool
}

func (n *nilChunk) Chunks() []vmm.Chunk {
	cs := n.Chunked.Chunks()
	if n.broken {
		cs[0].Allocation = nil
	}
	return cs
}

func TestPrepareRefusesAChunkWithoutAllocation(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		buf := &nilChunk{Chunked: newBuf(t, d, 4*mib, 2*mib, 1, nil)}
		set := newSet(t, b, offload.Options{SlotSize: 4 * mib})
		require.NoError(t, set.Add("w", buf, offload.Keep, offload.EntryOptions{}))
		buf.broken = true
		require.ErrorIs(t, set.Prepare(bg), offload.ErrInvalidValue)
		require.ErrorIs(t, set.Sleep(bg), offload.ErrInvalidValue)
		buf.broken = false
		require.NoError(t, set.Remove("w"))
	}, testutil.SimOnly())
}
