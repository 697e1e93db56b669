package nccl

import (
	"errors"
	"fmt"

	"github.com/cuvmm/cuvmm/driver"
)

// Result is an ncclResult_t other than ncclSuccess. Functions of this package never return a zero
// Result as an error: success is a nil error.
type Result int32

// ncclResult_t values (nccl.h 2.28).
const (
	Success            Result = 0
	UnhandledCudaError Result = 1
	SystemError        Result = 2
	InternalError      Result = 3
	InvalidArgument    Result = 4
	InvalidUsage       Result = 5
	RemoteError        Result = 6
	InProgress         Result = 7
)

var resultNames = map[Result]string{
	Success:            "ncclSuccess",
	UnhandledCudaError: "ncclUnhandledCudaError",
	SystemError:        "ncclSystemError",
	InternalError:      "ncclInternalError",
	InvalidArgument:    "ncclInvalidArgument",
	InvalidUsage:       "ncclInvalidUsage",
	RemoteError:        "ncclRemoteError",
	InProgress:         "ncclInProgress",
}

// builtinText is NCCL's own wording (ncclGetErrorString), used when no library is loaded.
var builtinText = map[Result]string{
	Success:            "no error",
	UnhandledCudaError: "unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
	SystemError:        "unhandled system error (run with NCCL_DEBUG=INFO for details)",
	InternalError:      "internal error - please report this issue to the NCCL developers",
	InvalidArgument:    "invalid argument (run with NCCL_DEBUG=WARN for details)",
	InvalidUsage:       "invalid usage (run with NCCL_DEBUG=WARN for details)",
	RemoteError:        "remote process exited or there was a network error",
	InProgress:         "NCCL operation in progress",
}

// Name is the enumerator's name, for example "ncclInvalidUsage".
func (r Result) Name() string {
	if n, ok := resultNames[r]; ok {
		return n
	}
	return fmt.Sprintf("ncclResult(%d)", int32(r))
}

// Description is ncclGetErrorString's text for r: the loaded library's when one is loaded.
func (r Result) Description() string {
	if s := loadedErrorString(r); s != "" {
		return s
	}
	if s, ok := builtinText[r]; ok {
		return s
	}
	return "unknown result code"
}

// Error gives the name and the description: "ncclInvalidUsage: invalid usage (...)".
func (r Result) Error() string { return r.Name() + ": " + r.Description() }

// Is makes a Result match the sentinel of its family (see the sentinel errors).
func (r Result) Is(target error) bool {
	switch r {
	case InvalidArgument, InvalidUsage:
		return target == ErrInvalidValue
	case RemoteError:
		return target == ErrRemote
	case SystemError:
		return target == ErrSystem
	case InternalError:
		return target == ErrInternal
	case UnhandledCudaError:
		return target == ErrCUDA
	case InProgress:
		return target == ErrInProgress
	}
	return false
}

// Check converts a raw ncclResult_t into an error: nil for ncclSuccess, else the Result.
func Check(code int32) error {
	if code == 0 {
		return nil
	}
	return Result(code)
}

