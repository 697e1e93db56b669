package broker

import (
	"errors"
	"fmt"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/ipc"
	"github.com/cuvmm/cuvmm/vmm"
)

// Sentinel errors; match them with errors.Is. A refusal by the broker arrives as a *BrokerError,
// which matches the sentinel of its code.
var (
	// ErrBrokerGone: the connection to the broker is lost (the broker exited, was killed, closed the
	// server, or hung up after a protocol fault; or the Client closed it because a request's context
	// ended in the middle of writing the request). It wraps the I/O (or the context's) error as well. Requests in flight
	// fail with it, and so does every later call on the Client: dial again (a restarted broker
	// serves new connections; register the buffers again).
	ErrBrokerGone = errors.New("broker: connection to the broker lost")
	// ErrOutOfRange: a copy's host range lies outside the worker's grant (or the region), or its
	// buffer range outside the buffer or over a hole between its chunks; or a buffer to register
	// claims address space past its last chunk.
	ErrOutOfRange = errors.New("broker: range out of bounds")
	// ErrUnknownBuffer: a buffer id this worker has not registered (or has unregistered).
	ErrUnknownBuffer = errors.New("broker: unknown buffer id")
	// ErrLimit: the worker already has Options.MaxBuffers buffers registered, or a new one would take
	// its buffers past Options.MaxRegisteredBytes of address space.
	ErrLimit = errors.New("broker: per-worker limit reached")
	// ErrDeviceNotServed: the buffer's memory is on a device the broker does not copy on (see
	// Options.Devices), or the region is not visible to it.
	ErrDeviceNotServed = errors.New("broker: the buffer's device is not served by this broker")
	// ErrInternal: a driver call failed on the broker's side (import, copy, synchronize); the
	// message says which and why.
	ErrInternal = errors.New("broker: the broker failed")
	// ErrClosed is vmm.ErrClosed: the Client (or Server) was used after Close.
	ErrClosed = vmm.ErrClosed
	// ErrConnLimit is ipc.ErrConnLimit: the broker holds its maximum of connections (in total or
	// for this uid).
	ErrConnLimit = ipc.ErrConnLimit
	// ErrIdle is ipc.ErrIdle: the broker dropped a worker that sent nothing for its idle timeout.
	ErrIdle = ipc.ErrIdle
	// ErrTimeout is ipc.ErrTimeout: the broker dropped a worker that left a message half-sent; or
	// Client.Close did not see the broker end the connection within DialOptions.CloseTimeout.
	ErrTimeout = ipc.ErrTimeout
	// ErrProtocol is ipc.ErrProtocol: a malformed message, in either direction.
	ErrProtocol = ipc.ErrProtocol
	// ErrPermission is ipc.ErrPermission: a peer whose uid (or Authorize hook) is refused, a copy
	// into a region devices may only read, or a region request under a window that may not be
	// shared.
	ErrPermission = ipc.ErrPermission
	// ErrInvalidValue is vmm.ErrInvalidValue: a bad argument caught before anything is sent (zero
	// length, unknown direction, nil buffer).
	ErrInvalidValue = vmm.ErrInvalidValue
	// ErrNotSupported is driver.ErrNotSupported: for example sharing a region whose memory the
	// broker's caller registered (it has no file descriptor to pass).
	ErrNotSupported = driver.ErrNotSupported
)

// Status codes of a response (0 is success).
const (
	StatusOK            uint16 = 0
	StatusProtocol      uint16 = 1  // ErrProtocol; the broker closes the connection after it
	StatusPermission    uint16 = 2  // ErrPermission
	StatusUnknownBuffer uint16 = 3  // ErrUnknownBuffer
	StatusOutOfRange    uint16 = 4  // ErrOutOfRange
	StatusLimit         uint16 = 5  // ErrLimit
	StatusDevice        uint16 = 6  // ErrDeviceNotServed
	StatusNotSupported  uint16 = 7  // ErrNotSupported
	StatusInternal      uint16 = 8  // ErrInternal
	StatusConnLimit     uint16 = 9  // ErrConnLimit; the broker closes the connection after it
	StatusIdle          uint16 = 10 // ErrIdle; the broker closes the connection after it
	StatusTimeout       uint16 = 11 // ErrTimeout; the broker closes the connection after it
	maxStatus                  = StatusTimeout
)

// errRefused marks a request the broker answered with a refusal and then ended the connection for.
var errRefused = errors.New("broker: the worker misbehaved")

// BrokerError is a refusal or failure the broker reported for one request (Op, the request's
// operation) or, with Op 0, for the whole connection. errors.Is matches the sentinel of its Status.
type BrokerError struct {
	Op      uint16
	Status  uint16
	Message string
}

// Deprecated: RemoteError is BrokerError.
type RemoteError = BrokerError

func (e *BrokerError) Error() string {
	return fmt.Sprintf("broker: the broker refused %s: %s (status %d)", opName(e.Op), e.Message, e.Status)
}

// Is matches the sentinel of the status code.
func (e *BrokerError) Is(target error) bool {
	return target != nil && target == statusSentinel(e.Status)
}

func statusSentinel(code uint16) error {
	switch code {
	case StatusProtocol:
		return ErrProtocol
	case StatusPermission:
		return ErrPermission
	case StatusUnknownBuffer:
		return ErrUnknownBuffer
	case StatusOutOfRange:
		return ErrOutOfRange
	case StatusLimit:
		return ErrLimit
	case StatusDevice:
		return ErrDeviceNotServed
	case StatusNotSupported:
		return ErrNotSupported
	case StatusInternal:
		return ErrInternal
	case StatusConnLimit:
		return ErrConnLimit
	case StatusIdle:
		return ErrIdle
	case StatusTimeout:
		return ErrTimeout
	}
	return nil
}

// statusOf picks the status code for an error made on the broker's side.
func statusOf(err error) uint16 {
	switch {
	case errors.Is(err, ErrConnLimit):
		return StatusConnLimit
	case errors.Is(err, ErrIdle):
		return StatusIdle
	case errors.Is(err, ErrTimeout):
		return StatusTimeout
	case errors.Is(err, ErrOutOfRange):
		return StatusOutOfRange
	case errors.Is(err, ErrUnknownBuffer):
		return StatusUnknownBuffer
	case errors.Is(err, ErrLimit):
		return StatusLimit
	case errors.Is(err, ErrDeviceNotServed):
		return StatusDevice
	case errors.Is(err, ErrPermission):
		return StatusPermission
	case errors.Is(err, ErrProtocol):
		return StatusProtocol
	case errors.Is(err, ErrNotSupported):
		return StatusNotSupported
	}
	return StatusInternal
}
