package offload

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"

	"github.com/cuvmm/cuvmm/vmm"
)

// Wake wakes the buffers tagged tags (every buffer when none is given): it creates chunks with the
// same properties at the same offsets, grants the same access and restores the content (Keep: from
// the backup, File: from the file, Discard: zeroed unless NoZero). Awake buffers are left as they
// are. On failure (for example an error wrapping driver.ErrOutOfMemory when another process took
// the memory, or ctx cancelled) the buffers stay asleep with their backups intact, and Wake can be
// retried. Buffers closed while asleep are dropped from the set; a buffer that shrank while asleep
// wakes with the chunks it kept.
func (s *Set) Wake(ctx context.Context, tags ...string) error {
	if s == nil {
		return fmt.Errorf("offload: wake: nil set: %w", ErrInvalidValue)
	}
	return s.counted(ctx, tags, true, s.wake)
}

// wake is Wake with s.mu held; n is the GPU memory of the buffers it wakes (0 when none sleeps).
func (s *Set) wake(ctx context.Context, tags []string) (n uint64, err error) {
	s.catchUp()
	es, err := s.selectEntries("wake", tags)
	if err != nil {
		return 0, err
	}
	var refs []chunkRef
	var todo []*entry
	for _, e := range es {
		if !e.asleep {
			continue
		}
		todo = append(todo, e)
		for i := range e.chunks {
			// A live chunk was never released: its content is in it. A closed one went while
			// asleep (the buffer shrank): nothing to wake, and its backup goes with the others'.
			if cs := &e.chunks[i]; !cs.live && !cs.alloc.Closed() {
				refs = append(refs, chunkRef{e, i})
			}
		}
	}
	if len(todo) == 0 {
		return 0, nil
	}
	if err := s.wakeRefs(ctx, refs); err != nil {
		return 0, fmt.Errorf("offload: wake: %w", err)
	}
	n = refsBytes(refs) // before forget drops the chunks' states
	s.dropBackups(todo)
	forget(todo)
	for _, e := range todo {
		e.asleep, e.busy = false, nil
	}
	return n, nil
}

// wakeRefs recreates the chunks and restores their content, every device at once; on each device
// a Keep chunk is recreated while the previous one's content is still being copied, so that the
// cost of mapping (cuMemSetAccess above all) hides behind the copies. On failure the chunks it
// recreated are released again, so every one is asleep as before, backups untouched.
func (s *Set) wakeRefs(ctx context.Context, refs []chunkRef) error {
	units := plan(refs, s.opts.SlotSize)
	streams, err := s.streamsFor(units)
	if err != nil {
		return err
	}
	prog := &progress{fn: s.opts.Progress}
	for _, r := range refs {
		if r.e.policy != Discard {
			prog.total += r.state().size
		}
	}
	var mu sync.Mutex
	var made []chunkRef
	recreate := func(r chunkRef) error {
		cs := r.state()
		var err error
		if cs.alloc.Asleep() { // a chunk that a failed undo left mapped (see entry.asleep) only needs its content
			err = cs.alloc.RecreateAt(cs.ptr, cs.access)
			if cs.alloc.Asleep() {
				return fmt.Errorf("recreate %s chunk %d: %w", r.e, r.i, err)
			}
			r.e.released.Add(-1)
		}
		mu.Lock()
		made = append(made, r) // mapped (even when its access failed): released again if the wake fails
		mu.Unlock()
		if err != nil {
			return fmt.Errorf("recreate %s chunk %d: %w", r.e, r.i, err)
		}
		return nil
	}
	err = perDevice(ctx, units, func(ctx context.Context, d *vmm.Device, us []*unit) error {
		return s.wakeDevice(ctx, streams[d], us, recreate, prog)
	})
	if err == nil {
		err = ctx.Err()
	}
	if err != nil {
		if errors.Is(err, errNotDrained) {
			return errors.Join(err, s.resleepBusy(made, units))
		}
		return errors.Join(err, s.resleep(made))
	}
	return nil
}

