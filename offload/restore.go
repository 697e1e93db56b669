package offload

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/vmm"
)

// Restore reads a checkpoint written by Save back into the set's buffers. Every buffer of the
// checkpoint must be in the set under its tag, awake, with the same chunk layout. The whole
// checkpoint is read into pinned memory and every checksum verified before a byte reaches the GPU,
// so a truncated, corrupted or foreign checkpoint (an error wrapping ErrBadCheckpoint that names the
// chunk) changes nothing.
func (s *Set) Restore(ctx context.Context, r io.Reader) error {
	if s == nil {
		return fmt.Errorf("offload: restore: nil set: %w", ErrInvalidValue)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	defer s.publish()
	if s.own.IsClosed() {
		return fmt.Errorf("offload: restore: %w", ErrClosed)
	}
	s.catchUp()
	hdr, err := readHeader(r)
	if err != nil {
		return err
	}
	refs, err := s.match(hdr)
	if err != nil {
		return err
	}
	defer forget(entriesOf(refs))
	if len(refs) == 0 {
		return nil
	}
	synced := map[*vmm.Device]bool{} // work queued on the buffers must not write over what is restored
	for _, e := range entriesOf(refs) {
		if err := syncEntry("restore", e, synced); err != nil {
			return err
		}
	}
	units := plan(refs, s.opts.SlotSize)
	defer func() {
		for _, us := range units {
			for _, u := range us {
				s.pool.put(u.slots...)
			}
		}
	}()
	prog := &progress{fn: s.opts.Progress}
	for _, ref := range refs {
		prog.total += ref.state().size
	}
	if err := s.stageAll(ctx, r, hdr, units, prog); err != nil {
		return err
	}
	streams, err := s.streamsFor(units)
	if err != nil {
		return err
	}
	return perDevice(ctx, units, func(_ context.Context, d *vmm.Device, us []*unit) error {
		return s.restoreDevice(d, streams[d], us)
	})
}

// restoreDevice copies the staged units of d to the device and waits. On failure no copy is left
// queued (drainOrHold) when the slots go back to the pool, unless neither st nor d can be
// synchronized: then the units' slots are held out of the pool and cleared from the units, and the
// error says that copies may still write into the buffers.
func (s *Set) restoreDevice(d *vmm.Device, st *vmm.Stream, us []*unit) (err error) {
	defer func() {
		if err == nil {
			return
		}
		var slots []*slot
		for _, u := range us {
			slots = append(slots, u.slots...)
		}
		herr := s.drainOrHold(st, slots...)
		if errors.Is(herr, errNotDrained) {
			herr = fmt.Errorf("offload: restore: copies may still write the checkpoint's bytes into the buffers until the set's next call synchronizes %s: %w", d, herr)
			for _, u := range us {
				clear(u.slots)
			}
		}
		err = errors.Join(err, herr)
	}()
	for _, u := range us {
		for _, pc := range u.pieces {
			if err := d.CopyAsync(pc.dev(), u.slots[pc.slot].ptr(pc.slotOff), pc.n, st); err != nil {
				return fmt.Errorf("offload: restore %s: %w", u.e, err)
			}
		}
	}
	if err := st.Synchronize(); err != nil {
		return fmt.Errorf("offload: restore: wait for the copies to %s: %w", d, err)
	}
	return nil
}

// match finds the set's entry for every entry of the checkpoint and checks the layout; it records
// the chunks in the entries (forget clears them).
func (s *Set) match(hdr *ckHeader) ([]chunkRef, error) {
	var refs []chunkRef
	for _, ce := range hdr.Entries {
		e := s.find(ce.Tag)
		if e == nil {
			return nil, fmt.Errorf("offload: restore: the checkpoint has %q, which the set does not: %w", ce.Tag, ErrBadCheckpoint)
		}
		if e.asleep {
			return nil, fmt.Errorf("offload: restore %s: %w", e, ErrAsleep)
		}
		chunks := e.buf.Chunks()
		if len(chunks) != len(ce.Chunks) {
			return nil, fmt.Errorf("offload: restore %s: %d chunks, the checkpoint has %d: %w", e, len(chunks), len(ce.Chunks), ErrBadCheckpoint)
		}
		e.chunks = make([]chunkState, len(chunks))
		for i, c := range chunks {
			cc := ce.Chunks[i]
			if c.Offset != cc.Offset || c.Allocation.Size() != cc.Size {
				return nil, fmt.Errorf("offload: restore %s: chunk %d is %d bytes at offset %#x, the checkpoint's %s: %w",
					e, i, c.Allocation.Size(), c.Offset, chunkName(ce.Tag, i, cc), ErrBadCheckpoint)
			}
			e.chunks[i] = chunkState{alloc: c.Allocation, ptr: e.buf.Ptr() + ptrOff(c.Offset), size: cc.Size}
			refs = append(refs, chunkRef{e, i})
		}
	}
	return refs, nil
}

// stageAll reads every chunk of the checkpoint into slots (u.slots, in the pieces' layout) and
// verifies the checksums. The chunks come in header order, which is the refs' order.
func (s *Set) stageAll(ctx context.Context, r io.Reader, hdr *ckHeader, units map[*vmm.Device][]*unit, prog *progress) (err error) {
	byRef := map[refKey][][]byte{}
	for d, us := range units {
		for _, u := range us {
			f := s.pool.feed(ctx, d, u.nSlots, u.slotSize)
			for j := 0; j < u.nSlots; j++ {
				sl, ferr := f.take()
				if ferr != nil {
					err = errors.Join(err, ferr)
					break
				}
				u.slots = append(u.slots, sl)
			}
			f.finish()
			for _, pc := range u.pieces {
				if pc.slot < len(u.slots) {
					k := refKey{pc.ref.e.tag, pc.ref.i}
					byRef[k] = append(byRef[k], u.slots[pc.slot].mem[pc.slotOff:pc.slotOff+pc.n])
				}
			}
		}
	}
	if err != nil {
		return fmt.Errorf("offload: restore: %w", err)
	}
	for _, ce := range hdr.Entries {
		for i, cc := range ce.Chunks {
			if err := readChunk(r, byRef[refKey{ce.Tag, i}], chunkName(ce.Tag, i, cc), prog); err != nil {
				return err
			}
			if err := ctx.Err(); err != nil {
				return err
			}
		}
	}
	return nil
}

// refKey names chunk i of the entry tagged tag.
type refKey struct {
	tag string
	i   int
}

// Restored is a buffer recreated from a checkpoint by Load: a reservation with one mapping per
// chunk, each owning its allocation. It implements vmm.Chunked; Close releases it.
type Restored struct {
	tag   string
	res   *vmm.Reservation
	maps  []*vmm.Mapping
	len   uint64
	moved bool
}

// Tag is the buffer's tag in the checkpoint.
func (b *Restored) Tag() string { return b.tag }

// Ptr is the buffer's address: the checkpoint's, unless Moved.
func (b *Restored) Ptr() driver.DevicePtr { return b.res.Ptr() }

// Len is the buffer's length as saved.
func (b *Restored) Len() uint64 { return b.len }

// Moved reports whether the driver did not grant the saved address, so the buffer lives elsewhere.
func (b *Restored) Moved() bool { return b.moved }

// Chunks lists the buffer's allocations (vmm.Chunked).
func (b *Restored) Chunks() []vmm.Chunk {
	out := make([]vmm.Chunk, len(b.maps))
	for i, m := range b.maps {
		out[i] = vmm.Chunk{Offset: m.Offset(), Allocation: m.Allocation()}
	}
	return out
}

// undo is teardown for a failed Load: what cannot be closed goes to the System, which retries it
// in its Close, since no Restored is returned to own it.
func (b *Restored) undo() error {
	var errs []error
	for i := len(b.maps) - 1; i >= 0; i-- {
		errs = append(errs, vmm.UndoClose(b.maps[i]))
	}
	b.maps = nil
	return errors.Join(append(errs, vmm.UndoClose(b.res))...)
}

// Close unmaps and releases the chunks and frees the reservation. Idempotent, nil-safe.
func (b *Restored) Close() error {
	if b == nil {
		return nil
	}
	for len(b.maps) > 0 {
		if err := b.maps[len(b.maps)-1].Close(); err != nil {
			return fmt.Errorf("offload: close restored %q: %w", b.tag, err)
		}
		b.maps = b.maps[:len(b.maps)-1]
	}
	if err := b.res.Close(); err != nil {
		return fmt.Errorf("offload: close restored %q: %w", b.tag, err)
	}
	return nil
}
