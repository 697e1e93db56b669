package offload_test

import (
	"fmt"
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/offload"
	"github.com/cuvmm/cuvmm/vmm"
)

// faultFunctions are the driver calls Sleep and Wake may make (the matrix below checks that each
// one of them, failing at each of its calls, leaves the old state or the new one).
var faultFunctions = []string{
	"cuCtxSetCurrent", "cuCtxSynchronize", "cuStreamCreate", "cuStreamSynchronize",
	"cuMemGetAccess", "cuMemUnmap", "cuMemRelease", "cuMemCreate", "cuMemMap", "cuMemSetAccess",
	"cuMemcpyAsync", "cuMemsetD8", "cuEventCreate", "cuEventRecord", "cuEventSynchronize",
	"cuEventDestroy", "cuMemHostRegister", "cuMemHostUnregister", "cuMemHostGetDevicePointer",
}

// matrixFixture is a set with one buffer per policy, filled.
type matrixFixture struct {
	set                 *offload.Set
	keep, discard, file *growbuf.Buffer
	d                   *vmm.Device
}

func newMatrixFixture(t *testing.T, b *testutil.Backend) *matrixFixture {
	return newMatrixFixtureFirst(t, b, offload.FirstSleepAuto)
}

// newMatrixFixtureFirst is newMatrixFixture whose set makes its first backup as first says.
func newMatrixFixtureFirst(t *testing.T, b *testutil.Backend, first offload.FirstSleep) *matrixFixture {
	d := b.Device(t, 0)
	f, err := os.CreateTemp(t.TempDir(), "matrix")
	require.NoError(t, err)
	t.Cleanup(func() { f.Close() })
	m := &matrixFixture{d: d,
		keep:    newBuf(t, d, 4*mib, 2*mib, 31, nil),
		discard: newBuf(t, d, 2*mib, 2*mib, 32, nil),
		file:    newBuf(t, d, 4*mib, 2*mib, 33, nil),
	}
	m.set = newSet(t, b, offload.Options{SlotSize: 2 * mib, FirstSleep: first})
	require.NoError(t, m.set.Add("keep", m.keep, offload.Keep, offload.EntryOptions{}))
	require.NoError(t, m.set.Add("discard", m.discard, offload.Discard, offload.EntryOptions{}))
	require.NoError(t, m.set.Add("file", m.file, offload.File, offload.EntryOptions{File: f}))
	return m
}

// requireAwakeIntact checks the state after a Sleep that failed, or a Wake that succeeded.
func (m *matrixFixture) requireAwakeIntact(t *testing.T, discardZeroOK bool) {
	t.Helper()
	for _, tag := range m.set.Tags() {
		require.False(t, m.set.Asleep(tag), tag)
	}
	requirePattern(t, m.d, m.keep.Ptr(), 4*mib, 31)
	requirePattern(t, m.d, m.file.Ptr(), 4*mib, 33)
	if bad, err := m.d.Verify(m.discard.Ptr(), 2*mib, 0, 32); err != nil || (bad != 0 && !discardZeroOK) {
		t.Fatalf("discard buffer: %d words changed, %v", bad, err)
	}
}

func (m *matrixFixture) requireAsleep(t *testing.T) {
	t.Helper()
	for _, tag := range m.set.Tags() {
		require.True(t, m.set.Asleep(tag), tag)
	}
}

// callsOf counts the calls of every fault function that fn makes.
func callsOf(s *sim.Sim, fn func()) map[string]int {
	before := map[string]int{}
	for _, f := range faultFunctions {
		before[f] = s.Calls(f)
	}
	fn()
	out := map[string]int{}
	for _, f := range faultFunctions {
		if n := s.Calls(f) - before[f]; n > 0 {
			out[f] = n
		}
	}
	return out
}

// TestSleepFaultMatrix fails each driver call of a Sleep, one at a time, with the backup pinned on
// the way and staged: the Sleep either fails with every buffer awake and intact, or succeeds; a
// Wake then restores everything, and the leak check at the end of each run finds nothing.
func TestSleepFaultMatrix(t *testing.T) {
	for _, first := range []offload.FirstSleep{offload.FirstSleepPin, offload.FirstSleepStage} {
		t.Run(first.String(), func(t *testing.T) { sleepFaultMatrix(t, first) })
	}
}

func sleepFaultMatrix(t *testing.T, first offload.FirstSleep) {
	var counts map[string]int
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		m := newMatrixFixtureFirst(t, b, first)
		counts = callsOf(b.Sim, func() { require.NoError(t, m.set.Sleep(bg)) })
		require.NoError(t, m.set.Wake(bg))
	}, testutil.SimOnly())
	require.NotEmpty(t, counts)
	for fn, n := range counts {
		for i := 1; i <= n; i++ {
			t.Run(fmt.Sprintf("%s#%d", fn, i), func(t *testing.T) {
				testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
					m := newMatrixFixtureFirst(t, b, first)
					b.Sim.FailNth(fn, i, driver.ErrorUnknown)
					err := m.set.Sleep(bg)
					b.Sim.ClearFaults()
					if err != nil {
						require.ErrorIs(t, err, driver.ErrorUnknown)
						m.requireAwakeIntact(t, true)
						require.NoError(t, m.set.Sleep(bg), "a failed sleep can be retried")
					}
					m.requireAsleep(t)
					require.NoError(t, m.set.Wake(bg))
					m.requireAwakeIntact(t, true)
				}, testutil.SimOnly())
			})
		}
	}
}

// TestWakeFaultMatrix fails each driver call of a Wake, one at a time, after a sleep that pinned
// its backup and after one that staged it: the Wake either fails with every buffer asleep and its
// backup intact (a retry restores it all), or succeeds.
func TestWakeFaultMatrix(t *testing.T) {
	for _, first := range []offload.FirstSleep{offload.FirstSleepPin, offload.FirstSleepStage} {
		t.Run(first.String(), func(t *testing.T) { wakeFaultMatrix(t, first) })
	}
}

func wakeFaultMatrix(t *testing.T, first offload.FirstSleep) {
	var counts map[string]int
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		m := newMatrixFixtureFirst(t, b, first)
		require.NoError(t, m.set.Sleep(bg))
		counts = callsOf(b.Sim, func() { require.NoError(t, m.set.Wake(bg)) })
	}, testutil.SimOnly())
	require.NotEmpty(t, counts)
	for fn, n := range counts {
		for i := 1; i <= n; i++ {
			t.Run(fmt.Sprintf("%s#%d", fn, i), func(t *testing.T) {
				testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
					m := newMatrixFixtureFirst(t, b, first)
					require.NoError(t, m.set.Sleep(bg))
					b.Sim.FailNth(fn, i, driver.ErrorUnknown)
					err := m.set.Wake(bg)
					b.Sim.ClearFaults()
					if err != nil {
						require.ErrorIs(t, err, driver.ErrorUnknown)
						m.requireAsleep(t)
						require.NoError(t, m.set.Wake(bg), "a failed wake can be retried")
					}
					m.requireAwakeIntact(t, true)
				}, testutil.SimOnly())
			})
		}
	}
}
