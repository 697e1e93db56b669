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

// mapRange backs the n unmapped pages at off with physical memory: the given pages (unmapped
// allocations the caller hands over), then idle pages moved from elsewhere (stitching, unless turned
// off), then new pages up to the limit, then one cuMemSetAccess over the whole range. When it fails
// it returns how many pages at off are mapped with access (those stay mapped as cache) and releases
// the pages it took but did not map; pages whose access and unmapping both failed stay mapped on
// p.stranded. It fails with errNoMemory before changing anything (but releasing the given pages) when
// the pages cannot be found.
func (p *Pool) mapRange(off, n uint64, given []*vmm.Allocation) (uint64, error) {
	if err := p.backable(n, uint64(len(given))); err != nil {
		_, rerr := p.release(given)
		return 0, errors.Join(err, rerr)
	}
	t0 := time.Now()
	defer p.driverTime(t0)
	defer p.notePeak() // stranded pages count too: they stay mapped
	taken, err := p.takeIdle(min(n-uint64(len(given)), p.stitchable()))
	moved := append(given, taken...)
	done, used, err := p.mapPages(off, n, moved, err)
	if _, rerr := p.release(moved[used:]); rerr != nil { // taken but not mapped: released
		err = errors.Join(err, rerr)
	}
	if done > 0 {
		if aerr := p.res.SetAccess(off, done*p.pageSize, p.access...); aerr != nil {
			return 0, errors.Join(err, aerr, p.strand(off, done))
		}
	}
	if err == nil && len(moved) > 0 {
		p.stats.Stitches++
		p.stats.StitchedBytes += uint64(len(moved)) * p.pageSize
	}
	return done, err
}

// notePeak records Mapped in PeakMapped when it is the most so far.
func (p *Pool) notePeak() {
	p.stats.PeakMapped = max(p.stats.PeakMapped, uint64(len(p.pages))*p.pageSize)
}

// strandedPages is the set of page offsets on p.stranded (nil when there are none).
func (p *Pool) strandedPages() map[uint64]bool {
	if p.stranded.empty() {
		return nil
	}
	out := map[uint64]bool{}
	for _, r := range p.stranded.runs() {
		for o := r.off; o < r.off+r.n; o += p.pageSize {
			out[o] = true
		}
	}
	return out
}

// backable fails with errNoMemory unless n pages can be found: the given ones (unmapped, held by the
// caller), idle ones to stitch, and new ones under the limit, which counts the given ones as held.
func (p *Pool) backable(n, given uint64) error {
	held := uint64(len(p.pages)) + given
	headroom := uint64(0)
	if limitPages := p.opts.Limit / p.pageSize; limitPages > held {
		headroom = limitPages - held
	}
	idle := p.stitchable()
	if given+idle+headroom < n {
		return fmt.Errorf("%d pages needed, %d idle to stitch, %d more allowed by the limit: %w", n, given+idle, headroom, errNoMemory)
	}
	return nil
}

// stitchable is how many idle pages a request may move from elsewhere: none without stitching.
func (p *Pool) stitchable() uint64 {
	if p.opts.NoStitch {
		return 0
	}
	return p.idleBytes() / p.pageSize
}

// mapPages maps pages at off, one after the other, until n are mapped or one fails (at once when err
// is set): the moved ones first, then new ones. It returns how many it mapped and how many of moved it
// consumed (mapped, or released by a failed map).
func (p *Pool) mapPages(off, n uint64, moved []*vmm.Allocation, err error) (done uint64, used int, _ error) {
	for err == nil && done < n {
		var a *vmm.Allocation
		if used < len(moved) {
			a = moved[used]
			used++
		} else if a, err = p.newPage(); err != nil {
			break
		}
		if err = p.mapPage(off+done*p.pageSize, a); err == nil {
			done++
		}
	}
	return done, used, err
}

// newPage creates one page (cuMemCreate); the driver's lack of memory wraps errNoMemory.
func (p *Pool) newPage() (*vmm.Allocation, error) {
	a, err := p.dev.Allocate(p.pageSize, vmm.AllocOptions{})
	if err != nil {
		if errors.Is(err, driver.ErrOutOfMemory) {
			err = fmt.Errorf("%w: %w", errNoMemory, err)
		}
		return nil, err
	}
	p.stats.NewPages++
	return a, nil
}

// strand undoes the mapping of the t pages at off after granting access to them failed. When the
// unmap fails too, they stay mapped without access and out of use on p.stranded, where Trim, Close
// and Sleep retry dropping them; their address range is free again only then.
func (p *Pool) strand(off, t uint64) error {
	err := p.dropPages(off, t)
	if p.pages[off] != nil {
		p.stranded.add(off, t*p.pageSize)
		err = fmt.Errorf("%s at offset %#x stay mapped without access until a Trim can unmap them: %w", units.FormatSize(t*p.pageSize), off, err)
	}
	return err
}

// dropStranded unmaps and releases the stranded pages and gives their address range back. It
// returns the bytes released; a page whose release fails waits on p.unreleased.
func (p *Pool) dropStranded() (uint64, error) {
	var released uint64
	var errs []error
	for _, r := range p.stranded.runs() {
		as, err := p.unmapPages(r.off, r.n/p.pageSize)
		if err != nil {
			errs = append(errs, fmt.Errorf("unmap %s left mapped without access: %w", units.FormatSize(r.n), err))
			continue
		}
		p.stranded.take(p.stranded.byStart[r.off], r.off, r.n)
		p.giveBack(r.off, r.n)
		n, err := p.release(as)
		released += n
		errs = append(errs, err)
	}
	return released, errors.Join(errs...)
}

