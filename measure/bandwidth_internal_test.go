package measure

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/vmm"
)

// bwTestBench is a bench of 1 MiB with every kind of host memory on a one-device simulator.
func bwTestBench(t *testing.T) (*bwBench, uint64) {
	t.Helper()
	const size = 1 << 20
	b, err := OpenSim(1)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, b.Close()) })
	d, err := device(b, 0, "device")
	require.NoError(t, err)
	bench, err := newBWBench(d, size)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, bench.close()) })
	_, err = bench.makeHosts(&BandwidthOptions{Env: Env{Backend: b}}, size)
	require.NoError(t, err)
	return bench, size
}

// bwRun is measureBandwidth's order: the pattern on the device, timed copies, then the check.
func bwRun(t *testing.T, bench *bwBench, dir string, size uint64) bool {
	t.Helper()
	require.NoError(t, bench.d.Fill(bench.dev.Ptr(), size, 0, bwSeed))
	_, err := bench.rows(dir, size, 2)
	require.NoError(t, err)
	ok, err := bench.verify(dir, size)
	require.NoError(t, err)
	return ok
}

func TestBandwidthVerifiesGoodCopies(t *testing.T) {
	bench, size := bwTestBench(t)
	require.True(t, bwRun(t, bench, "d2h", size))
	require.True(t, bwRun(t, bench, "h2d", size))
}

// TestBandwidthVerifyCatchesNoOpH2D: h2d copies that move nothing must not verify (the device
// buffer is zeroed before each kind's checked copy).
func TestBandwidthVerifyCatchesNoOpH2D(t *testing.T) {
	bench, size := bwTestBench(t)
	require.True(t, bwRun(t, bench, "d2h", size))
	for i := range bench.hosts {
		bench.hosts[i].h2d = func(driver.DevicePtr, uint64, *vmm.Stream) error { return nil }
	}
	require.False(t, bwRun(t, bench, "h2d", size))
}

// TestBandwidthVerifyChecksWholeD2H: a d2h copy that leaves one word in the middle wrong must not
// verify (every word is checked, not a sample).
func TestBandwidthVerifyChecksWholeD2H(t *testing.T) {
	bench, size := bwTestBench(t)
	for i := range bench.hosts {
		h := &bench.hosts[i]
		d2h := h.d2h
		h.d2h = func(src driver.DevicePtr, n uint64, s *vmm.Stream) error {
			if err := d2h(src, n, s); err != nil {
				return err
			}
			if err := s.Synchronize(); err != nil {
				return err
			}
			h.mem[n/2+5*8] ^= 0xff
			return nil
		}
	}
	require.False(t, bwRun(t, bench, "d2h", size))
}

// TestBandwidthMinPinnedNotMeasured: with no size of 16 MiB or more the lowest ratio is -1, not 0
// (which would read as a missed target).
func TestBandwidthMinPinnedNotMeasured(t *testing.T) {
	res := &BandwidthResult{Rows: []BandwidthRow{
		{Kind: HostAlloc, Direction: "h2d", SizeBytes: 1 << 20, MedianGBs: 10},
		{Kind: HostRegistered, Direction: "h2d", SizeBytes: 1 << 20, MedianGBs: 9},
	}}
	bwRatios(res)
	require.Equal(t, -1.0, res.MinPinnedVsHostAlloc)
	var w bytes.Buffer
	res.Text(&w)
	require.Contains(t, w.String(), "not measured")
	res.Rows = append(res.Rows, BandwidthRow{Kind: HostAlloc, Direction: "h2d", SizeBytes: 16 << 20, MedianGBs: 10},
		BandwidthRow{Kind: HostRegistered, Direction: "h2d", SizeBytes: 16 << 20, MedianGBs: 9.5})
	bwRatios(res)
	require.InDelta(t, 0.95, res.MinPinnedVsHostAlloc, 1e-9)
	w.Reset()
	res.Text(&w)
	require.True(t, strings.Contains(w.String(), "lowest ratio 0.950"), w.String())
}

// The median of an even count of iterations is the mean of the two middle rates, and the best is
// the fastest; the times' order does not matter.
func TestBWMedianBestEvenCount(t *testing.T) {
	const size = 1e9
	med, best := bwMedianBest(size, []time.Duration{4 * time.Second, time.Second, 3 * time.Second, 2 * time.Second})
	require.InDelta(t, (1.0/2+1.0/3)/2, med, 1e-12)
	require.InDelta(t, 1.0, best, 1e-12)
	med, best = bwMedianBest(size, []time.Duration{2 * time.Second, time.Second, 4 * time.Second})
	require.InDelta(t, 0.5, med, 1e-12)
	require.InDelta(t, 1.0, best, 1e-12)
}
