package offload

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/vmm"
)

// hostPiece is where a run of a Keep chunk's bytes is backed up.
type hostPiece struct {
	slot    *slot
	slotOff uint64
	off, n  uint64 // within the chunk
}

// pipe keeps two batches of copies in flight on a stream: batch j is marked with an event, and
// the caller waits for batch j-1 while j runs, so the copy engine never waits for the host.
type pipe struct {
	st *vmm.Stream
	ev [2]*vmm.Event
}

func newPipe(st *vmm.Stream) (*pipe, error) {
	p := &pipe{st: st}
	for i := range p.ev {
		e, err := st.Device().NewEvent(false)
		if err != nil {
			return nil, errors.Join(err, p.close())
		}
		p.ev[i] = e
	}
	return p, nil
}

func (p *pipe) mark(j int) error { return p.ev[j%2].Record(p.st) }
func (p *pipe) wait(j int) error { return p.ev[j%2].Synchronize() }

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

// drain waits for the stream after a failure, so that no copy still runs into memory about to be
// reused or freed; its error is secondary to the one being returned.
func drain(st *vmm.Stream) { _ = st.Synchronize() }

// keepOut copies a Keep unit's chunks into slots taken from the pool (pinned on the way when the
// pool has too few), recording where each piece went; share devices do the same at once.
func (s *Set) keepOut(ctx context.Context, st *vmm.Stream, u *unit, share int, prog *progress) (err error) {
	p, err := newPipe(st)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, p.close()) }()
	copyOut := func(j int, sl *slot) error { return u.copyOut(j, sl, st) }
	f := s.pool.feedUsing(ctx, u.dev, u.nSlots, u.slotSize, copyOut, share)
	u.slots = make([]*slot, u.nSlots)
	defer func() {
		f.finish() // first: no slot's copy is queued after the drain
		if err != nil {
			drain(st)
		}
	}()
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
		if err := p.mark(j); err != nil {
			return err
		}
		if j > 0 {
			if err := p.wait(j - 1); err != nil {
				return err
			}
			prog.add(u.used(j - 1))
		}
		if err := ctx.Err(); err != nil {
			return err
		}
	}
	if err := st.Synchronize(); err != nil {
		return err
	}
	prog.add(u.used(u.nSlots - 1))
	return nil
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
// pieces in flight: chunk k+1 is recreated while chunk k's copies run.
func keepIn(ctx context.Context, st *vmm.Stream, refs []chunkRef, recreate func(chunkRef) error, prog *progress) (err error) {
	p, err := newPipe(st)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, p.close()) }()
	defer func() {
		if err != nil {
			drain(st)
		}
	}()
	d := st.Device()
	j := 0
	var last uint64
	for _, r := range refs {
		if err := recreate(r); err != nil {
			return err
		}
		cs := r.state()
		for _, hp := range cs.backup {
			if err := d.CopyAsync(cs.ptr+ptrOff(hp.off), hp.slot.ptr(hp.slotOff), hp.n, st); err != nil {
				return err
			}
			if err := p.mark(j); err != nil {
				return err
			}
			if j > 0 {
				if err := p.wait(j - 1); err != nil {
					return err
				}
				prog.add(last)
			}
			if err := ctx.Err(); err != nil {
				return err
			}
			j, last = j+1, hp.n
		}
	}
	if err := st.Synchronize(); err != nil {
		return err
	}
	prog.add(last)
	return nil
}

// ring is two staging slots that File units cycle through.
func (s *Set) ring(ctx context.Context, d *vmm.Device, us []*unit) ([2]*slot, error) {
	var size uint64
	for _, u := range us {
		size = max(size, u.slotSize)
	}
	var r [2]*slot
	f := s.pool.feed(ctx, d, 2, size)
	defer f.finish()
	for i := range r {
		sl, err := f.take()
		if err != nil {
			s.pool.put(r[0])
			return r, err
		}
		r[i] = sl
	}
	return r, nil
}

// fileOut copies File units to their files through two staging slots: the device fills one while
// the other is written.
func (s *Set) fileOut(ctx context.Context, st *vmm.Stream, us []*unit, prog *progress) error {
	ring, err := s.ring(ctx, st.Device(), us)
	if err != nil {
		return err
	}
	defer s.pool.put(ring[:]...)
	var wg [2]sync.WaitGroup
	var werr [2]error
	defer func() { wg[0].Wait(); wg[1].Wait() }()
	k := 0
	for _, u := range us {
		for j := 0; j < u.nSlots; j, k = j+1, k+1 {
			sl := ring[k%2]
			wg[k%2].Wait() // the slot's previous write is done
			if err := errors.Join(werr[k%2], ctx.Err()); err != nil {
				return err
			}
			pcs := u.slotPieces(j)
			for _, pc := range pcs {
				if err := u.dev.CopyAsync(sl.ptr(pc.slotOff), pc.dev(), pc.n, st); err != nil {
					drain(st)
					return err
				}
			}
			if err := st.Synchronize(); err != nil {
				return err
			}
			wg[k%2].Add(1)
			go func(i int) {
				defer wg[i].Done()
				werr[i] = s.writePieces(u.e, sl, pcs, prog)
			}(k % 2)
		}
	}
	wg[0].Wait()
	wg[1].Wait()
	return errors.Join(werr[0], werr[1])
}

