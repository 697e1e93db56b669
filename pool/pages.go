package pool

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/vmm"
)

// mapRange backs the n unmapped pages at off with physical memory: idle pages moved from elsewhere
// first (stitching, unless turned off), then new pages up to the limit, then one cuMemSetAccess over
// the whole range. It returns how many pages at off are mapped, with access, when it fails (those
// stay mapped as cache); it fails with errNoMemory before changing anything when the pages cannot be
// found.
func (p *Pool) mapRange(off, n uint64) (uint64, error) {
	mappedPages := uint64(len(p.pages))
	headroom := uint64(0)
	if limitPages := p.opts.Limit / p.pageSize; limitPages > mappedPages {
		headroom = limitPages - mappedPages
	}
	var idle uint64
	if !p.opts.NoStitch {
		idle = p.idleBytes() / p.pageSize
	}
	if idle+headroom < n {
		return 0, fmt.Errorf("%d pages needed, %d idle to stitch, %d more allowed by the limit: %w", n, idle, headroom, errNoMemory)
	}
	t0 := time.Now()
	defer p.driverTime(t0)
	moved, err := p.takeIdle(min(n, idle))
	if len(moved) > 0 {
		p.stats.Stitches++
		p.stats.StitchedBytes += uint64(len(moved)) * p.pageSize
	}
	var done uint64
	used := 0 // moved pages consumed: mapped, or released by a failed map
	for err == nil && done < n {
		var a *vmm.Allocation
		if used < len(moved) {
			a = moved[used]
			used++
		} else if a, err = p.dev.Allocate(p.pageSize, vmm.AllocOptions{}); err != nil {
			if errors.Is(err, driver.ErrOutOfMemory) {
				err = fmt.Errorf("%w: %w", errNoMemory, err)
			}
			break
		} else {
			p.stats.NewPages++
		}
		if err = p.mapPage(off+done*p.pageSize, a); err == nil {
			done++
		}
	}
	for _, a := range moved[used:] {
		err = errors.Join(err, a.Close()) // taken but not mapped: released
	}
	if done > 0 {
		if aerr := p.res.SetAccess(off, done*p.pageSize, p.access...); aerr != nil {
			_, uerr := p.dropPages(off, done)
			return 0, errors.Join(err, aerr, uerr)
		}
	}
	p.stats.PeakMapped = max(p.stats.PeakMapped, uint64(len(p.pages))*p.pageSize)
	return done, err
}

// mapPage maps a (one page) at off without access; a is released when that fails.
func (p *Pool) mapPage(off uint64, a *vmm.Allocation) error {
	m, err := p.res.Map(off, a)
	if err != nil {
		return errors.Join(err, a.Close())
	}
	p.pages[off] = &page{alloc: a, m: m}
	return nil
}

// unmapPages unmaps the t pages at off with one cuMemUnmap and returns their allocations, still alive.
func (p *Pool) unmapPages(off, t uint64) ([]*vmm.Allocation, error) {
	if err := p.res.UnmapRange(off, t*p.pageSize); err != nil {
		return nil, err
	}
	out := make([]*vmm.Allocation, t)
	for i := range out {
		o := off + uint64(i)*p.pageSize
		out[i] = p.pages[o].alloc
		delete(p.pages, o)
	}
	return out, nil
}

// dropPages unmaps the t pages at off with one cuMemUnmap and releases them, with
// Options.ReleaseWorkers goroutines when there are many.
func (p *Pool) dropPages(off, t uint64) (uint64, error) {
	as, err := p.unmapPages(off, t)
	if err != nil {
		return 0, err
	}
	return t * p.pageSize, closeAll(as, p.opts.ReleaseWorkers)
}

