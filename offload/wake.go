package offload

import (
	"context"
	"errors"
	"fmt"

	"github.com/cuvmm/cuvmm/vmm"
)

// Wake wakes the buffers tagged tags (every buffer when none is given): it creates chunks with the
// same properties at the same offsets, grants the same access and restores the content (Keep: from
// the backup, File: from the file, Discard: zeroed unless NoZero). Awake buffers are left as they
// are. On failure (for example an error wrapping driver.ErrOutOfMemory when another process took
// the memory, or ctx cancelled) the buffers stay asleep with their backups intact, and Wake can be
// retried. Buffers closed while asleep are dropped from the set.
func (s *Set) Wake(ctx context.Context, tags ...string) error {
	if s == nil {
		return fmt.Errorf("offload: wake: nil set: %w", ErrInvalidValue)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.reap()
	es, err := s.selectEntries("wake", tags)
	if err != nil {
		return err
	}
	var refs []chunkRef
	var todo []*entry
	for _, e := range es {
		if !e.asleep {
			continue
		}
		if n := e.closed.Load(); n > 0 {
			return fmt.Errorf("offload: wake %s: %d of its %d chunks were closed while asleep: %w", e, n, len(e.chunks), ErrClosed)
		}
		todo = append(todo, e)
		for i := range e.chunks {
			refs = append(refs, chunkRef{e, i})
		}
	}
	if len(refs) == 0 {
		return nil
	}
	if err := s.wakeRefs(ctx, refs); err != nil {
		return fmt.Errorf("offload: wake: %w", err)
	}
	s.dropBackups(todo)
	forget(todo)
	for _, e := range todo {
		e.asleep = false
	}
	return nil
}

// wakeRefs recreates the chunks and restores their content. On failure the chunks it recreated are
// released again, so every one is asleep as before, backups untouched.
func (s *Set) wakeRefs(ctx context.Context, refs []chunkRef) error {
	for k, r := range refs {
		cs := r.state()
		if err := cs.alloc.RecreateAt(cs.ptr, cs.access); err != nil {
			err = fmt.Errorf("recreate %s chunk %d: %w", r.e, r.i, err)
			return errors.Join(err, s.resleep(refs[:k]))
		}
	}
	if err := s.restore(ctx, refs); err != nil {
		return errors.Join(err, s.resleep(refs))
	}
	if err := ctx.Err(); err != nil {
		return errors.Join(err, s.resleep(refs))
	}
	return nil
}

// resleep releases chunks recreated by a wake that failed.
func (s *Set) resleep(refs []chunkRef) error {
	var errs []error
	for _, r := range refs {
		cs := r.state()
		if err := cs.alloc.ReleaseAt(cs.ptr, cs.access, true, s.onChunkClosed(r.e)); err != nil {
			errs = append(errs, fmt.Errorf("undo: release %s chunk %d again: %w", r.e, r.i, err))
		}
	}
	return errors.Join(errs...)
}

// restore puts the content back, every device at once.
func (s *Set) restore(ctx context.Context, refs []chunkRef) error {
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
	return perDevice(ctx, units, func(ctx context.Context, d *vmm.Device, us []*unit) error {
		var keep []chunkRef
		var files []*unit
		for _, u := range us {
			switch u.e.policy {
			case Keep:
				for _, pc := range u.pieces {
					if pc.off == 0 {
						keep = append(keep, pc.ref)
					}
				}
			case File:
				files = append(files, u)
			case Discard:
				if err := zero(u); err != nil {
					return err
				}
			}
		}
		if len(keep) == 0 {
		} else if err := keepIn(ctx, streams[d], keep, prog); err != nil {
			return fmt.Errorf("restore backups on %s: %w", d, err)
		}
		if len(files) > 0 {
			if err := s.fileIn(ctx, streams[d], files, prog); err != nil {
				return fmt.Errorf("read back from file on %s: %w", d, err)
			}
		}
		return nil
	})
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
