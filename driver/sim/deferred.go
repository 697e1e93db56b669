package sim

import (
	"fmt"
	"os"

	"github.com/cuvmm/cuvmm/driver"
)

// Deferred work, the default (DeferWork; Eager turns it off).
//
// An asynchronous copy, fill or kernel launch (and so each node of a graph launch) on a stream is
// only checked when it is queued (arguments, stream, access rights: the errors the driver returns at
// once) and then waits in its stream's queue; it runs, in stream order, when something needs it
// complete: cuStreamSynchronize of its stream, cuCtxSynchronize, cuEventSynchronize / cuEventQuery /
// cuEventElapsedTime of an event recorded after it, work of another stream that waits for such an
// event (cuStreamWaitEvent) and is itself run, a synchronous copy or fill (which the driver orders
// after the legacy stream and every blocking stream of the device), cuMemFree and cuMemFreeHost (which
// synchronize on the driver), and cuStreamDestroy (best effort). Each queued operation is a gate of
// async.go's completion machinery: its stream's later work, events and asynchronous frees wait for it,
// so HoldStream holds the data movement too.
//
// Memory is resolved again when the work runs, as on the GPU: a copy whose source or destination was
// unmapped or freed before the stream passed it fails then, and so does a kernel that fails. The first
// such failure is reported (CUDA_ERROR_ILLEGAL_ADDRESS for memory, the kernel's code otherwise) by the
// next cuStreamSynchronize, cuEventSynchronize or cuCtxSynchronize, like the driver's asynchronous
// errors (the simulator's context stays usable afterwards).
//
// What this finds: code that reuses or frees a staging buffer, reads a destination, or unmaps memory
// before waiting for the stream, which passes when data moves at once and corrupts data on a GPU.
//
// With Eager, queued work moves its data before the queuing call returns, and a kernel's or a
// copy's memory error is the launching call's own: handy to see at once which call is wrong, but
// blind to a missing wait.

// DeferWorkEnv is the environment variable that picks the mode of every simulator New makes: "0"
// makes them eager (Eager), anything else leaves work deferred; an option passed to New wins.
const DeferWorkEnv = "CUVMM_SIM_DEFER"

// DeferWork makes queued work move its data only when its stream is run (see deferred.go): at the
// latest when it is synchronized with, in stream order. The default, unless CUVMM_SIM_DEFER=0.
func DeferWork() Option { return func(c *config) { c.deferWork = true } }

// Eager makes queued work move its data before the queuing call returns (see deferred.go).
func Eager() Option { return func(c *config) { c.deferWork = false } }

func deferFromEnv() bool { return os.Getenv(DeferWorkEnv) != "0" }

// deferred is one queued operation waiting for its stream to run it.
type deferred struct {
	st      driver.Stream
	name    string
	after   []*gate // what it waits for: its stream's earlier work, holds, waited events
	g       *gate   // done once it has run
	run     func() error
	running bool
}

// deferring reports whether an operation queued on stream st (nil: a synchronous call) is deferred.
func (s *Sim) deferring(st *driver.Stream) bool {
	return s.cfg.deferWork && st != nil
}

// enqueue queues run on st; the caller holds s.mu. The stream's later work waits for it.
func (s *Sim) enqueue(st driver.Stream, d *device, name string, run func() error) {
	a := s.async()
	after := a.pending(st)
	if s.blocking(st) {
		// The legacy stream and blocking streams wait for each other (implicit synchronization).
		for _, x := range s.blockingPeers(st, d) {
			after = append(after, a.pending(x)...)
		}
	}
	op := &deferred{st: st, name: name, after: after, run: run}
	op.g = &gate{op: op}
	a.queue[st] = append(a.queue[st], op)
	// The new gate completes only after everything in after, so it alone stands for the stream's
	// work so far (a hold gate added later is appended after it).
	a.waits[st] = []*gate{op.g}
}

