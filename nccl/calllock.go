package nccl

import "context"

// callLock serializes the calls on a communicator as a mutex does (NCCL takes one call at a time per
// communicator), but a call with a context stops waiting for it when the context ends (lockCtx):
// an operation queued behind a receive whose peer never comes gets its own deadline, not the
// receive's.
type callLock chan struct{}

func newCallLock() callLock { return make(callLock, 1) }

func (l callLock) Lock() { l <- struct{}{} }

func (l callLock) Unlock() { <-l }

// TryLock takes the lock when it is free, at once, and reports whether it did.
func (l callLock) TryLock() bool {
	select {
	case l <- struct{}{}:
		return true
	default:
		return false
	}
}

// lockCtx takes the lock, or returns ctx's error when ctx ends first; a free lock is taken even when
// ctx has ended.
func (l callLock) lockCtx(ctx context.Context) error {
	if l.TryLock() {
		return nil
	}
	select {
	case l <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
