package pool

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/vmm"
)

// Chunked returns the pool's mapped memory as a vmm.Chunked: Ptr is the reservation's start, and
// Chunks lists the mapped physical pages at their offsets, in offset order, with holes where nothing
// is mapped; Len is the end of the last chunk. The view is live: each call of Chunks or Len reads
// the pool as it is then.
//
// This is how package offload sleeps and wakes a pool with every block at its address: add the
// view to a Set (offload.Set.Add(tag, p.Chunked(), policy, ...)); its Sleep releases each page in
// place (vmm.Allocation.ReleaseAt) and its Wake recreates it (RecreateAt), so the pool's records stay
// valid. While the set holds the pool asleep, do not Alloc, Free or Trim: the pages under cached
// ranges have no memory.
func (p *Pool) Chunked() vmm.Chunked { return chunkView{p} }

type chunkView struct{ p *Pool }

func (v chunkView) Ptr() driver.DevicePtr { return v.p.res.Ptr() }

func (v chunkView) Len() uint64 {
	chunks := v.Chunks()
	if len(chunks) == 0 {
		return 0
	}
	return chunks[len(chunks)-1].Offset + v.p.pageSize
}

func (v chunkView) Chunks() []vmm.Chunk {
	p := v.p
	p.own.Lock()
	defer p.own.Unlock()
	stranded := p.strandedPages() // mapped without access, in use by nothing: not the pool's content
	offs := make([]uint64, 0, len(p.pages))
	for off := range p.pages {
		if !stranded[off] {
			offs = append(offs, off)
		}
	}
	slices.Sort(offs)
	out := make([]vmm.Chunk, len(offs))
	for i, off := range offs {
		out[i] = vmm.Chunk{Offset: off, Allocation: p.pages[off].alloc}
	}
	return out
}

// Sleep gives the pool's physical memory back to the driver while every block keeps its address:
// it waits for pending frees (their events), releases idle pages for good, and unmaps and releases
// the pages under live blocks, remembering where they were. Their content is not kept: copy what must
// survive out first (through Chunked). Until Wake, Alloc and Free fail with ErrAsleep and work must not
// touch the blocks. (Package offload can instead sleep the pool through Chunked, keeping content.)
//
// A failed Sleep leaves the pool awake with every block intact, unless its error wraps ErrAsleep:
// then the pool is asleep all the same, as after a successful Sleep, and only giving some pages back
// failed. A page it could not unmap stays mapped (Wake keeps it, content and all); a page it could not
// release is unmapped, and Trim and Close retry its release.
func (p *Pool) Sleep() error {
	if p == nil {
		return fmt.Errorf("pool: sleep: nil pool: %w", vmm.ErrInvalidValue)
	}
	p.own.Lock()
	defer p.own.Unlock()
	if err := p.usable("sleep"); err != nil {
		return err
	}
	if err := p.drain(true); err != nil {
		return fmt.Errorf("pool: sleep: %w", err)
	}
	if _, err := p.releaseIdle(0); err != nil {
		return fmt.Errorf("pool: sleep: %w", err)
	}
	if _, err := p.dropStranded(); err != nil {
		return fmt.Errorf("pool: sleep: %w", err)
	}
	if n, err := p.sleepPages(); err != nil {
		return fmt.Errorf("pool: sleep: %w, but %d of its pages were not given back: %w", ErrAsleep, n, err)
	}
	return nil
}

// sleepPages unmaps and releases every mapped page (all under live blocks) and puts the pool to sleep,
// whatever fails: it returns how many pages it could not give back, and why. A page it cannot unmap
// stays mapped and out of p.slept; one it cannot release waits on p.unreleased.
func (p *Pool) sleepPages() (int, error) {
	defer p.driverTime(time.Now())
	stranded := p.strandedPages() // mapped without access, in use by nothing: not the pool's content
	offs := make([]uint64, 0, len(p.pages))
	for off := range p.pages {
		if !stranded[off] {
			offs = append(offs, off)
		}
	}
	slices.Sort(offs)
	slept := make([]uint64, 0, len(offs))
	var errs []error
	for _, off := range offs {
		as, err := p.unmapPages(off, 1)
		if err == nil {
			slept = append(slept, off)
			_, err = p.release(as)
		}
		if err != nil {
			errs = append(errs, err)
		}
	}
	p.slept, p.asleep = slept, true
	return len(errs), errors.Join(errs...)
}

// Wake maps new physical memory at every offset Sleep released, with the same access, so every block
// is usable at its old address again (with undefined content). When the device has no room it fails
// with an error wrapping driver.ErrOutOfMemory, stays asleep as it was, and can be retried.
func (p *Pool) Wake() error {
	if p == nil {
		return fmt.Errorf("pool: wake: nil pool: %w", vmm.ErrInvalidValue)
	}
	p.own.Lock()
	defer p.own.Unlock()
	if p.own.Closed() {
		return fmt.Errorf("pool: wake: %w", vmm.ErrClosed)
	}
	if !p.asleep {
		return fmt.Errorf("pool: wake: the pool is not asleep: %w", vmm.ErrInvalidValue)
	}
	if err := p.restore(); err != nil {
		return fmt.Errorf("pool: wake: %w", err)
	}
	p.slept, p.asleep = nil, false
	return nil
}

// restore maps new pages at the offsets in p.slept, run by run; on failure it unmaps what it mapped.
// Pages that a failed Wake could not unmap are still mapped at some of those offsets, perhaps without
// access: it drops them first, and stays asleep when it cannot.
func (p *Pool) restore() error {
	defer p.driverTime(time.Now())
	if err := p.unrestore(); err != nil {
		return err
	}
	for i := 0; i < len(p.slept); {
		j := i + 1
		for j < len(p.slept) && p.slept[j] == p.slept[j-1]+p.pageSize {
			j++
		}
		if err := p.newRun(p.slept[i], uint64(j-i)); err != nil {
			return errors.Join(err, p.unrestore())
		}
		i = j
	}
	return nil
}

// unrestore unmaps and releases the pages mapped at the offsets in p.slept. A page it cannot unmap
// stays mapped (its access perhaps not granted) and its offset stays in p.slept: the next Wake drops
// it before mapping a new page there, so that no block is left on a page without access.
func (p *Pool) unrestore() error {
	var errs []error
	for _, off := range p.slept {
		if p.pages[off] != nil {
			errs = append(errs, p.dropPages(off, 1))
		}
	}
	return errors.Join(errs...)
}

// newRun creates and maps n new pages at off and grants access, all or nothing.
func (p *Pool) newRun(off, n uint64) error {
	var err error
	var done uint64
	for done < n {
		var a *vmm.Allocation
		if a, err = p.dev.Allocate(p.pageSize, vmm.AllocOptions{}); err != nil {
			break
		}
		p.stats.NewPages++
		if err = p.mapPage(off+done*p.pageSize, a); err != nil {
			break
		}
		done++
	}
	if err == nil {
		err = p.res.SetAccess(off, n*p.pageSize, p.access...)
	}
	if err != nil && done > 0 {
		err = errors.Join(err, p.dropPages(off, done))
	}
	return err
}
