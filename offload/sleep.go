package offload

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/cuvmm/cuvmm/vmm"
)

// Sleep puts the buffers tagged tags (every buffer when none is given) to sleep: it waits for the
// work queued on them, copies their content out as their policies say, and unmaps and releases
// their physical memory (a Keep chunk as soon as its copy is done), keeping the reservations and
// the access description of every chunk. Buffers already asleep are left as they are (so Sleep of
// a sleeping set is a no-op). On any error, and when ctx is cancelled before every copy is done,
// every buffer is left awake and intact (the chunks already released are recreated and their
// content restored) and the error says which step failed. The one exception is an undo that fails too (the driver refusing memory
// it just gave back): then the buffers with memory still released stay asleep with their content
// kept, Asleep reports them, the error names them, and Wake restores them (do not use them until
// then).
func (s *Set) Sleep(ctx context.Context, tags ...string) error {
	if s == nil {
		return fmt.Errorf("offload: sleep: nil set: %w", ErrInvalidValue)
	}
	return s.counted(ctx, tags, false, s.sleep)
}

// sleep is Sleep with s.mu held; n is the GPU memory of the buffers it puts to sleep (0 when none
// is awake).
func (s *Set) sleep(ctx context.Context, tags []string) (n uint64, err error) {
	s.catchUp()
	es, err := s.selectEntries("sleep", tags)
	if err != nil {
		return 0, err
	}
	var todo []*entry
	for _, e := range es {
		// A buffer with no memory (closed, or never grown) has nothing to give back: it stays awake,
		// where an entry asleep with nothing to wake would keep the set from closing.
		if !e.asleep && len(e.buf.Chunks()) > 0 {
			todo = append(todo, e)
		}
	}
	if len(todo) == 0 {
		return 0, nil
	}
	start := time.Now()
	refs, err := s.prepare(todo)
	if err != nil {
		forget(todo)
		return 0, err
	}
	copyStart := time.Now()
	s.staged.Store(0)
	err = s.copyOut(ctx, refs)
	if err == nil {
		err = ctx.Err()
	}
	if err != nil {
		return 0, fmt.Errorf("offload: sleep: %w", s.unrelease(refs, err))
	}
	releaseStart := time.Now()
	if err := s.release(refs); err != nil {
		return 0, fmt.Errorf("offload: sleep: %w", err)
	}
	s.steps = SleepSteps{Wait: copyStart.Sub(start), Copy: releaseStart.Sub(copyStart), Release: time.Since(releaseStart), StagedBytes: s.staged.Load()}
	for _, e := range todo {
		e.asleep = true
	}
	s.pruneSlotSizes()
	return refsBytes(refs), nil
}

// refsBytes is the size of the chunks refs name.
func refsBytes(refs []chunkRef) uint64 {
	var n uint64
	for _, r := range refs {
		n += r.state().size
	}
	return n
}

// prepare checks the entries, waits for their queued work and records each chunk's address, size
// and access. Nothing changes on the GPU.
func (s *Set) prepare(es []*entry) ([]chunkRef, error) {
	var refs []chunkRef
	synced := map[*vmm.Device]bool{}
	for _, e := range es {
		chunks := e.buf.Chunks()
		e.chunks = make([]chunkState, 0, len(chunks))
		e.closed.Store(0)
		e.released.Store(0)
		for i, c := range chunks {
			a := c.Allocation
			if err := checkChunk(e, i, a); err != nil {
				return nil, err
			}
			e.chunks = append(e.chunks, chunkState{alloc: a, ptr: e.buf.Ptr() + ptrOff(c.Offset), size: a.Size()})
			refs = append(refs, chunkRef{e, i})
		}
		if err := syncEntry("sleep", e, synced); err != nil {
			return nil, err
		}
	}
	for _, r := range refs {
		cs := r.state()
		acc, err := cs.alloc.AccessAt(cs.ptr)
		if err != nil {
			return nil, fmt.Errorf("offload: sleep %s: chunk %d: %w", r.e, r.i, err)
		}
		cs.access = acc
	}
	return refs, nil
}

