package offload_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"hash/crc32"
	"io"
	"maps"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver/sim"
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
		w, saved := savedBuf(t, b, d, "weights", 6*mib, 51)
		ptr := uint64(w.Ptr())
		require.NoError(t, w.Close())
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

// A checkpoint loaded while its saved address is taken, where the driver refuses the hinted
// range outright instead of placing it elsewhere (as it does on some machines), is loaded at a new
// address, reported by Moved.
func TestLoadWhereTheDriverRefusesTheSavedAddress(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		w, saved := savedBuf(t, b, d, "weights", 6*mib, 53)
		defer func() { require.NoError(t, w.Close()) }()

		loaded, bufs, err := offload.Load(bg, b.Sys, bytes.NewReader(saved), offload.Options{SlotSize: 2 * mib})
		require.NoError(t, err)
		require.Len(t, bufs, 1)
		require.True(t, bufs[0].Moved())
		require.NotEqual(t, w.Ptr(), bufs[0].Ptr())
		requirePattern(t, d, bufs[0].Ptr(), 6*mib, 53)
		require.NoError(t, loaded.Close())
		require.NoError(t, bufs[0].Close())
	}, testutil.SimOnly(), testutil.SimOptions(sim.RefuseUngrantedHints()))
}

// TestCheckpointProgress: Options.Progress is called during Save, Restore and Load too, and each
// ends at the bytes of the buffers.
func TestCheckpointProgress(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		var last, total uint64
		calls := 0
		opts := offload.Options{SlotSize: 2 * mib, Progress: func(done, all uint64) { calls, last, total = calls+1, done, all }}
		buf := newBuf(t, d, 6*mib, 2*mib, 61, nil)
		set := newSet(t, b, opts)
		require.NoError(t, set.Add("w", buf, offload.Keep, offload.EntryOptions{}))
		requireProgress := func(op string, fn func()) {
			t.Helper()
			calls, last, total = 0, 0, 0
			fn()
			require.Positive(t, calls, "%s reports progress", op)
			require.Equal(t, uint64(6*mib), total, op)
			require.Equal(t, uint64(6*mib), last, "%s ends at the bytes of the buffers", op)
		}
		var ck bytes.Buffer
		requireProgress("Save", func() { require.NoError(t, set.Save(bg, &ck)) })
		requireProgress("Restore", func() { require.NoError(t, set.Restore(bg, bytes.NewReader(ck.Bytes()))) })
		require.NoError(t, set.Remove("w"))
		require.NoError(t, buf.Close())
		requireProgress("Load", func() {
			set, bufs, err := offload.Load(bg, b.Sys, bytes.NewReader(ck.Bytes()), opts)
			require.NoError(t, err)
			require.NoError(t, set.Close())
			require.NoError(t, bufs[0].Close())
		})
	})
}

// rewriteHeader returns checkpoint ck with its header changed by edit (on the JSON, numbers kept
// exact) and its length and checksum recomputed, so that only the change is wrong.
func rewriteHeader(t *testing.T, ck []byte, edit func(h map[string]any)) []byte {
	t.Helper()
	n := binary.LittleEndian.Uint32(ck[12:16])
	dec := json.NewDecoder(bytes.NewReader(ck[16 : 16+n]))
	dec.UseNumber()
	var h map[string]any
	require.NoError(t, dec.Decode(&h))
	edit(h)
	js, err := json.Marshal(h)
	require.NoError(t, err)
	out := bytes.Clone(ck[:16])
	binary.LittleEndian.PutUint32(out[12:], uint32(len(js)))
	out = append(out, js...)
	out = binary.LittleEndian.AppendUint32(out, crc32.Checksum(js, crc32.MakeTable(crc32.Castagnoli)))
	return append(out, ck[16+n+4:]...)
}

// TestCheckpointLengthBeyondChunks: a checkpoint whose header says a buffer holds more bytes than
// its chunks (2^60 for 4 MiB) is refused by Load and Restore, naming the buffer, before anything
// is made or changed.
func TestCheckpointLengthBeyondChunks(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		buf, set, ck := savedW(t, b, d, 71)
		bad := rewriteHeader(t, ck, func(h map[string]any) {
			h["entries"].([]any)[0].(map[string]any)["len"] = json.Number("1152921504606846976")
		})
		before := free(t, d)
		_, bufs, err := offload.Load(bg, b.Sys, bytes.NewReader(bad), offload.Options{SlotSize: 2 * mib})
		require.ErrorIs(t, err, offload.ErrBadCheckpoint)
		require.ErrorContains(t, err, `"w"`)
		require.ErrorContains(t, err, "length 1152921504606846976")
		require.Nil(t, bufs)
		requireFreeAbout(t, b, before, free(t, d), "nothing made")

		require.NoError(t, d.Fill(buf.Ptr(), 4*mib, 0, 72))
		err = set.Restore(bg, bytes.NewReader(bad))
		require.ErrorIs(t, err, offload.ErrBadCheckpoint)
		require.ErrorContains(t, err, `"w"`)
		requirePattern(t, d, buf.Ptr(), 4*mib, 72)

		same := rewriteHeader(t, ck, func(map[string]any) {})
		require.NoError(t, set.Restore(bg, bytes.NewReader(same)), "a header rewritten unchanged is good")
		requirePattern(t, d, buf.Ptr(), 4*mib, 71)
	})
}

