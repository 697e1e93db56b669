package offload

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/vmm"
)

// File units move between the device and their files in parts of Options.FilePart bytes,
// Options.IOWorkers parts at once. Each goroutine takes the next part as soon as its last one is
// done, so no part waits for another, and moves it through the next of its own staging buffers, so
// that the bytes it has just read are still in the CPU's cache when the device copies them.

// fileJob is a part of a File unit: n bytes at off of chunk ref, at fileOff of the entry's file.
type fileJob struct {
	e       *entry
	ref     chunkRef
	off, n  uint64
	fileOff int64
}

func (j fileJob) dev() driver.DevicePtr { return j.ref.state().ptr + driver.DevicePtr(j.off) }

// stageBuf is a part of a staging slot, with the event recorded after the last copy through it.
type stageBuf struct {
	sl   *slot
	off  uint64
	ev   *vmm.Event
	used bool // a copy to the device was queued from it (Wake)
}

func (b *stageBuf) mem(n uint64) []byte   { return b.sl.mem[b.off : b.off+n] }
func (b *stageBuf) ptr() driver.DevicePtr { return b.sl.ptr(b.off) }

// fileParts cuts the units' pieces into parts of at most part bytes, in file order.
func fileParts(us []*unit, part uint64) []fileJob {
	var jobs []fileJob
	for _, u := range us {
		for _, pc := range u.pieces {
			for o := uint64(0); o < pc.n; o += part {
				jobs = append(jobs, fileJob{e: u.e, ref: pc.ref, off: pc.off + o, n: min(part, pc.n-o), fileOff: pc.fileOff + int64(o)})
			}
		}
	}
	return jobs
}

// newStaging cuts the ring's slots into n buffers of part bytes, each with an event, and deals
// them out to workers goroutines.
func newStaging(d *vmm.Device, ring []*slot, part uint64, n, workers int) ([][]*stageBuf, error) {
	out := make([][]*stageBuf, workers)
	var made []*stageBuf
	for _, sl := range ring {
		for off := uint64(0); off+part <= sl.size && len(made) < n; off += part {
			ev, err := d.NewBlockingEvent()
			if err != nil {
				return nil, errors.Join(err, closeStaging(made))
			}
			b := &stageBuf{sl: sl, off: off, ev: ev}
			out[len(made)%workers] = append(out[len(made)%workers], b)
			made = append(made, b)
		}
	}
	return out, nil
}

func closeStaging(bufs []*stageBuf) error {
	var errs []error
	for _, b := range bufs {
		errs = append(errs, closeRetry(b.ev))
	}
	return errors.Join(errs...)
}

// FileStaging is how a Set moves a File buffer's bytes on one device in a Sleep or a Wake:
// Goroutines goroutines at once, goroutine i through Buffers[i] pinned staging buffers of Part bytes
// each, carved from Slots pinned slots of SlotBytes; Parts is how many parts the buffer moves in.
type FileStaging struct {
	Goroutines int
	Buffers    []int
	Part       uint64
	Slots      int
	SlotBytes  uint64
	Parts      int
}

// PlanFileStaging is the staging a Set made with opts uses for a File buffer of size bytes, in
// chunks of chunk bytes, that is the set's only File buffer on its device: what it pins for
// staging, and how many goroutines read or write the file. Raw file I/O meant to compare with the
// set's (as vmmdemo sleep --mode file does) can move bytes the same way.
func PlanFileStaging(opts Options, size, chunk uint64) FileStaging {
	if size == 0 {
		return FileStaging{} // nothing to stage
	}
	o := opts.withDefaults()
	slot := unitSlotSize(o.SlotSize, size)
	part := min(o.FilePart, slot)
	jobs := countParts(size, chunk, slot, part)
	slots, bufs, g := stagingPlan(slot, part, o.IOWorkers, o.FileBuffers, jobs)
	per := make([]int, g)
	for b := range bufs {
		per[b%g]++ // newStaging deals the buffers out in turn
	}
	return FileStaging{Goroutines: g, Buffers: per, Part: part, Slots: slots, SlotBytes: slot, Parts: jobs}
}

// countParts is how many parts plan and fileParts cut a buffer of size bytes in chunks of chunk
// into: pieces end at chunk and slot boundaries, and each piece is cut into parts.
func countParts(size, chunk, slot, part uint64) int {
	if chunk == 0 || slot == 0 || part == 0 {
		return 0
	}
	n := 0
	for off := uint64(0); off < size; {
		end := min(size, (off/chunk+1)*chunk, (off/slot+1)*slot)
		n += int((end - off + part - 1) / part)
		off = end
	}
	return n
}

// stagingPlan says how many slots of size bytes the staging buffers take, how many buffers there
// are and how many goroutines move the jobs parts: each goroutine gets perWorker buffers of part
// bytes (at most size) where two slots hold them (at least one), and no more buffers than parts.
func stagingPlan(size, part uint64, workers, perWorker, jobs int) (slots, bufs, goroutines int) {
	perSlot := int(size / part)
	want := max(min(min(workers, jobs)*perWorker, jobs), 1)
	slots = min((want+perSlot-1)/perSlot, 2)
	bufs = min(want, slots*perSlot)
	goroutines = max(min(workers, jobs, bufs), 1)
	return slots, bufs, goroutines
}

