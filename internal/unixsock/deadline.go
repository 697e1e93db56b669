package unixsock

import (
	"context"
	"time"
)

// DeadlineWhenDone calls set with a past time once ctx ends (which makes a blocked Accept, Read or
// Write return). The function it returns undoes that: it stops the watch, waits for a set already
// under way, and clears the deadline (set with the zero time), so nothing sets it after.
func DeadlineWhenDone(ctx context.Context, set func(time.Time)) (undo func()) {
	fired := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		defer close(fired)
		set(time.Unix(1, 0))
	})
	return func() {
		if !stop() {
			<-fired
		}
		set(time.Time{})
	}
}