// mapPage maps a (one page) at off without access; a is released when that fails.
func (p *Pool) mapPage(off uint64, a *vmm.Allocation) error {
	m, err := p.res.Map(off, a)
	if err != nil {
		_, rerr := p.release([]*vmm.Allocation{a})
		return errors.Join(err, rerr)
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

// dropPages unmaps the t pages at off with one cuMemUnmap and releases them. When the unmap fails
// nothing changed. Once it succeeded the pages are gone from p.pages whatever the error says: the
// caller updates its ranges when p.pages[off] is nil.
func (p *Pool) dropPages(off, t uint64) error {
	as, err := p.unmapPages(off, t)
	if err != nil {
		return err
	}
	_, err = p.release(as)
	return err
}

// release releases unmapped pages (cuMemRelease), with Options.ReleaseWorkers goroutines when there
// are many, and returns the bytes released. A page whose release fails is kept on p.unreleased, which
// Trim and Close retry, so that nothing leaks.
func (p *Pool) release(as []*vmm.Allocation) (uint64, error) {
	errs := make([]error, len(as))
	closeAll(as, errs, p.opts.ReleaseWorkers)
	var n uint64
	for i, err := range errs {
		if err != nil {
			p.unreleased = append(p.unreleased, as[i])
		} else {
			n += p.pageSize
		}
	}
	return n, errors.Join(errs...)
}

// retryReleases releases again the pages whose release failed before and returns the bytes released.
func (p *Pool) retryReleases() (uint64, error) {
	as := p.unreleased
	p.unreleased = nil
	n, err := p.release(as)
	if err != nil {
		err = fmt.Errorf("retry releasing %d pages, %d still fail: %w", len(as), len(p.unreleased), err)
	}
	return n, err
}

// closeAll closes the allocations into errs (one per allocation), spread over up to workers
// goroutines when there are at least 64.
func closeAll(as []*vmm.Allocation, errs []error, workers int) {
	if len(as) < 64 || workers <= 1 {
		for i, a := range as {
			errs[i] = a.Close()
		}
		return
	}
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		lo, hi := w*len(as)/workers, (w+1)*len(as)/workers
		wg.Add(1)
		go func() {
			defer wg.Done()
			closeAll(as[lo:hi], errs[lo:hi], 1)
		}()
	}
	wg.Wait()
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

// releaseIdle is dropIdleTo counted as one trim (the high-water mark, Sleep).
func (p *Pool) releaseIdle(keep uint64) (uint64, error) {
	n, err := p.dropIdleTo(keep)
	p.trimmed(n)
	return n, err
}

// dropIdleTo unmaps and releases idle pages until at most keep bytes of them remain, large cache
// first (the tail of the largest run), then small pages. It returns the bytes released; pages it
// unmapped but could not release are no longer cached (they wait on p.unreleased).
func (p *Pool) dropIdleTo(keep uint64) (uint64, error) {
	t0 := time.Now()
	defer p.driverTime(t0)
	var released uint64
	for p.idleBytes() > keep {
		excess := (p.idleBytes() - keep + p.pageSize - 1) / p.pageSize
		n, err := p.dropIdle(excess)
		released += n
		if err != nil {
			return released, err
		}
	}
	return released, nil
}

// dropIdle unmaps and releases up to excess idle pages: the tail of the largest cached run, or else
// the first idle small page. Once unmapped they leave the cache even when their release fails.
func (p *Pool) dropIdle(excess uint64) (uint64, error) {
	if r := p.cached.largest(); r != nil {
		t := min(r.n/p.pageSize, excess)
		start := r.end() - t*p.pageSize
		as, err := p.unmapPages(start, t)
		if err != nil {
			return 0, err
		}
		p.cached.take(r, start, t*p.pageSize)
		p.unmapped.add(start, t*p.pageSize)
		return p.release(as)
	}
	pg := p.idleSmallPages()[0]
	as, err := p.unmapPages(pg, 1)
	if err != nil {
		return 0, err
	}
	p.forgetSmallPage(pg)
	return p.release(as)
}

// trimmed counts n bytes released by a trim (Trim, the high-water mark, Close).
func (p *Pool) trimmed(n uint64) {
	if n > 0 {
		p.stats.Trims++
		p.stats.TrimmedBytes += n
	}
}

// releaseAll retries the releases that failed before and the pages left mapped without access, then
// releases every idle page (unless the pool is asleep: it has none), and returns the bytes released
// (Trim, Close), counted as one trim.
func (p *Pool) releaseAll() (uint64, error) {
	n, err := p.retryReleases()
	s, serr := p.dropStranded()
	var m uint64
	var ierr error
	if !p.asleep {
		m, ierr = p.dropIdleTo(0)
	}
	p.trimmed(n + s + m)
	return n + s + m, errors.Join(err, serr, ierr)
}

// Trim waits for pending frees (their events, not the device), then unmaps and releases every idle
// page, so that the driver can give the memory to others. It returns the bytes released. Blocks keep
// their memory and addresses.
//
// A page whose release (cuMemRelease) fails is unmapped all the same and no longer cached: the error
// says so, and every later Trim, and Close, retries the release; the bytes count once released.
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
	n, err := p.releaseAll()
	if err != nil {
		return n, fmt.Errorf("pool: trim (%s released): %w", units.FormatSize(n), err)
	}
	return n, nil
}
