package offload

import (
	"context"
	"errors"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/vmm"
)

// chunkRef names chunk i of entry e.
type chunkRef struct {
	e *entry
	i int
}

func (r chunkRef) state() *chunkState { return &r.e.chunks[r.i] }

// piece is a run of bytes of one chunk and where it lives on the host: a slot and an offset in it,
// and (File policy) an offset in the file.
type piece struct {
	ref     chunkRef
	off, n  uint64 // within the chunk
	slot    int    // index of the slot among the unit's
	slotOff uint64
	fileOff int64
}

func (p piece) dev() driver.DevicePtr { return p.ref.state().ptr + driver.DevicePtr(p.off) }

// unit is the chunks of one entry on one device, copied through one sequence of slots.
type unit struct {
	e        *entry
	dev      *vmm.Device
	bytes    uint64
	slotSize uint64
	nSlots   int
	pieces   []piece // in slot order
	slots    []*slot // the slots taken, by index (Keep: the backup)
	released int     // Keep, sleeping: the pieces whose chunks releaseDone has released
}

// plan groups refs by device and, within a device, by entry, and cuts the chunks into pieces of at
// most slotSize bytes laid out in slots of slotSize (or the unit's size, rounded to 2 MiB, when
// smaller).
func plan(refs []chunkRef, slotSize uint64) map[*vmm.Device][]*unit {
	out := map[*vmm.Device][]*unit{}
	byKey := map[[2]any]*unit{}
	for _, r := range refs {
		st := r.state()
		d := st.alloc.Device()
		u := byKey[[2]any{r.e, d}]
		if u == nil {
			u = &unit{e: r.e, dev: d}
			byKey[[2]any{r.e, d}] = u
			out[d] = append(out[d], u)
		}
		u.bytes += st.size
	}
	for _, us := range out {
		for _, u := range us {
			u.slotSize = unitSlotSize(slotSize, u.bytes)
		}
	}
	pos := map[*unit]uint64{}
	for _, r := range refs {
		st := r.state()
		u := byKey[[2]any{r.e, st.alloc.Device()}]
		fileBase := r.e.opts.FileOffset + int64(r.e.chunkOffset(r.i))
		for off := uint64(0); off < st.size; {
			p := pos[u]
			j, so := p/u.slotSize, p%u.slotSize
			n := min(st.size-off, u.slotSize-so)
			u.pieces = append(u.pieces, piece{ref: r, off: off, n: n, slot: int(j), slotOff: so, fileOff: fileBase + int64(off)})
			off += n
			pos[u] = p + n
		}
		u.nSlots = int((pos[u] + u.slotSize - 1) / u.slotSize)
	}
	return out
}

// chunkOffset is the offset of chunk i in the entry's content (the sum of the earlier chunks).
func (e *entry) chunkOffset(i int) uint64 {
	var n uint64
	for _, c := range e.chunks[:i] {
		n += c.size
	}
	return n
}

// slotPieces returns the pieces of slot j.
func (u *unit) slotPieces(j int) []piece {
	lo := slices.IndexFunc(u.pieces, func(p piece) bool { return p.slot == j })
	if lo < 0 {
		return nil
	}
	hi := lo
	for hi < len(u.pieces) && u.pieces[hi].slot == j {
		hi++
	}
	return u.pieces[lo:hi]
}

// used is how many bytes of slot j the unit fills.
func (u *unit) used(j int) uint64 {
	var n uint64
	for _, p := range u.slotPieces(j) {
		n = max(n, p.slotOff+p.n)
	}
	return n
}

// progress counts copied bytes and reports them.
type progress struct {
	fn    func(done, total uint64)
	total uint64
	done  atomic.Uint64
	mu    sync.Mutex
}

func (p *progress) add(n uint64) {
	d := p.done.Add(n)
	if p.fn != nil {
		p.mu.Lock()
		p.fn(d, p.total)
		p.mu.Unlock()
	}
}

// perDevice runs fn for every device at once and joins the errors; the first failure cancels the
// others' context.
func perDevice(ctx context.Context, units map[*vmm.Device][]*unit, fn func(ctx context.Context, d *vmm.Device, us []*unit) error) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	errs := make([]error, 0, len(units))
	var mu sync.Mutex
	for d, us := range units {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := fn(ctx, d, us); err != nil {
				cancel()
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// unitSlotSize is the slot size of a unit of bytes: slotSize, or the unit rounded up to a huge page
// when it is smaller. Sleep's plan, Prepare, the pool's pruning and PlanFileStaging all use it.
func unitSlotSize(slotSize, bytes uint64) uint64 {
	return min(slotSize, (bytes+hugePage-1)/hugePage*hugePage)
}
