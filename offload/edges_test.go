package offload_test

import (
	"bytes"
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/offload"
)

// Save reads a buffer once the work queued on it is done, and Restore writes it once that work is
// done, as Sleep waits: a checkpoint holds the last write queued before it, and no write queued
// before a Restore lands over what it restores.
func TestSaveAndRestoreWaitForQueuedWork(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		buf := newBuf(t, d, 4*mib, 2*mib, 7, nil)
		src := newBuf(t, d, 4*mib, 2*mib, 9, nil)
		st, err := d.NewStream(true)
		require.NoError(t, err)
		defer func() { require.NoError(t, st.Close()) }()
		set := newSet(t, b, offload.Options{})
		require.NoError(t, set.Add("w", buf, offload.Keep, offload.EntryOptions{Stream: st}))
		require.NoError(t, d.CopyAsync(buf.Ptr(), src.Ptr(), 4*mib, st))
		var ck bytes.Buffer
		require.NoError(t, set.Save(bg, &ck))
		require.NoError(t, d.Fill(buf.Ptr(), 4*mib, 0, 3))
		require.NoError(t, set.Restore(bg, bytes.NewReader(ck.Bytes())))
		requirePattern(t, d, buf.Ptr(), 4*mib, 9)

		require.NoError(t, d.Fill(src.Ptr(), 4*mib, 0, 5))
		require.NoError(t, d.CopyAsync(buf.Ptr(), src.Ptr(), 4*mib, st)) // queued before the Restore
		require.NoError(t, set.Restore(bg, bytes.NewReader(ck.Bytes())))
		require.NoError(t, st.Synchronize())
		requirePattern(t, d, buf.Ptr(), 4*mib, 9)
	})
}

// A buffer with no memory (closed) has nothing to give back: Sleep leaves it awake, and the set
// still closes. A huge SlotSize is capped instead of wrapping to 0; a closed set refuses Remove.
func TestSleepOfAClosedBufferAndOtherEdges(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		buf, err := growbuf.New(d, growbuf.Options{MaxSize: 16 * mib, Chunk: growbuf.FixedChunks(2 * mib)})
		require.NoError(t, err)
		require.NoError(t, buf.Grow(4*mib))
		set := offload.NewSet(b.Sys, offload.Options{SlotSize: math.MaxUint64})
		require.NoError(t, set.Add("a", buf, offload.Keep, offload.EntryOptions{}))
		require.NoError(t, buf.Close())
		require.NoError(t, set.Sleep(bg))
		require.False(t, set.Asleep("a"))
		require.NoError(t, set.Close())
		require.ErrorIs(t, set.Remove("a"), offload.ErrClosed)
		require.NotPanics(t, func() { offload.PlanFileStaging(offload.Options{SlotSize: math.MaxUint64}, 4*mib, 2*mib) })
		require.Zero(t, offload.PlanFileStaging(offload.Options{}, 0, 2*mib).Parts)
	}, testutil.SimOnly())
}

// Save refuses a buffer it could not write a checkpoint of that Load and Restore accept: one closed
// while in the set, one grown while asleep. Nothing is written.
func TestSaveRefusesWhatLoadWouldRefuse(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		grown, err := growbuf.New(d, growbuf.Options{MaxSize: 16 * mib, Chunk: growbuf.FixedChunks(2 * mib)})
		require.NoError(t, err)
		defer func() { require.NoError(t, grown.Close()) }()
		require.NoError(t, grown.Grow(4*mib))
		set := newSet(t, b, offload.Options{})
		require.NoError(t, set.Add("grown", grown, offload.Keep, offload.EntryOptions{}))
		require.NoError(t, set.Sleep(bg))
		require.NoError(t, grown.Grow(6*mib))
		var ck bytes.Buffer
		err = set.Save(bg, &ck)
		require.ErrorIs(t, err, offload.ErrInvalidValue)
		require.ErrorContains(t, err, `save "grown"`)
		require.Zero(t, ck.Len(), "nothing written")
		require.NoError(t, set.Wake(bg))
	}, testutil.SimOnly())
}