func checkChunk(e *entry, i int, a *vmm.Allocation) error {
	switch {
	case a == nil:
		return fmt.Errorf("offload: sleep %s: chunk %d has no allocation: %w", e, i, ErrInvalidValue)
	case a.Imported():
		return fmt.Errorf("offload: sleep %s: chunk %d is imported from another process, which owns its memory: %w", e, i, ErrInvalidValue)
	case a.Exported() && !e.opts.Force:
		return fmt.Errorf("offload: sleep %s: chunk %d was exported to other processes, so releasing it would not free it (EntryOptions.Force sleeps it anyway): %w", e, i, ErrExported)
	}
	return nil
}

// syncEntry waits for the work queued on the entry: its stream, else every device its chunks live
// on (once per device per Sleep).
func syncEntry(op string, e *entry, synced map[*vmm.Device]bool) error {
	if e.opts.Stream != nil {
		if err := e.opts.Stream.Synchronize(); err != nil {
			return fmt.Errorf("offload: %s %s: wait for its stream: %w", op, e, err)
		}
		return nil
	}
	for _, c := range e.chunks {
		d := c.alloc.Device()
		if synced[d] {
			continue
		}
		if err := d.Synchronize(); err != nil {
			return fmt.Errorf("offload: %s %s: wait for %s: %w", op, e, d, err)
		}
		synced[d] = true
	}
	return nil
}

// copyOut copies the content of Keep and File chunks out, every device at once, releasing each
// Keep chunk as soon as its copies are done (keepOut).
func (s *Set) copyOut(ctx context.Context, refs []chunkRef) error {
	units := plan(refs, s.opts.SlotSize)
	prog := &progress{fn: s.opts.Progress}
	for _, r := range refs {
		if r.e.policy != Discard {
			prog.total += r.state().size
		}
	}
	streams, err := s.streamsFor(units)
	if err != nil {
		return err
	}
	share := devicesKeeping(units)
	defer s.startRegistration() // of the backups staged, once every device's copies are done
	err = perDevice(ctx, units, func(ctx context.Context, d *vmm.Device, us []*unit) error {
		var files []*unit
		for _, u := range us {
			switch u.e.policy {
			case Keep:
				if err := s.keepOut(ctx, streams[d], u, share, prog); err != nil {
					return fmt.Errorf("back up %s on %s: %w", u.e, d, err)
				}
			case File:
				files = append(files, u)
			}
		}
		if len(files) == 0 {
			return nil
		}
		if err := s.fileOut(ctx, streams[d], files, prog); err != nil {
			return fmt.Errorf("write to file on %s: %w", d, err)
		}
		return nil
	})
	// Record the backups, also on failure, so that dropBackups returns every slot to the pool.
	for _, us := range units {
		for _, u := range us {
			for _, sl := range u.slots { // nil: held out of the pool (keepOut)
				if sl != nil {
					u.e.backup = append(u.e.backup, sl)
				}
			}
			for _, pc := range u.pieces {
				if u.e.policy != Keep || pc.slot >= len(u.slots) || u.slots[pc.slot] == nil {
					continue
				}
				cs := pc.ref.state()
				cs.backup = append(cs.backup, hostPiece{slot: u.slots[pc.slot], slotOff: pc.slotOff, off: pc.off, n: pc.n})
			}
		}
	}
	return err
}

// streamsFor makes (once) the copy stream of every device of units; the caller holds s.mu.
func (s *Set) streamsFor(units map[*vmm.Device][]*unit) (map[*vmm.Device]*vmm.Stream, error) {
	out := map[*vmm.Device]*vmm.Stream{}
	for d := range units {
		st, err := s.stream(d)
		if err != nil {
			return nil, err
		}
		out[d] = st
	}
	return out, nil
}

// release unmaps and releases every chunk that copyOut has not released already (Keep chunks go
// as soon as their copies are done: see releaseDone). When one fails, unrelease undoes the sleep.
func (s *Set) release(refs []chunkRef) error {
	for _, r := range refs {
		if r.state().alloc.Asleep() {
			continue
		}
		if err := s.releaseChunk(r, r.e.opts.Force); err != nil {
			return s.unrelease(refs, fmt.Errorf("release %s chunk %d: %w", r.e, r.i, err))
		}
	}
	return nil
}

