package ipc_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/ipc"
)

func TestMessageRoundTrip(t *testing.T) {
	before := testutil.OpenFDs(t)
	a, b := testutil.SocketPair(t)
	pr, pw := pipe(t)

	require.NoError(t, ipc.WriteMessage(a, ipc.KindUser+7, []byte("hello"), []*os.File{pr, pw}))
	kind, payload, files, err := ipc.ReadMessage(b)
	require.NoError(t, err)
	require.Equal(t, ipc.KindUser+7, kind)
	require.Equal(t, []byte("hello"), payload)
	require.Len(t, files, 2)
	for _, f := range files {
		require.True(t, isCloexec(t, f), "received descriptors must be close-on-exec")
	}
	require.True(t, sameInode(t, pr, files[0]))
	require.True(t, sameInode(t, pw, files[1]))
	// The received write end writes into the original pipe.
	_, err = files[1].Write([]byte("x"))
	require.NoError(t, err)
	var one [1]byte
	_, err = io.ReadFull(pr, one[:])
	require.NoError(t, err)
	for _, f := range files {
		require.NoError(t, f.Close())
	}

	// No payload, no files; then a payload at the limit, which takes several reads.
	require.NoError(t, ipc.WriteMessage(a, ipc.KindUser, nil, nil))
	big := bytes.Repeat([]byte{0xab}, ipc.MaxPayload)
	done := make(chan error, 1)
	go func() { done <- ipc.WriteMessage(a, ipc.KindUser+1, big, []*os.File{pr}) }()
	kind, payload, files, err = ipc.ReadMessage(b)
	require.NoError(t, err)
	require.Equal(t, ipc.KindUser, kind)
	require.Empty(t, payload)
	require.Empty(t, files)
	kind, payload, files, err = ipc.ReadMessage(b)
	require.NoError(t, err)
	require.NoError(t, <-done)
	require.Equal(t, ipc.KindUser+1, kind)
	require.Equal(t, big, payload)
	require.Len(t, files, 1)
	require.NoError(t, files[0].Close())

	// The peer hangs up between messages: io.EOF.
	require.NoError(t, a.Close())
	_, _, _, err = ipc.ReadMessage(b)
	require.ErrorIs(t, err, io.EOF)
	require.NotErrorIs(t, err, io.ErrUnexpectedEOF)
	pr.Close()
	pw.Close()
	b.Close()
	require.Equal(t, before, testutil.OpenFDs(t), "file descriptors leaked")
}

func TestWriteMessageLimits(t *testing.T) {
	a, _ := testutil.SocketPair(t)
	err := ipc.WriteMessage(a, ipc.KindUser, make([]byte, ipc.MaxPayload+1), nil)
	require.ErrorIs(t, err, ipc.ErrTooLarge)
	require.ErrorIs(t, err, ipc.ErrProtocol)
	pr, _ := pipe(t)
	many := make([]*os.File, ipc.MaxFDsPerMessage+1)
	for i := range many {
		many[i] = pr
	}
	require.ErrorIs(t, ipc.WriteMessage(a, ipc.KindUser, nil, many), ipc.ErrTooLarge)
	require.ErrorIs(t, ipc.WriteMessage(a, 0, nil, nil), ipc.ErrProtocol)
	require.ErrorIs(t, ipc.WriteMessage(a, ipc.KindUser, nil, []*os.File{nil}), ipc.ErrProtocol)
}

// rawSend writes b with the descriptors fds attached (any bytes, valid message or not).
func rawSend(t *testing.T, c *net.UnixConn, b []byte, fds ...int) {
	t.Helper()
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	n, _, err := c.WriteMsgUnix(b, oob, nil)
	require.NoError(t, err)
	require.Equal(t, len(b), n)
}

func withPayload(h []byte, payload string) []byte { return append(h, payload...) }

