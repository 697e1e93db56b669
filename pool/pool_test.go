package pool_test

import (
	"bytes"
	"fmt"
	"math"
	"math/rand/v2"
	"sort"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/pool"
	"github.com/cuvmm/cuvmm/vmm"
)

const mib = uint64(1) << 20

// simMemory keeps the simulated device small, so that the limits below are what bind.
var simMemory = testutil.SimOptions(sim.MemoryPerDevice(1 << 30))

// newPool makes a pool on device 0 that the test closes at its end (after freeing what it keeps).
func newPool(t *testing.T, b *testutil.Backend, opts pool.Options) (*pool.Pool, *vmm.Device) {
	t.Helper()
	d := b.Device(t, 0)
	p, err := pool.New(d, opts)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, p.Close()) })
	return p, d
}

// fill writes a pattern that depends on seed into the block; check reads it back.
func fill(t testing.TB, d *vmm.Device, blk *pool.Block, seed byte) []byte {
	t.Helper()
	want := make([]byte, blk.Size)
	for i := range want {
		want[i] = seed + byte(i*7) + byte(i>>12)
	}
	require.NoError(t, d.CopyHtoD(blk.Ptr, want))
	return want
}

func check(t testing.TB, d *vmm.Device, blk *pool.Block, want []byte) {
	t.Helper()
	got := make([]byte, len(want))
	require.NoError(t, d.CopyDtoH(got, blk.Ptr))
	require.True(t, bytes.Equal(want, got), "%s: content changed", blk)
}

func TestAllocFreeReuse(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		p, d := newPool(t, b, pool.Options{Limit: 64 * mib})
		small, err := p.Alloc(1000, nil)
		require.NoError(t, err)
		require.Equal(t, uint64(1024), small.Span())
		large, err := p.AllocTag(5*mib, nil, "kv")
		require.NoError(t, err)
		require.Equal(t, 6*mib, large.Span())
		ws, wl := fill(t, d, small, 1), fill(t, d, large, 2)
		check(t, d, small, ws)
		check(t, d, large, wl)
		st := p.Stats()
		require.Equal(t, uint64(5*mib+1000), st.InUse)
		require.Equal(t, 8*mib, st.Mapped, "one small page and three large ones")
		require.Equal(t, map[string]uint64{"kv": 5 * mib}, st.Tags)
		vs := b.Sys.Stats()
		require.Equal(t, st.Mapped, vs.Devices[0].MappedByKind["pool"], "vmm.Stats (and package metrics) see the pool's pages")

		ptr := large.Ptr
		require.NoError(t, p.Free(large, nil))
		again, err := p.Alloc(6*mib, nil)
		require.NoError(t, err)
		require.Equal(t, ptr, again.Ptr, "same stream: the freed range is reused at once")
		require.Equal(t, st.NewPages, p.Stats().NewPages, "from the cache: no new page")
		require.NoError(t, p.Free(again, nil))
		require.NoError(t, p.Free(small, nil))
		st = p.Stats()
		require.Zero(t, st.Allocated)
		require.Equal(t, 8*mib, st.Cached)
		require.Equal(t, uint64(3), st.Allocs)
	}, simMemory)
}

