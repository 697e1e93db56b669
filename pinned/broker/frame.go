package broker

import (
	"fmt"

	"github.com/cuvmm/cuvmm/internal/unixsock"
)

// The broker's frames go through the transport's one framed connection type: a request or the fixed
// part of a response arrives with one receive into the buffer the connection reuses, and only the
// bytes of one frame are read, so the frames that follow (a buffer after a register request, a
// region after its response) are left for ipc.Receive and pinned.Receive. Any descriptor that
// arrives with a request or response was sent where none belongs: it is closed and the frame
// refused.

// readRequest reads and decodes one request frame.
func readRequest(c *unixsock.Conn) (request, error) {
	f, err := c.ReadAtLeast(RequestSize)
	if err != nil {
		return request{}, fmt.Errorf("broker: %w", err)
	}
	if err := checkFrame(f, KindRequest, RequestSize); err != nil {
		return request{}, err
	}
	return decodeRequest(f.Payload)
}

// readResponse reads and decodes one response frame.
func readResponse(c *unixsock.Conn) (response, error) {
	f, err := c.ReadAtLeast(ResponseSize)
	if err != nil {
		return response{}, fmt.Errorf("broker: %w", err)
	}
	if err := checkFrame(f, KindResponse, ResponseSize+MaxText); err != nil {
		return response{}, err
	}
	return decodeResponse(f.Payload)
}

// checkFrame refuses a frame of another kind, one longer than maxLen, or one with descriptors
// (closing them).
func checkFrame(f unixsock.Frame, kind uint16, maxLen int) error {
	if n := len(f.Files); n > 0 {
		_ = unixsock.CloseFiles(f.Files)
		return fmt.Errorf("broker: %d descriptors arrived with a message that carries none (closed): %w", n, ErrProtocol)
	}
	if f.Kind != kind {
		return fmt.Errorf("broker: message kind %#x, want %#x: %w", f.Kind, kind, ErrProtocol)
	}
	if len(f.Payload) > maxLen {
		return fmt.Errorf("broker: kind %#x payload of %d bytes, at most %d: %w", kind, len(f.Payload), maxLen, ErrProtocol)
	}
	return nil
}

// writeRequest sends one request frame; the caller holds c's write lock. buf is the caller's
// reusable payload buffer.
func writeRequest(c *unixsock.Conn, buf *[RequestSize]byte, req *request) error {
	req.encode(buf)
	return c.WriteLocked(KindRequest, buf[:], nil)
}
