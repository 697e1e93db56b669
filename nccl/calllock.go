package nccl

import (
	"context"
	"sync"
)

// callLock serializes the calls on a communicator as a mutex does (NCCL takes one call at a time per
// communicator), but a call with a context stops waiting for it when the context ends (lockCtx):
// an operation queued behind a receive whose peer never comes gets its own deadline, not the
// receive's. Lock, Unlock and TryLock are a sync.Mutex's, so a waiter is not handed the lock ahead
// of a caller that tries it (Close only tries it). The zero value is unlocked.
type callLock struct {
	mu    sync.Mutex
	gate  sync.Mutex    // guards freed
	freed chan struct{} // closed, and replaced, by each Unlock: lockCtx's waiters try again
}

func (l *callLock) Lock() { l.mu.Lock() }

func (l *callLock) TryLock() bool { return l.mu.TryLock() }

func (l *callLock) Unlock() {
	l.mu.Unlock()
	l.gate.Lock()
	if l.freed != nil {
		close(l.freed)
		l.freed = nil
	}
	l.gate.Unlock()
}

// lockCtx takes the lock, or returns ctx's error when ctx ends first; a free lock is taken even when
// ctx has ended.
func (l *callLock) lockCtx(ctx context.Context) error {
	for {
		freed := l.next()
		if l.mu.TryLock() {
			return nil
		}
		select {
		case <-freed:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// next is the channel the next Unlock closes.
func (l *callLock) next() chan struct{} {
	l.gate.Lock()
	defer l.gate.Unlock()
	if l.freed == nil {
		l.freed = make(chan struct{})
	}
	return l.freed
}