// TestCrossStreamReuseWaitsForTheFree holds the freeing stream (simulator): the freeing stream reuses
// the memory at once; another stream gets it only ordered after the free (its later work waits for
// the freeing stream's event), and without a new page.
func TestCrossStreamReuseWaitsForTheFree(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		p, d := newPool(t, b, pool.Options{Limit: 64 * mib})
		sa, err := d.NewStream(true)
		require.NoError(t, err)
		defer sa.Close()
		sb, err := d.NewStream(true)
		require.NoError(t, err)
		defer sb.Close()
		ev, err := d.NewEvent(false)
		require.NoError(t, err)
		defer ev.Close()

		blk, err := p.Alloc(4*mib, sa)
		require.NoError(t, err)
		ptr := blk.Ptr
		require.NoError(t, b.Sim.HoldStream(sa.Handle()))
		require.NoError(t, p.Free(blk, sa))
		same, err := p.Alloc(4*mib, sa)
		require.NoError(t, err)
		require.Equal(t, ptr, same.Ptr, "the freeing stream reuses at once")
		require.NoError(t, p.Free(same, sa))

		pages := p.Stats().NewPages
		other, err := p.Alloc(4*mib, sb)
		require.NoError(t, err)
		require.Equal(t, ptr, other.Ptr, "borrowed from the pending free")
		st := p.Stats()
		require.Equal(t, uint64(1), st.Borrows)
		require.Equal(t, pages, st.NewPages)
		require.NoError(t, ev.Record(sb))
		done, err := ev.Query()
		require.NoError(t, err)
		require.False(t, done, "work on b after the allocation waits for a to pass the free")
		require.NoError(t, b.Sim.ReleaseStream(sa.Handle()))
		done, err = ev.Query()
		require.NoError(t, err)
		require.True(t, done)
		require.NoError(t, p.Free(other, sb))
		require.NoError(t, sb.Synchronize())
	}, testutil.SimOnly(), simMemory)
}

// fragment fills a pool of 8 pages with one-page blocks and frees every other one: 4 pages idle, no
// two of them adjacent.
func fragment(t *testing.T, p *pool.Pool, d *vmm.Device) (kept []*pool.Block, want [][]byte) {
	var blocks []*pool.Block
	for i := 0; i < 8; i++ {
		blk, err := p.Alloc(2*mib, nil)
		require.NoError(t, err)
		blocks = append(blocks, blk)
	}
	for i, blk := range blocks {
		if i%2 == 0 {
			require.NoError(t, p.Free(blk, nil))
			continue
		}
		kept = append(kept, blk)
		want = append(want, fill(t, d, blk, byte(i)))
	}
	return kept, want
}

func TestStitchingServesWhatFragmentationWouldRefuse(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		for _, stitch := range []bool{true, false} {
			t.Run(fmt.Sprintf("stitch=%v", stitch), func(t *testing.T) {
				p, d := newPool(t, b, pool.Options{Limit: 16 * mib, NoStitch: !stitch, HighWater: ^uint64(0)})
				kept, want := fragment(t, p, d)
				big, err := p.Alloc(8*mib, nil)
				if !stitch {
					require.ErrorIs(t, err, driver.ErrOutOfMemory)
					for _, s := range []string{"8 MiB needed", "8 MiB allocated in 4 blocks", "8 MiB cached", "0 B free under the limit of 16 MiB"} {
						require.Contains(t, err.Error(), s)
					}
					require.Equal(t, uint64(1), p.Stats().Failures)
				} else {
					require.NoError(t, err)
					w := fill(t, d, big, 99)
					check(t, d, big, w)
					st := p.Stats()
					require.Equal(t, uint64(1), st.Stitches)
					require.Equal(t, 8*mib, st.StitchedBytes)
					require.Equal(t, 16*mib, st.PeakMapped, "no page beyond the limit")
					require.NoError(t, p.Free(big, nil))
				}
				for i, blk := range kept {
					check(t, d, blk, want[i])
					require.NoError(t, p.Free(blk, nil))
				}
			})
		}
	}, simMemory)
}

