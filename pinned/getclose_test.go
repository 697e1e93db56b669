package pinned_test

import (
	"context"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/pinned"
)

// TestPoolGetRacingClose: a Get that fails because the pool closed meanwhile returns no buffer.
func TestPoolGetRacingClose(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		for range 200 {
			p, err := pinned.CreatePool(b.Device(t, 0), 64<<10, 4, pinned.Options{Kind: pinned.SharedMemory})
			require.NoError(t, err)
			var wg sync.WaitGroup
			var mu sync.Mutex
			var bad []string
			for range 8 {
				wg.Go(func() {
					for {
						buf, err := p.Get(context.Background())
						if err != nil {
							if buf != nil {
								mu.Lock()
								bad = append(bad, err.Error())
								mu.Unlock()
							}
							return
						}
						_ = p.Put(buf)
					}
				})
			}
			for p.Close() != nil {
			}
			wg.Wait()
			require.Empty(t, bad, "a failed Get returned a buffer")
		}
	}, testutil.SimOnly())
}
