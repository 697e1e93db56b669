package growbuf_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/vmm"
)

// A failure in any step of a grow of several chunks leaves the buffer exactly as it was: same
// state, same content, the simulator holding the same objects.
func TestGrowRollsBack(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		buf, err := growbuf.New(d, growbuf.Options{MaxSize: 64 * mib, Chunk: growbuf.FixedChunks(2 * mib)})
		require.NoError(t, err)
		defer closeBuf(t, buf)
		require.NoError(t, buf.Grow(4*mib))
		fill(t, d, buf, 0, 4*mib, 12)
		for _, fn := range []string{"cuMemCreate", "cuMemMap", "cuMemSetAccess"} {
			for _, nth := range []int{1, 2, 3} {
				before, live := stateOf(buf), b.Sim.Live()
				b.Sim.FailNth(fn, nth, driver.ErrorOutOfMemory)
				err := buf.Grow(10 * mib) // three chunks: the nth fails
				require.ErrorIs(t, err, driver.ErrOutOfMemory, "%s #%d", fn, nth)
				require.ErrorContains(t, err, fn)
				require.ErrorContains(t, err, "grow from 4 MiB to 10485760 bytes")
				require.Equal(t, before, stateOf(buf), "%s #%d", fn, nth)
				require.Equal(t, live, b.Sim.Live(), "%s #%d: every chunk of the failed grow released", fn, nth)
				verify(t, d, buf, 4*mib, 12)
			}
		}
		require.NoError(t, buf.Grow(10*mib), "with no fault armed the same grow works")
		verify(t, d, buf, 4*mib, 12)
	}, testutil.SimOnly())
}

func TestExtendRollsBack(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		// A full reservation of 64 MiB (one under 32 MiB is never extended in place); growing to
		// 160 MiB needs an extension of 96 MiB, with three chunks.
		buf, err := growbuf.New(d, growbuf.Options{MaxSize: 64 * mib, Chunk: growbuf.FixedChunks(32 * mib)})
		require.NoError(t, err)
		defer closeBuf(t, buf)
		require.NoError(t, buf.Grow(64*mib))
		fill(t, d, buf, 0, 64*mib, 13)
		before, live := stateOf(buf), b.Sim.Live()

		// The extension is made, then a chunk in it fails: the extension goes too.
		for _, fn := range []string{"cuMemCreate", "cuMemMap", "cuMemSetAccess"} {
			b.Sim.FailNth(fn, 2, driver.ErrorOutOfMemory)
			err = buf.Grow(160 * mib)
			require.ErrorIs(t, err, driver.ErrOutOfMemory, fn)
			require.Equal(t, before, stateOf(buf), fn)
			require.Equal(t, live, b.Sim.Live(), fn)
		}

		// The extension itself fails.
		b.Sim.FailNth("cuMemAddressReserve", 1, driver.ErrorOutOfMemory)
		err = buf.Grow(160 * mib)
		require.ErrorIs(t, err, growbuf.ErrReservationFull)
		require.ErrorIs(t, err, driver.ErrOutOfMemory)
		require.Equal(t, before, stateOf(buf))
		require.Equal(t, live, b.Sim.Live())
		verify(t, d, buf, 64*mib, 13)

		require.NoError(t, buf.Grow(160*mib))
		require.Equal(t, 2, buf.Reservations())
		require.Equal(t, before.Ptr, buf.Ptr())
		verify(t, d, buf, 64*mib, 13)
	}, testutil.SimOnly())
}

func TestMoveRollsBack(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		moved := 0
		buf, err := growbuf.New(d, growbuf.Options{MaxSize: 6 * mib, Chunk: growbuf.FixedChunks(2 * mib), AllowMove: true,
			OnMove: func(old, new driver.DevicePtr) { moved++ }})
		require.NoError(t, err)
		defer closeBuf(t, buf)
		blocker := blockAfter(t, b, buf, 64*mib)
		defer func() { require.NoError(t, blocker.Close()) }()
		require.NoError(t, buf.Grow(6*mib))
		fill(t, d, buf, 0, 6*mib, 14)
		before, live := stateOf(buf), b.Sim.Live()

		faults := []struct {
			fn  string
			nth int
		}{
			{"cuMemAddressReserve", 3}, // the first two are the in-place attempts (6 MiB, then 4 MiB), refused
			{"cuMemMap", 2},            // mapping an old chunk again
			{"cuMemSetAccess", 3},      // access for an old chunk in the new range
			{"cuMemCreate", 2},         // the second new chunk
			{"cuMemMap", 5},            // the second new chunk
			{"cuMemSetAccess", 5},      // the second new chunk
			{"cuCtxSynchronize", 1},    // waiting before the old range is unmapped
		}
		for _, f := range faults {
			b.Sim.FailNth(f.fn, f.nth, driver.ErrorOutOfMemory)
			err := buf.Grow(10 * mib)
			require.ErrorIs(t, err, driver.ErrOutOfMemory, "%s #%d", f.fn, f.nth)
			require.ErrorIs(t, err, growbuf.ErrReservationFull, "%s #%d", f.fn, f.nth)
			require.Equal(t, before, stateOf(buf), "%s #%d", f.fn, f.nth)
			require.Equal(t, live, b.Sim.Live(), "%s #%d", f.fn, f.nth)
			require.Zero(t, moved)
			b.Sim.ClearFaults()
			verify(t, d, buf, 6*mib, 14)
		}
		require.NoError(t, buf.Grow(10*mib))
		require.Equal(t, 1, moved)
		require.NotEqual(t, before.Ptr, buf.Ptr())
		verify(t, d, buf, 6*mib, 14)
	}, testutil.SimOnly())
}