func TestTrimAndHighWater(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		p, d := newPool(t, b, pool.Options{Limit: 64 * mib, HighWater: 8 * mib})
		var blocks []*pool.Block
		for i := 0; i < 8; i++ {
			blk, err := p.Alloc(4*mib, nil)
			require.NoError(t, err)
			blocks = append(blocks, blk)
		}
		for _, blk := range blocks[:6] {
			require.NoError(t, p.Free(blk, nil))
		}
		st := p.Stats()
		if b.IsSim() {
			// The simulator's idle stream passes each free at once: above the high-water mark, the
			// frees release idle pages down to it.
			require.Equal(t, 16*mib, st.Mapped)
			require.Equal(t, 16*mib, st.TrimmedBytes)
		}
		require.LessOrEqual(t, st.Mapped, 32*mib)

		before, _, err := d.MemInfo()
		require.NoError(t, err)
		n, err := p.Trim()
		require.NoError(t, err)
		require.Equal(t, st.Mapped-8*mib, n)
		after, _, err := d.MemInfo()
		require.NoError(t, err)
		require.GreaterOrEqual(t, after+2*mib, before+n, "the driver got the memory back")
		require.Equal(t, 8*mib, p.Stats().Mapped, "the two live blocks")
		for _, blk := range blocks[6:] {
			require.NoError(t, p.Free(blk, nil))
		}
	}, simMemory)
}

func TestBadInput(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		p, d := newPool(t, b, pool.Options{Limit: 16 * mib})
		_, err := p.Alloc(0, nil)
		require.ErrorIs(t, err, vmm.ErrInvalidValue)
		_, err = p.Alloc(16*mib+1, nil)
		require.ErrorIs(t, err, vmm.ErrInvalidValue)
		require.Contains(t, err.Error(), "above the pool's limit of 16 MiB")

		blk, err := p.Alloc(100, nil)
		require.NoError(t, err)
		require.NoError(t, p.Free(blk, nil))
		err = p.Free(blk, nil)
		require.ErrorIs(t, err, vmm.ErrInvalidValue)
		require.Contains(t, err.Error(), "freed twice")
		require.ErrorIs(t, p.Free(nil, nil), vmm.ErrInvalidValue)

		other, err := pool.New(d, pool.Options{Limit: 4 * mib})
		require.NoError(t, err)
		foreign, err := other.Alloc(10, nil)
		require.NoError(t, err)
		err = p.Free(foreign, nil)
		require.ErrorIs(t, err, vmm.ErrInvalidValue)
		require.Contains(t, err.Error(), "another pool")

		err = other.Close()
		require.ErrorIs(t, err, vmm.ErrInUse)
		require.Contains(t, err.Error(), "1 blocks")
		require.NoError(t, other.Free(foreign, nil), "a refused Close freed nothing")
		require.NoError(t, other.Close())
		require.NoError(t, other.Close(), "idempotent")
		_, err = other.Alloc(10, nil)
		require.ErrorIs(t, err, vmm.ErrClosed)
		require.ErrorIs(t, other.Free(foreign, nil), vmm.ErrClosed)
		_, err = other.Trim()
		require.ErrorIs(t, err, vmm.ErrClosed)
		var nilPool *pool.Pool
		require.NoError(t, nilPool.Close())
		_, err = nilPool.Alloc(1, nil)
		require.ErrorIs(t, err, vmm.ErrInvalidValue)

		_, err = pool.New(nil, pool.Options{})
		require.ErrorIs(t, err, vmm.ErrInvalidValue)
		_, err = pool.New(d, pool.Options{Limit: 1})
		require.ErrorIs(t, err, vmm.ErrInvalidValue)
		_, err = pool.New(d, pool.Options{Limit: 4 * mib, SmallSize: 4 * mib})
		require.ErrorIs(t, err, vmm.ErrInvalidValue)
	}, simMemory)
}

