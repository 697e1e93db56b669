package offload

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/vmm"
)

// A staged first sleep copies a Keep unit's bytes through a small ring of pinned pieces into plain
// memory, which goroutines copy them out to (faulting it in on the way), and registers that memory
// only once the sleep is done, in the background. Registering host memory costs every GPU the
// process holds a context on: on the measured host 16 GiB took 0.59-0.76 s to register in a process
// holding two GPUs, against 0.36-0.45 s with one, so the pinned way's first sleep took 0.81-1.04 s
// there, while the staged copy alone took 0.53-0.63 s (scripts/host/first_pin.c --mode stage). In a
// process holding one GPU both ways took the same time, and the pinned way leaves nothing to do
// after the sleep: FirstSleepAuto stages only where the process holds several.
const (
	stagePiece = 32 << 20 // the bytes of one copy into the ring
	stageRing  = 8        // ring pieces: how far the copies run ahead of the copying out
	stagePart  = 2 << 20  // the bytes a goroutine copies out of the ring at once
)

// FirstSleep says how a sleep makes the backup of a Keep buffer when the pool has no slots for it.
type FirstSleep int

const (
	// FirstSleepAuto stages (FirstSleepStage) when the System has opened several devices, else pins
	// (FirstSleepPin).
	FirstSleepAuto FirstSleep = iota
	// FirstSleepPin pins the slots while it copies into them: each slot is faulted in and
	// registered, then the copies into it are queued.
	FirstSleepPin
	// FirstSleepStage copies through a ring of pinned pieces into plain memory, registered in the
	// background once the sleep is done. A Wake (or a Sleep that fails and undoes itself) right
	// after waits for that registration; if it fails (out of host memory to pin) the Wake retries
	// it and fails with an error wrapping driver.ErrOutOfMemory, the buffers staying asleep with
	// their backup.
	FirstSleepStage
)

func (f FirstSleep) String() string {
	switch f {
	case FirstSleepAuto:
		return "auto"
	case FirstSleepPin:
		return "pin"
	case FirstSleepStage:
		return "stage"
	}
	return fmt.Sprintf("FirstSleep(%d)", int(f))
}

// ParseFirstSleep parses "auto", "pin" or "stage" (FirstSleep.String).
func ParseFirstSleep(s string) (FirstSleep, error) {
	for _, f := range []FirstSleep{FirstSleepAuto, FirstSleepPin, FirstSleepStage} {
		if f.String() == s {
			return f, nil
		}
	}
	return 0, fmt.Errorf("offload: first sleep %q: want auto, pin or stage: %w", s, ErrInvalidValue)
}

// stages reports whether a Keep unit's sleep stages its backup (see FirstSleep).
func (s *Set) stages(u *unit) bool {
	if s.pool.has(u.slotSize) {
		return false
	}
	switch s.opts.FirstSleep {
	case FirstSleepStage:
		return true
	case FirstSleepAuto:
		return len(s.sys.OpenedDevices()) > 1
	}
	return false
}

// pin makes sure the slot is registered: it waits for a staged slot's background registration and
// tries again when that failed.
func (s *slot) pin() error {
	if s.reg != nil {
		<-s.reg
	}
	s.closeMu.Lock()
	defer s.closeMu.Unlock()
	if s.region != nil {
		return nil
	}
	if s.freed {
		return fmt.Errorf("offload: a %s backup slot was freed: %w", units.FormatSize(s.size), ErrClosed)
	}
	return s.registerLocked()
}

// registerLocked registers a staged slot's memory; closeMu is held.
func (s *slot) registerLocked() error {
	r, err := registerMem(s.dev, s.mem)
	if err != nil {
		return fmt.Errorf("pin a %s backup slot: %w", units.FormatSize(s.size), err)
	}
	s.region = r
	return nil
}

// queueRegistration marks staged slots as waiting for their registration, which copyOut starts once
// every device's copies are done (startRegistration), so that it does not compete with the staging
// of the units after them.
func (s *Set) queueRegistration(slots []*slot) {
	s.stagedMu.Lock()
	defer s.stagedMu.Unlock()
	for _, sl := range slots {
		sl.reg = make(chan struct{})
		s.toRegister = append(s.toRegister, sl)
	}
}

// startRegistration registers the slots queueRegistration queued, in the background.
func (s *Set) startRegistration() {
	s.stagedMu.Lock()
	slots := s.toRegister
	s.toRegister = nil
	s.stagedMu.Unlock()
	if len(slots) > 0 {
		registerInBackground(slots)
	}
}

