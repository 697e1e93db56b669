package unixsock

import (
	"errors"
	"io"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/internal/fuzzfd"
)

func frameBytes(kind uint16, payload []byte, nfds uint16) []byte {
	b := make([]byte, HeaderSize, HeaderSize+len(payload))
	Header{Kind: kind, Length: uint32(len(payload)), NFDs: nfds}.Put(b)
	return append(b, payload...)
}

// FuzzFrameDescriptors sends random bytes with random descriptors of every kind over a socket pair:
// the reader returns frames or an error of a known class, never panics or hangs, and every
// descriptor that arrived is either handed over in a frame or closed.
func FuzzFrameDescriptors(f *testing.F) {
	f.Add(frameBytes(5, []byte("hello"), 2), []byte{0, 3}, uint16(3))
	f.Add(frameBytes(5, nil, 1), []byte{6}, uint16(0))
	f.Add(append(frameBytes(5, nil, 1), frameBytes(6, []byte("x"), 0)...), []byte{4, 5}, uint16(20))
	f.Add([]byte("CVMI"), []byte{1, 2}, uint16(2))
	f.Add([]byte{}, []byte{0, 1, 2, 3, 4, 5, 6}, uint16(0))
	f.Fuzz(func(t *testing.T, data, kinds []byte, cut uint16) {
		if len(data) > 64<<10 {
			t.Skip("larger inputs only fill the socket buffer")
		}
		fuzzfd.Settle() // files dropped earlier are closed now, not between the two counts
		before := fuzzfd.OpenFDs(t)
		files := fuzzfd.Make(t, kinds, 8)
		a, b := socketPair(t)
		sent := make(chan error, 1)
		go func() { sent <- fuzzfd.Send(a, data, files, cut) }()
		c := NewConn(b, unix.Ucred{})
		require.NoError(t, b.SetReadDeadline(time.Now().Add(10*time.Second)))
		var got []*os.File
		for {
			fr, err := c.Read()
			if err != nil {
				require.Nil(t, fr.Files)
				require.True(t, errors.Is(err, ErrProtocol) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF),
					"unexpected error class: %v", err)
				break
			}
			got = append(got, fr.Files...)
		}
		require.NoError(t, <-sent)
		require.NoError(t, CloseFiles(got))
		a.Close()
		b.Close()
		for _, f := range files {
			f.Close()
		}
		require.Equal(t, before, fuzzfd.OpenFDs(t), "descriptors leaked")
	})
}

// FuzzFrameRoundTrip: any frame Write accepts, Read returns unchanged, with as many descriptors.
func FuzzFrameRoundTrip(f *testing.F) {
	f.Add(uint16(1), []byte("payload"), []byte{0, 3, 6})
	f.Add(uint16(0xffff), []byte{}, []byte{})
	f.Fuzz(func(t *testing.T, kind uint16, payload, kinds []byte) {
		files := fuzzfd.Make(t, kinds, 16)
		a, b := socketPair(t)
		w, r := NewConn(a, unix.Ucred{}), NewConn(b, unix.Ucred{})
		done := make(chan error, 1)
		go func() { done <- w.Write(kind, payload, files) }()
		if kind == 0 {
			require.ErrorIs(t, <-done, ErrProtocol)
			return
		}
		fr, err := r.Read()
		require.NoError(t, <-done)
		require.NoError(t, err)
		require.Equal(t, kind, fr.Kind)
		require.Equal(t, len(payload), len(fr.Payload))
		require.Len(t, fr.Files, len(files))
		require.NoError(t, CloseFiles(fr.Files))
	})
}