// The pool, not the Block value, knows which blocks are live: a copy of a block freed already, or a
// stale block whose range was handed out again, is refused and changes nothing, so no two later
// blocks share memory.
func TestFreeOfACopiedOrStaleBlockIsRefused(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		p, _ := newPool(t, b, pool.Options{Limit: 16 * mib})
		refused := func(blk *pool.Block) {
			t.Helper()
			before := p.Stats()
			err := p.Free(blk, nil)
			require.ErrorIs(t, err, vmm.ErrInvalidValue)
			require.Contains(t, err.Error(), "freed twice")
			require.Equal(t, before, p.Stats(), "a refused free changes nothing")
		}
		for _, size := range []uint64{1000, 4 * mib} {
			blk, err := p.AllocTag(size, nil, "kv")
			require.NoError(t, err)
			cp := *blk
			require.NoError(t, p.Free(blk, nil))
			refused(&cp)
			cp2 := *blk
			cp2.Size, cp2.Tag = 1, "other"
			refused(&cp2)

			x, err := p.AllocTag(size, nil, "kv")
			require.NoError(t, err)
			refused(blk) // stale: x may have its range
			y, err := p.Alloc(size, nil)
			require.NoError(t, err)
			var reg liveSet
			require.NoError(t, reg.add(x))
			require.NoError(t, reg.add(y), "two live blocks never share memory")
			xc := *x
			require.NoError(t, p.Free(&xc, nil), "a copy of a live block frees it")
			refused(x)
			require.NoError(t, p.Free(y, nil))
			st := p.Stats()
			require.Zero(t, st.Blocks)
			require.Zero(t, st.Allocated)
			require.Zero(t, st.InUse)
			require.Empty(t, st.Tags)
		}
	}, simMemory)
}

// A limit whose default reservation (three times it) does not fit in 64 bits is refused rather than
// wrapped around to a tiny reservation.
func TestNewRefusesALimitWhoseReserveOverflows(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		g, err := d.DeviceGranularity()
		require.NoError(t, err)
		for _, limit := range []uint64{(math.MaxUint64/3/g + 16) * g, math.MaxUint64} {
			p, err := pool.New(d, pool.Options{Limit: limit})
			if err == nil {
				t.Errorf("limit %#x: New made a pool with a reservation of %#x", limit, p.Reservation().Size())
				require.NoError(t, p.Close())
				continue
			}
			require.ErrorIs(t, err, vmm.ErrInvalidValue)
			require.Contains(t, err.Error(), "overflows")
		}
	}, simMemory)
}

func TestStreamOfAnotherDevice(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		p, _ := newPool(t, b, pool.Options{Limit: 16 * mib})
		s1, err := b.Device(t, 1).NewStream(true)
		require.NoError(t, err)
		defer s1.Close()
		_, err = p.Alloc(10, s1)
		require.ErrorIs(t, err, vmm.ErrInvalidValue)
		blk, err := p.Alloc(10, nil)
		require.NoError(t, err)
		err = p.Free(blk, s1)
		require.ErrorIs(t, err, vmm.ErrInvalidValue)
		require.Contains(t, err.Error(), "stream of device 1")
		require.NoError(t, p.Free(blk, nil), "the refused free changed nothing")
	}, testutil.Devices(2), simMemory)
}

func TestSleepKeepsAddresses(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		p, d := newPool(t, b, pool.Options{Limit: 64 * mib})
		blk, err := p.Alloc(6*mib, nil)
		require.NoError(t, err)
		idle, err := p.Alloc(8*mib, nil)
		require.NoError(t, err)
		require.NoError(t, p.Free(idle, nil))
		ch := p.Chunked()
		require.Len(t, ch.Chunks(), 7)
		before, _, err := d.MemInfo()
		require.NoError(t, err)

		require.NoError(t, p.Sleep())
		after, _, err := d.MemInfo()
		require.NoError(t, err)
		require.GreaterOrEqual(t, after+2*mib, before+14*mib, "every page went back to the driver")
		_, err = p.Alloc(1, nil)
		require.ErrorIs(t, err, pool.ErrAsleep)
		require.ErrorIs(t, p.Free(blk, nil), pool.ErrAsleep)
		st := p.Stats()
		require.Zero(t, st.Mapped)
		require.Zero(t, st.Cached)
		require.Equal(t, 6*mib, st.Allocated)

		require.NoError(t, p.Wake())
		require.Equal(t, 6*mib, p.Stats().Mapped, "the pages under live blocks, at their offsets")
		want := fill(t, d, blk, 5)
		check(t, d, blk, want)
		require.Equal(t, ch.Ptr(), p.Chunked().Ptr())
		require.ErrorIs(t, p.Wake(), vmm.ErrInvalidValue)
		require.NoError(t, p.Free(blk, nil))
	}, simMemory)
}

