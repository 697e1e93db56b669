package pinned_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/pinned"
)

func TestPool(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		r, err := pinned.New(d, 4*mib, pinned.Options{})
		require.NoError(t, err)
		p, err := pinned.NewPool(r, 1000, 4)
		require.NoError(t, err)
		require.Equal(t, uint64(4*kib), p.BufferSize(), "rounded up to the page")
		require.Equal(t, 4, p.Len())
		require.Same(t, r, p.Region())
		// A second pool takes the next part of the region.
		p2, err := pinned.NewPool(r, mib, 2)
		require.NoError(t, err)
		b2, ok := p2.TryGet()
		require.True(t, ok)
		require.Equal(t, uint64(16*kib), b2.Offset())
		require.NoError(t, b2.Release())

		ctx := t.Context()
		var bufs []*pinned.Buffer
		seen := map[uint64]bool{}
		for i := 0; i < 4; i++ {
			buf, err := p.Get(ctx)
			require.NoError(t, err)
			require.False(t, seen[buf.Offset()], "every buffer is distinct")
			seen[buf.Offset()] = true
			require.Equal(t, r.Ptr()+driverPtr(buf.Offset()), buf.Ptr())
			require.Len(t, buf.Bytes(), 4*kib)
			require.Same(t, p, buf.Pool())
			bufs = append(bufs, buf)
		}
		// The buffers are the region's memory: the GPU reads what the CPU wrote into one.
		fillCPU(bufs[2].Bytes(), 0, 6)
		bad, err := d.Verify(bufs[2].Ptr(), bufs[2].Len(), 0, 6)
		require.NoError(t, err)
		require.Zero(t, bad)

		// Exhausted: TryGet misses, Get with a cancelled or expiring context gives up.
		_, ok = p.TryGet()
		require.False(t, ok)
		cctx, cancel := context.WithCancel(ctx)
		cancel()
		_, err = p.Get(cctx)
		require.ErrorIs(t, err, context.Canceled)
		dctx, cancel2 := context.WithTimeout(ctx, 20*time.Millisecond)
		defer cancel2()
		_, err = p.Get(dctx)
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.ErrorContains(t, err, "all 4 buffers in use")

		// A waiting Get gets the buffer a Put gives back.
		got := make(chan *pinned.Buffer)
		go func() {
			buf, err := p.Get(ctx)
			if err != nil {
				close(got)
				return
			}
			got <- buf
		}()
		time.Sleep(5 * time.Millisecond)
		require.NoError(t, p.Put(bufs[0]))
		back := <-got
		require.NotNil(t, back)
		require.Equal(t, bufs[0].Offset(), back.Offset())

		// Bad puts.
		require.ErrorIs(t, p.Put(nil), pinned.ErrInvalidValue)
		require.ErrorIs(t, p.Put(b2), pinned.ErrInvalidValue, "a buffer of another pool")
		require.ErrorIs(t, p2.Put(b2), pinned.ErrInvalidValue, "put back twice")

		st := p.Stats()
		require.Equal(t, 4, st.Buffers)
		require.Equal(t, 4, st.InUse)
		require.Equal(t, 4, st.MaxInUse)
		require.Equal(t, uint64(5), st.Gets)
		require.Equal(t, uint64(1), st.Puts)
		require.Equal(t, uint64(1), st.Misses)
		require.Equal(t, uint64(2), st.Waits)
		require.Equal(t, uint64(2), st.Cancelled)
		require.Greater(t, st.WaitTime, time.Duration(0))

		// Closing the pool or the region while buffers are out frees nothing.
		require.ErrorIs(t, p.Close(), pinned.ErrInUse)
		require.ErrorIs(t, r.Close(), pinned.ErrInUse)
		fillCPU(back.Bytes(), 0, 7)
		require.Zero(t, badWords(back.Bytes(), 0, 7), "the memory is still there")
		for _, buf := range append(bufs[1:], back) {
			require.NoError(t, buf.Release())
		}
		require.ErrorIs(t, r.Close(), pinned.ErrInUse, "the pools are still open")
		require.NoError(t, p.Close())
		require.NoError(t, p.Close(), "idempotent")
		_, err = p.Get(ctx)
		require.ErrorIs(t, err, pinned.ErrClosed)
		_, ok = p.TryGet()
		require.False(t, ok)
		require.NoError(t, p2.Close())
		require.NoError(t, r.Close())
		var nilPool *pinned.Pool
		require.NoError(t, nilPool.Close())
	})
}

