package offload

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/vmm"
)

// hostPiece is where a run of a Keep chunk's bytes is backed up.
type hostPiece struct {
	slot    *slot
	slotOff uint64
	off, n  uint64 // within the chunk
}

// pipe keeps two batches of copies in flight on a stream: batch j is marked with an event, and
// the caller waits for batch j-1 while j runs, so the copy engine never waits for the host. The
// events block: a waiting goroutine sleeps instead of spinning on a core that a first sleep's
// populating goroutines need.
type pipe struct {
	st   *vmm.Stream
	ev   [2]*vmm.Event
	last uint64 // the bytes of the last batch marked, counted once it is done
}

func newPipe(st *vmm.Stream) (*pipe, error) {
	p := &pipe{st: st}
	for i := range p.ev {
		e, err := st.Device().NewBlockingEvent()
		if err != nil {
			return nil, errors.Join(err, p.close())
		}
		p.ev[i] = e
	}
	return p, nil
}

// next marks batch j of n bytes, just queued, then waits for batch j-1 and counts its bytes in
// prog. It returns ctx's error, so that a cancelled call stops between batches.
func (p *pipe) next(ctx context.Context, j int, n uint64, prog *progress) error {
	if err := p.ev[j%2].Record(p.st); err != nil {
		return err
	}
	if j > 0 {
		if err := p.ev[(j-1)%2].Synchronize(); err != nil {
			return err
		}
		prog.add(p.last)
	}
	p.last = n
	return ctx.Err()
}

// finish waits for the last batch and counts its bytes in prog.
func (p *pipe) finish(prog *progress) error {
	if err := p.st.Synchronize(); err != nil {
		return err
	}
	prog.add(p.last)
	return nil
}

func (p *pipe) close() error { return errors.Join(closeRetry(p.ev[0]), closeRetry(p.ev[1])) }

// closeRetry closes c, trying once more when the first attempt fails: vmm owners stay open after a
// failed destroy so that it can be retried, and a passing failure must not leak the object.
func closeRetry(c interface{ Close() error }) error {
	if err := c.Close(); err != nil {
		if err2 := c.Close(); err2 != nil {
			return err
		}
	}
	return nil
}

// errNotDrained marks a failure after which the copy stream could not be drained, nor its device
// synchronized: copies may still be queued on it, so the memory they read or write must be neither
// reused nor freed until the device has been synchronized (see Set.drainOrHold and keepBusy).
var errNotDrained = errors.New("the copy stream could not be drained, so copies may still be queued")

// drain waits for the stream after a failure, so that no copy still runs into memory about to be
// reused or freed. When every wait fails it returns an error wrapping errNotDrained (and
// vmm.ErrNotDrained): the caller must then keep the memory the stream's copies use out of the pool
// and away from any free. A stream that drains on a later attempt is fine: the failure that
// brought the caller here already carries the copy's error.
func drain(st *vmm.Stream) error {
	if err := st.Drain(vmm.DrainAttempts); errors.Is(err, vmm.ErrNotDrained) {
		return notDrained(err)
	}
	return nil
}

// notDrained marks err, a failed vmm.Stream.Drain, as errNotDrained.
func notDrained(err error) error { return fmt.Errorf("%w: %w", errNotDrained, err) }

// drainOrHold is what a call does after a failure on st, before it pools, reuses or frees the
// memory st's copies use, and before it returns: it drains st and, when that fails, synchronizes
// st's device, so that no copy is left queued (one still reading a buffer that the caller unmaps
// next would fault). It returns nil when st drained, and an error saying so when only the device
// synchronized. When both fail it holds slots (those the copies may use) out of the pool until
// the device synchronizes (the set's next call pools them, its Close hands them to the System:
// see hostPool.hold) and returns an error wrapping errNotDrained: the caller must then leave
// slots alone, and keep any device memory the copies use from being freed.
func (s *Set) drainOrHold(st *vmm.Stream, slots ...*slot) error {
	derr := st.Drain(vmm.DrainAttempts)
	if !errors.Is(derr, vmm.ErrNotDrained) {
		return nil
	}
	d := st.Device()
	serr := d.Synchronize()
	if serr == nil { // nothing is left queued: the error says why, but does not wrap derr
		return fmt.Errorf("offload: the copy stream could not be drained (%v), but %s was synchronized, so no copy is left queued", derr, d)
	}
	return errors.Join(notDrained(derr), fmt.Errorf("offload: synchronizing %s failed too: %w", d, serr), s.pool.hold(slots, d))
}

// copyWait copies n bytes from src to dst on st and waits for the copy. When either fails it
// leaves no copy queued (drainOrHold), so that the caller may pool stage at once, unless the error
// wraps errNotDrained: then stage is held out of the pool.
func (s *Set) copyWait(dst, src driver.DevicePtr, n uint64, st *vmm.Stream, stage *slot) error {
	if err := errors.Join(st.Device().CopyAsync(dst, src, n, st), st.Synchronize()); err != nil {
		return errors.Join(err, s.drainOrHold(st, stage))
	}
	return nil
}

