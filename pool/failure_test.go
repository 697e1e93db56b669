package pool_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/pool"
	"github.com/cuvmm/cuvmm/vmm"
)

// freeMemory is the device's free memory now.
func freeMemory(t *testing.T, d *vmm.Device) uint64 {
	t.Helper()
	free, _, err := d.MemInfo()
	require.NoError(t, err)
	return free
}

// usable fails unless every byte of blk is mapped and accessible.
func usable(t *testing.T, d *vmm.Device, blk *pool.Block) {
	t.Helper()
	check(t, d, blk, fill(t, d, blk, 5))
}

// newFailurePool is a pool of 64 MiB on device 0, and the device's free memory before it.
func newFailurePool(t *testing.T, b *testutil.Backend) (*pool.Pool, *vmm.Device, uint64) {
	t.Helper()
	d := b.Device(t, 0)
	before := freeMemory(t, d)
	p, err := pool.New(d, pool.Options{Limit: 64 * mib})
	require.NoError(t, err)
	return p, d, before
}

// closeGivesAllBack closes p and checks that the device has the memory it had before the pool.
func closeGivesAllBack(t *testing.T, p *pool.Pool, d *vmm.Device, before uint64) {
	t.Helper()
	require.NoError(t, p.Close())
	require.Equal(t, before, freeMemory(t, d), "every page released")
}

// A page whose release fails during Trim leaves the cache (its memory is unmapped), counts as
// released only once a later Trim releases it, and the next Alloc gets mapped memory.
func TestTrimReleaseFailureUncachesThePageAndRetries(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		p, d, before := newFailurePool(t, b)
		blk, err := p.Alloc(6*mib, nil)
		require.NoError(t, err)
		require.NoError(t, p.Free(blk, nil))
		b.Sim.FailNth("cuMemRelease", 1, driver.ErrorUnknown)
		n, err := p.Trim()
		require.ErrorIs(t, err, driver.ErrorUnknown)
		require.Equal(t, 4*mib, n, "two of the three pages released")
		st := p.Stats()
		require.Zero(t, st.Mapped)
		require.Zero(t, st.Cached)
		require.Equal(t, 4*mib, st.TrimmedBytes)

		again, err := p.Alloc(6*mib, nil)
		require.NoError(t, err)
		usable(t, d, again)
		require.NoError(t, p.Free(again, nil))
		n, err = p.Trim()
		require.NoError(t, err, "the failed release is retried")
		require.Equal(t, 8*mib, n, "the retried page and the three idle ones")
		require.Equal(t, 12*mib, p.Stats().TrimmedBytes)
		closeGivesAllBack(t, p, d, before)
	}, testutil.SimOnly(), simMemory)
}

// Close retries a release that failed before and, while it fails, reports it and stays open.
func TestCloseRetriesAFailedReleaseUntilItSucceeds(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		p, d, before := newFailurePool(t, b)
		blk, err := p.Alloc(2*mib, nil)
		require.NoError(t, err)
		require.NoError(t, p.Free(blk, nil))
		b.Sim.FailNth("cuMemRelease", 1, driver.ErrorUnknown)
		b.Sim.FailNth("cuMemRelease", 2, driver.ErrorUnknown)
		require.ErrorIs(t, p.Close(), driver.ErrorUnknown, "the release fails")
		require.ErrorIs(t, p.Close(), driver.ErrorUnknown, "the retry fails too")
		closeGivesAllBack(t, p, d, before)
	}, testutil.SimOnly(), simMemory)
}

// A release that fails under the high-water mark of a Free leaves the cache consistent.
func TestHighWaterReleaseFailureKeepsTheCacheMapped(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		before := freeMemory(t, d)
		p, err := pool.New(d, pool.Options{Limit: 64 * mib, HighWater: 2 * mib})
		require.NoError(t, err)
		blk, err := p.Alloc(8*mib, nil)
		require.NoError(t, err)
		b.Sim.FailNth("cuMemRelease", 1, driver.ErrorUnknown)
		require.ErrorIs(t, p.Free(blk, nil), driver.ErrorUnknown)
		require.Equal(t, 2*mib, p.Stats().Mapped, "the pages above the mark are unmapped")
		for _, size := range []uint64{2 * mib, 8 * mib} {
			again, err := p.Alloc(size, nil)
			require.NoError(t, err)
			usable(t, d, again)
			require.NoError(t, p.Free(again, nil))
		}
		closeGivesAllBack(t, p, d, before)
	}, testutil.SimOnly(), simMemory)
}

