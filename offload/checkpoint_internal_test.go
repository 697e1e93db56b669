package offload

import (
	"bytes"
	"context"
	"io"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/growbuf"
	"github.com/cuvmm/cuvmm/internal/testutil"
)

// A checkpoint whose header (checksum and all) names a policy this release does not know is
// refused by Load as a bad checkpoint that names the buffer, with nothing left allocated.
func TestLoadRefusesUnknownPolicy(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		const mib = 1 << 20
		d := b.Device(t, 0)
		var saved bytes.Buffer
		func() {
			buf, err := growbuf.New(d, growbuf.Options{MaxSize: 8 * mib, Chunk: growbuf.FixedChunks(2 * mib)})
			require.NoError(t, err)
			defer func() { require.NoError(t, buf.Close()) }()
			require.NoError(t, buf.Grow(4*mib))
			set := NewSet(b.Sys, Options{SlotSize: 2 * mib})
			defer func() { require.NoError(t, set.Close()) }()
			require.NoError(t, set.Add("weights", buf, Keep, EntryOptions{}))
			require.NoError(t, set.Save(context.Background(), &saved))
		}()
		r := bytes.NewReader(saved.Bytes())
		hdr, err := readHeader(r)
		require.NoError(t, err)
		rest := saved.Bytes()[saved.Len()-r.Len():]
		hdr.Entries[0].Policy = "archive"
		var forged bytes.Buffer
		require.NoError(t, writeHeader(&forged, hdr))
		forged.Write(rest)
		set, bufs, err := Load(context.Background(), b.Sys, &forged, Options{SlotSize: 2 * mib})
		require.ErrorIs(t, err, ErrBadCheckpoint)
		require.ErrorContains(t, err, `checkpoint entry "weights"`)
		require.ErrorContains(t, err, "archive")
		require.Nil(t, set)
		require.Nil(t, bufs)
	})
}

// A checkpoint cut short after a header length of 64 MiB is refused as truncated without making
// A header that claims a large length but is cut short costs the bytes that came, not the length
// claimed: the reader is never handed room for more than a few kilobytes.
func TestReadHeaderClaimedLengthAllocatesNothing(t *testing.T) {
	claim := []byte("CUVMMCKP\x01\x00\x00\x00\x00\x00\x00\x04{}")
	r := &widestRead{r: bytes.NewReader(claim)}
	_, err := readHeader(r)
	require.ErrorIs(t, err, ErrBadCheckpoint)
	require.ErrorContains(t, err, "truncated")
	require.Less(t, r.widest, 1<<20, "room offered for a header of 2 bytes that claims 64 MiB")
}

// widestRead records the largest buffer its reader was asked to fill.
type widestRead struct {
	r      io.Reader
	widest int
}

func (w *widestRead) Read(p []byte) (int, error) {
	w.widest = max(w.widest, len(p))
	return w.r.Read(p)
}