// closeAll closes the allocations, spread over up to workers goroutines when there are at least 64.
func closeAll(as []*vmm.Allocation, workers int) error {
	if len(as) < 64 || workers <= 1 {
		var errs []error
		for _, a := range as {
			errs = append(errs, a.Close())
		}
		return errors.Join(errs...)
	}
	errs := make([]error, workers)
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			errs[w] = closeAll(as[w*len(as)/workers:(w+1)*len(as)/workers], 1)
		}(w)
	}
	wg.Wait()
	return errors.Join(errs...)
}

// takeIdle unmaps up to k idle pages (large cache first, smallest runs first so that large contiguous
// runs survive, then idle small pages) and returns their allocations for mapping elsewhere.
func (p *Pool) takeIdle(k uint64) ([]*vmm.Allocation, error) {
	var out []*vmm.Allocation
	for _, r := range p.cached.runs() {
		if uint64(len(out)) == k {
			return out, nil
		}
		t := min(r.n/p.pageSize, k-uint64(len(out)))
		start := r.end() - t*p.pageSize
		as, err := p.unmapPages(start, t)
		if err != nil {
			return out, err
		}
		p.cached.take(p.cached.byStart[r.off], start, t*p.pageSize)
		p.unmapped.add(start, t*p.pageSize)
		out = append(out, as...)
	}
	for _, pg := range p.idleSmallPages() {
		if uint64(len(out)) == k {
			break
		}
		as, err := p.unmapPages(pg, 1)
		if err != nil {
			return out, err
		}
		p.forgetSmallPage(pg)
		out = append(out, as...)
	}
	return out, nil
}

// idleSmallPages lists the idle small pages in address order.
func (p *Pool) idleSmallPages() []uint64 {
	out := make([]uint64, 0, len(p.smallIdle))
	for pg := range p.smallIdle {
		out = append(out, pg)
	}
	slices.Sort(out)
	return out
}

// forgetSmallPage returns an unmapped idle small page to the small address space.
func (p *Pool) forgetSmallPage(pg uint64) {
	p.smallFree.take(p.smallFree.byStart[pg], pg, p.pageSize)
	delete(p.smallIdle, pg)
	p.smallVA.add(pg, p.pageSize)
}

// releaseIdle unmaps and releases idle pages until at most keep bytes of them remain, large cache
// first (the tail of the largest run), then small pages.
func (p *Pool) releaseIdle(keep uint64) (uint64, error) {
	t0 := time.Now()
	defer p.driverTime(t0)
	var released uint64
	defer func() {
		if released > 0 {
			p.stats.Trims++
			p.stats.TrimmedBytes += released
		}
	}()
	for p.idleBytes() > keep {
		excess := (p.idleBytes() - keep + p.pageSize - 1) / p.pageSize
		if r := p.cached.largest(); r != nil {
			t := min(r.n/p.pageSize, excess)
			start := r.end() - t*p.pageSize
			n, err := p.dropPages(start, t)
			released += n
			if err != nil {
				return released, err
			}
			p.cached.take(r, start, t*p.pageSize)
			p.unmapped.add(start, t*p.pageSize)
			continue
		}
		pg := p.idleSmallPages()[0]
		n, err := p.dropPages(pg, 1)
		released += n
		if err != nil {
			return released, err
		}
		p.forgetSmallPage(pg)
	}
	return released, nil
}

// Trim waits for pending frees (their events, not the device), then unmaps and releases every idle
// page, so that the driver can give the memory to others. It returns the bytes released. Blocks keep
// their memory and addresses.
func (p *Pool) Trim() (uint64, error) {
	if p == nil {
		return 0, fmt.Errorf("pool: trim: nil pool: %w", vmm.ErrInvalidValue)
	}
	p.own.Lock()
	defer p.own.Unlock()
	if err := p.usable("trim"); err != nil {
		return 0, err
	}
	if err := p.drain(true); err != nil {
		return 0, fmt.Errorf("pool: trim: %w", err)
	}
	n, err := p.releaseIdle(0)
	if err != nil {
		return n, fmt.Errorf("pool: trim (%s released): %w", units.FormatSize(n), err)
	}
	return n, nil
}