// Sentinel errors. Results match theirs with errors.Is; ErrNotSupported and ErrInvalidValue are the
// driver package's, so one errors.Is covers CUDA and NCCL alike.
var (
	// ErrNoNCCL: libnccl.so.2 could not be loaded (the error names every place tried).
	ErrNoNCCL = errors.New("NCCL not available")
	// ErrNotSupported: the loaded NCCL is too old for the call (the error names the minimum version),
	// or lacks its entry point.
	ErrNotSupported = driver.ErrNotSupported
	// ErrInvalidValue: an argument NCCL or this package refuses (ncclInvalidArgument,
	// ncclInvalidUsage, a count that overflows, a buffer on another device).
	ErrInvalidValue = driver.ErrInvalidValue
	// ErrRemote: a peer exited or the network failed (ncclRemoteError).
	ErrRemote = errors.New("nccl: remote rank failed")
	// ErrSystem: a system call failed inside NCCL (ncclSystemError).
	ErrSystem = errors.New("nccl: system error")
	// ErrInternal: NCCL reported an internal error (ncclInternalError).
	ErrInternal = errors.New("nccl: internal error")
	// ErrCUDA: a CUDA call failed inside NCCL (ncclUnhandledCudaError).
	ErrCUDA = errors.New("nccl: CUDA error")
	// ErrInProgress: a non-blocking operation has not finished (ncclInProgress); the methods of Comm
	// poll until it has, so callers see it only from the raw API.
	ErrInProgress = errors.New("nccl: in progress")
	// ErrAborted: the communicator was aborted (ncclCommAbort), because a context ended while an
	// operation waited, because NCCL reported an error for it, or because Abort was called; it cannot
	// be used again. The error of the operation that was waiting also wraps the context's error
	// (context.DeadlineExceeded) or NCCL's (ErrInvalidValue for ncclInvalidUsage, ErrRemote...).
	ErrAborted = errors.New("nccl: communicator aborted")
	// ErrClosed: a method was called after Close.
	ErrClosed = errors.New("nccl: use after Close")
	// ErrInUse: Close of a communicator while another goroutine's call is using it (Close returns at
	// once and may be called again; Abort interrupts a call that hangs), or of one whose ranks in
	// other processes have not closed theirs within Options.CloseTimeout (NCCL's destroy waits for
	// them).
	ErrInUse = errors.New("nccl: still in use")
	// ErrAlreadyRegistered: Register of a buffer (or part of one) that is already registered with
	// the communicator.
	ErrAlreadyRegistered = errors.New("nccl: buffer already registered")
	// ErrWrongDevice: a buffer whose memory is on another device than the communicator's.
	ErrWrongDevice = errors.New("nccl: buffer on another device")
	// ErrRegistered is not returned by this package; it is kept for callers that name it. A
	// registration holds the buffer's allocations (vmm.Allocation.Hold), so closing or shrinking a
	// registered buffer fails in the buffer's own Close or Shrink with an error wrapping
	// vmm.ErrInUse: close the registration first.
	ErrRegistered = errors.New("nccl: buffer still registered")
)

// CallError is an NCCL call that failed: the call, its Result, and ncclGetLastError's text when the
// library had one. errors.Is(err, ErrInvalidValue) and the like work through the Result.
type CallError struct {
	Call   string // "ncclSend", "ncclCommInitRankConfig", ...
	Result Result
	Last   string // ncclGetLastError: the library's last message, "" when none
}

func (e *CallError) Error() string {
	s := e.Call + ": " + e.Result.Error()
	if e.Last != "" {
		s += " (last NCCL error: " + e.Last + ")"
	}
	return s
}

// Unwrap gives the Result.
func (e *CallError) Unwrap() error { return e.Result }

// VersionError is returned when the loaded NCCL is older than a feature needs, or lacks the entry
// point. It wraps ErrNotSupported.
type VersionError struct {
	Feature string // the entry point or feature, for example "ncclCommWindowRegister"
	Need    int    // the minimum NCCL_VERSION_CODE, for example 22700
	Have    int    // the loaded library's version code (0 when unknown)
}

func (e *VersionError) Error() string {
	s := fmt.Sprintf("nccl: %s needs NCCL %s or newer", e.Feature, FormatVersion(e.Need))
	if e.Have != 0 {
		s += fmt.Sprintf(", the loaded library is %s", FormatVersion(e.Have))
	} else {
		s += ", the loaded library does not export it"
	}
	return s + ": " + ErrNotSupported.Error()
}

// Unwrap makes errors.Is(err, ErrNotSupported) hold.
func (e *VersionError) Unwrap() error { return ErrNotSupported }

// FormatVersion writes an NCCL_VERSION_CODE as "2.28.9" (codes below 10000 use the old encoding,
// major*1000 + minor*100 + patch).
func FormatVersion(code int) string {
	if code < 10000 {
		return fmt.Sprintf("%d.%d.%d", code/1000, code%1000/100, code%100)
	}
	return fmt.Sprintf("%d.%d.%d", code/10000, code%10000/100, code%100)
}

// loadedErrorString asks the loaded library for ncclGetErrorString(r); replaced by the cgo loader.
var loadedErrorString = func(r Result) string { return "" }
