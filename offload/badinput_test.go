package offload_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/offload"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/vmm"
)

func TestAddBadInput(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		buf := newBuf(t, d, 4*mib, 2*mib, 1, nil)
		set := newSet(t, b, offload.Options{})
		for _, c := range []struct {
			name   string
			tag    string
			buf    vmm.Chunked
			policy offload.Policy
			opts   offload.EntryOptions
		}{
			{"empty tag", "", buf, offload.Keep, offload.EntryOptions{}},
			{"nil buffer", "x", nil, offload.Keep, offload.EntryOptions{}},
			{"nil reservation", "x", offload.Mappings(nil), offload.Keep, offload.EntryOptions{}},
			{"unknown policy", "x", buf, offload.Policy(7), offload.EntryOptions{}},
			{"file policy without a file", "x", buf, offload.File, offload.EntryOptions{}},
			{"negative file offset", "x", buf, offload.Keep, offload.EntryOptions{FileOffset: -1}},
		} {
			err := set.Add(c.tag, c.buf, c.policy, c.opts)
			require.ErrorIs(t, err, offload.ErrInvalidValue, c.name)
		}
		empty, err := growbuf.New(d, growbuf.Options{MaxSize: 4 * mib})
		require.NoError(t, err)
		defer func() { require.NoError(t, empty.Close()) }()
		require.ErrorIs(t, set.Add("empty", empty, offload.Keep, offload.EntryOptions{}), offload.ErrInvalidValue)

		require.NoError(t, set.Add("w", buf, offload.Keep, offload.EntryOptions{}))
		err = set.Add("w", buf, offload.Keep, offload.EntryOptions{})
		require.ErrorIs(t, err, offload.ErrInvalidValue)
		require.ErrorContains(t, err, "taken")
		err = set.Add("again", buf, offload.Keep, offload.EntryOptions{})
		require.ErrorIs(t, err, offload.ErrInvalidValue)
		require.ErrorContains(t, err, "shares memory")
		require.ErrorIs(t, set.Sleep(bg, "nope"), offload.ErrInvalidValue)
		require.ErrorIs(t, set.Wake(bg, "nope"), offload.ErrInvalidValue)
		require.ErrorIs(t, set.Remove("nope"), offload.ErrInvalidValue)
		require.NoError(t, set.Wake(bg), "Wake of an awake set is a no-op")
		require.NoError(t, set.Sleep(bg, "w"))
		require.ErrorIs(t, set.Remove("w"), offload.ErrAsleep)
		require.NoError(t, set.Wake(bg, "w", "w"))
		require.NoError(t, set.Sleep(bg, "w"))
		require.ErrorIs(t, set.Close(), vmm.ErrInUse, "a sleeping buffer keeps the set open")
		require.NoError(t, set.Wake(bg))
		require.NoError(t, set.Remove("w"))
		require.Empty(t, set.Tags())
		_, err = offload.ParsePolicy("maybe")
		require.ErrorIs(t, err, offload.ErrInvalidValue)

		// Use after Close.
		require.NoError(t, set.Close())
		require.ErrorIs(t, set.Add("w", buf, offload.Keep, offload.EntryOptions{}), offload.ErrClosed)
		require.ErrorIs(t, set.Sleep(bg), offload.ErrClosed)
		var nilSet *offload.Set
		require.NoError(t, nilSet.Close())
		require.ErrorIs(t, nilSet.Sleep(bg), offload.ErrInvalidValue)
		require.ErrorIs(t, nilSet.Wake(bg), offload.ErrInvalidValue)
		require.ErrorIs(t, nilSet.Save(bg, io.Discard), offload.ErrInvalidValue)
		require.ErrorIs(t, nilSet.Restore(bg, strings.NewReader("")), offload.ErrInvalidValue)
		require.ErrorIs(t, nilSet.Remove("w"), offload.ErrInvalidValue)
		require.Empty(t, nilSet.Tags())
		require.False(t, nilSet.Asleep("w"))
		require.Zero(t, nilSet.BackupBytes())
		require.NoError(t, nilSet.TrimPool())
		require.ErrorIs(t, nilSet.Prepare(bg), offload.ErrInvalidValue)
	})
}

// TestCloseTwice: a second Close is a no-op, and every method that uses the set then fails with
// ErrClosed, while the buffer it held stays the caller's and usable.
func TestCloseTwice(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		buf := newBuf(t, d, 4*mib, 2*mib, 1, nil)
		set := offload.NewSet(b.Sys, offload.Options{SlotSize: 4 * mib})
		require.NoError(t, set.Add("w", buf, offload.Keep, offload.EntryOptions{}))
		require.NoError(t, set.Close())
		require.NoError(t, set.Close(), "a second Close is a no-op")
		bg := context.Background()
		require.ErrorIs(t, set.Add("v", buf, offload.Keep, offload.EntryOptions{}), offload.ErrClosed)
		require.ErrorIs(t, set.Sleep(bg), offload.ErrClosed)
		require.ErrorIs(t, set.Wake(bg), offload.ErrClosed)
		require.ErrorIs(t, set.Prepare(bg), offload.ErrClosed)
		require.ErrorIs(t, set.Save(bg, io.Discard), offload.ErrClosed)
		require.ErrorIs(t, set.Restore(bg, bytes.NewReader(nil)), offload.ErrClosed)
		requirePattern(t, d, buf.Ptr(), 4*mib, 1)
	})
}