// registerInBackground registers staged slots from registerWorkers goroutines, in order, closing each
// slot's reg once its attempt has ended. A failed attempt leaves the slot unregistered for pin to
// retry.
func registerInBackground(slots []*slot) {
	next := make(chan *slot, len(slots))
	for _, sl := range slots {
		next <- sl
	}
	close(next)
	for range min(registerWorkers, len(slots)) {
		go func() {
			for sl := range next {
				sl.closeMu.Lock()
				if !sl.freed && sl.region == nil {
					_ = sl.registerLocked() // pin retries and reports it
				}
				sl.closeMu.Unlock()
				close(sl.reg)
			}
		}()
	}
}

// stageBit is one copy through the ring: n bytes of the device into ring piece r, then out to dst,
// part of slot j's memory.
type stageBit struct {
	j    int
	r    int
	n    uint64
	dst  []byte
	left atomic.Int32 // parts not yet copied out
}

// stager moves a unit's bytes through the ring: the caller queues each bit's copy into a free ring
// piece (queue), a dispatching goroutine waits for the copy's event and hands its parts to the
// copying goroutines, and the last part of a bit frees its piece and reports the bit (out).
type stager struct {
	ring   []*slot
	pooled int // the first pooled ring pieces came from the pool (giveBackRing)
	ev     []*vmm.Event
	free   chan int       // ring pieces free for a copy
	bits   chan *stageBit // queued copies, in order, for the dispatcher
	parts  chan stageWork
	out    chan *stageBit // bits copied out
	fail   chan struct{}  // closed when an event wait failed
	err    error          // that failure; read after wg.Wait or once fail is closed
	wg     sync.WaitGroup
}

type stageWork struct {
	b   *stageBit
	off uint64
}

// newStager takes the ring (up to stageRing pinned pieces of piece bytes from the pool, no more than
// the bits to move) and its events, and starts workers goroutines that copy out.
func (s *Set) newStager(ctx context.Context, d *vmm.Device, piece uint64, bits, workers int) (*stager, error) {
	ring, pooled, err := s.ring(ctx, d, piece, min(stageRing, bits))
	if err != nil {
		return nil, err
	}
	g := &stager{ring: ring, pooled: pooled, free: make(chan int, stageRing), bits: make(chan *stageBit, stageRing),
		parts: make(chan stageWork, 2*workers), out: make(chan *stageBit, bits), fail: make(chan struct{})}
	for r := range ring {
		ev, err := d.NewBlockingEvent()
		if err != nil {
			s.giveBackRing(g)
			return nil, errors.Join(err, g.closeEvents())
		}
		g.ev = append(g.ev, ev)
		g.free <- r
	}
	g.wg.Add(1 + workers)
	go g.dispatch()
	for range workers {
		go g.copyOut()
	}
	return g, nil
}

// giveBackRing pools again the ring pieces taken from the pool (the warm slots of a buffer whose
// slot size is the piece size) and frees those made for the ring: a staged sleep leaves the set
// holding its backups and what it held before.
func (s *Set) giveBackRing(g *stager) {
	s.pool.put(g.ring[:g.pooled]...)
	s.pool.free(g.ring[g.pooled:])
}

// dispatch waits for each queued bit's copy into the ring, then hands out its parts; after a failed
// wait it hands out nothing more.
func (g *stager) dispatch() {
	defer g.wg.Done()
	defer close(g.parts)
	failed := false
	for b := range g.bits {
		if failed {
			continue
		}
		if err := g.ev[b.r].Synchronize(); err != nil {
			g.err, failed = err, true
			close(g.fail)
			continue
		}
		for off := uint64(0); off < b.n; off += stagePart {
			g.parts <- stageWork{b, off}
		}
	}
}

// copyOut copies parts out of the ring; the last part of a bit frees its ring piece.
func (g *stager) copyOut() {
	defer g.wg.Done()
	for w := range g.parts {
		n := min(stagePart, w.b.n-w.off)
		copy(w.b.dst[w.off:w.off+n], g.ring[w.b.r].mem[w.off:w.off+n])
		if w.b.left.Add(-1) == 0 {
			g.free <- w.b.r
			g.out <- w.b
		}
	}
}

