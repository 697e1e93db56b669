package pinned_test

import (
	"bytes"
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/vmm"
)

// copiesRacingClose queues copies of r from four goroutines while r is closed: each must either be
// queued before the memory goes or fail with ErrClosed, never touch freed memory (the simulator
// moves the data inside the call, so a copy of freed memory fails at once).
func copiesRacingClose(t *testing.T, d *vmm.Device, r *pinned.Region, dev driver.DevicePtr) {
	t.Helper()
	s, err := d.CreateStream(vmm.StreamOptions{NonBlocking: true})
	require.NoError(t, err)
	defer func() { require.NoError(t, s.Close()) }()
	var wg sync.WaitGroup
	var bad atomic.Value
	for range 4 {
		wg.Go(func() {
			for range 20 {
				for _, err := range []error{
					r.CopyToDevice(s, dev, 0, 4096),
					r.CopyFromDevice(s, dev, 4096, 4096),
				} {
					if err != nil && !errors.Is(err, vmm.ErrClosed) {
						bad.Store(err)
					}
				}
			}
		})
	}
	require.NoError(t, r.Close())
	wg.Wait()
	require.NoError(t, s.Synchronize())
	if e := bad.Load(); e != nil {
		t.Fatalf("a copy racing Close: %v", e)
	}
}

// TestRegionCopiesRacingClose: Region is safe for concurrent use, Close included.
func TestRegionCopiesRacingClose(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		dev, free := deviceBuffer(t, d, 2*mib)
		defer free()
		kinds := []pinned.Kind{pinned.SharedMemory}
		if pinned.SupportsHostNUMA(d) {
			kinds = append(kinds, pinned.HostNUMA)
		}
		for _, kind := range kinds {
			for range 100 {
				r, err := pinned.New(d, 2*mib, pinned.Options{Kind: kind})
				require.NoError(t, err)
				copiesRacingClose(t, d, r, dev)
			}
		}
	}, testutil.SimOnly(), testutil.SimOptions(sim.Eager()))
}

// TestStagerStreamRacingClose: Stream may be called while the stager closes.
func TestStagerStreamRacingClose(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		st, err := pinned.NewStager(b.Device(t, 0), pinned.StagerOptions{BufferSize: 64 << 10, Region: pinned.Options{Kind: pinned.SharedMemory}})
		require.NoError(t, err)
		var wg sync.WaitGroup
		wg.Go(func() {
			for range 1000 {
				_ = st.Stream()
			}
		})
		require.NoError(t, st.Close())
		wg.Wait()
		_, err = st.ReaderToDevice(context.Background(), 0, bytes.NewReader([]byte{1}), 1)
		require.ErrorIs(t, err, pinned.ErrClosed)
	}, testutil.SimOnly())
}

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

// TestPoolCloseRacingClose: a Close of a pool that owns its region returns nil only once the
// region is closed, also while another Close of the pool is still closing it.
func TestPoolCloseRacingClose(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		for range 300 {
			p, err := pinned.CreatePool(b.Device(t, 0), 64<<10, 4, pinned.Options{Kind: pinned.SharedMemory})
			require.NoError(t, err)
			var wg sync.WaitGroup
			var early atomic.Int32
			for range 2 {
				wg.Go(func() {
					if p.Close() == nil && b.Sim.Live().HostRegistrations != 0 {
						early.Add(1)
					}
				})
			}
			wg.Wait()
			require.Zero(t, early.Load(), "a Close returned nil while the pool's region was still registered")
		}
	}, testutil.SimOnly())
}
