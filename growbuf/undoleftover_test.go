package growbuf_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/internal/testutil"
)

// A Grow whose step fails and whose undo fails too hands the leftover (a mapping at the buffer's
// end, or the extension's range after it) to the System. The leftover sits exactly where the next
// Grow goes, so that Grow retries freeing it first: with no fault armed, the same Grow works, in
// place and without moving.
func TestGrowAfterAFailedUndo(t *testing.T) {
	for _, c := range []struct {
		name        string
		max, chunk  uint64
		from, to    uint64
		fault, undo string
	}{
		{"in place: set access fails, undo unmap fails", 64 * mib, 2 * mib, 4 * mib, 8 * mib, "cuMemSetAccess", "cuMemUnmap"},
		// A full reservation of 64 MiB (one under 32 MiB is never extended in place) and an extension.
		{"extension: create fails, address free fails", 64 * mib, 32 * mib, 64 * mib, 128 * mib, "cuMemCreate", "cuMemAddressFree"},
	} {
		t.Run(c.name, func(t *testing.T) {
			testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
				d := b.Device(t, 0)
				buf, err := growbuf.New(d, growbuf.Options{MaxSize: c.max, Chunk: growbuf.FixedChunks(c.chunk)})
				require.NoError(t, err)
				defer closeBuf(t, buf)
				require.NoError(t, buf.Grow(c.from))
				fill(t, d, buf, 0, c.from, 3)
				before := stateOf(buf)
				ptr := buf.Ptr()

				b.Sim.FailNth(c.fault, 1, driver.ErrorOutOfMemory)
				b.Sim.FailNth(c.undo, 1, driver.ErrorUnknown)
				require.ErrorIs(t, buf.Grow(c.to), driver.ErrOutOfMemory)
				require.Equal(t, before, stateOf(buf))
				require.Len(t, b.Sys.Orphans(), 1, "the leftover is kept by the System")

				require.NoError(t, buf.Grow(c.to), "no fault armed: the same grow works")
				require.Equal(t, ptr, buf.Ptr(), "in place, not moved")
				require.Empty(t, b.Sys.Orphans(), "the leftover was freed on the way")
				verify(t, d, buf, c.from, 3)
			}, testutil.SimOnly())
		})
	}
}

// TestCloseAfterAFailedMoveUndo: a move whose undo cannot unmap one of the buffer's chunks from the
// new range (and whose range then cannot be freed either) leaves that range with the System, still
// mapping the chunk. The buffer is unchanged, and its Close retries that range first, so the chunk
// can be released.
func TestCloseAfterAFailedMoveUndo(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		buf, err := growbuf.New(d, growbuf.Options{MaxSize: 6 * mib, Chunk: growbuf.FixedChunks(2 * mib), AllowMove: true})
		require.NoError(t, err)
		require.NoError(t, buf.Grow(6*mib))
		fill(t, d, buf, 0, 6*mib, 9)
		blocker := blockAfter(t, b, buf, 64*mib)
		defer func() { require.NoError(t, blocker.Close()) }()
		before := stateOf(buf)

		b.Sim.FailNth("cuMemMap", 2, driver.ErrorOutOfMemory) // the 2nd chunk, in the new range
		b.Sim.FailNth("cuMemUnmap", 1, driver.ErrorUnknown)   // undoing the 1st chunk's new mapping
		b.Sim.FailNth("cuMemUnmap", 2, driver.ErrorUnknown)   // the new range's Close retrying it
		err = buf.Grow(10 * mib)
		b.Sim.ClearFaults()
		require.ErrorIs(t, err, growbuf.ErrReservationFull)
		require.ErrorIs(t, err, driver.ErrOutOfMemory)
		require.NotEmpty(t, b.Sys.Orphans(), "the new range, still mapping a chunk, is the System's")
		require.Equal(t, before, stateOf(buf))
		verify(t, d, buf, 6*mib, 9)

		require.NoError(t, buf.Close())
		require.Empty(t, b.Sys.Orphans())
	}, testutil.SimOnly())
}
