package pool_test

import (
	"bytes"
	"math"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/pool"
	"github.com/cuvmm/cuvmm/vmm"
)

// A reserve whose large blocks' part cannot hold the limit is refused: an empty pool must serve its
// whole limit in one block.
func TestNewRefusesAReserveTooSmallForTheLimit(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		_, err := pool.New(b.Device(t, 0), pool.Options{Limit: 16 * mib, Reserve: 16 * mib})
		require.ErrorIs(t, err, vmm.ErrInvalidValue)
		require.ErrorContains(t, err, "less than the limit")
		p, _ := newPool(t, b, pool.Options{Limit: 16 * mib, Reserve: 24 * mib})
		blk, err := p.Alloc(16*mib, nil)
		require.NoError(t, err, "the smallest reserve accepted serves the limit")
		require.NoError(t, p.Free(blk, nil))
	}, simMemory)
}

// A Free whose block is freed but whose high-water release fails says so with ErrReleaseFailed; the
// block is free (a second Free is refused), and Trim releases the page later.
func TestFreeWhoseReleaseFails(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		p, _ := newPool(t, b, pool.Options{Limit: 64 * mib, HighWater: 2 * mib})
		blk, err := p.Alloc(8*mib, nil)
		require.NoError(t, err)
		b.Sim.FailNth("cuMemRelease", 1, driver.ErrorUnknown)
		err = p.Free(blk, nil)
		require.ErrorIs(t, err, pool.ErrReleaseFailed)
		require.ErrorIs(t, p.Free(blk, nil), vmm.ErrInvalidValue, "the block was freed")
		b.Sim.ClearFaults()
		_, err = p.Trim()
		require.NoError(t, err)
	}, testutil.SimOnly(), simMemory)
}

// Wake's new pages count in NewPages and its driver calls in DriverTime, as Sleep's do.
func TestWakeCountsItsPages(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		p, _ := newPool(t, b, pool.Options{Limit: 64 * mib})
		blk, err := p.Alloc(32*mib, nil)
		require.NoError(t, err)
		before := p.Stats()
		require.NoError(t, p.Sleep())
		slept := p.Stats()
		require.Greater(t, slept.DriverTime, before.DriverTime, "Sleep's unmapping is timed")
		require.NoError(t, p.Wake())
		after := p.Stats()
		require.Equal(t, before.NewPages+16, after.NewPages)
		require.Greater(t, after.DriverTime, slept.DriverTime, "Wake's mapping is timed")
		require.NoError(t, p.Free(blk, nil))
	}, testutil.SimOnly(), simMemory)
}

// A nil pool is an error or empty, never a panic; a stream of another System is named as such.
func TestNilPoolAndStreamOfAnotherSystem(t *testing.T) {
	var nilPool *pool.Pool
	require.ErrorIs(t, nilPool.Sleep(), vmm.ErrInvalidValue)
	require.ErrorIs(t, nilPool.Wake(), vmm.ErrInvalidValue)
	require.Zero(t, nilPool.Stats().Allocs)
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		p, _ := newPool(t, b, pool.Options{Limit: 16 * mib})
		other, err := vmm.Open(sim.New())
		require.NoError(t, err)
		defer func() { require.NoError(t, other.Close()) }()
		d, err := other.Device(0)
		require.NoError(t, err)
		s, err := d.NewStream(true)
		require.NoError(t, err)
		defer func() { require.NoError(t, s.Close()) }()
		_, err = p.Alloc(100, s)
		require.ErrorIs(t, err, vmm.ErrInvalidValue)
		require.ErrorContains(t, err, "another System")
	}, testutil.SimOnly(), simMemory)
}

// WriteTo refuses events its text format cannot carry, which ParseTrace would refuse or misread;
// a line too long is refused naming it; Scale saturates instead of wrapping around.
func TestTraceTextCarriesWhatItWrites(t *testing.T) {
	for _, e := range []pool.TraceEvent{
		{Size: 4096, Lifetime: -1, Tag: "kv cache"},
		{Size: 4096, Lifetime: -1, Tag: "kv#1"},
		{Size: 0, Lifetime: -1},
		{Size: 4096, Stream: pool.MaxTraceStream + 1, Lifetime: -1},
	} {
		var out bytes.Buffer
		_, err := (&pool.Trace{Events: []pool.TraceEvent{e}}).WriteTo(&out)
		require.ErrorIs(t, err, vmm.ErrInvalidValue, "%+v", e)
		require.ErrorContains(t, err, "event 0")
		require.Zero(t, out.Len(), "nothing written")
	}
	long := "4096 0 - " + strings.Repeat("x", 2<<20) + "\n"
	_, err := pool.ParseTrace(strings.NewReader("4096 0 -\n" + long))
	require.ErrorIs(t, err, vmm.ErrInvalidValue)
	require.ErrorContains(t, err, "trace line 2: longer than")
	big := (&pool.Trace{Events: []pool.TraceEvent{{Size: 1 << 30, Lifetime: -1}}}).Scale(1e12)
	require.Equal(t, uint64(math.MaxUint64/pool.MinBlock*pool.MinBlock), big.Events[0].Size)
	require.Equal(t, uint64(1), (&pool.Trace{Events: []pool.TraceEvent{{Size: 4096}}}).Scale(math.NaN()).Events[0].Size)
}

// LargestFree is a request the pool serves without a driver call: after one small block, the rest
// of its page serves up to SmallSize, not the whole remainder.
func TestLargestFreeIsServedWithoutADriverCall(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		p, _ := newPool(t, b, pool.Options{Limit: 16 * mib})
		small, err := p.Alloc(1000, nil)
		require.NoError(t, err)
		lf := p.Stats().LargestFree
		require.Equal(t, uint64(1*mib), lf, "SmallSize")
		maps := b.Sim.Calls("cuMemMap")
		blk, err := p.Alloc(lf, nil)
		require.NoError(t, err)
		require.Equal(t, maps, b.Sim.Calls("cuMemMap"), "served without mapping")
		require.NoError(t, p.Free(blk, nil))
		require.NoError(t, p.Free(small, nil))
	}, testutil.SimOnly(), simMemory)
}
