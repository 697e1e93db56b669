package offload

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/vmm"
)

// File units move between the device and their files in parts (IOPart of a staging slot), each
// through a staging buffer of its own, Options.IOWorkers parts at once. A goroutine that has
// moved its part takes the next one at once: no part waits for the slowest part of a slot, and
// the device's copies overlap the file's reads and writes part by part.

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

// newStaging cuts the ring's slots into buffers of part bytes, each with an event.
func newStaging(d *vmm.Device, ring [2]*slot, part uint64) ([]*stageBuf, error) {
	var bufs []*stageBuf
	for _, sl := range ring {
		for off := uint64(0); off+part <= sl.size; off += part {
			ev, err := d.NewEvent(false)
			if err != nil {
				return nil, errors.Join(err, closeStaging(bufs))
			}
			bufs = append(bufs, &stageBuf{sl: sl, off: off, ev: ev})
		}
	}
	return bufs, nil
}

func closeStaging(bufs []*stageBuf) error {
	var errs []error
	for _, b := range bufs {
		errs = append(errs, closeRetry(b.ev))
	}
	return errors.Join(errs...)
}

// moveFiles runs step over the File units' parts, Options.IOWorkers goroutines at once, each part
// with a free staging buffer; the first failure, or the end of ctx, stops the others. The stream
// is idle when it returns.
func (s *Set) moveFiles(ctx context.Context, st *vmm.Stream, us []*unit, step func(context.Context, fileJob, *stageBuf) error) (err error) {
	ring, err := s.ring(ctx, st.Device(), us)
	if err != nil {
		return err
	}
	defer s.pool.put(ring[:]...)
	part := IOPart(ring[0].size, s.opts.IOWorkers)
	bufs, err := newStaging(st.Device(), ring, part)
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			drain(st) // first: no copy still uses a buffer
		}
		err = errors.Join(err, closeStaging(bufs))
	}()
	jobs := fileParts(us, part)
	next := make(chan fileJob, len(jobs))
	for _, j := range jobs {
		next <- j
	}
	close(next)
	free := make(chan *stageBuf, len(bufs))
	for _, b := range bufs {
		free <- b
	}
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	var wg sync.WaitGroup
	for range min(s.opts.IOWorkers, len(jobs), len(bufs)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			fileWorker(ctx, next, free, step, cancel)
		}()
	}
	wg.Wait()
	if err := context.Cause(ctx); err != nil {
		return err
	}
	return st.Synchronize()
}

// fileWorker moves parts from next until none is left or ctx ends. A buffer whose step failed is
// not handed on: a copy may still use it.
func fileWorker(ctx context.Context, next <-chan fileJob, free chan *stageBuf, step func(context.Context, fileJob, *stageBuf) error, cancel context.CancelCauseFunc) {
	for j := range next {
		var b *stageBuf
		select {
		case b = <-free:
		case <-ctx.Done():
			return
		}
		if ctx.Err() != nil {
			return
		}
		if err := step(ctx, j, b); err != nil {
			cancel(err)
			return
		}
		free <- b
	}
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
		if _, err := j.e.opts.File.ReadAt(b.mem(j.n), j.fileOff); err != nil {
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
