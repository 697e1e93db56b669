package broker

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/driver/sim"
	"github.com/cuvmm/cuvmm/internal/fuzzfd"
	"github.com/cuvmm/cuvmm/internal/testutil"
	"github.com/cuvmm/cuvmm/internal/unixsock"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/vmm"
)

// frameHeader is an ipc frame header (see ipc.WriteMessage), valid or not.
func frameHeader(kind uint16, length uint32, nfds uint16) []byte {
	b := make([]byte, ipc.HeaderSize)
	binary.LittleEndian.PutUint32(b[0:], 'C'|'V'<<8|'M'<<16|'I'<<24)
	binary.LittleEndian.PutUint16(b[4:], ipc.Version)
	binary.LittleEndian.PutUint16(b[6:], kind)
	binary.LittleEndian.PutUint32(b[8:], length)
	binary.LittleEndian.PutUint16(b[12:], nfds)
	return b
}

func encodeReq(r request) []byte {
	var b [RequestSize]byte
	r.encode(&b)
	return b[:]
}

func TestRequestRoundTrip(t *testing.T) {
	for _, r := range []request{
		{op: OpHello, id: 1},
		{op: OpPing, id: 2},
		{op: OpRegister, id: 3},
		{op: OpUnregister, id: 4, buffer: 7},
		{op: OpRegion, id: 5},
		{op: OpCopy, id: 6, buffer: 1, dir: ToDevice, hostOff: 1 << 40, bufOff: 5, length: 1 << 20},
		{op: OpCopy, id: ^uint64(0), buffer: ^uint32(0), dir: ToHost, hostOff: ^uint64(0) - 1, bufOff: 0, length: 1},
	} {
		got, err := decodeRequest(encodeReq(r))
		require.NoError(t, err)
		require.Equal(t, r, got)
	}
}

func TestRequestStrict(t *testing.T) {
	good := encodeReq(request{op: OpCopy, id: 9, buffer: 1, dir: ToDevice, hostOff: 4096, bufOff: 0, length: 4096})
	mutate := func(f func(b []byte)) []byte {
		b := bytes.Clone(good)
		f(b)
		return b
	}
	for name, b := range map[string][]byte{
		"short":            good[:RequestSize-1],
		"long":             append(bytes.Clone(good), 0),
		"empty":            nil,
		"op 0":             mutate(func(b []byte) { binary.LittleEndian.PutUint16(b[0:], 0) }),
		"op unknown":       mutate(func(b []byte) { binary.LittleEndian.PutUint16(b[0:], maxOp+1) }),
		"id 0":             mutate(func(b []byte) { binary.LittleEndian.PutUint64(b[8:], 0) }),
		"buffer 0":         mutate(func(b []byte) { binary.LittleEndian.PutUint32(b[4:], 0) }),
		"direction 0":      mutate(func(b []byte) { binary.LittleEndian.PutUint16(b[2:], 0) }),
		"direction 3":      mutate(func(b []byte) { binary.LittleEndian.PutUint16(b[2:], 3) }),
		"length 0":         mutate(func(b []byte) { binary.LittleEndian.PutUint64(b[32:], 0) }),
		"host overflow":    mutate(func(b []byte) { binary.LittleEndian.PutUint64(b[16:], ^uint64(0)) }),
		"buffer overflow":  mutate(func(b []byte) { binary.LittleEndian.PutUint64(b[24:], ^uint64(0)-100) }),
		"ping with fields": encodeReq(request{op: OpPing, id: 1, length: 5}),
		"hello with dir":   encodeReq(request{op: OpHello, id: 1, dir: ToHost}),
		"unregister 0":     encodeReq(request{op: OpUnregister, id: 1}),
		"unregister len":   encodeReq(request{op: OpUnregister, id: 1, buffer: 2, length: 1}),
		"register buffer":  encodeReq(request{op: OpRegister, id: 1, buffer: 2}),
	} {
		_, err := decodeRequest(b)
		require.ErrorIs(t, err, ErrProtocol, name)
	}
}