// Many goroutines share a small pool: no buffer is ever held twice, and every buffer comes back.
func TestPoolConcurrent(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		const n = 3
		p, err := pinned.CreatePool(b.Device(t, 0), 4*kib, n, pinned.Options{})
		require.NoError(t, err)
		defer func() { require.NoError(t, p.Close()) }()
		var held [n]atomic.Int32
		var wg sync.WaitGroup
		var failures atomic.Int32
		for g := 0; g < 8; g++ {
			wg.Add(1)
			go func(g int) {
				defer wg.Done()
				for i := 0; i < 200; i++ {
					var buf *pinned.Buffer
					if i%3 == 0 {
						var ok bool
						if buf, ok = p.TryGet(); !ok {
							continue
						}
					} else {
						ctx, cancel := context.WithTimeout(context.Background(), time.Duration(i%5)*time.Millisecond)
						var err error
						buf, err = p.Get(ctx)
						cancel()
						if err != nil {
							if !errors.Is(err, context.DeadlineExceeded) {
								failures.Add(1)
							}
							continue
						}
					}
					if held[buf.Index()].Add(1) != 1 {
						failures.Add(1)
					}
					buf.Bytes()[0] = byte(g)
					held[buf.Index()].Add(-1)
					if buf.Release() != nil {
						failures.Add(1)
					}
				}
			}(g)
		}
		wg.Wait()
		require.Zero(t, failures.Load())
		st := p.Stats()
		require.Zero(t, st.InUse)
		require.Equal(t, st.Gets, st.Puts)
		require.LessOrEqual(t, st.MaxInUse, n)
	})
}

// Closing a pool gives its range back: a later pool takes the lowest free range that fits, and a
// region full of open pools refuses another.
func TestPoolCloseFreesItsRange(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		r, err := pinned.New(d, 4*mib, pinned.Options{})
		require.NoError(t, err)
		defer func() { require.NoError(t, r.Close()) }()
		p1, err := pinned.NewPool(r, mib, 2) // [0, 2 MiB)
		require.NoError(t, err)
		p2, err := pinned.NewPool(r, mib, 2) // [2, 4 MiB)
		require.NoError(t, err)
		_, err = pinned.NewPool(r, mib, 1)
		require.ErrorIs(t, err, pinned.ErrInvalidValue, "the region is full")
		require.NoError(t, p1.Close())
		_, err = pinned.NewPool(r, mib, 3)
		require.ErrorIs(t, err, pinned.ErrInvalidValue, "3 MiB fits no free range")
		p3, err := pinned.NewPool(r, mib, 1)
		require.NoError(t, err)
		p4, err := pinned.NewPool(r, mib, 1)
		require.NoError(t, err)
		for i, p := range []*pinned.Pool{p3, p4} {
			buf, ok := p.TryGet()
			require.True(t, ok)
			require.Equal(t, uint64(i)*mib, buf.Offset())
			require.NoError(t, buf.Release())
		}
		require.NoError(t, p2.Close())
		require.NoError(t, p3.Close())
		p5, err := pinned.NewPool(r, mib, 3) // [0, 1) free, [1, 2) p4, [2, 4) free: too small
		require.ErrorIs(t, err, pinned.ErrInvalidValue)
		require.Nil(t, p5)
		require.NoError(t, p4.Close())
		p5, err = pinned.NewPool(r, mib, 4)
		require.NoError(t, err)
		require.NoError(t, p5.Close())
	}, testutil.SimOnly())
}