// unrelease undoes a sleep of refs that failed with err: the chunks already released (those
// whose allocation is asleep, a failed release's included: unmapped with its memory kept) are
// recreated and their content restored, so that every buffer is awake again, and the backups go
// back to the pool. When that fails too, the entries with a chunk still released, or left mapped
// for the System to release because copies may still be queued into it (chunkState.pending), stay
// asleep with their backups (Wake finishes the undo) and the error names them.
func (s *Set) unrelease(refs []chunkRef, err error) error {
	var undo []chunkRef
	for _, r := range refs {
		if r.state().alloc.Asleep() {
			undo = append(undo, r)
		}
	}
	var werr error
	if len(undo) > 0 {
		werr = s.wakeRefs(context.Background(), undo)
	}
	var asleep []*entry
	for _, e := range entriesOf(refs) {
		if werr != nil && (e.released.Load() > 0 || hasPending(e)) {
			e.asleep = true
			markLive(e, undo)
			asleep = append(asleep, e)
			continue
		}
		s.dropBackups([]*entry{e})
		forget([]*entry{e})
	}
	if werr != nil {
		return errors.Join(err, fmt.Errorf("and undoing the release failed, so %v stay asleep with their content kept, for Wake to restore: %w", asleep, werr))
	}
	return err
}

// markLive marks the chunks of e that the failed Sleep never released (not in undo, still mapped,
// not left for the System) as holding their own content (chunkState.live).
func markLive(e *entry, undo []chunkRef) {
	for i := range e.chunks {
		cs := &e.chunks[i]
		if !cs.alloc.Asleep() && !cs.pending && !slices.Contains(undo, chunkRef{e, i}) {
			cs.live = true
		}
	}
}

// releaseDone releases, in order, the chunks of a Keep unit whose every piece lies in slots up to
// m, once their copies are done (keepOut calls it as its pipe sees slot m's batch end), so that
// releasing the memory overlaps the copies of the chunks after them instead of following them all.
func (s *Set) releaseDone(u *unit, m int) error {
	for u.released < len(u.pieces) {
		r, end := u.pieces[u.released].ref, u.released
		for end < len(u.pieces) && u.pieces[end].ref == r {
			end++
		}
		if u.pieces[end-1].slot > m {
			return nil
		}
		if err := s.releaseChunk(r, r.e.opts.Force); err != nil {
			return fmt.Errorf("release %s chunk %d: %w", r.e, r.i, err)
		}
		u.released = end
	}
	return nil
}

// releaseChunk releases one chunk's memory (ReleaseAt) and counts it, and counts it too when a
// failed ReleaseAt left it asleep with its memory kept; either way it no longer waits for the
// System (chunkState.pending).
func (s *Set) releaseChunk(r chunkRef, force bool) error {
	cs := r.state()
	err := cs.alloc.ReleaseAt(cs.ptr, cs.access, force, s.onChunkClosed(r.e))
	if err == nil || cs.alloc.Asleep() {
		r.e.released.Add(1)
		cs.pending = false
	}
	return err
}

// hasPending reports whether a chunk of e waits for the System to release it (chunkState.pending).
func hasPending(e *entry) bool {
	return slices.ContainsFunc(e.chunks, func(cs chunkState) bool { return cs.pending })
}

// dropBackups returns the entries' backup slots to the pool.
func (s *Set) dropBackups(es []*entry) {
	for _, e := range es {
		s.pool.put(e.backup...)
		e.backup = nil
		for i := range e.chunks {
			e.chunks[i].backup = nil
		}
	}
}

// forget clears the sleep records of awake entries.
func forget(es []*entry) {
	for _, e := range es {
		e.chunks = nil
	}
}

func entriesOf(refs []chunkRef) []*entry {
	var out []*entry
	for _, r := range refs {
		if len(out) == 0 || out[len(out)-1] != r.e {
			out = append(out, r.e)
		}
	}
	return out
}

// devicesKeeping counts the devices with a Keep unit: those that may pin backup slots at once.
func devicesKeeping(units map[*vmm.Device][]*unit) int {
	n := 0
	for _, us := range units {
		for _, u := range us {
			if u.e.policy == Keep {
				n++
				break
			}
		}
	}
	return n
}