func TestResponseStrict(t *testing.T) {
	buf := make([]byte, 0, ResponseSize+MaxText)
	ok := (&response{op: OpCopy, id: 3, values: [4]uint64{1, 2, 3, 4}}).encode(buf)
	got, err := decodeResponse(ok)
	require.NoError(t, err)
	require.Equal(t, response{op: OpCopy, id: 3, values: [4]uint64{1, 2, 3, 4}}, got)
	refusal := (&response{status: StatusPermission, text: "no"}).encode(make([]byte, 0, ResponseSize+MaxText))
	got, err = decodeResponse(refusal)
	require.NoError(t, err)
	require.Equal(t, "no", got.text)
	long := (&response{op: OpCopy, id: 1, status: StatusInternal, text: string(bytes.Repeat([]byte("é"), MaxText))}).encode(make([]byte, 0, ResponseSize+MaxText))
	require.LessOrEqual(t, len(long), ResponseSize+MaxText, "the text is cut to MaxText")
	_, err = decodeResponse(long)
	require.NoError(t, err, "cut at a rune boundary")

	mutate := func(src []byte, f func(b []byte)) []byte {
		b := bytes.Clone(src)
		f(b)
		return b
	}
	for name, b := range map[string][]byte{
		"short":           ok[:ResponseSize-1],
		"too long":        append(bytes.Clone(refusal), bytes.Repeat([]byte{'x'}, MaxText)...),
		"op unknown":      mutate(ok, func(b []byte) { b[0] = 99 }),
		"status unknown":  mutate(ok, func(b []byte) { b[2] = 99 }),
		"op without id":   mutate(ok, func(b []byte) { binary.LittleEndian.PutUint64(b[8:], 0) }),
		"id without op":   mutate(refusal, func(b []byte) { b[8] = 1 }),
		"ok refusal":      mutate(refusal[:ResponseSize], func(b []byte) { b[2] = 0 }),
		"text on success": append(bytes.Clone(ok), 'x'),
		"bad utf-8":       append(bytes.Clone(refusal), 0xff),
		"values on error": mutate(refusal, func(b []byte) { b[16] = 1 }),
	} {
		_, err := decodeResponse(b)
		require.ErrorIs(t, err, ErrProtocol, name)
	}
}

// requireRefused reads the broker's protocol refusal of the whole connection, then its hang-up.
func requireRefused(t *testing.T, conn *net.UnixConn, what string) {
	t.Helper()
	fr := unixsock.NewConn(conn, unix.Ucred{})
	resp, err := readResponse(fr)
	require.NoError(t, err, what)
	require.Equal(t, uint64(0), resp.id, what)
	require.Equal(t, StatusProtocol, resp.status, "%s: %s", what, resp.text)
	_, err = readResponse(fr)
	// A hang-up with part of our bytes unread resets the connection.
	require.True(t, errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET), "%s: %v", what, err)
}

