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
		max         uint64
		fault, undo string
	}{
		{"in place: set access fails, undo unmap fails", 64 * mib, "cuMemSetAccess", "cuMemUnmap"},
		{"extension: create fails, address free fails", 4 * mib, "cuMemCreate", "cuMemAddressFree"},
	} {
		t.Run(c.name, func(t *testing.T) {
			testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
				d := b.Device(t, 0)
				buf, err := growbuf.New(d, growbuf.Options{MaxSize: c.max, Chunk: growbuf.FixedChunks(2 * mib)})
				require.NoError(t, err)
				defer closeBuf(t, buf)
				require.NoError(t, buf.Grow(4*mib))
				fill(t, d, buf, 0, 4*mib, 3)
				before := stateOf(buf)
				ptr := buf.Ptr()

				b.Sim.FailNth(c.fault, 1, driver.ErrorOutOfMemory)
				b.Sim.FailNth(c.undo, 1, driver.ErrorUnknown)
				require.ErrorIs(t, buf.Grow(8*mib), driver.ErrOutOfMemory)
				require.Equal(t, before, stateOf(buf))
				require.Len(t, b.Sys.Orphans(), 1, "the leftover is kept by the System")

				require.NoError(t, buf.Grow(8*mib), "no fault armed: the same grow works")
				require.Equal(t, ptr, buf.Ptr(), "in place, not moved")
				require.Empty(t, b.Sys.Orphans(), "the leftover was freed on the way")
				verify(t, d, buf, 4*mib, 3)
			}, testutil.SimOnly())
		})
	}
}