// ioJob is a part of a piece: bytes [off, off+n) of slot memory at file offset fileOff.
type ioJob struct {
	off, n  uint64
	fileOff int64
}

// splitIO cuts a slot's pieces into the parts the set's I/O goroutines move (see IOPart).
func (s *Set) splitIO(pcs []piece) []ioJob {
	var total uint64
	for _, pc := range pcs {
		total += pc.n
	}
	part := IOPart(total, s.opts.IOWorkers)
	var jobs []ioJob
	for _, pc := range pcs {
		for o := uint64(0); o < pc.n; o += part {
			jobs = append(jobs, ioJob{off: pc.slotOff + o, n: min(part, pc.n-o), fileOff: pc.fileOff + int64(o)})
		}
	}
	return jobs
}

// parallelIO runs fn over the parts of pcs, Options.IOWorkers at a time, and joins the errors.
func (s *Set) parallelIO(pcs []piece, fn func(j ioJob) error) error {
	jobs := s.splitIO(pcs)
	next := make(chan ioJob, len(jobs))
	for _, j := range jobs {
		next <- j
	}
	close(next)
	workers := min(s.opts.IOWorkers, len(jobs))
	errs := make([]error, workers)
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range next {
				if err := fn(j); err != nil && errs[w] == nil {
					errs[w] = err
				}
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

func (s *Set) writePieces(e *entry, sl *slot, pcs []piece, prog *progress) error {
	return s.parallelIO(pcs, func(j ioJob) error {
		if _, err := e.opts.File.WriteAt(sl.mem[j.off:j.off+j.n], j.fileOff); err != nil {
			return fmt.Errorf("write %s of %q at file offset %d: %w", units.FormatSize(j.n), e.tag, j.fileOff, err)
		}
		prog.add(j.n)
		return nil
	})
}

// fileIn reads File units back from their files through two staging slots: the next slot is read
// while the device copies the current one. recreate, which maps the units' chunks again, runs
// while the first slot is read.
func (s *Set) fileIn(ctx context.Context, st *vmm.Stream, us []*unit, recreate func() error, prog *progress) (err error) {
	ring, err := s.ring(ctx, st.Device(), us)
	if err != nil {
		return err
	}
	defer s.pool.put(ring[:]...)
	type job struct {
		u *unit
		j int
	}
	var jobs []job
	for _, u := range us {
		for j := 0; j < u.nSlots; j++ {
			jobs = append(jobs, job{u, j})
		}
	}
	read := func(k int) chan error {
		ch := make(chan error, 1)
		go func() { ch <- s.readPieces(jobs[k].u.e, ring[k%2], jobs[k].u.slotPieces(jobs[k].j)) }()
		return ch
	}
	next := read(0)
	defer func() {
		if next != nil {
			<-next
		}
		if err != nil {
			drain(st)
		}
	}()
	if err := recreate(); err != nil {
		return err
	}
	for k, jb := range jobs {
		rerr := <-next
		next = nil
		if err := errors.Join(rerr, ctx.Err()); err != nil {
			return err
		}
		if err := st.Synchronize(); err != nil { // the other slot's copy is done: it may be refilled
			return err
		}
		if k+1 < len(jobs) {
			next = read(k + 1)
		}
		for _, pc := range jb.u.slotPieces(jb.j) {
			if err := jb.u.dev.CopyAsync(pc.dev(), ring[k%2].ptr(pc.slotOff), pc.n, st); err != nil {
				return err
			}
			prog.add(pc.n)
		}
	}
	return st.Synchronize()
}

func (s *Set) readPieces(e *entry, sl *slot, pcs []piece) error {
	return s.parallelIO(pcs, func(j ioJob) error {
		if _, err := e.opts.File.ReadAt(sl.mem[j.off:j.off+j.n], j.fileOff); err != nil {
			return fmt.Errorf("read %s of %q at file offset %d: %w", units.FormatSize(j.n), e.tag, j.fileOff, err)
		}
		return nil
	})
}