// While the pool sleeps nothing is mapped, so nothing is free: the free parts of a small page whose
// memory Sleep gave back are no mapped range.
func TestStatsWhileAsleepShowNothingFree(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		p, _ := newPool(t, b, pool.Options{Limit: 16 * mib})
		blk, err := p.Alloc(1000, nil)
		require.NoError(t, err)
		require.Equal(t, 1*mib, p.Stats().LargestFree, "the rest of the small page serves up to SmallSize")
		require.NoError(t, p.Sleep())
		st := p.Stats()
		require.Zero(t, st.LargestFree)
		require.Zero(t, st.Fragmentation)
		require.NoError(t, p.Wake())
		require.Equal(t, 1*mib, p.Stats().LargestFree, "the rest of the small page serves up to SmallSize")
		require.NoError(t, p.Free(blk, nil))
	}, simMemory)
}

func TestWakeOutOfMemoryStaysAsleep(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		p, _ := newPool(t, b, pool.Options{Limit: 64 * mib})
		blk, err := p.Alloc(8*mib, nil)
		require.NoError(t, err)
		require.NoError(t, p.Sleep())
		b.Sim.FailNth("cuMemCreate", 3, driver.ErrorOutOfMemory)
		err = p.Wake()
		require.ErrorIs(t, err, driver.ErrOutOfMemory)
		require.Zero(t, p.Stats().Mapped, "nothing half-woken")
		require.ErrorIs(t, p.Free(blk, nil), pool.ErrAsleep)
		require.NoError(t, p.Wake(), "retried")
		require.NoError(t, p.Free(blk, nil))
	}, testutil.SimOnly(), simMemory)
}

// TestRandomizedConcurrent is the pool's main property: with many goroutines on several streams
// allocating and freeing blocks of every size under a tight limit (so that pages are stitched and
// released all the time), no two live blocks overlap, every byte written reads back, and no request
// fails while the memory exists.
func TestRandomizedConcurrent(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		const workers, rounds, perWorker = 8, 60, 3
		p, d := newPool(t, b, pool.Options{Limit: 128 * mib, HighWater: 8 * mib})
		streams := make([]*vmm.Stream, 4)
		for i := range streams {
			s, err := d.NewStream(true)
			require.NoError(t, err)
			streams[i] = s
			defer s.Close()
		}
		var reg liveSet
		var wg sync.WaitGroup
		errs := make(chan error, workers)
		for w := 0; w < workers; w++ {
			wg.Add(1)
			go func(w int) {
				defer wg.Done()
				errs <- worker(p, d, streams[w%len(streams)], &reg, rand.New(rand.NewPCG(uint64(w), 7)), rounds, perWorker)
			}(w)
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			require.NoError(t, err)
		}
		st := p.Stats()
		require.Zero(t, st.Failures)
		require.Zero(t, st.Blocks)
		require.LessOrEqual(t, st.PeakMapped, uint64(128*mib))
		t.Logf("stats: %+v", st)
	}, simMemory)
}

type liveBlock struct {
	blk  *pool.Block
	want []byte
}