// TestCheckpointEmptyTag: a checkpoint whose header (checksum and all) gives a buffer an empty tag,
// which no set can hold, is a bad checkpoint for Load and Restore alike, refused before anything
// is made.
func TestCheckpointEmptyTag(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		_, set, ck := savedW(t, b, d, 73)
		bad := rewriteHeader(t, ck, func(h map[string]any) {
			h["entries"].([]any)[0].(map[string]any)["tag"] = ""
		})
		before := free(t, d)
		loaded, bufs, err := offload.Load(bg, b.Sys, bytes.NewReader(bad), offload.Options{SlotSize: 2 * mib})
		require.ErrorIs(t, err, offload.ErrBadCheckpoint)
		require.ErrorContains(t, err, "empty tag")
		require.Nil(t, loaded)
		require.Nil(t, bufs)
		requireFreeAbout(t, b, before, free(t, d), "nothing made")
		require.ErrorIs(t, set.Restore(bg, bytes.NewReader(bad)), offload.ErrBadCheckpoint)
	})
}

// TestSaveFromBackupCancel: a context cancelled while Save writes sleeping Keep buffers from their
// backups stops it, as it stops a Save of awake buffers, and the buffers stay asleep and intact.
func TestSaveFromBackupCancel(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		buf := newBuf(t, d, 8*mib, 2*mib, 74, nil)
		ctx, cancel := context.WithCancel(bg)
		defer cancel()
		saving := false
		set := newSet(t, b, offload.Options{SlotSize: 2 * mib, Progress: func(done, total uint64) {
			if saving && done < total {
				cancel()
			}
		}})
		require.NoError(t, set.Add("w", buf, offload.Keep, offload.EntryOptions{}))
		require.NoError(t, set.Sleep(bg))
		saving = true
		var ck bytes.Buffer
		require.ErrorIs(t, set.Save(ctx, &ck), context.Canceled)
		require.True(t, set.Asleep("w"))
		require.NoError(t, set.Wake(bg))
		requirePattern(t, d, buf.Ptr(), 8*mib, 74)
	})
}

// TestLoadTruncatedClaimsMoreThanTheDevice: a checkpoint whose header claims more chunks than the
// device could hold, followed by the bytes of two, is refused as truncated in its third chunk: Load
// maps a chunk only when its bytes come, so it neither maps the device full nor loops over the
// claimed chunks first.
func TestLoadTruncatedClaimsMoreThanTheDevice(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		buf, saved := savedBuf(t, b, d, "w", 4*mib, 75)
		require.NoError(t, buf.Close())
		_, total, err := d.MemInfo()
		require.NoError(t, err)
		bad := rewriteHeader(t, saved, func(h map[string]any) {
			e := h["entries"].([]any)[0].(map[string]any)
			chunks := e["chunks"].([]any)
			for off := uint64(4 * mib); off <= total; off += 2 * mib {
				c := maps.Clone(chunks[1].(map[string]any))
				c["offset"] = json.Number(strconv.FormatUint(off, 10))
				chunks = append(chunks, c)
			}
			e["chunks"] = chunks
		})
		before := free(t, d)
		loaded, bufs, err := offload.Load(bg, b.Sys, bytes.NewReader(bad), offload.Options{SlotSize: 2 * mib})
		require.ErrorIs(t, err, offload.ErrBadCheckpoint)
		require.ErrorContains(t, err, `truncated in "w" chunk 2`)
		require.Nil(t, loaded)
		require.Nil(t, bufs)
		requireFreeAbout(t, b, before, free(t, d), "nothing left mapped")
	}, testutil.SimOptions(sim.MemoryPerDevice(4<<30)))
}

// TestSaveStagesNoMoreThanItNeeds: Save of a small awake buffer pins a staging slot of its size, not
// of the set's slot size, and Save of a sleeping one pins none.
func TestSaveStagesNoMoreThanItNeeds(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		d := b.Device(t, 0)
		buf := newBuf(t, d, 4*mib, 4*mib, 43, nil)
		set := offload.NewSet(b.Sys, offload.Options{}) // 256 MiB slots
		t.Cleanup(func() { require.NoError(t, set.Close()) })
		require.NoError(t, set.Add("w", buf, offload.Keep, offload.EntryOptions{}))
		require.NoError(t, set.Save(bg, io.Discard))
		require.Equal(t, uint64(4*mib), set.Stats().PooledBytes, "a 4 MiB staging slot")
		require.NoError(t, set.TrimPool())
		require.NoError(t, set.Sleep(bg))
		backup := set.BackupBytes()
		var ck bytes.Buffer
		require.NoError(t, set.Save(bg, &ck))
		require.Equal(t, backup, set.BackupBytes(), "the backup is written as it is: nothing staged")
		require.NoError(t, set.Wake(bg))
		require.NoError(t, d.Fill(buf.Ptr(), 4*mib, 0, 1))
		require.NoError(t, set.Restore(bg, bytes.NewReader(ck.Bytes())))
		requirePattern(t, d, buf.Ptr(), 4*mib, 43)
	})
}
