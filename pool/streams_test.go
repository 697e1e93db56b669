package pool

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/internal/testutil"
)

// A stream per request, closed after it: the pool does not keep the closed streams (nor walk them on
// every drain), whether their blocks were freed on them or on another stream.
func TestShortLivedStreamsAreForgotten(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		p, err := New(d, Options{Limit: 16 << 20})
		require.NoError(t, err)
		for i := 0; i < 100; i++ {
			s, err := d.NewStream(true)
			require.NoError(t, err)
			blk, err := p.Alloc(1000, s)
			require.NoError(t, err)
			big, err := p.Alloc(4<<20, s)
			require.NoError(t, err)
			require.NoError(t, p.Free(blk, nil))
			require.NoError(t, p.Free(big, s))
			require.NoError(t, s.Close())
			require.LessOrEqual(t, len(p.streams), 2, "only streams with open frees are tracked")
		}
		_, err = p.Trim()
		require.NoError(t, err)
		require.Empty(t, p.streams, "closed streams are still tracked")
		require.NoError(t, p.Close())
	}, testutil.SimOnly(), testutil.SimOptions(sim.MemoryPerDevice(1<<30)))
}
