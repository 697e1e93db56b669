package driver

// Graph is a CUgraph: work recorded by stream capture (StreamBeginCapture, StreamEndCapture).
type Graph uintptr

// GraphExec is a CUgraphExec: an instantiated graph that GraphLaunch queues on a stream.
type GraphExec uintptr

// CaptureMode is CUstreamCaptureMode: which calls made during a capture are refused as unsafe.
type CaptureMode int32

// Capture modes (cuStreamBeginCapture_v2).
const (
	// CaptureModeGlobal refuses unsafe calls (synchronous copies, allocation) on any thread while
	// the capture is open, and ties the capture to the thread that began it.
	CaptureModeGlobal CaptureMode = 0
	// CaptureModeThreadLocal refuses unsafe calls on the capturing thread only.
	CaptureModeThreadLocal CaptureMode = 1
	// CaptureModeRelaxed refuses nothing and lets any thread end the capture: the mode for Go, where
	// goroutines move between OS threads.
	CaptureModeRelaxed CaptureMode = 2
)

// CUresult values of stream capture and graphs.
const (
	ErrorIllegalState             Result = 401
	ErrorStreamCaptureUnsupported Result = 900
	ErrorStreamCaptureInvalidated Result = 901
	ErrorStreamCaptureImplicit    Result = 906 // the legacy stream used while a blocking stream of its context captures
	ErrorStreamCaptureWrongThread Result = 908
)

func init() {
	builtinResults[ErrorIllegalState] = resultText{"CUDA_ERROR_ILLEGAL_STATE", "the operation is not permitted in the current state"}
	builtinResults[ErrorStreamCaptureUnsupported] = resultText{"CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "operation not permitted when stream is capturing"}
	builtinResults[ErrorStreamCaptureInvalidated] = resultText{"CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", "operation failed due to a previous error during capture"}
	builtinResults[ErrorStreamCaptureImplicit] = resultText{"CUDA_ERROR_STREAM_CAPTURE_IMPLICIT", "operation would make the legacy stream depend on a capturing blocking stream"}
	builtinResults[ErrorStreamCaptureWrongThread] = resultText{"CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD", "attempt to terminate a thread-local capture sequence from another thread"}
	resultSentinel[ErrorStreamCaptureUnsupported] = ErrNotSupported
}
