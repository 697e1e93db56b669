// Package lifetime is the close-once ownership state that every cuvmm owning type holds: a lock, a
// closed flag, the parent it counts as a child of, and its own children counted by kind. Built with
// the cuvmmleak tag, every tracked owner that becomes unreachable without being closed is reported
// with the stack that created it (runtime.AddCleanup); without the tag tracking costs nothing.
package lifetime

import (
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync"
)

// Sentinels shared by every owning type (package vmm re-exports them).
var (
	// ErrClosed: a method was called on an object after its Close.
	ErrClosed = errors.New("vmm: use after Close")
	// ErrInUse: Close of a parent that still has live children.
	ErrInUse = errors.New("vmm: still in use")
)

// Owner is the ownership state of one object. The zero value is an open owner with no parent. Hold
// it as a named field (never embedded: its methods are not the owning type's API).
type Owner struct {
	mu     sync.Mutex
	closed bool
	parent *Owner
	kind   string
	leak   *leakState

	calls   int        // calls in progress on the object, from Begin to End
	closers int        // Closes waiting for the calls in progress: Begin refuses while there are any
	idle    *sync.Cond // broadcast when calls drops to zero; L is &mu, made by the first Close that waits

	kidsMu sync.Mutex
	kids   map[string]int
	nkids  int
}

// Init names the owner's kind ("allocation", "reservation", ...) and counts it as a child of parent
// (nil: none). Call it once, before the object is shared.
func (o *Owner) Init(parent *Owner, kind string) {
	o.parent, o.kind = parent, kind
	if parent != nil {
		parent.addChild(kind, 1)
	}
}

// Track reports obj, which holds o, as a leak when it becomes unreachable while o is open (only in
// builds with the cuvmmleak tag), naming o's kind. Call it after Init; it panics on an owner Init
// did not name, whose leak report could not say what leaked.
func Track[T any](obj *T, o *Owner) {
	if o.kind == "" {
		panic("lifetime: Track of an owner with no kind (call Init first)")
	}
	track(obj, o)
}

// Lock locks the owner's mutex, which also guards the owning type's own state.
func (o *Owner) Lock() { o.mu.Lock() }

// Unlock unlocks it.
func (o *Owner) Unlock() { o.mu.Unlock() }

// Closed reports whether the owner is closed; the caller holds the lock.
func (o *Owner) Closed() bool { return o.closed }

// IsClosed reports whether the owner is closed, taking the lock.
func (o *Owner) IsClosed() bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.closed
}

// MarkClosed closes the owner: it no longer counts as its parent's child and is no leak. The caller
// holds the lock; a second call does nothing.
func (o *Owner) MarkClosed() {
	if o.closed {
		return
	}
	o.closed = true
	if o.parent != nil {
		o.parent.addChild(o.kind, -1)
	}
	if o.leak != nil {
		o.leak.closed.Store(true)
	}
}

// Shut marks the owner closed, taking the lock, and reports whether it was open: for a Close that
// must look closed to concurrent calls at once and frees afterwards without the lock.
// It does not wait for calls counted by Begin: an owner that counts calls is closed with Close.
func (o *Owner) Shut() (wasOpen bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	wasOpen = !o.closed
	o.MarkClosed()
	return wasOpen
}

// Begin counts a call in progress on the object, one that passes its driver handle to the driver,
// until End. It reports false, counting nothing, once the owner is closed or while Close waits for
// the calls in progress. Close frees only after every counted call has ended, so a call between
// Begin and End never passes a freed handle (which the driver may since have given to a new object).
// The owner's lock is not held in between, so calls on one object run concurrently.
func (o *Owner) Begin() bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.closed || o.closers > 0 {
		return false
	}
	o.calls++
	return true
}

// End ends a call counted by Begin.
func (o *Owner) End() {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.calls--; o.calls == 0 && o.idle != nil {
		o.idle.Broadcast()
	}
}

// waitCalls waits, with the lock released meanwhile, until no call counted by Begin is in progress;
// new ones are refused until then. The caller holds the lock.
func (o *Owner) waitCalls() {
	if o.calls == 0 {
		return
	}
	if o.idle == nil {
		o.idle = sync.NewCond(&o.mu)
	}
	// Counted until it wakes, so that another Close, woken first and failing to free, leaves Begin
	// refusing while this one has yet to run.
	o.closers++
	for o.calls > 0 {
		o.idle.Wait()
	}
	o.closers-- // the lock is held from here until free is done
}

// Close is the common Close: nothing when already closed; an error wrapping ErrInUse, naming what
// still depends on it, while children remain; otherwise, once the calls in progress (Begin) have
// ended, free, and on success the owner is closed. A failed free leaves the owner open, so Close can
// be retried. what names the object in errors.
func (o *Owner) Close(what string, free func() error) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.closed {
		return nil
	}
	if n := o.Children(); n > 0 {
		return fmt.Errorf("%s: still owns %s: %w", what, o.Remaining(), ErrInUse)
	}
	if o.waitCalls(); o.closed {
		return nil // closed by another Close while this one waited
	}
	if free != nil {
		if err := free(); err != nil {
			return err
		}
	}
	o.MarkClosed()
	return nil
}

func (o *Owner) addChild(kind string, n int) {
	o.kidsMu.Lock()
	defer o.kidsMu.Unlock()
	if o.kids == nil {
		o.kids = map[string]int{}
	}
	o.kids[kind] += n
	if o.kids[kind] == 0 {
		delete(o.kids, kind)
	}
	o.nkids += n
}

// Children is the number of open children.
func (o *Owner) Children() int {
	o.kidsMu.Lock()
	defer o.kidsMu.Unlock()
	return o.nkids
}

// Remaining lists the open children by kind, for example "2 allocation(s), 1 reservation(s)"; ""
// when there are none.
func (o *Owner) Remaining() string {
	o.kidsMu.Lock()
	defer o.kidsMu.Unlock()
	kinds := make([]string, 0, len(o.kids))
	for k := range o.kids {
		kinds = append(kinds, k)
	}
	sort.Strings(kinds)
	parts := make([]string, len(kinds))
	for i, k := range kinds {
		parts[i] = fmt.Sprintf("%d %s(s)", o.kids[k], k)
	}
	return strings.Join(parts, ", ")
}
