package nccl

import "time"

// Test hooks, visible to package nccl_test in the test binary only.

// SetAbortWait sets how long Wait still waits for the stream after an abort, until restore is called.
func SetAbortWait(d time.Duration) (restore func()) {
	old := abortWait
	abortWait = d
	return func() { abortWait = old }
}
