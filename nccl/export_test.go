package nccl

import (
	"time"

	"github.com/cuvmm/cuvmm/vmm"
)

// Test hooks, visible to package nccl_test in the test binary only.

// SetAbortWait sets how long Wait still waits for the stream after an abort, until restore is called.
func SetAbortWait(d time.Duration) (restore func()) {
	old := abortWait
	abortWait = d
	return func() { abortWait = old }
}

// SetHoldStream replaces how Group.Run holds a stream (vmm.Stream.Hold) until restore is called.
func SetHoldStream(f func(*vmm.Stream) (release func(), err error)) (restore func()) {
	old := holdStream
	holdStream = f
	return func() { holdStream = old }
}

// PauseAfter takes the pause Wait takes before its next poll after waiting for elapsed.
func PauseAfter(elapsed time.Duration) { pollPause(elapsed) }

// SetPause replaces the pause between the polls of Wait and waitLocked until restore is called.
func SetPause(f func(elapsed time.Duration)) (restore func()) {
	old := pause
	pause = f
	return func() { pause = old }
}