// Every bad message gives a clear error and closes every descriptor that came with it.
func TestReadMessageBadInput(t *testing.T) {
	cases := []struct {
		name     string
		bytes    func() []byte
		fds      int  // pipe descriptors attached
		hangUp   bool // the writer closes after writing
		want     error
		contains string
	}{
		{"wrong magic", func() []byte {
			h := ipc.EncodeHeader(ipc.KindUser, 0, 1)
			copy(h, "XXXX")
			return h
		}, 1, false, ipc.ErrProtocol, "magic"},
		{"wrong version", func() []byte {
			h := ipc.EncodeHeader(ipc.KindUser, 0, 1)
			binary.LittleEndian.PutUint16(h[4:], 2)
			return h
		}, 1, false, ipc.ErrProtocol, "version 2"},
		{"kind 0", func() []byte { return ipc.EncodeHeader(0, 0, 0) }, 0, false, ipc.ErrProtocol, "kind 0"},
		{"reserved field", func() []byte {
			h := ipc.EncodeHeader(ipc.KindUser, 0, 0)
			h[15] = 1
			return h
		}, 0, false, ipc.ErrProtocol, "reserved"},
		{"payload above the limit", func() []byte { return ipc.EncodeHeader(ipc.KindUser, ipc.MaxPayload+1, 2) }, 2, false, ipc.ErrTooLarge, "limit"},
		{"too many descriptors announced", func() []byte { return ipc.EncodeHeader(ipc.KindUser, 0, ipc.MaxFDsPerMessage+1) }, 1, false, ipc.ErrTooLarge, "descriptors"},
		{"fewer descriptors than announced", func() []byte { return withPayload(ipc.EncodeHeader(ipc.KindUser, 3, 2), "abc") }, 1, false, ipc.ErrProtocol, "1 descriptors arrived, the header announces 2"},
		{"extra descriptors nobody asked for", func() []byte { return withPayload(ipc.EncodeHeader(ipc.KindUser, 3, 1), "abc") }, 3, false, ipc.ErrProtocol, "nobody asked for"},
		{"peer closes mid-header", func() []byte { return ipc.EncodeHeader(ipc.KindUser, 8, 1)[:9] }, 1, true, io.ErrUnexpectedEOF, "after 9 of 16 header bytes"},
		{"peer closes mid-payload", func() []byte { return withPayload(ipc.EncodeHeader(ipc.KindUser, 100, 2), "only part") }, 2, true, io.ErrUnexpectedEOF, "after 9 of 100"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			before := testutil.OpenFDs(t)
			a, b := testutil.SocketPair(t)
			pr, pw, err := os.Pipe()
			require.NoError(t, err)
			fds := make([]int, tc.fds)
			for i := range fds {
				fds[i] = int(pr.Fd())
			}
			rawSend(t, a, tc.bytes(), fds...)
			require.NoError(t, pr.Close())
			if tc.hangUp {
				require.NoError(t, a.Close())
			}
			kind, payload, files, err := ipc.ReadMessage(b)
			require.ErrorIs(t, err, tc.want)
			require.ErrorContains(t, err, tc.contains)
			require.Zero(t, kind)
			require.Nil(t, payload)
			require.Nil(t, files)
			// Every received copy of the pipe's read end was closed: the pipe has no reader left.
			_, err = pw.Write([]byte("x"))
			require.ErrorIs(t, err, unix.EPIPE, "a received descriptor is still open")
			pw.Close()
			a.Close()
			b.Close()
			require.Equal(t, before, testutil.OpenFDs(t), "file descriptors leaked")
		})
	}
}

// More descriptors than one message may carry: the kernel truncates the control data
// (MSG_CTRUNC), which is an error, and the ones that did arrive are closed.
func TestReadMessageTruncatedControlData(t *testing.T) {
	before := testutil.OpenFDs(t)
	a, b := testutil.SocketPair(t)
	pr, pw, err := os.Pipe()
	require.NoError(t, err)
	fds := make([]int, 253) // SCM_MAX_FD
	for i := range fds {
		fds[i] = int(pr.Fd())
	}
	rawSend(t, a, ipc.EncodeHeader(ipc.KindUser, 0, ipc.MaxFDsPerMessage), fds...)
	require.NoError(t, pr.Close())
	_, _, files, err := ipc.ReadMessage(b)
	require.ErrorIs(t, err, ipc.ErrProtocol)
	require.ErrorContains(t, err, "MSG_CTRUNC")
	require.Nil(t, files)
	_, err = pw.Write([]byte("x"))
	require.ErrorIs(t, err, unix.EPIPE, "a received descriptor is still open")
	pw.Close()
	a.Close()
	b.Close()
	require.Equal(t, before, testutil.OpenFDs(t), "file descriptors leaked")
}

func TestRemoteErrorIs(t *testing.T) {
	err := error(&ipc.RemoteError{Code: ipc.CodeNotFound, Message: "no buffer named \"x\""})
	require.True(t, errors.Is(err, ipc.ErrNotFound))
	require.False(t, errors.Is(err, ipc.ErrPermission))
	require.ErrorContains(t, err, "no buffer named")
	require.ErrorIs(t, &ipc.RemoteError{Code: ipc.CodePermission}, ipc.ErrPermission)
	require.ErrorIs(t, &ipc.RemoteError{Code: ipc.CodeProtocol}, ipc.ErrProtocol)
}

// A receiver out of file descriptors (RLIMIT_NOFILE) gets fewer than were sent, with the control
// data truncated: the error says so, wrapping EMFILE, and does not blame the peer.
func TestReadMessageOutOfDescriptors(t *testing.T) {
	a, b := testutil.SocketPair(t)
	pr, pw, err := os.Pipe()
	require.NoError(t, err)
	defer pw.Close()
	fds := make([]int, 20)
	for i := range fds {
		fds[i] = int(pr.Fd())
	}
	rawSend(t, a, ipc.EncodeHeader(ipc.KindUser, 0, uint16(len(fds))), fds...)
	require.NoError(t, pr.Close())
	var old unix.Rlimit
	require.NoError(t, unix.Getrlimit(unix.RLIMIT_NOFILE, &old))
	low := old
	low.Cur = uint64(testutil.OpenFDs(t) + 5)
	require.NoError(t, unix.Setrlimit(unix.RLIMIT_NOFILE, &low))
	_, _, files, err := ipc.ReadMessage(b)
	require.NoError(t, unix.Setrlimit(unix.RLIMIT_NOFILE, &old))
	require.ErrorIs(t, err, unix.EMFILE)
	require.NotErrorIs(t, err, ipc.ErrProtocol)
	require.ErrorContains(t, err, "out of file descriptors")
	require.Nil(t, files)
}
