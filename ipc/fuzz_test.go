package ipc_test

import (
	"bytes"
	"errors"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"io"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/internal/fuzzfd"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/vmm"
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
		a, b := testutil.SocketPair(t)
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
		if data[4] == 1 {
			// Version 1 is read and written as version 2, with the length in use equal to the size.
			require.Equal(t, d.Size, d.Len)
			var d2 ipc.Descriptor
			require.NoError(t, d2.UnmarshalBinary(again))
			require.Equal(t, d, d2)
			return
		}
		require.Equal(t, data, again)
	})
}

// FuzzReceiveOpen sends random frames with random descriptors of every kind (sealed and unsealed
// memfds named like the simulator's allocations, pipes, sockets, /dev/null, a directory) to Receive
// and, when a buffer arrives, to Open on a simulator: every path ends in a buffer or an error,
// nothing stays mapped, and every descriptor is closed.
func FuzzReceiveOpen(f *testing.F) {
	d := ipc.Descriptor{Size: 2 * mib, Chunks: []ipc.ChunkDesc{{Size: 2 * mib, Location: driver.DeviceLocation(0), HandleType: driver.HandleTypePosixFD}}}
	payload, err := d.MarshalBinary()
	require.NoError(f, err)
	buffer := append(ipc.EncodeHeader(ipc.KindBuffer, uint32(len(payload)), 1), payload...)
	for k := byte(0); k < fuzzfd.Kinds; k++ {
		f.Add(buffer, []byte{k}, uint16(0))
	}
	f.Add(buffer, []byte{0, 1}, uint16(5))
	f.Add(append(ipc.EncodeHeader(ipc.KindError, 2, 1), 1, 0), []byte{3}, uint16(0))
	s := sim.New(sim.Devices(1))
	sys, err := vmm.Open(s)
	require.NoError(f, err)
	dev, err := sys.Device(0)
	require.NoError(f, err)
	f.Cleanup(func() {
		require.NoError(f, sys.Close())
		require.True(f, s.Live().Zero(), "simulator objects leaked: %s", s.Live())
		require.NoError(f, s.Close())
	})
	f.Fuzz(func(t *testing.T, data, kinds []byte, cut uint16) {
		if len(data) > 64<<10 {
			t.Skip("larger inputs only fill the socket buffer")
		}
		fuzzfd.Settle() // files dropped earlier are closed now, not between the two counts
		before := fuzzfd.OpenFDs(t)
		live := s.Live()
		files := fuzzfd.Make(t, kinds, 8)
		a, b := testutil.SocketPair(t)
		sent := make(chan error, 1)
		go func() { sent <- fuzzfd.Send(a, data, files, cut) }()
		require.NoError(t, b.SetReadDeadline(time.Now().Add(10*time.Second)))
		r, err := ipc.Receive(b)
		if err == nil {
			buf, oerr := ipc.Open(dev, r)
			if oerr == nil {
				require.NoError(t, buf.Close())
			}
			require.NoError(t, r.Close())
		}
		require.NoError(t, <-sent)
		a.Close()
		b.Close()
		for _, f := range files {
			f.Close()
		}
		require.Equal(t, live, s.Live(), "simulator objects left")
		require.Equal(t, before, fuzzfd.OpenFDs(t), "descriptors leaked")
	})
}