// TestAnotherSystem: a buffer of another System is refused.
func TestAnotherSystem(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		other := sim.New()
		sys, err := vmm.Open(other)
		require.NoError(t, err)
		defer func() { require.NoError(t, sys.Close()); require.NoError(t, other.Close()) }()
		od, err := sys.Device(0)
		require.NoError(t, err)
		buf, err := growbuf.New(od, growbuf.Options{MaxSize: 4 * mib})
		require.NoError(t, err)
		defer func() { require.NoError(t, buf.Close()) }()
		require.NoError(t, buf.Grow(2*mib))
		set := newSet(t, b, offload.Options{})
		err = set.Add("x", buf, offload.Keep, offload.EntryOptions{})
		require.ErrorIs(t, err, offload.ErrInvalidValue)
		require.ErrorContains(t, err, "another System")
	}, testutil.SimOnly())
}

// TestExportedNeedsForce: memory shared with other processes is not slept unless forced.
func TestExportedNeedsForce(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		buf := newBuf(t, d, 4*mib, 2*mib, 7, &growbuf.Options{HandleTypes: driver.HandleTypePosixFD})
		exp, err := ipc.Export(buf)
		require.NoError(t, err)
		require.NoError(t, exp.Close())
		set := newSet(t, b, offload.Options{})
		require.NoError(t, set.Add("shared", buf, offload.Keep, offload.EntryOptions{}))
		before := free(t, d)
		err = set.Sleep(bg)
		require.ErrorIs(t, err, offload.ErrExported)
		require.ErrorContains(t, err, "Force")
		require.False(t, set.Asleep("shared"))
		requireFreeAbout(t, b, before, free(t, d), "nothing released")
		requirePattern(t, d, buf.Ptr(), 4*mib, 7)

		require.NoError(t, set.Remove("shared"))
		require.NoError(t, set.Add("shared", buf, offload.Keep, offload.EntryOptions{Force: true}))
		require.NoError(t, set.Sleep(bg))
		require.NoError(t, set.Wake(bg))
		requirePattern(t, d, buf.Ptr(), 4*mib, 7)
	})
}

// A buffer exported and forced to sleep leaves its importers the memory they mapped: it is not
// freed while they hold it, they still read the content of the sleep, and after the wake the
// buffer has new memory that their writes no longer reach (EntryOptions.Force's doc).
func TestForcedSleepDetachesImporters(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		buf := newBuf(t, d, 4*mib, 2*mib, 7, &growbuf.Options{HandleTypes: driver.HandleTypePosixFD})
		imp := importOf(t, d, buf)
		defer func() { require.NoError(t, imp.Close()) }()
		set := newSet(t, b, offload.Options{})
		require.NoError(t, set.Add("shared", buf, offload.Keep, offload.EntryOptions{Force: true}))
		before := free(t, d)
		require.NoError(t, set.Sleep(bg))
		require.Less(t, free(t, d), before+2*mib, "nothing freed: the importer holds the memory")
		requirePattern(t, d, imp.Ptr(), 4*mib, 7)
		require.NoError(t, set.Wake(bg))
		requirePattern(t, d, buf.Ptr(), 4*mib, 7)
		require.NoError(t, d.Fill(imp.Ptr(), 4*mib, 0, 9))
		requirePattern(t, d, buf.Ptr(), 4*mib, 7)
	})
}

// importOf exports buf and opens it again, as another process would.
func importOf(t *testing.T, d *vmm.Device, buf vmm.Chunked) *ipc.Buffer {
	t.Helper()
	e, err := ipc.Export(buf)
	require.NoError(t, err)
	a, c := testutil.SocketPair(t)
	require.NoError(t, ipc.Send(a, e))
	require.NoError(t, e.Close())
	r, err := ipc.Receive(c)
	require.NoError(t, err)
	imp, err := ipc.Open(d, r, vmm.ReadWrite(d))
	require.NoError(t, errors.Join(err, r.Close()))
	return imp
}

