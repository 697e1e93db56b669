package broker

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/internal/testutil"
)

// Buffer ids are per connection: a client refuses to unregister another client's buffer, which
// would otherwise name its own buffer of the same id.
func TestUnregisterRefusesAnotherClientsBuffer(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		ctx, dev, srv, path := serveDevice0(t, b, Options{})
		a, c := dial(t, path), dial(t, path)
		ba, err := a.Register(ctx, newDevBuffer(t, dev, 1, 2*mib))
		require.NoError(t, err)
		bc, err := c.Register(ctx, newDevBuffer(t, dev, 1, 2*mib))
		require.NoError(t, err)
		require.Equal(t, ba.ID(), bc.ID(), "ids collide between connections")
		err = a.Unregister(ctx, bc)
		require.ErrorIs(t, err, ErrInvalidValue)
		require.ErrorContains(t, err, "belongs to another client")
		require.Equal(t, 2, srv.Stats().Buffers, "nothing was unregistered")
		require.NoError(t, a.Unregister(ctx, ba))
		require.NoError(t, c.Unregister(ctx, bc))
	})
}
