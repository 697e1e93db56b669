package unixsock

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// DeadlineWhenDone sets a past deadline when the context ends, and its undo clears the deadline;
// an undo before the end sets only the zero time.
func TestDeadlineWhenDone(t *testing.T) {
	var mu sync.Mutex
	var got []time.Time
	set := func(d time.Time) { mu.Lock(); got = append(got, d); mu.Unlock() }

	ctx, cancel := context.WithCancel(context.Background())
	undo := DeadlineWhenDone(ctx, set)
	cancel()
	require.Eventually(t, func() bool { mu.Lock(); defer mu.Unlock(); return len(got) == 1 }, time.Second, time.Millisecond)
	undo()
	require.Equal(t, []time.Time{time.Unix(1, 0), {}}, got)

	got = nil
	ctx, cancel = context.WithCancel(context.Background())
	DeadlineWhenDone(ctx, set)()
	cancel()
	time.Sleep(10 * time.Millisecond)
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, []time.Time{{}}, got, "nothing is set after the undo")
}