// Malformed input on the socket: each is refused with StatusProtocol, the connection is closed, and
// the broker keeps serving a well-behaved worker.
func TestMalformedRequests(t *testing.T) {
	testutil.Run(t, func(t *testing.T, b *testutil.Backend) {
		ctx, dev, srv, path := serveDevice0(t, b, Options{})
		good := dial(t, path)
		rb, err := good.Register(ctx, newDevBuffer(t, dev, 1, 2*mib))
		require.NoError(t, err)

		frame := func(kind uint16, payload []byte) []byte {
			h := frameHeader(kind, uint32(len(payload)), 0)
			return append(h, payload...)
		}
		badVersion := frame(KindRequest, encodeReq(request{op: OpHello, id: 1}))
		badVersion[4] = 7
		for name, tc := range map[string]struct {
			hello bool
			bytes []byte
		}{
			"not a frame":          {false, []byte("GET / HTTP/1.1\r\n\r\n")},
			"short request":        {false, frame(KindRequest, make([]byte, RequestSize-1))},
			"frame version 7":      {false, badVersion},
			"protocol version 1":   {false, frame(ipc.KindUser+0x60, encodeReq(request{op: OpHello, id: 1}))},
			"copy before hello":    {false, frame(KindRequest, encodeReq(request{op: OpCopy, id: 2, buffer: 1, dir: ToDevice, length: 8}))},
			"a response frame":     {true, frame(KindResponse, encodeReq(request{op: OpPing, id: 2}))},
			"second hello":         {true, frame(KindRequest, encodeReq(request{op: OpHello, id: 2}))},
			"unknown op":           {true, frame(KindRequest, append([]byte{99, 0}, encodeReq(request{op: OpPing, id: 2})[2:]...))},
			"register, no buffer":  {true, append(frame(KindRequest, encodeReq(request{op: OpRegister, id: 2})), frame(KindRequest, encodeReq(request{op: OpPing, id: 3}))...)},
			"payload over the cap": {true, frameHeader(KindRequest, ipc.MaxPayload+1, 0)},
			// An ipc error reply where the buffer was due: the worker is no server to refuse anything.
			"register, an error in place of the buffer": {true, append(frame(KindRequest, encodeReq(request{op: OpRegister, id: 2})), frame(ipc.KindError, []byte{byte(ipc.CodeNotFound), 0, 'x'})...)},
		} {
			conn := rawConn(t, path, tc.hello)
			_, err := conn.Write(tc.bytes)
			require.NoError(t, err, name)
			requireRefused(t, conn, name)
		}

		// Descriptors nobody asked for are closed and refused.
		conn := rawConn(t, path, true)
		r, w, err := os.Pipe()
		require.NoError(t, err)
		require.NoError(t, ipc.WriteMessage(conn, KindRequest, encodeReq(request{op: OpPing, id: 2}), []*os.File{r}))
		require.NoError(t, r.Close())
		requireRefused(t, conn, "descriptors with a ping")
		_, err = w.Write([]byte{1})
		require.Error(t, err, "the broker closed the read end it was sent")
		require.NoError(t, w.Close())

		// A worker that hangs up in the middle of a frame is simply gone.
		conn = rawConn(t, path, true)
		_, err = conn.Write(frame(KindRequest, encodeReq(request{op: OpPing, id: 2}))[:20])
		require.NoError(t, err)
		require.NoError(t, conn.Close())

		eventually(t, "the broken connections to end", func() bool { return srv.Stats().Workers == 1 })
		require.NoError(t, good.Copy(ctx, Request{Buffer: rb.ID(), Dir: ToDevice, Length: mib}))
		require.NoError(t, good.Ping(ctx))
	})
}

// FuzzDecodeRequest: the decoder accepts only what the encoder produces (decode then encode gives
// the same bytes) and rejects everything else with ErrProtocol.
func FuzzDecodeRequest(f *testing.F) {
	f.Add(encodeReq(request{op: OpHello, id: 1}))
	f.Add(encodeReq(request{op: OpCopy, id: 7, buffer: 3, dir: ToHost, hostOff: 1 << 30, bufOff: 4096, length: 1 << 20}))
	f.Add(encodeReq(request{op: OpUnregister, id: 8, buffer: 3}))
	f.Add([]byte{1, 0})
	f.Fuzz(func(t *testing.T, data []byte) {
		r, err := decodeRequest(data)
		if err != nil {
			require.ErrorIs(t, err, ErrProtocol)
			return
		}
		require.Equal(t, data, encodeReq(r))
	})
}