// worker allocates, fills, checks and frees random blocks, keeping at most keep live at once.
func worker(p *pool.Pool, d *vmm.Device, s *vmm.Stream, reg *liveSet, r *rand.Rand, rounds, keep int) error {
	var live []liveBlock
	release := func(i int) error {
		lb := live[i]
		got := make([]byte, len(lb.want))
		if err := d.CopyDtoH(got, lb.blk.Ptr); err != nil {
			return err
		}
		if !bytes.Equal(got, lb.want) {
			return fmt.Errorf("%s: content changed while live", lb.blk)
		}
		reg.remove(lb.blk)
		live = append(live[:i], live[i+1:]...)
		return p.Free(lb.blk, s)
	}
	for i := 0; i < rounds; i++ {
		if len(live) == keep {
			if err := release(r.IntN(len(live))); err != nil {
				return err
			}
		}
		size := uint64(1 + r.IntN(1<<20))
		if r.IntN(3) == 0 {
			size = uint64(1<<20 + r.IntN(3<<20))
		}
		blk, err := p.Alloc(size, s)
		if err != nil {
			return err
		}
		if err := reg.add(blk); err != nil {
			return err
		}
		o := r.IntN(len(noise) - int(size))
		want := noise[o : o+int(size)]
		if err := d.CopyHtoD(blk.Ptr, want); err != nil {
			return err
		}
		live = append(live, liveBlock{blk, want})
	}
	for len(live) > 0 {
		if err := release(0); err != nil {
			return err
		}
	}
	return nil
}

// noise is random bytes; each block gets a slice at a random offset, so no two blocks hold the same
// content in the same place.
var noise = func() []byte {
	b := make([]byte, 16<<20)
	_, _ = rand.NewChaCha8([32]byte{1}).Read(b)
	return b
}()

// liveSet checks that live blocks never overlap.
type liveSet struct {
	mu     sync.Mutex
	blocks []*pool.Block // sorted by Ptr
}

func (l *liveSet) add(b *pool.Block) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	i := sort.Search(len(l.blocks), func(i int) bool { return l.blocks[i].Ptr >= b.Ptr })
	if i < len(l.blocks) && l.blocks[i].Ptr < b.Ptr+driver.DevicePtr(b.Span()) {
		return fmt.Errorf("%s overlaps live %s", b, l.blocks[i])
	}
	if i > 0 && l.blocks[i-1].Ptr+driver.DevicePtr(l.blocks[i-1].Span()) > b.Ptr {
		return fmt.Errorf("%s overlaps live %s", b, l.blocks[i-1])
	}
	l.blocks = append(l.blocks, nil)
	copy(l.blocks[i+1:], l.blocks[i:])
	l.blocks[i] = b
	return nil
}

func (l *liveSet) remove(b *pool.Block) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for i, x := range l.blocks {
		if x == b {
			l.blocks = append(l.blocks[:i], l.blocks[i+1:]...)
			return
		}
	}
}

// TestFreeOnAStreamClosedLater: frees queued on a stream that is then closed are not lost: the next
// request that needs them waits for the device once and reuses the memory.
func TestFreeOnAStreamClosedLater(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		p, d := newPool(t, b, pool.Options{Limit: 8 * mib, HighWater: ^uint64(0)})
		s, err := d.NewStream(true)
		require.NoError(t, err)
		blk, err := p.Alloc(8*mib, s)
		require.NoError(t, err)
		require.NoError(t, p.Free(blk, s))
		require.NoError(t, s.Close())
		again, err := p.Alloc(8*mib, nil)
		require.NoError(t, err, "the closed stream's free was collected")
		require.Equal(t, blk.Ptr, again.Ptr)
		require.NoError(t, p.Free(again, nil))
	}, simMemory)
}

// TestTrimReleasesManyPagesInParallel covers the release workers: 160 idle pages released by Trim.
func TestTrimReleasesManyPagesInParallel(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		p, d := newPool(t, b, pool.Options{Limit: 320 * mib, HighWater: ^uint64(0), ReleaseWorkers: 3})
		blk, err := p.Alloc(320*mib, nil)
		require.NoError(t, err)
		require.NoError(t, p.Free(blk, nil))
		before, _, err := d.MemInfo()
		require.NoError(t, err)
		n, err := p.Trim()
		require.NoError(t, err)
		require.Equal(t, 320*mib, n)
		after, _, err := d.MemInfo()
		require.NoError(t, err)
		require.GreaterOrEqual(t, after+2*mib, before+n)
		require.Zero(t, p.Stats().Mapped)
	}, simMemory)
}