// When releasing a page under a live block fails, Sleep puts the pool to sleep all the same and says
// so (ErrAsleep); Wake gives the block memory again and Close releases the page at last.
func TestSleepReleaseFailureStillSleeps(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		p, d, before := newFailurePool(t, b)
		blk, err := p.Alloc(4*mib, nil)
		require.NoError(t, err)
		b.Sim.FailNth("cuMemRelease", 2, driver.ErrorUnknown) // the second page under blk
		err = p.Sleep()
		require.ErrorIs(t, err, pool.ErrAsleep)
		require.ErrorIs(t, err, driver.ErrorUnknown)
		require.Zero(t, p.Stats().Mapped)
		_, err = p.Alloc(1, nil)
		require.ErrorIs(t, err, pool.ErrAsleep)
		require.NoError(t, p.Wake())
		usable(t, d, blk)
		require.NoError(t, p.Free(blk, nil))
		closeGivesAllBack(t, p, d, before)
	}, testutil.SimOnly(), simMemory)
}

// A page that Sleep cannot unmap stays mapped, with its content, while the pool sleeps; Wake maps the
// others again.
func TestSleepUnmapFailureKeepsThePageMapped(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		p, d, before := newFailurePool(t, b)
		blk, err := p.Alloc(4*mib, nil)
		require.NoError(t, err)
		want := fill(t, d, blk, 3)
		b.Sim.FailNth("cuMemUnmap", 1, driver.ErrorUnknown) // the first page under blk
		err = p.Sleep()
		require.ErrorIs(t, err, pool.ErrAsleep)
		require.Equal(t, 2*mib, p.Stats().Mapped)
		require.NoError(t, p.Wake())
		got := make([]byte, 2*mib)
		require.NoError(t, d.CopyDtoH(got, blk.Ptr))
		require.Equal(t, want[:2*mib], got, "the page that stayed mapped kept its content")
		usable(t, d, blk)
		require.NoError(t, p.Free(blk, nil))
		closeGivesAllBack(t, p, d, before)
	}, testutil.SimOnly(), simMemory)
}

// A request whose stitch fails counts as a failure, not as a stitch, and the idle pages it took are
// released (retrying one whose release failed) rather than leaked.
func TestFailedStitchIsNotCountedAndLeaksNothing(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		before := freeMemory(t, d)
		p, err := pool.New(d, pool.Options{Limit: 16 * mib, HighWater: ^uint64(0)})
		require.NoError(t, err)
		kept, _ := fragment(t, p, d)
		b.Sim.FailNth("cuMemMap", 2, driver.ErrorUnknown)     // the second stitched page
		b.Sim.FailNth("cuMemRelease", 2, driver.ErrorUnknown) // of the pages taken but not mapped
		_, err = p.Alloc(8*mib, nil)
		require.ErrorIs(t, err, driver.ErrorUnknown)
		st := p.Stats()
		require.Zero(t, st.Stitches)
		require.Zero(t, st.StitchedBytes)
		require.Equal(t, uint64(1), st.Failures)
		big, err := p.Alloc(8*mib, nil)
		require.NoError(t, err)
		usable(t, d, big)
		for _, blk := range append(kept, big) {
			require.NoError(t, p.Free(blk, nil))
		}
		closeGivesAllBack(t, p, d, before)
	}, testutil.SimOnly(), simMemory)
}

