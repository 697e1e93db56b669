package driver

import (
	"errors"
	"fmt"
)

// Result is a CUresult other than CUDA_SUCCESS. Functions of this package never return a zero Result
// as an error: success is a nil error.
type Result int32

// CUresult values the project names (docs/driver-facts.md, section 1).
const (
	Success                          Result = 0
	ErrorInvalidValue                Result = 1
	ErrorOutOfMemory                 Result = 2
	ErrorNotInitialized              Result = 3
	ErrorDeinitialized               Result = 4
	ErrorStubLibrary                 Result = 34
	ErrorNoDevice                    Result = 100
	ErrorInvalidDevice               Result = 101
	ErrorInvalidImage                Result = 200
	ErrorInvalidContext              Result = 201
	ErrorAlreadyMapped               Result = 208
	ErrorNotMapped                   Result = 211
	ErrorPeerAccessUnsupported       Result = 217
	ErrorInvalidPTX                  Result = 218
	ErrorInvalidHandle               Result = 400
	ErrorNotFound                    Result = 500
	ErrorNotReady                    Result = 600
	ErrorIllegalAddress              Result = 700
	ErrorLaunchFailed                Result = 719
	ErrorPeerAccessAlreadyEnabled    Result = 704
	ErrorPeerAccessNotEnabled        Result = 705
	ErrorHostMemoryAlreadyRegistered Result = 712
	ErrorHostMemoryNotRegistered     Result = 713
	ErrorNotPermitted                Result = 800
	ErrorNotSupported                Result = 801
	ErrorSystemDriverMismatch        Result = 803
	ErrorUnknown                     Result = 999
)

// Sentinel errors. A Result matches the sentinel of its family with errors.Is, so callers need not
// know the code: errors.Is(err, driver.ErrOutOfMemory) holds for CUDA_ERROR_OUT_OF_MEMORY.
var (
	// ErrNoDriver: libcuda.so.1 could not be loaded, or it is the toolkit's stub library.
	ErrNoDriver = errors.New("CUDA driver not available")
	// ErrNotSupported: the driver or device lacks the feature (CUDA_ERROR_NOT_SUPPORTED, a peer pair
	// without access, or an entry point missing from the loaded library).
	ErrNotSupported = errors.New("not supported")
	// ErrInvalidValue: an argument the driver (or this project) refuses.
	ErrInvalidValue = errors.New("invalid value")
	// ErrOutOfMemory: device memory, host memory or address space ran out.
	ErrOutOfMemory = errors.New("out of memory")
	// ErrNoDevice: no CUDA device, or an ordinal out of range.
	ErrNoDevice = errors.New("no such device")
	// ErrInvalidHandle: a stream, event or other handle the driver does not know. (The driver
	// reports a released allocation handle or a non-CUDA FD as CUDA_ERROR_INVALID_VALUE.)
	ErrInvalidHandle = errors.New("invalid handle")
	// ErrNotPermitted: the operation is refused by policy (for example FABRIC handles without an IMEX
	// channel).
	ErrNotPermitted = errors.New("not permitted")
	// ErrNotInitialized: cuInit has not run, or the driver is shutting down.
	ErrNotInitialized = errors.New("driver not initialized")
	// ErrInvalidContext: no current context on the calling thread, or a destroyed one.
	ErrInvalidContext = errors.New("invalid context")
	// ErrIllegalAddress: a kernel or copy touched memory it may not.
	ErrIllegalAddress = errors.New("illegal address")
)

var resultSentinel = map[Result]error{
	ErrorInvalidValue:          ErrInvalidValue,
	ErrorOutOfMemory:           ErrOutOfMemory,
	ErrorNotInitialized:        ErrNotInitialized,
	ErrorDeinitialized:         ErrNotInitialized,
	ErrorStubLibrary:           ErrNoDriver,
	ErrorSystemDriverMismatch:  ErrNoDriver,
	ErrorNoDevice:              ErrNoDevice,
	ErrorInvalidDevice:         ErrNoDevice,
	ErrorInvalidContext:        ErrInvalidContext,
	ErrorPeerAccessUnsupported: ErrNotSupported,
	ErrorInvalidHandle:         ErrInvalidHandle,
	ErrorNotPermitted:          ErrNotPermitted,
	ErrorNotSupported:          ErrNotSupported,
	ErrorIllegalAddress:        ErrIllegalAddress,
}

// Is reports whether r belongs to target's family (see the sentinel errors).
func (r Result) Is(target error) bool {
	if s, ok := resultSentinel[r]; ok && s == target {
		return true
	}
	return false
}

