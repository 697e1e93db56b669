package broker

import (
	"encoding/binary"
	"fmt"
	"unicode/utf8"

	"github.com/cuvmm/cuvmm/ipc"
)

// Wire format. Every message travels in one ipc frame (magic "CVMI", version, kind, payload
// length, descriptor count: the one header of the module's transport) of kind KindRequest or
// KindResponse; the payload is one of the two layouts below (little-endian). A register request is
// followed by the buffer itself as ipc.Send writes it (a KindBuffer frame with the chunks'
// descriptors, then KindFDs frames if it has more than ipc.MaxFDsPerMessage chunks); an OK region
// response is followed by the region as pinned.Region.Share writes it. No other frame carries
// descriptors. The frame kind names the protocol version: version 1 used kinds 0x160 and 0x161 and
// repeated a magic and version inside each payload.
//
// Request, exactly RequestSize bytes:
//
//	0   2  op (OpHello, OpPing, OpRegister, OpUnregister, OpRegion, OpCopy)
//	2   2  direction (OpCopy: ToDevice 1 or ToHost 2; otherwise zero)
//	4   4  buffer id (OpUnregister, OpCopy: non-zero; otherwise zero)
//	8   8  request id: chosen by the client, non-zero, echoed by the response
//	16  8  host offset: a byte offset in the broker's region (OpCopy; otherwise zero)
//	24  8  buffer offset: a byte offset in the buffer (OpCopy; otherwise zero)
//	32  8  length in bytes (OpCopy: non-zero, and neither range may overflow; otherwise zero)
//
// Response, ResponseSize bytes plus an error text:
//
//	0   2  op of the request answered (0 with id 0: a refusal of the whole connection)
//	2   2  status (StatusOK or an error code)
//	4   4  buffer id (OpRegister: the new buffer's id; OpHello: flags; otherwise zero)
//	8   8  request id (0 only for a refusal of the whole connection)
//	16  32 four values whose meaning depends on op (see the ops)
//	48  n  error text, UTF-8, at most MaxText bytes; present only when the status is not OK
const (
	// Version is the protocol version this package speaks, carried by the frame kinds.
	Version = 2
	// KindRequest and KindResponse are the ipc frame kinds of the broker's messages.
	KindRequest  = ipc.KindUser + 0x62
	KindResponse = ipc.KindUser + 0x63
	// RequestSize is the size of a request payload.
	RequestSize = 40
	// ResponseSize is the size of a response payload without its error text.
	ResponseSize = 48
	// MaxText is the longest error text a response carries.
	MaxText = 1024
)

// Operations.
const (
	// OpHello must be the first request of a connection. Response values: region length, grant
	// offset, grant length, bit mask of the served device ordinals (below 64); buffer id field:
	// bit 0 set when the region may be shared with the worker, bits 8-15 the region's pinned.Kind,
	// bits 16-31 the broker's idle timeout in tenths of a second (0: none), which the client keeps
	// ahead of with pings.
	OpHello uint16 = 1
	// OpPing is answered at once, with no value: the round trip of the protocol alone.
	OpPing uint16 = 2
	// OpRegister is followed by a buffer (ipc.Send). Response: buffer id; values: buffer length,
	// device ordinal.
	OpRegister uint16 = 3
	// OpUnregister drains the copies in flight on the buffer, then unmaps and releases it.
	OpUnregister uint16 = 4
	// OpRegion asks for the region: an OK response is followed by pinned.Region.Share's messages.
	OpRegion uint16 = 5
	// OpCopy copies between the region and a buffer. Response values: the broker's time from
	// issuing the copy to its stream's completion (ns), the bytes copied.
	OpCopy uint16 = 6
	maxOp         = OpCopy
)

func opName(op uint16) string {
	switch op {
	case 0:
		return "the connection"
	case OpHello:
		return "hello"
	case OpPing:
		return "ping"
	case OpRegister:
		return "register"
	case OpUnregister:
		return "unregister"
	case OpRegion:
		return "region"
	case OpCopy:
		return "copy"
	}
	return fmt.Sprintf("op %d", op)
}

// Direction says which way a copy goes.
type Direction uint16

const (
	// ToDevice copies from the broker's region (host) into the buffer (device).
	ToDevice Direction = 1
	// ToHost copies from the buffer (device) into the broker's region (host).
	ToHost Direction = 2
)

func (d Direction) String() string {
	switch d {
	case ToDevice:
		return "host→device"
	case ToHost:
		return "device→host"
	}
	return fmt.Sprintf("direction(%d)", uint16(d))
}

// request is a decoded request.
type request struct {
	op      uint16
	id      uint64
	buffer  uint32
	dir     Direction
	hostOff uint64
	bufOff  uint64
	length  uint64
}

func (r *request) encode(b *[RequestSize]byte) {
	binary.LittleEndian.PutUint16(b[0:], r.op)
	binary.LittleEndian.PutUint16(b[2:], uint16(r.dir))
	binary.LittleEndian.PutUint32(b[4:], r.buffer)
	binary.LittleEndian.PutUint64(b[8:], r.id)
	binary.LittleEndian.PutUint64(b[16:], r.hostOff)
	binary.LittleEndian.PutUint64(b[24:], r.bufOff)
	binary.LittleEndian.PutUint64(b[32:], r.length)
}