// queue queues bit b's copy of src into a free ring piece on st, waiting for one; it returns ctx's
// error or a failed wait's, and reports the bits copied out meanwhile to done.
func (g *stager) queue(ctx context.Context, st *vmm.Stream, b *stageBit, src driver.DevicePtr, done func(*stageBit) error) error {
	for {
		select {
		case r := <-g.free:
			b.r = r
			b.left.Store(int32((b.n + stagePart - 1) / stagePart))
			if err := st.Device().CopyAsync(g.ring[r].ptr(0), src, b.n, st); err != nil {
				return err
			}
			if err := g.ev[r].Record(st); err != nil {
				return err
			}
			g.bits <- b
			return nil
		case ob := <-g.out:
			if err := done(ob); err != nil {
				return err
			}
		case <-g.fail:
			return g.err
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// wait reports the bits copied out until n in all have been, or a wait fails, or ctx ends.
func (g *stager) wait(ctx context.Context, n int, done func(*stageBit) error) error {
	for ; n > 0; n-- {
		select {
		case b := <-g.out:
			if err := done(b); err != nil {
				return err
			}
		case <-g.fail:
			return g.err
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// stop ends the goroutines once the bits queued so far are copied out (or their wait failed).
func (g *stager) stop() {
	close(g.bits)
	g.wg.Wait()
}

func (g *stager) closeEvents() error {
	var errs []error
	for _, ev := range g.ev {
		errs = append(errs, closeRetry(ev))
	}
	return errors.Join(errs...)
}

// keepOutStaged is keepOut for a staged first sleep (FirstSleepStage): it copies the unit through
// the ring into fresh memory, releases each chunk once the slots holding it are wholly copied out
// (releaseDone), and on success registers the slots in the background. On failure the slots wholly
// copied out stay the unit's (the backup of the chunks released), registered when first needed; the
// others are unmapped.
func (s *Set) keepOutStaged(ctx context.Context, st *vmm.Stream, u *unit, share int, prog *progress) error {
	mems, err := mapSlots(u.dev, u.nSlots, u.slotSize)
	if err != nil {
		return fmt.Errorf("map %d backup slot(s) of %s: %w", u.nSlots, units.FormatSize(u.slotSize), err)
	}
	piece := min(uint64(stagePiece), u.slotSize)
	bits, srcs := u.stageBits(piece, mems)
	g, err := s.newStager(ctx, u.dev, piece, len(bits), populateWorkers(share))
	if err != nil {
		return errors.Join(err, unmapAll(mems))
	}
	left := make([]int, u.nSlots) // the bits of each slot not yet copied out
	for _, b := range bits {
		left[b.j]++
	}
	complete, reported := 0, 0        // slots [0, complete) are wholly copied out
	done := func(b *stageBit) error { // releases first, so that a copy counted is a chunk given back
		reported++
		left[b.j]--
		for complete < u.nSlots && left[complete] == 0 {
			complete++
		}
		err := s.releaseDone(u, complete-1)
		prog.add(b.n)
		return err
	}
	err = func() error {
		for k, b := range bits {
			if err := g.queue(ctx, st, b, srcs[k], done); err != nil {
				return err
			}
		}
		return g.wait(ctx, len(bits)-reported, done)
	}()
	return s.endStaged(st, u, g, mems, complete, err)
}

// endStaged ends keepOutStaged, which failed with err unless it is nil, once the first complete
// slots are wholly copied out: it stops the stager, gives the ring back once no copy into it is left
// queued (else holds it: drainOrHold), keeps those slots as the unit's and unmaps the rest.
func (s *Set) endStaged(st *vmm.Stream, u *unit, g *stager, mems [][]byte, complete int, err error) error {
	g.stop()
	err = errors.Join(err, g.closeEvents())
	herr := error(nil)
	if err != nil {
		herr = s.drainOrHold(st, g.ring...)
	}
	if !errors.Is(herr, errNotDrained) {
		s.giveBackRing(g)
	}
	u.slots = make([]*slot, u.nSlots)
	for j := range complete {
		u.slots[j] = &slot{mem: mems[j], size: u.slotSize, dev: u.dev}
	}
	if err == nil {
		s.queueRegistration(u.slots)
		s.staged.Add(u.bytes)
		return nil
	}
	return errors.Join(err, herr, unmapAll(mems[complete:]))
}

// stageBits cuts the unit's pieces into bits of at most piece bytes, each copied out to its place in
// mems, and returns them with the device address each copies from.
func (u *unit) stageBits(piece uint64, mems [][]byte) ([]*stageBit, []driver.DevicePtr) {
	var bits []*stageBit
	var srcs []driver.DevicePtr
	for _, pc := range u.pieces {
		for off := uint64(0); off < pc.n; off += piece {
			n := min(piece, pc.n-off)
			at := pc.slotOff + off
			bits = append(bits, &stageBit{j: pc.slot, n: n, dst: mems[pc.slot][at : at+n]})
			srcs = append(srcs, pc.dev()+driver.DevicePtr(off))
		}
	}
	return bits, srcs
}

// unmapAll unmaps memory from mapSlots.
func unmapAll(mems [][]byte) error {
	var errs []error
	for _, m := range mems {
		errs = append(errs, pinned.Unmap(m))
	}
	return errors.Join(errs...)
}
