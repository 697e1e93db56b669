package unixsock

import (
	"bytes"
	"errors"
	"io"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

func TestFrameRoundTrip(t *testing.T) {
	a, b := socketPair(t)
	wc, rc := NewConn(a, unix.Ucred{}), NewConn(b, unix.Ucred{})
	r, w, err := os.Pipe()
	require.NoError(t, err)
	defer r.Close()
	defer w.Close()
	before := openFDs(t)
	for i := range 3 {
		payload := make([]byte, 100*(i+1))
		payload[0] = byte(i)
		require.NoError(t, wc.Write(uint16(0x100+i), payload, []*os.File{r}))
		f, err := rc.Read()
		require.NoError(t, err)
		require.Equal(t, uint16(0x100+i), f.Kind)
		require.Equal(t, payload, f.Payload)
		require.Len(t, f.Files, 1)
		flags, err := unix.FcntlInt(f.Files[0].Fd(), unix.F_GETFD, 0)
		require.NoError(t, err)
		require.NotZero(t, flags&unix.FD_CLOEXEC, "received with MSG_CMSG_CLOEXEC")
		require.NoError(t, CloseFiles(f.Files))
	}
	require.Equal(t, before, openFDs(t))
	// ReadAtLeast takes a frame at least that long and refuses a shorter one.
	require.NoError(t, wc.Write(7, make([]byte, 48), nil))
	f, err := rc.ReadAtLeast(48)
	require.NoError(t, err)
	require.Len(t, f.Payload, 48)
	require.NoError(t, wc.Write(7, make([]byte, 100), nil))
	_, err = rc.ReadAtLeast(48)
	require.NoError(t, err)
	require.NoError(t, wc.Write(7, make([]byte, 8), nil))
	require.NoError(t, wc.Write(7, make([]byte, 40), nil))
	_, err = rc.ReadAtLeast(48)
	require.ErrorIs(t, err, ErrProtocol)
}

// Every descriptor that arrives with a refused frame is closed.
func TestFrameRefusalsCloseDescriptors(t *testing.T) {
	r, w, err := os.Pipe()
	require.NoError(t, err)
	defer r.Close()
	defer w.Close()
	cases := []struct {
		name string
		send func(a *Conn) error
		want error
	}{
		{"more descriptors than announced", func(a *Conn) error {
			b := make([]byte, HeaderSize)
			Header{Kind: 5, NFDs: 1}.Put(b)
			_, _, err := a.uc.WriteMsgUnix(b, unix.UnixRights(int(r.Fd()), int(w.Fd())), nil)
			return err
		}, ErrProtocol},
		{"fewer descriptors than announced", func(a *Conn) error {
			b := make([]byte, HeaderSize)
			Header{Kind: 5, NFDs: 2}.Put(b)
			_, _, err := a.uc.WriteMsgUnix(b, unix.UnixRights(int(r.Fd())), nil)
			return err
		}, ErrProtocol},
		{"truncated control data", func(a *Conn) error {
			fds := make([]int, 253)
			for i := range fds {
				fds[i] = int(r.Fd())
			}
			b := make([]byte, HeaderSize)
			Header{Kind: 5, NFDs: 250}.Put(b)
			_, _, err := a.uc.WriteMsgUnix(b, unix.UnixRights(fds...), nil)
			return err
		}, ErrProtocol},
		{"bad magic with descriptors", func(a *Conn) error {
			_, _, err := a.uc.WriteMsgUnix(make([]byte, HeaderSize), unix.UnixRights(int(r.Fd())), nil)
			return err
		}, ErrProtocol},
		{"peer closes mid-frame", func(a *Conn) error {
			b := make([]byte, HeaderSize+4)
			Header{Kind: 5, Length: 100, NFDs: 1}.Put(b)
			_, _, err := a.uc.WriteMsgUnix(b, unix.UnixRights(int(r.Fd())), nil)
			a.Close()
			return err
		}, io.ErrUnexpectedEOF},
		{"payload above the limit", func(a *Conn) error {
			b := make([]byte, HeaderSize)
			Header{Kind: 5, Length: MaxPayload + 1}.Put(b)
			_, err := a.uc.Write(b)
			return err
		}, ErrMessageTooLarge},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			before := openFDs(t)
			x, y := socketPair(t)
			a, b := NewConn(x, unix.Ucred{}), NewConn(y, unix.Ucred{})
			require.NoError(t, c.send(a))
			f, err := b.Read()
			require.ErrorIs(t, err, c.want)
			require.Nil(t, f.Files)
			a.Close()
			b.Close()
			require.Equal(t, before, openFDs(t), "every received descriptor closed")
		})
	}
}

