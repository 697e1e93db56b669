//go:build cuvmmleak

package lifetime

import (
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

type thing struct {
	own  Owner
	data [64]byte
}

func makeThings(closeOne bool) {
	leaked := &thing{}
	leaked.own.Init(nil, "test object")
	Track(leaked, &leaked.own)
	closed := &thing{}
	closed.own.Init(nil, "closed object")
	Track(closed, &closed.own)
	if closeOne {
		_ = closed.own.Close("closed", nil)
	}
}

// An owner that becomes unreachable while open is reported with its creation stack; a closed one
// is not.
func TestLeakReported(t *testing.T) {
	before := len(Leaks())
	makeThings(true)
	var got []string
	for i := 0; i < 50 && len(got) == 0; i++ {
		runtime.GC()
		time.Sleep(5 * time.Millisecond)
		got = Leaks()[before:]
	}
	require.Len(t, got, 1)
	require.Contains(t, got[0], "a test object was never closed")
	require.Contains(t, got[0], "makeThings", "the creation stack")
}