// Name is the enumerator's name, for example "CUDA_ERROR_INVALID_VALUE".
func (r Result) Name() string {
	if n, _, ok := loadedErrorText(r); ok {
		return n
	}
	if e, ok := builtinResults[r]; ok {
		return e.name
	}
	return fmt.Sprintf("CUDA_ERROR_%d", int32(r))
}

// Description is the driver's sentence for r (cuGetErrorString), or the built-in one when the driver
// is not loaded.
func (r Result) Description() string {
	if _, d, ok := loadedErrorText(r); ok {
		return d
	}
	if e, ok := builtinResults[r]; ok {
		return e.desc
	}
	return "unknown CUresult"
}

// Error gives the name and the description: "CUDA_ERROR_INVALID_VALUE: invalid argument".
func (r Result) Error() string { return r.Name() + ": " + r.Description() }

// Check converts a raw CUresult into an error: nil for CUDA_SUCCESS, else the Result.
func Check(code int32) error {
	if code == 0 {
		return nil
	}
	return Result(code)
}

// SymbolError is returned by a call whose entry point is missing from the loaded driver library. It
// wraps ErrNotSupported.
type SymbolError struct {
	Symbol string // the versioned symbol, for example "cuMemCreate"
	Since  string // the first CUDA version that has it, when known
}

func (e *SymbolError) Error() string {
	s := "driver: " + e.Symbol + " is not exported by the loaded libcuda.so.1"
	if e.Since != "" {
		s += " (needs a CUDA " + e.Since + "+ driver)"
	}
	return s + ": " + ErrNotSupported.Error()
}

// Unwrap makes errors.Is(err, ErrNotSupported) hold.
func (e *SymbolError) Unwrap() error { return ErrNotSupported }

type resultText struct{ name, desc string }

// builtinResults is used when the library is absent (or for codes it does not name). The texts follow
// the driver's own wording.
var builtinResults = map[Result]resultText{
	Success:                          {"CUDA_SUCCESS", "no error"},
	ErrorInvalidValue:                {"CUDA_ERROR_INVALID_VALUE", "invalid argument"},
	ErrorOutOfMemory:                 {"CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
	ErrorNotInitialized:              {"CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
	ErrorDeinitialized:               {"CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
	ErrorStubLibrary:                 {"CUDA_ERROR_STUB_LIBRARY", "CUDA driver is a stub library"},
	ErrorNoDevice:                    {"CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
	ErrorInvalidDevice:               {"CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
	ErrorInvalidImage:                {"CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
	ErrorInvalidContext:              {"CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
	ErrorAlreadyMapped:               {"CUDA_ERROR_ALREADY_MAPPED", "resource already mapped"},
	ErrorNotMapped:                   {"CUDA_ERROR_NOT_MAPPED", "resource not mapped"},
	ErrorPeerAccessUnsupported:       {"CUDA_ERROR_PEER_ACCESS_UNSUPPORTED", "peer access is not supported between these two devices"},
	ErrorInvalidPTX:                  {"CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed"},
	ErrorInvalidHandle:               {"CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
	ErrorNotFound:                    {"CUDA_ERROR_NOT_FOUND", "named symbol not found"},
	ErrorNotReady:                    {"CUDA_ERROR_NOT_READY", "device not ready"},
	ErrorIllegalAddress:              {"CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
	ErrorLaunchFailed:                {"CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
	ErrorPeerAccessAlreadyEnabled:    {"CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED", "peer access is already enabled"},
	ErrorPeerAccessNotEnabled:        {"CUDA_ERROR_PEER_ACCESS_NOT_ENABLED", "peer access has not been enabled"},
	ErrorHostMemoryAlreadyRegistered: {"CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED", "part or all of the requested memory range is already mapped"},
	ErrorHostMemoryNotRegistered:     {"CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED", "pointer does not correspond to a registered memory region"},
	ErrorNotPermitted:                {"CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
	ErrorNotSupported:                {"CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
	ErrorSystemDriverMismatch:        {"CUDA_ERROR_SYSTEM_DRIVER_MISMATCH", "system has unsupported display driver / cuda driver combination"},
	ErrorUnknown:                     {"CUDA_ERROR_UNKNOWN", "unknown error"},
}

// loadedErrorText asks the loaded library for r's name and description. It is replaced by the cgo
// loader; without a library it reports ok=false.
var loadedErrorText = func(r Result) (name, desc string, ok bool) { return "", "", false }