func TestWriteRefusals(t *testing.T) {
	a, _ := socketPair(t)
	c := NewConn(a, unix.Ucred{})
	require.ErrorIs(t, c.Write(0, nil, nil), ErrProtocol)
	require.ErrorIs(t, c.Write(1, make([]byte, MaxPayload+1), nil), ErrMessageTooLarge)
	require.ErrorIs(t, c.Write(1, nil, make([]*os.File, MaxFDs+1)), ErrMessageTooLarge)
	require.ErrorIs(t, c.Write(1, nil, []*os.File{nil}), ErrProtocol)
	require.ErrorIs(t, WriteMessage(nil, 1, nil, nil), ErrProtocol)
	_, _, _, err := ReadMessage(nil)
	require.ErrorIs(t, err, ErrProtocol)
	require.True(t, errors.Is(ErrMessageTooLarge, ErrProtocol))
}

// A peer that sends a frame in pieces, each carrying descriptors, is refused at its second piece:
// the reader never holds more than one message's descriptors from it, and closes them all.
func TestFrameDescriptorsAfterTheFirstBytes(t *testing.T) {
	r, w, err := os.Pipe()
	require.NoError(t, err)
	defer r.Close()
	defer w.Close()
	fds := make([]int, MaxFDs)
	for i := range fds {
		fds[i] = int(r.Fd())
	}
	before := openFDs(t)
	x, y := socketPair(t)
	hdr := make([]byte, HeaderSize+8)
	Header{Kind: 5, Length: 8}.Put(hdr)
	for i := 0; i < 4; i++ { // the rest of the frame never comes
		_, _, err := x.WriteMsgUnix(hdr[i:i+1], unix.UnixRights(fds...), nil)
		require.NoError(t, err)
	}
	require.NoError(t, y.SetReadDeadline(time.Now().Add(5*time.Second)))
	f, err := NewConn(y, unix.Ucred{}).Read()
	require.ErrorIs(t, err, ErrProtocol, "refused at once, not after waiting for the rest")
	require.ErrorContains(t, err, "after the frame's first bytes")
	require.Nil(t, f.Files)
	x.Close()
	y.Close()
	require.Equal(t, before, openFDs(t), "every received descriptor closed")
}

// A frame's buffer grows as its bytes arrive: a peer that announces a megabyte and sends only the
// header makes the reader hold no more than growStep, until it is dropped.
func TestAnnouncedPayloadNotAllocatedAhead(t *testing.T) {
	a, b := socketPair(t)
	var hdr [HeaderSize]byte
	Header{Kind: 7, Length: MaxPayload}.Put(hdr[:])
	_, err := b.Write(hdr[:])
	require.NoError(t, err)
	var r reader
	_, err = r.read(a, readLimits{message: 100 * time.Millisecond}, 0)
	require.ErrorIs(t, err, ErrTimeout)
	require.LessOrEqual(t, cap(r.payload), HeaderSize+growStep)

	// A whole frame sent in pieces still arrives whole.
	require.NoError(t, a.SetReadDeadline(time.Time{}))
	payload := bytes.Repeat([]byte{0xa5}, MaxPayload)
	go func() {
		_, _ = b.Write(hdr[:])
		for off := 0; off < len(payload); off += 10000 {
			_, _ = b.Write(payload[off:min(off+10000, len(payload))])
		}
	}()
	f, err := r.read(a, readLimits{message: 10 * time.Second}, 0)
	require.NoError(t, err)
	require.Equal(t, payload, f.Payload)
}