// TestCloseWhileAsleep: closing a sleeping buffer frees its backup and its reservation; the set
// forgets it.
func TestCloseWhileAsleep(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		buf, err := growbuf.New(d, growbuf.Options{MaxSize: 16 * mib, Chunk: growbuf.FixedChunks(2 * mib)})
		require.NoError(t, err)
		require.NoError(t, buf.Grow(6*mib))
		keep := newBuf(t, d, 2*mib, 2*mib, 3, nil)
		set := newSet(t, b, offload.Options{SlotSize: 2 * mib})
		require.NoError(t, set.Add("gone", buf, offload.Keep, offload.EntryOptions{}))
		require.NoError(t, set.Add("kept", keep, offload.Keep, offload.EntryOptions{}))
		require.NoError(t, set.Sleep(bg))
		require.Equal(t, uint64(8*mib), set.BackupBytes())
		require.NoError(t, buf.Close())
		require.Equal(t, uint64(2*mib), set.BackupBytes(), "the closed buffer's backup is freed")
		require.Equal(t, []string{"kept"}, set.Tags())
		st := set.Stats()
		require.Equal(t, set.BackupBytes(), st.BackupBytes, "Stats at once, as BackupBytes")
		require.Len(t, st.Buffers, 1)
		require.NoError(t, set.Wake(bg))
		requirePattern(t, d, keep.Ptr(), 2*mib, 3)
	})
}

// TestCancel: a context cancelled before or during the copies leaves everything awake and intact,
// in either direction.
func TestCancel(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		buf := newBuf(t, d, 8*mib, 2*mib, 5, nil)
		ctx, cancel := context.WithCancel(bg)
		set := newSet(t, b, offload.Options{SlotSize: 2 * mib, Progress: func(done, total uint64) { cancel() }})
		require.NoError(t, set.Add("w", buf, offload.Keep, offload.EntryOptions{}))
		before := free(t, d)
		err := set.Sleep(ctx)
		require.ErrorIs(t, err, context.Canceled)
		require.False(t, set.Asleep("w"))
		requireFreeAbout(t, b, before-pinned.PageTableCost(set.BackupBytes()), free(t, d), "nothing released; the pooled slots cost their page tables")
		requirePattern(t, d, buf.Ptr(), 8*mib, 5)

		done, stop := context.WithCancel(bg)
		stop()
		require.ErrorIs(t, set.Sleep(done), context.Canceled)
		require.False(t, set.Asleep("w"))

		require.NoError(t, set.Sleep(bg))
		ctx, cancel = context.WithCancel(bg)
		err = set.Wake(ctx)
		require.ErrorIs(t, err, context.Canceled, "the progress callback cancels mid-wake")
		require.True(t, set.Asleep("w"), "still asleep, backup intact")
		require.GreaterOrEqual(t, free(t, d)+pinned.PageTableCost(set.BackupBytes())+4*mib, before+8*mib, "still released")
		cancel()
		require.NoError(t, set.Wake(bg))
		requirePattern(t, d, buf.Ptr(), 8*mib, 5)
	})
}

// TestWakeOutOfMemory: another user takes the memory while the set sleeps; Wake fails with
// ErrOutOfMemory, stays asleep, and succeeds once the memory is back.
func TestWakeOutOfMemory(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		buf := newBuf(t, d, 8*mib, 2*mib, 9, nil)
		set := newSet(t, b, offload.Options{SlotSize: 2 * mib})
		require.NoError(t, set.Add("w", buf, offload.Keep, offload.EntryOptions{}))
		require.NoError(t, set.Sleep(bg))
		// Someone else takes all but 4 MiB.
		f := free(t, d)
		hog, err := d.Allocate(f-4*mib, vmm.AllocOptions{})
		require.NoError(t, err)
		defer func() { require.NoError(t, hog.Close()) }()
		err = set.Wake(bg)
		require.ErrorIs(t, err, driver.ErrOutOfMemory)
		require.True(t, set.Asleep("w"))
		require.Equal(t, uint64(4*mib), free(t, d)+pinned.PageTableCost(set.BackupBytes()), "the chunks a failed wake made are released again")
		require.NoError(t, hog.Close())
		require.NoError(t, set.Wake(bg))
		requirePattern(t, d, buf.Ptr(), 8*mib, 9)
	}, testutil.SimOnly(), testutil.SimOptions(sim.MemoryPerDevice(64*mib)))
}

// TestOutOfHostMemory: pinning the backup fails; the sleep fails and nothing changes.
func TestOutOfHostMemory(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		buf := newBuf(t, d, 8*mib, 2*mib, 2, nil)
		set := newSet(t, b, offload.Options{SlotSize: 2 * mib})
		require.NoError(t, set.Add("w", buf, offload.Keep, offload.EntryOptions{}))
		b.Sim.FailNth("cuMemHostRegister", 3, driver.ErrorOutOfMemory)
		err := set.Sleep(bg)
		require.ErrorIs(t, err, driver.ErrOutOfMemory)
		require.ErrorContains(t, err, "host memory")
		require.False(t, set.Asleep("w"))
		requirePattern(t, d, buf.Ptr(), 8*mib, 2)
		require.NoError(t, set.Sleep(bg))
		require.NoError(t, set.Wake(bg))
		requirePattern(t, d, buf.Ptr(), 8*mib, 2)
	}, testutil.SimOnly())
}
