package offload_test

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/offload"
)

func TestCheckpointRoundTrip(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		w := newBuf(t, d, 6*mib, 2*mib, 41, nil)
		kv := newBuf(t, d, 4*mib, 4*mib, 42, nil)
		set := newSet(t, b, offload.Options{SlotSize: 4 * mib})
		require.NoError(t, set.Add("weights", w, offload.Keep, offload.EntryOptions{}))
		require.NoError(t, set.Add("kv", kv, offload.Discard, offload.EntryOptions{}))
		var ck bytes.Buffer
		require.NoError(t, set.Save(bg, &ck))
		require.Greater(t, ck.Len(), 10*mib)
		saved := ck.Bytes()

		require.NoError(t, d.Fill(w.Ptr(), 6*mib, 0, 1))
		require.NoError(t, d.Fill(kv.Ptr(), 4*mib, 0, 2))
		require.NoError(t, set.Restore(bg, bytes.NewReader(saved)))
		requirePattern(t, d, w.Ptr(), 6*mib, 41)
		requirePattern(t, d, kv.Ptr(), 4*mib, 42)

		// Bad checkpoints change nothing and name the problem.
		require.NoError(t, d.Fill(w.Ptr(), 6*mib, 0, 1))
		corrupt := bytes.Clone(saved)
		corrupt[len(corrupt)-4*mib-4-100] ^= 1 // in weights' last chunk (chunk 2)
		err := set.Restore(bg, bytes.NewReader(corrupt))
		require.ErrorIs(t, err, offload.ErrBadCheckpoint)
		require.ErrorContains(t, err, `"weights" chunk 2`)
		require.ErrorContains(t, err, "corrupted")
		requirePattern(t, d, w.Ptr(), 6*mib, 1)

		err = set.Restore(bg, bytes.NewReader(saved[:len(saved)-mib]))
		require.ErrorIs(t, err, offload.ErrBadCheckpoint)
		require.ErrorContains(t, err, `truncated in "kv" chunk 0`)
		err = set.Restore(bg, bytes.NewReader([]byte("PK\x03\x04 certainly not a checkpoint")))
		require.ErrorIs(t, err, offload.ErrBadCheckpoint)
		require.ErrorContains(t, err, "not a cuvmm offload checkpoint")
		hdr := bytes.Clone(saved)
		hdr[20] ^= 0x20
		require.ErrorIs(t, set.Restore(bg, bytes.NewReader(hdr)), offload.ErrBadCheckpoint)
		requirePattern(t, d, w.Ptr(), 6*mib, 1)

		// A set with another layout refuses it.
		other := newSet(t, b, offload.Options{})
		require.NoError(t, other.Add("weights", kv, offload.Keep, offload.EntryOptions{}))
		err = other.Restore(bg, bytes.NewReader(saved))
		require.ErrorIs(t, err, offload.ErrBadCheckpoint)

		// A sleeping Keep buffer is saved from its backup; a sleeping Discard one has nothing to save,
		// and Restore needs the buffers awake.
		require.NoError(t, set.Restore(bg, bytes.NewReader(saved)))
		require.NoError(t, set.Sleep(bg, "weights"))
		var fromBackup bytes.Buffer
		require.NoError(t, set.Save(bg, &fromBackup))
		require.Equal(t, saved, fromBackup.Bytes(), "the same checkpoint, awake or asleep")
		require.True(t, set.Asleep("weights"), "saving does not wake")
		require.NoError(t, set.Sleep(bg, "kv"))
		require.ErrorIs(t, set.Save(bg, &bytes.Buffer{}), offload.ErrAsleep)
		require.ErrorIs(t, set.Restore(bg, bytes.NewReader(saved)), offload.ErrAsleep)
		require.NoError(t, set.Wake(bg))
		requirePattern(t, d, w.Ptr(), 6*mib, 41)
	})
}

// TestLoad recreates a checkpoint's buffers as a new process would, at the saved addresses once
// the old buffers are gone, and releases everything when the checkpoint is bad.
func TestLoad(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		var saved []byte
		var ptr uint64
		func() {
			set := offload.NewSet(b.Sys, offload.Options{SlotSize: 2 * mib})
			defer func() { require.NoError(t, set.Close()) }()
			w, err := newOwnedBuf(d, 6*mib, 2*mib, 51)
			require.NoError(t, err)
			defer func() { require.NoError(t, w.Close()) }()
			ptr = uint64(w.Ptr())
			require.NoError(t, set.Add("weights", w, offload.Keep, offload.EntryOptions{}))
			var ck bytes.Buffer
			require.NoError(t, set.Save(bg, &ck))
			saved = ck.Bytes()
		}()
		before := free(t, d)

		bad := bytes.Clone(saved)
		bad[len(bad)-5] ^= 0xff
		_, _, err := offload.Load(bg, b.Sys, bytes.NewReader(bad), offload.Options{SlotSize: 2 * mib})
		require.ErrorIs(t, err, offload.ErrBadCheckpoint)
		require.ErrorContains(t, err, `"weights" chunk 2`)
		requireFreeAbout(t, b, before, free(t, d), "nothing left mapped")

		set, bufs, err := offload.Load(bg, b.Sys, bytes.NewReader(saved), offload.Options{SlotSize: 2 * mib})
		require.NoError(t, err)
		require.Len(t, bufs, 1)
		require.Equal(t, "weights", bufs[0].Tag())
		if !bufs[0].Moved() {
			require.Equal(t, ptr, uint64(bufs[0].Ptr()), "at the saved address")
		}
		requirePattern(t, d, bufs[0].Ptr(), 6*mib, 51)
		require.NoError(t, set.Sleep(bg))
		require.NoError(t, set.Wake(bg))
		requirePattern(t, d, bufs[0].Ptr(), 6*mib, 51)
		require.NoError(t, set.Close())
		require.NoError(t, bufs[0].Close())
		require.NoError(t, bufs[0].Close())
	})
}