// moveFiles runs step over the File units' parts, Options.IOWorkers goroutines at once, each with
// staging buffers of its own; the first failure, or the end of ctx, stops the others. The stream
// is idle when it returns.
func (s *Set) moveFiles(ctx context.Context, st *vmm.Stream, us []*unit, step func(context.Context, fileJob, *stageBuf) error) (err error) {
	size := ringSize(us)
	part := min(s.opts.FilePart, size)
	jobs := fileParts(us, part)
	nSlots, nBufs, workers := stagingPlan(size, part, s.opts.IOWorkers, s.opts.FileBuffers, len(jobs))
	ring, _, err := s.ring(ctx, st.Device(), size, nSlots)
	if err != nil {
		return err
	}
	bufs, err := newStaging(st.Device(), ring, part, nBufs, workers)
	if err != nil {
		s.pool.put(ring...)
		return err
	}
	defer func() {
		held := false
		if err != nil { // first: no copy still uses a buffer, or the ring is held
			herr := s.drainOrHold(st, ring...)
			held = errors.Is(herr, errNotDrained)
			err = errors.Join(err, herr)
		}
		for _, b := range bufs {
			err = errors.Join(err, closeStaging(b))
		}
		if !held {
			s.pool.put(ring...)
		}
	}()
	next := make(chan fileJob, len(jobs))
	for _, j := range jobs {
		next <- j
	}
	close(next)
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				j, ok := <-next
				if !ok || ctx.Err() != nil {
					return
				}
				if err := step(ctx, j, bufs[w][i%len(bufs[w])]); err != nil {
					cancel(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	if err := context.Cause(ctx); err != nil {
		return err
	}
	return st.Synchronize()
}

// fileOut writes File units to their files: each part is copied from the device into its buffer,
// then written.
func (s *Set) fileOut(ctx context.Context, st *vmm.Stream, us []*unit, prog *progress) error {
	d := st.Device()
	return s.moveFiles(ctx, st, us, func(_ context.Context, j fileJob, b *stageBuf) error {
		if err := d.CopyAsync(b.ptr(), j.dev(), j.n, st); err != nil {
			return err
		}
		if err := b.ev.Record(st); err != nil {
			return err
		}
		if err := b.ev.Synchronize(); err != nil {
			return err
		}
		if _, err := j.e.opts.File.WriteAt(b.mem(j.n), j.fileOff); err != nil {
			return fmt.Errorf("write %s of %q at file offset %d: %w", units.FormatSize(j.n), j.e.tag, j.fileOff, err)
		}
		prog.add(j.n)
		return nil
	})
}

// fileIn reads File units back from their files: each part is read into its buffer, then copied
// to the device once its chunk is mapped again. recreate maps the chunks, in order, while the
// first parts are read.
func (s *Set) fileIn(ctx context.Context, st *vmm.Stream, us []*unit, recreate func(chunkRef) error, prog *progress) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	rm := startRemap(ctx, us, recreate)
	d := st.Device()
	err := s.moveFiles(ctx, st, us, func(ctx context.Context, j fileJob, b *stageBuf) error {
		if b.used {
			if err := b.ev.Synchronize(); err != nil { // the buffer's last copy is done
				return err
			}
		}
		// io.ReaderAt may answer a read that ends at the end of its data with io.EOF.
		if n, err := j.e.opts.File.ReadAt(b.mem(j.n), j.fileOff); err != nil && (n < int(j.n) || !errors.Is(err, io.EOF)) {
			return fmt.Errorf("read %s of %q at file offset %d: %w", units.FormatSize(j.n), j.e.tag, j.fileOff, err)
		}
		if err := rm.wait(ctx, j.ref); err != nil {
			return err
		}
		if err := d.CopyAsync(j.dev(), b.ptr(), j.n, st); err != nil {
			return err
		}
		b.used = true
		if err := b.ev.Record(st); err != nil {
			return err
		}
		prog.add(j.n)
		return nil
	})
	cancel()
	<-rm.fin // no chunk is being mapped once fileIn returns
	if err == nil {
		err = rm.err
	}
	return err
}

// remap maps the chunks of File units again, in order, in a goroutine of its own.
type remap struct {
	mapped map[chunkRef]chan struct{} // closed once the chunk is mapped
	failed chan struct{}              // closed when mapping stops early; err says why
	fin    chan struct{}              // closed when the goroutine ends
	err    error
}

func startRemap(ctx context.Context, us []*unit, recreate func(chunkRef) error) *remap {
	r := &remap{mapped: map[chunkRef]chan struct{}{}, failed: make(chan struct{}), fin: make(chan struct{})}
	var refs []chunkRef
	for _, u := range us {
		for _, ref := range u.refs() {
			refs = append(refs, ref)
			r.mapped[ref] = make(chan struct{})
		}
	}
	go func() {
		defer close(r.fin)
		for _, ref := range refs {
			err := ctx.Err()
			if err == nil {
				err = recreate(ref)
			}
			if err != nil {
				r.err = err
				close(r.failed)
				return
			}
			close(r.mapped[ref])
		}
	}()
	return r
}

// wait returns once ref is mapped, or why it will not be.
func (r *remap) wait(ctx context.Context, ref chunkRef) error {
	select {
	case <-r.mapped[ref]:
		return nil
	case <-r.failed:
		return r.err
	case <-ctx.Done():
		return ctx.Err()
	}
}