// blocking reports whether st takes part in the legacy stream's implicit synchronization: the
// legacy stream, the per-thread default stream (2, which is not a non-blocking stream) and every
// stream made without NON_BLOCKING.
func (s *Sim) blocking(st driver.Stream) bool {
	if st == 0 || st == 1 || st == 2 {
		return true
	}
	x, ok := s.streams[st]
	return ok && x.flags&driver.StreamNonBlocking == 0
}

// blockingPeers lists the streams st synchronizes with implicitly: for the legacy stream, every
// blocking stream of d and the per-thread default stream; for a blocking stream, the legacy stream.
func (s *Sim) blockingPeers(st driver.Stream, d *device) []driver.Stream {
	if st != 0 && st != 1 {
		return []driver.Stream{0, 1}
	}
	out := []driver.Stream{0, 1, 2}
	for h, x := range s.streams {
		if x.dev == d && s.blocking(h) {
			out = append(out, h)
		}
	}
	return out
}

// drive runs, as far as it can, the queued work the gates stand for; the caller holds s.mu, which
// is released while work runs. Gates that wait for a hold or for work another goroutine is running
// stay open; the caller waits (waitFor) and drives again.
func (s *Sim) drive(gs []*gate) {
	if !s.cfg.deferWork {
		return
	}
	gs = append([]*gate(nil), gs...) // the caller's slice may change while s.mu is released
	for _, g := range gs {
		if !g.done && g.op != nil {
			s.runUpTo(g.op)
		}
	}
}

// runUpTo runs op's stream from its head until op has run.
func (s *Sim) runUpTo(op *deferred) {
	for !op.g.done && s.as != nil {
		a := s.as
		q := a.queue[op.st]
		if len(q) == 0 || q[0].running {
			return
		}
		h := q[0]
		s.drive(h.after)
		if s.as == nil {
			return
		}
		if _, done := open(h.after); !done {
			return
		}
		if q := a.queue[op.st]; len(q) == 0 || q[0] != h || h.running {
			continue // another goroutine ran it while s.mu was released
		}
		h.running = true
		s.mu.Unlock()
		err := h.run()
		s.mu.Lock()
		if s.as != a {
			return // closed meanwhile
		}
		a.queue[op.st] = a.queue[op.st][1:]
		if len(a.queue[op.st]) == 0 {
			delete(a.queue, op.st)
		}
		h.running, h.g.done = false, true
		if err != nil && a.err == nil {
			a.err = fmt.Errorf("sim: deferred %s on stream %#x: %w", h.name, uintptr(h.st), err)
		}
		a.cond.Broadcast()
	}
}

// asyncErr returns, and clears, the first failure of deferred work since the last one was reported.
func (s *Sim) asyncErr() error {
	if s.as == nil || s.as.err == nil {
		return nil
	}
	err := s.as.err
	s.as.err = nil
	return err
}

// waitBlocking waits, before a synchronous copy or fill on d, for the legacy stream and every
// blocking stream of d, as the driver orders such calls; the caller holds s.mu.
func (s *Sim) waitBlocking(d *device) {
	if !s.cfg.deferWork {
		return
	}
	s.waitAside(func() bool {
		for _, st := range s.blockingPeers(0, d) {
			if !s.streamIdle(st) {
				return false
			}
		}
		return true
	})
}

// waitAside is waitFor on another goroutine, which holds s.mu for the caller meanwhile. A copy
// call carries its host addresses as integers; when they point into the caller's Go stack, running
// deferred work (kernels, deep calls) on the caller's goroutine could grow and move that stack.
func (s *Sim) waitAside(done func() bool) {
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		s.waitFor(done)
	}()
	<-finished
}

// drainAll waits until every queued operation has run (cuMemFree and cuMemFreeHost synchronize on
// the driver); the caller holds s.mu.
func (s *Sim) drainAll() {
	if !s.cfg.deferWork || s.as == nil {
		return
	}
	s.waitFor(func() bool {
		if s.as == nil {
			return true
		}
		var gs []*gate
		for _, q := range s.as.queue {
			gs = append(gs, q[len(q)-1].g)
		}
		s.drive(gs)
		return s.as == nil || len(s.as.queue) == 0
	})
}