// When granting access to a fresh range fails and undoing its mapping fails too, the pages stay mapped
// but out of use: later requests of both kinds are served from other pages and address ranges, and
// Trim (or Sleep) unmaps and releases them once the driver works again, so that Close gives
// everything back.
func TestGrowSetAccessAndUnmapFailureKeepsThePagesOutOfUse(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		for _, tc := range []struct {
			size  uint64
			sleep bool
		}{{4 * mib, false}, {1000, false}, {4 * mib, true}} {
			size := tc.size
			t.Run(fmt.Sprintf("size=%d,sleep=%v", size, tc.sleep), func(t *testing.T) {
				d := b.Device(t, 0)
				before := freeMemory(t, d)
				p, err := pool.New(d, pool.Options{Limit: 16 * mib})
				require.NoError(t, err)
				b.Sim.FailNth("cuMemSetAccess", 1, driver.ErrorUnknown)
				b.Sim.FailNth("cuMemUnmap", 1, driver.ErrorUnknown)
				_, err = p.Alloc(size, nil)
				require.ErrorIs(t, err, driver.ErrorUnknown)
				stranded := p.Stats().Mapped
				require.NotZero(t, stranded, "the pages could not be unmapped")
				var blocks []*pool.Block
				for i := 0; i < 3; i++ {
					blk, err := p.Alloc(size, nil)
					require.NoError(t, err, "request %d after the failure", i)
					usable(t, d, blk)
					blocks = append(blocks, blk)
				}
				for _, blk := range blocks {
					require.NoError(t, p.Free(blk, nil))
				}
				if tc.sleep {
					require.NoError(t, p.Sleep())
					require.Zero(t, p.Stats().Mapped, "the stranded pages are released")
					require.NoError(t, p.Wake())
				} else {
					n, err := p.Trim()
					require.NoError(t, err)
					require.GreaterOrEqual(t, n, stranded, "the stranded pages are released")
				}
				require.Zero(t, p.Stats().Mapped)
				allocFree(t, p, 16*mib, nil)
				closeGivesAllBack(t, p, d, before)
			})
		}
	}, testutil.SimOnly(), simMemory)
}

// A request whose range must first be cleared of idle pages fails cleanly when unmapping them fails:
// nothing changes, and the same request succeeds once the driver works again.
func TestClearRangeUnmapFailureChangesNothing(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		before := freeMemory(t, d)
		p, err := pool.New(d, pool.Options{Limit: 64 * mib, HighWater: ^uint64(0)})
		require.NoError(t, err)
		allocFree(t, p, 32*mib, nil)
		allocFree(t, p, 48*mib, nil) // idle pages now cut the address range short of 64 MiB
		st := p.Stats()
		b.Sim.FailNth("cuMemUnmap", 1, driver.ErrorUnknown)
		_, err = p.Alloc(64*mib, nil)
		require.ErrorIs(t, err, driver.ErrorUnknown)
		require.Contains(t, err.Error(), "clear an address range")
		after := p.Stats()
		require.Equal(t, st.Mapped, after.Mapped)
		require.Equal(t, st.Cached, after.Cached)
		require.Equal(t, st.TrimmedBytes, after.TrimmedBytes)
		blk, err := p.Alloc(64*mib, nil)
		require.NoError(t, err)
		usable(t, d, blk)
		require.NoError(t, p.Free(blk, nil))
		closeGivesAllBack(t, p, d, before)
	}, testutil.SimOnly(), simMemory)
}

// Close keeps an event whose destruction failed and destroys it on the next Close, which does not
// report success while the event is still alive.
func TestCloseRetriesAFailedEventDestroy(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		p, d, before := newFailurePool(t, b)
		s, err := d.NewStream(false)
		require.NoError(t, err)
		blk, err := p.Alloc(4*mib, s)
		require.NoError(t, err)
		require.NoError(t, p.Free(blk, s))
		_, err = p.Trim() // records an event for the free: the pool keeps it as a spare
		require.NoError(t, err)
		b.Sim.FailNth("cuEventDestroy", 1, driver.ErrorUnknown)
		require.ErrorIs(t, p.Close(), driver.ErrorUnknown)
		require.NotZero(t, b.Sim.Live().Events, "the event is still alive")
		closeGivesAllBack(t, p, d, before)
		require.Zero(t, b.Sim.Live().Events, "the second Close destroyed it")
		require.NoError(t, s.Close())
	}, testutil.SimOnly(), simMemory)
}

// A Trim counts once in Trims, also when it both retries a release that failed before and releases
// idle pages.
func TestTrimCountsOnceWhenItAlsoRetriesARelease(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		p, d, before := newFailurePool(t, b)
		allocFree(t, p, 6*mib, nil)
		b.Sim.FailNth("cuMemRelease", 1, driver.ErrorUnknown)
		_, err := p.Trim()
		require.ErrorIs(t, err, driver.ErrorUnknown)
		require.Equal(t, uint64(1), p.Stats().Trims)
		allocFree(t, p, 6*mib, nil)
		n, err := p.Trim()
		require.NoError(t, err)
		require.Equal(t, 8*mib, n, "the retried page and the three idle ones")
		st := p.Stats()
		require.Equal(t, uint64(2), st.Trims, "two Trim calls released memory")
		require.Equal(t, 12*mib, st.TrimmedBytes)
		closeGivesAllBack(t, p, d, before)
	}, testutil.SimOnly(), simMemory)
}
