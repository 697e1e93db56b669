package offload_test

import (
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/offload"
)

// TestShrinkWhileAsleep: a buffer shrunk while asleep (its last chunks closed) wakes with the chunks
// it kept, content restored, and does not keep the rest of the set asleep; the closed chunks'
// backup is dropped.
func TestShrinkWhileAsleep(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		shrunk := newBuf(t, d, 6*mib, 2*mib, 71, nil)
		other := newBuf(t, d, 2*mib, 2*mib, 72, nil)
		filed := newBuf(t, d, 6*mib, 2*mib, 73, nil)
		f, err := os.CreateTemp(t.TempDir(), "filed")
		require.NoError(t, err)
		t.Cleanup(func() { f.Close() })
		set := newSet(t, b, offload.Options{SlotSize: 2 * mib})
		require.NoError(t, set.Add("shrunk", shrunk, offload.Keep, offload.EntryOptions{}))
		require.NoError(t, set.Add("other", other, offload.Keep, offload.EntryOptions{}))
		require.NoError(t, set.Add("filed", filed, offload.File, offload.EntryOptions{File: f}))
		ptr := shrunk.Ptr()
		require.NoError(t, set.Sleep(bg))
		require.NoError(t, shrunk.Shrink(2*mib))
		require.NoError(t, filed.Shrink(4*mib))
		require.NoError(t, set.Wake(bg))
		for _, tag := range set.Tags() {
			require.False(t, set.Asleep(tag), tag)
		}
		require.Equal(t, ptr, shrunk.Ptr())
		requirePattern(t, d, shrunk.Ptr(), 2*mib, 71)
		requirePattern(t, d, other.Ptr(), 2*mib, 72)
		requirePattern(t, d, filed.Ptr(), 4*mib, 73)
		require.NoError(t, shrunk.Grow(6*mib), "the shrunk buffer grows again")
		require.NoError(t, set.Sleep(bg))
		require.NoError(t, set.Wake(bg))
		requirePattern(t, d, shrunk.Ptr(), 2*mib, 71)
	})
}
