//go:build cuvmmleak

package lifetime

import (
	"fmt"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
)

// Enabled reports whether leak tracking is built in (the cuvmmleak build tag).
const Enabled = true

// leakState is what the clean-up sees: it must not point back at the owning object, or the object
// would never become unreachable.
type leakState struct {
	closed atomic.Bool
	kind   string
	stack  string
}

var leaks struct {
	sync.Mutex
	list []string
}

func track[T any](obj *T, o *Owner) {
	buf := make([]byte, 4096)
	buf = buf[:runtime.Stack(buf, false)]
	st := &leakState{kind: o.kind, stack: string(buf)}
	o.leak = st
	runtime.AddCleanup(obj, report, st)
}

func report(st *leakState) {
	if st.closed.Load() {
		return
	}
	msg := fmt.Sprintf("cuvmm: leak: a %s was never closed; it was created at:\n%s", st.kind, st.stack)
	fmt.Fprintln(os.Stderr, msg)
	leaks.Lock()
	leaks.list = append(leaks.list, msg)
	leaks.Unlock()
}

// Leaks returns the leak reports made so far.
func Leaks() []string {
	leaks.Lock()
	defer leaks.Unlock()
	return append([]string(nil), leaks.list...)
}