func TestShrinkFaults(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		buf, err := growbuf.New(d, growbuf.Options{MaxSize: 16 * mib, Chunk: growbuf.FixedChunks(2 * mib)})
		require.NoError(t, err)
		defer closeBuf(t, buf)
		require.NoError(t, buf.Grow(8*mib))
		fill(t, d, buf, 0, 8*mib, 15)
		before := stateOf(buf)

		b.Sim.FailNth("cuCtxSynchronize", 1, driver.ErrorIllegalAddress)
		err = buf.Shrink(2 * mib)
		require.ErrorIs(t, err, driver.ErrIllegalAddress)
		require.ErrorContains(t, err, "nothing was unmapped")
		require.Equal(t, before, stateOf(buf), "no memory is pulled from under work that may still run")

		b.Sim.FailNth("cuMemUnmap", 1, driver.ErrorInvalidValue)
		err = buf.Shrink(2 * mib)
		require.ErrorIs(t, err, vmm.ErrInvalidValue)
		require.Equal(t, uint64(2*mib), buf.Len())
		require.Equal(t, uint64(8*mib), buf.Cap(), "a failed unmap keeps the chunks")
		require.NoError(t, buf.Shrink(2*mib), "and a second Shrink retries")
		require.Equal(t, uint64(2*mib), buf.Cap())
		verify(t, d, buf, 2*mib, 15)
	}, testutil.SimOnly())
}

func TestCloseRetries(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		buf, err := growbuf.New(d, growbuf.Options{MaxSize: 16 * mib, Chunk: growbuf.FixedChunks(2 * mib)})
		require.NoError(t, err)
		require.NoError(t, buf.Grow(8*mib))
		b.Sim.FailNth("cuMemUnmap", 1, driver.ErrorInvalidValue)
		require.ErrorIs(t, buf.Close(), vmm.ErrInvalidValue)
		require.ErrorIs(t, buf.Grow(10*mib), vmm.ErrClosed)
		require.NoError(t, buf.Close(), "the second Close frees what the first could not")
		require.True(t, b.Sim.Live().Allocations == 0 && b.Sim.Live().Reservations == 0, b.Sim.Live().String())
	}, testutil.SimOnly())
}

func TestHostNUMANotSupported(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		_, err := growbuf.New(d, growbuf.Options{Location: driver.HostNUMALocation(0)})
		require.ErrorIs(t, err, driver.ErrNotSupported)
		require.ErrorContains(t, err, "host-NUMA")
	}, testutil.SimOnly(), testutil.SimOptions(sim.Attribute(0, driver.AttrHostNUMAVirtualMemoryManagementSupported, 0)))
}

// A move whose clean-up of the old range failed (Grow returns nil, Close reports it) leaves the old
// mappings of the same allocations: Shrink unmaps them first instead of failing with "still in use",
// and when that fails it changes nothing and can be retried.
func TestShrinkAfterFailedMoveCleanup(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		buf, err := growbuf.New(d, growbuf.Options{MaxSize: 4 * mib, Chunk: growbuf.FixedChunks(2 * mib), AllowMove: true})
		require.NoError(t, err)
		blocker := blockAfter(t, b, buf, 64*mib)
		defer func() { require.NoError(t, blocker.Close()) }()
		require.NoError(t, buf.Grow(4*mib))
		b.Sim.FailNth("cuMemUnmap", 1, driver.ErrorUnknown)
		require.NoError(t, buf.Grow(8*mib), "the move succeeds; its clean-up error waits for Close")
		fill(t, d, buf, 0, 8*mib, 5)

		b.Sim.FailNth("cuMemUnmap", 1, driver.ErrorUnknown)
		before := stateOf(buf)
		err = buf.Shrink(2 * mib)
		require.ErrorIs(t, err, driver.ErrorUnknown)
		require.ErrorContains(t, err, "old range left by a move")
		require.Equal(t, before, stateOf(buf), "a failed retry changes nothing")

		require.NoError(t, buf.Shrink(2*mib))
		require.Equal(t, []uint64{2}, chunkSizes(buf))
		verify(t, d, buf, 2*mib, 5)
		require.NoError(t, buf.Resize(0), "Resize releases like Shrink")
		require.NoError(t, buf.Grow(6*mib))

		require.ErrorContains(t, buf.Close(), "after moving the buffer", "Close reports the move's clean-up error")
		closeBuf(t, buf)
		live := b.Sim.Live()
		require.Zero(t, live.Mappings+live.Allocations, live.String())
	}, testutil.SimOnly())
}
