package offload_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/vmm"
)

// matrixChunks is how many chunks the matrix fixture's buffers have (keep 2, discard 1, file 2).
const matrixChunks = 5

// requireHalfAsleep checks the state a failed undo leaves: some buffer asleep, so the set refuses
// to close (its backups would be lost), and the error names what happened.
func (m *matrixFixture) requireHalfAsleep(t *testing.T, err error) {
	t.Helper()
	require.ErrorIs(t, err, driver.ErrorUnknown)
	require.ErrorIs(t, err, driver.ErrorOutOfMemory)
	asleep := 0
	for _, tag := range m.set.Tags() {
		if m.set.Asleep(tag) {
			asleep++
		}
	}
	require.Positive(t, asleep, "some buffer keeps a chunk released: %v", err)
	require.ErrorIs(t, m.set.Close(), vmm.ErrInUse, "a set with a sleeping buffer does not close")
}

// TestSleepUndoFails: a release fails, and recreating the chunks already released fails too. The
// buffers with memory still released stay asleep with their content, and Wake restores them all.
func TestSleepUndoFails(t *testing.T) {
	for k := 2; k <= matrixChunks; k++ {
		t.Run(fmt.Sprintf("release#%d", k), func(t *testing.T) {
			testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
				m := newMatrixFixture(t, b)
				b.Sim.FailNth("cuMemRelease", k, driver.ErrorUnknown)
				b.Sim.FailNth("cuMemCreate", 1, driver.ErrorOutOfMemory)
				err := m.set.Sleep(bg)
				b.Sim.ClearFaults()
				m.requireHalfAsleep(t, err)
				require.ErrorContains(t, err, "stay asleep")
				require.NoError(t, m.set.Wake(bg))
				m.requireAwakeIntact(t, true)
				require.NoError(t, m.set.Sleep(bg), "the set sleeps again")
				require.NoError(t, m.set.Wake(bg))
				m.requireAwakeIntact(t, true)
			}, testutil.SimOnly())
		})
	}
}

// TestWakeUndoFails: recreating a chunk fails, and releasing the chunks already recreated fails
// too, so those stay mapped. The set stays asleep with its backups, and the next Wake recreates
// only what is missing and restores every buffer's content.
func TestWakeUndoFails(t *testing.T) {
	for k := 2; k <= matrixChunks; k++ {
		t.Run(fmt.Sprintf("create#%d", k), func(t *testing.T) {
			testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
				m := newMatrixFixture(t, b)
				require.NoError(t, m.set.Sleep(bg))
				b.Sim.FailNth("cuMemCreate", k, driver.ErrorOutOfMemory)
				b.Sim.FailNth("cuMemRelease", 1, driver.ErrorUnknown)
				err := m.set.Wake(bg)
				b.Sim.ClearFaults()
				m.requireHalfAsleep(t, err)
				require.NoError(t, m.set.Wake(bg), "the wake can be retried")
				m.requireAwakeIntact(t, true)
			}, testutil.SimOnly())
		})
	}
}

// A buffer closed while a failed undo left it half asleep is dropped from the set with its backup,
// whichever of its chunks were still mapped: the set then closes, and nothing leaks.
func TestCloseHalfAsleepBuffer(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		m := newMatrixFixture(t, b)
		require.NoError(t, m.set.Sleep(bg))
		b.Sim.FailNth("cuMemCreate", 2, driver.ErrorOutOfMemory) // keep's second chunk
		b.Sim.FailNth("cuMemRelease", 1, driver.ErrorUnknown)    // keep's first stays mapped
		err := m.set.Wake(bg)
		b.Sim.ClearFaults()
		m.requireHalfAsleep(t, err)
		require.True(t, m.set.Asleep("keep"))
		require.NoError(t, m.keep.Close())
		require.NotContains(t, m.set.Tags(), "keep", "the closed buffer is dropped")
		require.NoError(t, m.set.Wake(bg))
		for _, tag := range m.set.Tags() {
			require.False(t, m.set.Asleep(tag), tag)
		}
	}, testutil.SimOnly())
}

// A wake whose chunk gets no access and cannot be unmapped either leaves that chunk mapped: the
// wake releases it with the others, the set stays asleep, and a retry restores everything.
func TestWakeWhenARecreateUndoFails(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		m := newMatrixFixture(t, b)
		require.NoError(t, m.set.Sleep(bg))
		b.Sim.FailNth("cuMemSetAccess", 1, driver.ErrorUnknown)
		b.Sim.FailNth("cuMemUnmap", 1, driver.ErrorUnknown)
		err := m.set.Wake(bg)
		b.Sim.ClearFaults()
		require.ErrorIs(t, err, driver.ErrorUnknown)
		m.requireAsleep(t)
		require.NoError(t, m.set.Wake(bg))
		m.requireAwakeIntact(t, true)
	}, testutil.SimOnly())
}

// A sleep whose chunk can neither be released nor mapped again keeps that chunk's memory: the
// sleep maps it again with the chunks it released, every buffer is awake and intact, and a later
// sleep and wake work.
func TestSleepWhenAReleaseUndoFails(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		m := newMatrixFixture(t, b)
		b.Sim.FailNth("cuMemRelease", 2, driver.ErrorUnknown)
		b.Sim.FailNth("cuMemMap", 1, driver.ErrorUnknown)
		err := m.set.Sleep(bg)
		b.Sim.ClearFaults()
		require.ErrorIs(t, err, driver.ErrorUnknown)
		m.requireAwakeIntact(t, false)
		require.NoError(t, m.set.Sleep(bg))
		require.NoError(t, m.set.Wake(bg))
		m.requireAwakeIntact(t, true)
	}, testutil.SimOnly())
}
