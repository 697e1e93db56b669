package ipc_test

import (
	"bytes"
	"errors"
	"io"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/ipc"
)

// FuzzReadMessage feeds arbitrary bytes to the message decoder through a real socket: it must
// return a message or an error, never panic or hang, and a decoded message must be what WriteMessage
// would have sent for it.
func FuzzReadMessage(f *testing.F) {
	f.Add(append(ipc.EncodeHeader(ipc.KindUser, 5, 0), "hello"...))
	f.Add(ipc.EncodeHeader(ipc.KindFetch, 0, 0))
	f.Add(ipc.EncodeHeader(ipc.KindBuffer, ipc.MaxPayload+1, 0))
	f.Add(ipc.EncodeHeader(ipc.KindUser, 0, 3))
	f.Add([]byte("CVMI"))
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) > 64<<10 {
			t.Skip("larger inputs only fill the socket buffer")
		}
		a, b := socketPair(t)
		go func() {
			_, _ = a.Write(data)
			a.Close()
		}()
		require.NoError(t, b.SetReadDeadline(time.Now().Add(10*time.Second)))
		kind, payload, files, err := ipc.ReadMessage(b)
		if err != nil {
			require.Nil(t, files)
			require.True(t, errors.Is(err, ipc.ErrProtocol) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF), "unexpected error class: %v", err)
			return
		}
		require.Empty(t, files, "no descriptors were sent")
		require.NotZero(t, kind)
		require.LessOrEqual(t, len(payload), ipc.MaxPayload)
		want := append(ipc.EncodeHeader(kind, uint32(len(payload)), 0), payload...)
		require.True(t, bytes.HasPrefix(data, want), "the decoded message does not re-encode to the input")
	})
}

// FuzzDescriptor feeds arbitrary bytes to the descriptor decoder: it must accept only what the
// encoder produces (decode then encode gives the same bytes) and reject the rest with ErrProtocol.
func FuzzDescriptor(f *testing.F) {
	d := sampleDescriptor()
	good, err := d.MarshalBinary()
	require.NoError(f, err)
	f.Add(good)
	f.Add(good[:24])
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, data []byte) {
		var d ipc.Descriptor
		if err := d.UnmarshalBinary(data); err != nil {
			require.ErrorIs(t, err, ipc.ErrProtocol)
			return
		}
		require.NoError(t, d.Validate())
		again, err := d.MarshalBinary()
		require.NoError(t, err)
		require.Equal(t, data, again)
	})
}