// resleepBusy is resleep after a wake whose copy stream could not be drained (errNotDrained): copies
// may still be queued into the recreated chunks, reading the backup slots. Each device is
// synchronized first; the chunks of those that synchronize are released again at once. The chunks of
// a device that does not are left mapped and handed to the System (System.Keep), whose RetryOrphans
// and Close synchronize the device, then release them again (unless a later Wake woke the entry
// meanwhile); their entries stay asleep with their backups, which are held rather than freed should
// the buffer be closed meanwhile (entry.busy). The error says which.
func (s *Set) resleepBusy(made []chunkRef, units map[*vmm.Device][]*unit) error {
	idle := map[*vmm.Device]bool{}
	for d := range units {
		idle[d] = d.Synchronize() == nil
	}
	for d, us := range units {
		if idle[d] { // synchronized under the set's lock: no copy on d reads a backup any more
			for _, u := range us {
				u.e.busy = slices.DeleteFunc(u.e.busy, func(b *vmm.Device) bool { return b == d })
			}
		}
	}
	var now []chunkRef
	var errs []error
	for _, r := range made {
		d := r.state().alloc.Device()
		if ok, known := idle[d]; !known || ok {
			now = append(now, r)
			continue
		}
		if !slices.Contains(r.e.busy, d) { // a copy into r may still read the entry's backup
			r.e.busy = append(r.e.busy, d)
		}
		r.state().pending = true
		errs = append(errs, s.sys.Keep(fmt.Sprintf("offload: %s chunk %d, which copies queued on %s may still write, to be released again", r.e, r.i, d), s.resleepLater(r, d)))
	}
	if busy := unsynced(idle); len(busy) > 0 {
		errs = append(errs, fmt.Errorf("offload: %s could not be synchronized either: the chunks a copy may still write stay mapped until the System releases them, and the buffers stay asleep with their backups", devNames(busy)))
	} else {
		errs = append(errs, errors.New("offload: the devices were synchronized, so no copy is left queued and the chunks were released again"))
	}
	return errors.Join(append(errs, s.resleep(now))...)
}

// resleepLater is the close resleepBusy gives the System for a chunk r left mapped on d: synchronize
// d, under the set's lock so that no Wake queues new copies between the synchronization and what
// follows (then no copy on d reads the entry's backup: d is taken off entry.busy), then, if the
// entry still sleeps with r recorded, mapped and open, release r again.
func (s *Set) resleepLater(r chunkRef, d *vmm.Device) func() error {
	cs := r.state()
	return func() error {
		if !s.mu.TryLock() {
			return fmt.Errorf("offload: %s chunk %d: the set is busy; retry", r.e, r.i)
		}
		defer s.mu.Unlock()
		if err := d.Synchronize(); err != nil {
			return err
		}
		r.e.busy = slices.DeleteFunc(r.e.busy, func(b *vmm.Device) bool { return b == d })
		s.reap() // counts r as released and closed if the caller closed it
		if !r.e.asleep || r.i >= len(r.e.chunks) || &r.e.chunks[r.i] != cs || !cs.pending {
			return nil // woken, or closed since
		}
		return s.releaseChunk(r, true)
	}
}

// unsynced lists, by ordinal, the devices of idle that could not be synchronized.
func unsynced(idle map[*vmm.Device]bool) []*vmm.Device {
	var out []*vmm.Device
	for d, ok := range idle {
		if !ok {
			out = append(out, d)
		}
	}
	slices.SortFunc(out, func(a, b *vmm.Device) int { return a.Ordinal() - b.Ordinal() })
	return out
}

// wakeDevice recreates and restores the units of one device.
func (s *Set) wakeDevice(ctx context.Context, st *vmm.Stream, us []*unit, recreate func(chunkRef) error, prog *progress) error {
	var files []*unit
	for _, u := range us {
		refs := u.refs()
		if u.e.policy == Keep {
			if err := keepIn(ctx, st, refs, recreate, prog); err != nil {
				return fmt.Errorf("restore %s on %s: %w", u.e, u.dev, err)
			}
			continue
		}
		if u.e.policy == File {
			files = append(files, u)
			continue
		}
		for _, r := range refs {
			if err := recreate(r); err != nil {
				return err
			}
		}
		if err := zero(u); err != nil {
			return err
		}
	}
	if len(files) > 0 {
		if err := s.fileIn(ctx, st, files, recreate, prog); err != nil {
			return fmt.Errorf("read back from file on %s: %w", st.Device(), err)
		}
	}
	return nil
}

// refs lists the unit's chunks in order.
func (u *unit) refs() []chunkRef {
	var out []chunkRef
	for _, pc := range u.pieces {
		if pc.off == 0 {
			out = append(out, pc.ref)
		}
	}
	return out
}

// resleep releases chunks recreated by a wake that failed.
func (s *Set) resleep(refs []chunkRef) error {
	var errs []error
	for _, r := range refs {
		if err := s.releaseChunk(r, true); err != nil {
			errs = append(errs, fmt.Errorf("undo: release %s chunk %d again: %w", r.e, r.i, err))
		}
	}
	return errors.Join(errs...)
}

// zero clears a Discard unit's chunks unless the entry asked for NoZero.
func zero(u *unit) error {
	if u.e.opts.NoZero {
		return nil
	}
	for _, pc := range u.pieces {
		if pc.off == 0 {
			cs := pc.ref.state()
			if err := u.dev.Memset(cs.ptr, 0, cs.size); err != nil {
				return fmt.Errorf("zero %s chunk %d: %w", u.e, pc.ref.i, err)
			}
		}
	}
	return nil
}
