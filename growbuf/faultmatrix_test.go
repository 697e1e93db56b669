package growbuf_test

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/vmm"
)

type growState struct {
	buf     *growbuf.Buffer
	blocker *vmm.Reservation
}

// growCase is a fault matrix over buf.Grow(to) from a buffer made with opts and grown to from; with
// block, the range after the buffer is taken (or, after a reservation under 32 MiB, refused by the
// simulator as by the driver), so that the grow must move.
func growCase(name string, opts growbuf.Options, from, to uint64, block bool) testutil.FaultCase[growState, struct{}] {
	return testutil.FaultCase[growState, struct{}]{
		Name: name,
		Setup: func(t testing.TB, sys *vmm.System) growState {
			d, err := sys.Device(0)
			require.NoError(t, err)
			buf, err := growbuf.New(d, opts)
			require.NoError(t, err)
			require.NoError(t, buf.Grow(from))
			st := growState{buf: buf}
			if block {
				st.blocker = blockAfterIn(t, sys, true, buf, 64*mib)
			}
			return st
		},
		Op: func(sys *vmm.System, st growState) (struct{}, error) {
			return struct{}{}, st.buf.Grow(to)
		},
		Close: func(sys *vmm.System, st growState, _ struct{}, _ error) error {
			return errors.Join(st.buf.Close(), st.blocker.Close())
		},
	}
}

// Every fault of a grow (in place, extending the reservation, moving, host-NUMA), alone or with any
// failing clean-up call, leaves nothing that Close and System.Close cannot free.
func TestGrowFaultMatrix(t *testing.T) {
	total := 0
	total += testutil.FaultMatrix(t, growCase("growbuf Grow in place", growbuf.Options{MaxSize: 64 * mib, Chunk: growbuf.FixedChunks(2 * mib)}, 4*mib, 10*mib, false))
	// Extensions start from 64 MiB: a reservation under 32 MiB is never extended in place. The
	// extension holds three new chunks; the host-NUMA grow maps one chunk in place and two in an
	// extension.
	total += testutil.FaultMatrix(t, growCase("growbuf Grow with extend", growbuf.Options{MaxSize: 64 * mib, Chunk: growbuf.FixedChunks(32 * mib)}, 64*mib, 160*mib, false))
	total += testutil.FaultMatrix(t, growCase("growbuf Grow with move", growbuf.Options{MaxSize: 6 * mib, Chunk: growbuf.FixedChunks(2 * mib), AllowMove: true}, 6*mib, 10*mib, true))
	total += testutil.FaultMatrix(t, growCase("growbuf Grow host-NUMA", growbuf.Options{Location: driver.HostNUMALocation(0), MaxSize: 64 * mib, Chunk: growbuf.FixedChunks(32 * mib)}, 32*mib, 128*mib, false))
	t.Logf("growbuf fault matrix: %d combinations in all", total)
}

// After a move, unmapping the old range fails: Grow succeeds, and Close, retried, frees everything
// (a second Close never reports success while allocations are held).
func TestMoveOldUnmapFails(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		buf, err := growbuf.New(d, growbuf.Options{MaxSize: 4 * mib, Chunk: growbuf.FixedChunks(2 * mib), AllowMove: true})
		require.NoError(t, err)
		blocker := blockAfter(t, b, buf, 64*mib)
		require.NoError(t, buf.Grow(4*mib))
		b.Sim.FailNth("cuMemUnmap", 1, driver.ErrorUnknown)
		require.NoError(t, buf.Grow(8*mib), "the grow itself worked")
		err = buf.Close()
		require.Error(t, err, "the old range's failure is reported")
		require.NoError(t, buf.Close(), "a retry frees what is left")
		require.NoError(t, blocker.Close())
		require.True(t, b.Sim.Live().Contexts == 1 && b.Sim.Live().Allocations == 0, "live: %s", b.Sim.Live())
	}, testutil.SimOnly())
}