// keepOut copies a Keep unit's chunks into slots taken from the pool (pinned on the way when the
// pool has too few), recording where each piece went, and releases each chunk as soon as its
// copies are done (releaseDone); share devices do the same at once.
func (s *Set) keepOut(ctx context.Context, st *vmm.Stream, u *unit, share int, prog *progress) (err error) {
	if s.stages(u) {
		return s.keepOutStaged(ctx, st, u, share, prog)
	}
	p, err := newPipe(st)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, p.close()) }()
	copyOut := func(j int, sl *slot) error { return u.copyOut(j, sl, st) }
	f := s.pool.feedUsing(ctx, u.dev, u.nSlots, u.slotSize, copyOut, share)
	u.slots = make([]*slot, u.nSlots)
	done := 0 // the slots whose copies are done: the backup of the chunks releaseDone released
	defer func() { err = s.endKeepOut(st, u, f, done, err) }()
	for j := 0; j < u.nSlots; j++ {
		sl, queued, err := f.takeUsed()
		if err != nil {
			return err
		}
		u.slots[j] = sl
		if !queued {
			if err := copyOut(j, sl); err != nil {
				return err
			}
		}
		if err := p.next(ctx, j, u.used(j), prog); err != nil {
			return err
		}
		done = j
		if err := s.releaseDone(u, j-1); err != nil {
			return err
		}
	}
	if err := p.finish(prog); err != nil {
		return err
	}
	done = u.nSlots
	return s.releaseDone(u, u.nSlots-1)
}

// endKeepOut ends keepOut, which failed with err unless it is nil, once the copies of its first
// done slots are done. On failure only those slots are a backup (of chunks releaseDone may have
// released); the copies into the slots after them may not have run, or may still run, as may
// those into the slots the pinning goroutines queued copies into but that were never taken
// (f.spent). Those slots leave the unit, so that no chunk is restored from them: back to the pool
// once the stream drains, else held until the device synchronizes (drainOrHold).
func (s *Set) endKeepOut(st *vmm.Stream, u *unit, f *feed, done int, err error) error {
	f.finish() // first: no slot's copy is queued after the drain
	if err == nil {
		s.pool.put(f.spent...) // no copy into them is left queued: free again
		return nil
	}
	later := append(slices.Clone(u.slots[done:]), f.spent...)
	clear(u.slots[done:])
	herr := s.drainOrHold(st, later...)
	if !errors.Is(herr, errNotDrained) {
		s.pool.put(later...)
	}
	return errors.Join(err, herr)
}

// copyOut queues the copies of the unit's bytes that slot j backs up into sl.
func (u *unit) copyOut(j int, sl *slot, st *vmm.Stream) error {
	for _, pc := range u.slotPieces(j) {
		if err := u.dev.CopyAsync(sl.ptr(pc.slotOff), pc.dev(), pc.n, st); err != nil {
			return err
		}
	}
	return nil
}

// keepIn recreates Keep chunks (recreate) and copies them back from their backup pieces, two
// pieces in flight: chunk k+1 is recreated while chunk k's copies run. On failure it only drains
// st: the backup slots stay the entries', and when the drain fails, the Wake's undo
// (resleepBusy) synchronizes the devices itself once every device has stopped, since it decides
// by device which chunks to release at once and which backups copies may still read.
func keepIn(ctx context.Context, st *vmm.Stream, refs []chunkRef, recreate func(chunkRef) error, prog *progress) (err error) {
	p, err := newPipe(st)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, p.close()) }()
	defer func() {
		if err != nil {
			err = errors.Join(err, drain(st))
		}
	}()
	d := st.Device()
	j := 0
	for _, r := range refs {
		cs := r.state()
		for _, hp := range cs.backup {
			if err := hp.slot.pin(); err != nil { // a staged backup may still be registering
				return err
			}
		}
		if err := recreate(r); err != nil {
			return err
		}
		for _, hp := range cs.backup {
			if err := d.CopyAsync(cs.ptr+ptrOff(hp.off), hp.slot.ptr(hp.slotOff), hp.n, st); err != nil {
				return err
			}
			if err := p.next(ctx, j, hp.n, prog); err != nil {
				return err
			}
			j++
		}
	}
	return p.finish(prog)
}

// ring takes n staging slots of size bytes to move through: first those the pool has (pooled says
// how many, at the start), then new ones.
func (s *Set) ring(ctx context.Context, d *vmm.Device, size uint64, n int) (r []*slot, pooled int, err error) {
	f := s.pool.feed(ctx, d, n, size)
	defer f.finish()
	for range n {
		sl, err := f.take()
		if err != nil {
			s.pool.put(r...)
			return nil, 0, err
		}
		r = append(r, sl)
	}
	return r, f.pooled, nil
}

// ringSize is the staging slot size of File units: their largest slot.
func ringSize(us []*unit) uint64 {
	var size uint64
	for _, u := range us {
		size = max(size, u.slotSize)
	}
	return size
}