// FuzzDecodeResponse: likewise for responses.
func FuzzDecodeResponse(f *testing.F) {
	f.Add((&response{op: OpCopy, id: 3, values: [4]uint64{1, 2, 3, 4}}).encode(make([]byte, 0, ResponseSize+MaxText)))
	f.Add((&response{status: StatusPermission, text: "refused"}).encode(make([]byte, 0, ResponseSize+MaxText)))
	f.Add((&response{op: OpRegister, id: 9, buffer: 1, values: [4]uint64{2 << 20, 0}}).encode(make([]byte, 0, ResponseSize+MaxText)))
	f.Fuzz(func(t *testing.T, data []byte) {
		r, err := decodeResponse(data)
		if err != nil {
			require.ErrorIs(t, err, ErrProtocol)
			return
		}
		require.Equal(t, data, r.encode(make([]byte, 0, ResponseSize+MaxText)))
	})
}

// FuzzServer feeds arbitrary bytes with random descriptors of every kind (sealed and unsealed
// memfds, pipes, sockets, /dev/null, a directory), after a hello, to a live broker (on the
// simulator): it must answer or hang up, never crash or hang, close every descriptor, map nothing
// it keeps, and keep serving.
func FuzzServer(f *testing.F) {
	req := func(r request) []byte { return append(frameHeader(KindRequest, RequestSize, 0), encodeReq(r)...) }
	f.Add(encodeReq(request{op: OpPing, id: 2}), []byte{}, uint16(0))
	f.Add(req(request{op: OpPing, id: 2}), []byte{}, uint16(0))
	f.Add(req(request{op: OpCopy, id: 2, buffer: 1, dir: ToHost, length: 8}), []byte{}, uint16(0))
	f.Add(req(request{op: OpUnregister, id: 2, buffer: 1}), []byte{}, uint16(0))
	d := ipc.Descriptor{Size: 2 * mib, Chunks: []ipc.ChunkDesc{{Size: 2 * mib, Location: driver.DeviceLocation(0), HandleType: driver.HandleTypePosixFD}}}
	payload, err := d.MarshalBinary()
	require.NoError(f, err)
	register := append(req(request{op: OpRegister, id: 2}), append(frameHeader(ipc.KindBuffer, uint32(len(payload)), 1), payload...)...)
	for k := byte(0); k < fuzzfd.Kinds; k++ {
		f.Add(register, []byte{k}, uint16(RequestSize+ipc.HeaderSize))
	}
	f.Add(req(request{op: OpPing, id: 2}), []byte{3, 5}, uint16(0))
	s := sim.New(sim.Devices(1))
	sys, err := vmm.Open(s)
	require.NoError(f, err)
	dev, err := sys.Device(0)
	require.NoError(f, err)
	region, err := pinned.New(dev, 4*mib, pinned.Options{})
	require.NoError(f, err)
	dir, err := os.MkdirTemp("", "broker-fuzz")
	require.NoError(f, err)
	path := dir + "/broker.sock"
	srv, err := Listen(region, path, Options{HelloTimeout: 5 * time.Second})
	require.NoError(f, err)
	go srv.Serve()
	f.Cleanup(func() {
		require.NoError(f, srv.Close())
		require.NoError(f, region.Close())
		require.NoError(f, sys.Close())
		require.True(f, s.Live().Zero(), "simulator objects leaked: %s", s.Live())
		require.NoError(f, s.Close())
		os.RemoveAll(dir)
	})
	f.Fuzz(func(t *testing.T, data, kinds []byte, cut uint16) {
		if len(data) > 64<<10 {
			t.Skip("larger inputs only fill the socket buffer")
		}
		files := fuzzfd.Make(t, kinds, 8)
		conn := rawConn(t, path, true)
		sent := make(chan error, 1)
		go func() { sent <- fuzzfd.Send(conn, data, files, cut) }()
		fr := unixsock.NewConn(conn, unix.Ucred{})
		for {
			_, err := readResponse(fr)
			if err != nil {
				require.False(t, errors.Is(err, os.ErrDeadlineExceeded), "the broker neither answered nor hung up")
				break
			}
		}
		<-sent
		require.NoError(t, conn.Close())
		eventually(t, "the connection to end", func() bool { return srv.Stats().Workers == 0 })
		require.Zero(t, srv.Stats().Buffers)
	})
}
