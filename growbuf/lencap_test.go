package growbuf_test

import (
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/internal/testutil"
)

// Close lowers Len before Cap, so a reader that loads Cap and then Len (with no Grow in between)
// never sees Len > Cap. A race of atomic loads: the test catches a wrong order often, not always.
func TestCloseNeverShowsLenPastCap(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		var bad atomic.Int64
		for range 1000 {
			buf, err := growbuf.New(d, growbuf.Options{MaxSize: 8 * mib, Chunk: growbuf.FixedChunks(2 * mib)})
			require.NoError(t, err)
			require.NoError(t, buf.Grow(8*mib))
			var stop atomic.Bool
			var wg sync.WaitGroup
			for range 2 {
				wg.Go(func() {
					for !stop.Load() {
						if c := buf.Cap(); buf.Len() > c {
							bad.Add(1)
						}
					}
				})
			}
			require.NoError(t, buf.Close())
			stop.Store(true)
			wg.Wait()
		}
		require.Zero(t, bad.Load(), "reads of Cap then Len that saw Len > Cap during Close")
	}, testutil.SimOnly())
}
