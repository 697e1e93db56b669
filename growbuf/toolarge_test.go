package growbuf_test

import (
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/internal/testutil"
)

// growFast runs buf.Grow(n), failing the test when it takes more than a second (it holds the
// buffer's lock meanwhile) or allocates more than 16 MiB of Go memory. It returns Grow's error.
func growFast(t *testing.T, buf *growbuf.Buffer, n uint64) error {
	t.Helper()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	done := make(chan error, 1)
	go func() { done <- buf.Grow(n) }()
	select {
	case err := <-done:
		runtime.ReadMemStats(&after)
		require.Less(t, after.TotalAlloc-before.TotalAlloc, uint64(16<<20), "bytes allocated by Grow(%#x)", n)
		return err
	case <-time.After(time.Second):
		t.Fatalf("Grow(%#x) still running after a second", n)
		return nil
	}
}

// A Grow past what the device could ever back fails at once with ErrTooLarge, whatever the Limit
// (none here) and whether or not the buffer may move; the buffer stays usable.
func TestGrowPastDeviceMemoryFailsFast(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		for _, move := range []bool{false, true} {
			buf, err := growbuf.New(d, growbuf.Options{MaxSize: 64 * mib, AllowMove: move})
			require.NoError(t, err)
			blocker := blockAfter(t, b, buf, 64*mib)
			require.NoError(t, buf.Grow(4*mib))
			fill(t, d, buf, 0, 4*mib, 21)
			before := stateOf(buf)
			for _, n := range []uint64{1 << 62, 1 << 52, d.TotalMemory() + 1} {
				err := growFast(t, buf, n)
				require.ErrorIs(t, err, growbuf.ErrTooLarge, "move %v, Grow(%#x)", move, n)
				require.ErrorContains(t, err, "could ever back")
				require.Equal(t, before, stateOf(buf))
			}
			require.NoError(t, buf.Grow(6*mib), "the buffer is still usable")
			verify(t, d, buf, 4*mib, 21)
			closeBuf(t, buf)
			require.NoError(t, blocker.Close())
		}
	}, testutil.SimOnly())
}

// A host-NUMA buffer is bounded by the host's memory (at most 128 TiB): a huge Grow fails at once.
func TestHostNUMAGrowPastHostMemoryFailsFast(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		node := d.HostNUMAID()
		if node < 0 || !d.Supports(driver.AttrHostNUMAVirtualMemoryManagementSupported) {
			t.Skipf("device reports no host-NUMA VMM support (host NUMA id %d)", node)
		}
		buf, err := growbuf.New(d, growbuf.Options{Location: driver.HostNUMALocation(node), MaxSize: 4 * mib,
			Chunk: growbuf.FixedChunks(2 * mib), AllowMove: true})
		require.NoError(t, err)
		defer closeBuf(t, buf)
		for _, n := range []uint64{1 << 62, 1<<47 + 1} {
			require.ErrorIs(t, growFast(t, buf, n), growbuf.ErrTooLarge, "Grow(%#x)", n)
		}
		require.NoError(t, buf.Grow(8*mib))
	}, testutil.SimOnly())
}
