package pool

import (
	"errors"
	"fmt"
	"time"

	"github.com/cuvmm/cuvmm/vmm"
)

// streamState holds the frees queued on one stream that no event covers yet. p.streams has an entry
// only while there are some (drain drops the empty ones), so that streams used once, or closed, are
// not kept; sealed batches name their stream by st.s, not by the entry.
type streamState struct {
	s            *vmm.Stream // nil: the legacy default stream
	small, large *rangeSet
}

// batch is frees of one stream covered by an event recorded after them: once the event completes,
// every stream may reuse the memory.
type batch struct {
	st           *streamState
	ev           *vmm.Event
	small, large *rangeSet
}

// lookup is s's state for a request, without adding an entry when s has no open frees.
func (p *Pool) lookup(s *vmm.Stream) *streamState {
	if st := p.streams[s]; st != nil {
		return st
	}
	return &streamState{s: s, small: p.none, large: p.none}
}

// stream is s's state for a free, made when s has none.
func (p *Pool) stream(s *vmm.Stream) *streamState {
	st := p.streams[s]
	if st == nil {
		st = &streamState{s: s, small: newRangeSet(p.pageSize), large: newRangeSet(0)}
		p.streams[s] = st
	}
	return st
}

// event returns a spare event or makes one (timing off, the cheapest kind).
func (p *Pool) event() (*vmm.Event, error) {
	if n := len(p.spare); n > 0 {
		e := p.spare[n-1]
		p.spare = p.spare[:n-1]
		return e, nil
	}
	return p.dev.NewEvent(false)
}

// seal records an event on st covering its open frees, and queues them as a batch.
func (p *Pool) seal(st *streamState) error {
	if st.small.empty() && st.large.empty() {
		return nil
	}
	t0 := time.Now()
	defer p.driverTime(t0)
	b := &batch{st: st, small: st.small, large: st.large}
	st.small, st.large = newRangeSet(p.pageSize), newRangeSet(0)
	ev, err := p.event()
	if err == nil {
		err = ev.Record(st.s)
		if err != nil {
			p.spare = append(p.spare, ev)
		}
	}
	if errors.Is(err, vmm.ErrClosed) {
		// The stream was closed with frees queued on it; the driver still finishes its work. Wait for
		// the device once rather than lose the memory.
		if err = p.dev.Synchronize(); err == nil {
			p.ready(b)
			return nil
		}
	}
	if err != nil {
		st.small, st.large = b.small, b.large
		return fmt.Errorf("pool: record the event of a free: %w", err)
	}
	b.ev = ev
	p.sealed = append(p.sealed, b)
	return nil
}

// drain seals every stream's open frees, forgetting the streams left with none, and makes ready the
// batches whose event has completed; with wait it waits for each (cuEventSynchronize: the events,
// never the device).
func (p *Pool) drain(wait bool) error {
	var errs []error
	for s, st := range p.streams {
		if err := p.seal(st); err != nil {
			errs = append(errs, err)
		} else {
			delete(p.streams, s) // sealed: no open frees left
		}
	}
	if err := p.poll(wait); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// poll makes ready the sealed batches whose events have completed (waiting for them with wait).
func (p *Pool) poll(wait bool) error {
	if len(p.sealed) == 0 {
		return nil
	}
	t0 := time.Now()
	defer p.driverTime(t0)
	keep := p.sealed[:0]
	var errs []error
	for _, b := range p.sealed {
		var done bool
		var err error
		if wait {
			err = b.ev.Synchronize()
			done = err == nil
		} else {
			done, err = b.ev.Query()
		}
		if err != nil {
			errs = append(errs, err)
		}
		if !done {
			keep = append(keep, b)
			continue
		}
		p.spare = append(p.spare, b.ev)
		p.ready(b)
	}
	clear(p.sealed[len(keep):])
	p.sealed = keep
	return errors.Join(errs...)
}

// ready hands a completed batch's memory to every stream.
func (p *Pool) ready(b *batch) {
	for _, r := range b.small.runs() {
		pg := r.off / p.pageSize * p.pageSize
		p.smallUse[pg] -= r.n
		p.smallFree.add(r.off, r.n)
		if p.smallUse[pg] == 0 {
			delete(p.smallUse, pg)
			p.smallIdle[pg] = true
		}
	}
	for _, r := range b.large.runs() {
		p.cached.add(r.off, r.n)
	}
}

// pendingBytes is the memory freed but not yet known to be reusable by every stream.
func (p *Pool) pendingBytes() uint64 {
	var n uint64
	for _, st := range p.streams {
		n += st.small.total + st.large.total
	}
	for _, b := range p.sealed {
		n += b.small.total + b.large.total
	}
	return n
}