// decodeRequest decodes a request strictly: the exact size, a known op, a non-zero id, and for each
// op exactly the fields it uses (see the wire format). Errors wrap ErrProtocol.
func decodeRequest(b []byte) (request, error) {
	if len(b) != RequestSize {
		return request{}, fmt.Errorf("broker: request of %d bytes, want %d: %w", len(b), RequestSize, ErrProtocol)
	}
	r := request{
		op:      binary.LittleEndian.Uint16(b[0:]),
		dir:     Direction(binary.LittleEndian.Uint16(b[2:])),
		buffer:  binary.LittleEndian.Uint32(b[4:]),
		id:      binary.LittleEndian.Uint64(b[8:]),
		hostOff: binary.LittleEndian.Uint64(b[16:]),
		bufOff:  binary.LittleEndian.Uint64(b[24:]),
		length:  binary.LittleEndian.Uint64(b[32:]),
	}
	if err := r.validate(); err != nil {
		return request{}, err
	}
	return r, nil
}

func (r *request) validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("broker: %s request %d: %s: %w", opName(r.op), r.id, fmt.Sprintf(format, args...), ErrProtocol)
	}
	if r.op == 0 || r.op > maxOp {
		return bad("unknown op %d", r.op)
	}
	if r.id == 0 {
		return bad("request id 0")
	}
	switch r.op {
	case OpCopy:
		if r.buffer == 0 {
			return bad("buffer id 0")
		}
		if r.dir != ToDevice && r.dir != ToHost {
			return bad("direction %d (want 1 to device or 2 to host)", uint16(r.dir))
		}
		if r.length == 0 {
			return bad("length 0")
		}
		if r.hostOff+r.length < r.hostOff || r.bufOff+r.length < r.bufOff {
			return bad("offset + length overflows")
		}
		return nil
	case OpUnregister:
		if r.buffer == 0 {
			return bad("buffer id 0")
		}
		if r.dir != 0 || r.hostOff != 0 || r.bufOff != 0 || r.length != 0 {
			return bad("fields an unregister does not use are set")
		}
		return nil
	}
	if r.buffer != 0 || r.dir != 0 || r.hostOff != 0 || r.bufOff != 0 || r.length != 0 {
		return bad("fields a %s does not use are set", opName(r.op))
	}
	return nil
}

// response is a decoded response.
type response struct {
	op     uint16
	id     uint64
	status uint16
	buffer uint32
	values [4]uint64
	text   string
}

// encode appends the response to b (with room for ResponseSize+MaxText more bytes) and returns it.
// A text longer than MaxText is cut at a rune boundary.
func (r *response) encode(b []byte) []byte {
	text := r.text
	if r.status == StatusOK {
		text = ""
	}
	if len(text) > MaxText {
		text = text[:MaxText]
		for !utf8.ValidString(text) {
			text = text[:len(text)-1]
		}
	}
	start := len(b)
	b = b[:start+ResponseSize]
	p := b[start:]
	binary.LittleEndian.PutUint16(p[0:], r.op)
	binary.LittleEndian.PutUint16(p[2:], r.status)
	binary.LittleEndian.PutUint32(p[4:], r.buffer)
	binary.LittleEndian.PutUint64(p[8:], r.id)
	for i, v := range r.values {
		binary.LittleEndian.PutUint64(p[16+8*i:], v)
	}
	return append(b, text...)
}

// decodeResponse decodes a response strictly: size, a known op (0 only with id 0 and an error
// status), a known status, no text on success and valid UTF-8 text of at most MaxText bytes
// otherwise. Errors wrap ErrProtocol.
func decodeResponse(b []byte) (response, error) {
	if len(b) < ResponseSize || len(b) > ResponseSize+MaxText {
		return response{}, fmt.Errorf("broker: response of %d bytes, want %d to %d: %w", len(b), ResponseSize, ResponseSize+MaxText, ErrProtocol)
	}
	r := response{
		op:     binary.LittleEndian.Uint16(b[0:]),
		status: binary.LittleEndian.Uint16(b[2:]),
		buffer: binary.LittleEndian.Uint32(b[4:]),
		id:     binary.LittleEndian.Uint64(b[8:]),
	}
	for i := range r.values {
		r.values[i] = binary.LittleEndian.Uint64(b[16+8*i:])
	}
	text := b[ResponseSize:]
	bad := func(format string, args ...any) (response, error) {
		return response{}, fmt.Errorf("broker: response to request %d: %s: %w", r.id, fmt.Sprintf(format, args...), ErrProtocol)
	}
	if r.op > maxOp {
		return bad("unknown op %d", r.op)
	}
	if r.status > maxStatus {
		return bad("unknown status %d", r.status)
	}
	if (r.op == 0) != (r.id == 0) {
		return bad("op %d with request id %d (op 0 and id 0 go together)", r.op, r.id)
	}
	if r.op == 0 && r.status == StatusOK {
		return bad("a connection-wide response must be a refusal")
	}
	if r.status == StatusOK {
		if len(text) != 0 {
			return bad("%d bytes of text on a success", len(text))
		}
	} else {
		if !utf8.Valid(text) {
			return bad("error text is not UTF-8")
		}
		if r.buffer != 0 || r.values != [4]uint64{} {
			return bad("values set on an error")
		}
		r.text = string(text)
	}
	return r, nil
}
