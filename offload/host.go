package offload

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/hostmem"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/pinned"
	"github.com/cuvmm/cuvmm/vmm"
)

const hugePage = 2 << 20

// A first sleep makes its slots in two stages that run ahead of the copies: populate faults each
// slot's pages in from the cores the registrations leave (populateWorkers; the kernel zeroes a
// fresh page in the thread that faults it, and on a virtual machine the host provides it then),
// slot after slot in order; registerWorkers goroutines register the populated slots
// (cuMemHostRegister then only pins pages already present) and queue each slot's copy (see
// feedUsing). So populating slot i+1 overlaps registering slot i and copying slot i-1, and the
// first sleep takes about the longest of the three stages rather than their sum. The registering
// goroutines get cores of their own: a C model of this pipeline on the measured host pinned and
// copied 16 GiB in 0.64 s on average with 14 populating threads and in 0.78 s with 16. The pages
// are faulted in by writing to them (hostmem.FaultIn), not with MADV_POPULATE_WRITE, which holds
// the address-space lock that the registrations need too: a first sleep of 16 GiB took 0.55-0.56 s
// against 0.82-0.91 s on the measured host.
const (
	registerWorkers = 2
	populateStep    = 16 << 20
)

// slot is one pinned host buffer of a backup: transparent-huge-page memory registered with the
// driver (pinned.Register), the fastest pinned memory to make on the measured host. A staged slot
// (see stage.go) starts as plain memory holding a backup and is registered in the background; pin
// waits for that.
type slot struct {
	mem    []byte
	region *pinned.Region // nil while a staged slot is not registered
	size   uint64
	dev    *vmm.Device   // staged: the device it is registered through
	reg    chan struct{} // staged: closed once its background registration has ended

	closeMu sync.Mutex // close may be retried by the System (hostPool.free, hostPool.handOver)
	freed   bool
}

// ptr is the address devices use for byte off of the slot.
func (s *slot) ptr(off uint64) driver.DevicePtr { return s.region.Ptr() + driver.DevicePtr(off) }

// registerSlot pins memory from mapSlot; it unmaps the memory when that fails.
func registerSlot(dev *vmm.Device, mem []byte, size uint64) (*slot, error) {
	r, err := registerMem(dev, mem)
	if err != nil {
		return nil, errors.Join(err, pinned.Unmap(mem))
	}
	return &slot{mem: mem, region: r, size: size}, nil
}

// registerMem registers a slot's memory, saying so when the host is out of memory to pin.
func registerMem(dev *vmm.Device, mem []byte) (*pinned.Region, error) {
	r, err := pinned.Register(dev, mem, pinned.RegisterOptions{HugePages: true})
	if err != nil && errors.Is(err, driver.ErrOutOfMemory) {
		err = fmt.Errorf("out of host memory to pin: %w", err)
	}
	return r, err
}

// close unpins and unmaps the slot. It is idempotent: once it has succeeded, later calls do nothing,
// and after a failure a later call retries what is left. A staged slot's background registration
// ends first.
func (s *slot) close() error {
	if s.reg != nil {
		<-s.reg
	}
	s.closeMu.Lock()
	defer s.closeMu.Unlock()
	if s.freed {
		return nil
	}
	if s.region != nil {
		if err := closeRetry(s.region); err != nil {
			return err
		}
		s.region = nil
	}
	if err := pinned.Unmap(s.mem); err != nil {
		return err
	}
	s.freed = true
	return nil
}

// hostPool keeps pinned slots between sleeps, by size. It is used under the Set's mutex.
type hostPool struct {
	sys  *vmm.System // where a slot that fails to be freed goes (System.Keep)
	mu   sync.Mutex
	idle map[uint64][]*slot
	held []heldSlots // slots that copies may still use: pooled again once their device synchronizes
	errs []error     // failures to free, reported by trim
}

// heldSlots are slots that copies queued on devs may still read or write: a failed call could not
// drain its stream (errNotDrained).
type heldSlots struct {
	devs  []*vmm.Device
	slots []*slot
}

// hold keeps slots out of the pool until every one of devs synchronizes (settle), or until
// handOver gives them to the System. The error says so.
func (p *hostPool) hold(slots []*slot, devs ...*vmm.Device) error {
	slots = slices.DeleteFunc(slices.Clone(slots), func(s *slot) bool { return s == nil })
	if len(slots) == 0 {
		return nil
	}
	p.mu.Lock()
	p.held = append(p.held, heldSlots{slices.Clone(devs), slots})
	p.mu.Unlock()
	return fmt.Errorf("offload: %d pinned slot(s) that copies queued on %s may still use are held out of the pool until the device synchronizes (the set's next call retries; its Close hands them to the System)", len(slots), devNames(devs))
}

// settle synchronizes the devices of the held slots and pools again the slots whose devices all
// succeed; the others stay held.
func (p *hostPool) settle() {
	p.mu.Lock()
	held := p.held
	p.held = nil
	p.mu.Unlock()
	var left []heldSlots
	ok := map[*vmm.Device]bool{}
	idle := func(d *vmm.Device) bool {
		if _, tried := ok[d]; !tried {
			ok[d] = d.Synchronize() == nil
		}
		return ok[d]
	}
	for _, h := range held {
		if !slices.ContainsFunc(h.devs, func(d *vmm.Device) bool { return !idle(d) }) {
			p.put(h.slots...)
		} else {
			left = append(left, h)
		}
	}
	p.mu.Lock()
	p.held = append(left, p.held...)
	p.mu.Unlock()
}

// heldBytes is the size of the held slots.
func (p *hostPool) heldBytes() uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	var n uint64
	for _, h := range p.held {
		for _, s := range h.slots {
			n += s.size
		}
	}
	return n
}

// handOver gives the slots still held to the System, whose RetryOrphans and Close synchronize
// their device, then free them (Set.Close). The error says so.
func (p *hostPool) handOver() error {
	p.mu.Lock()
	held := p.held
	p.held = nil
	p.mu.Unlock()
	var errs []error
	for _, h := range held {
		for _, s := range h.slots {
			what := fmt.Sprintf("offload: pinned %s slot that copies queued on %s may still use", units.FormatSize(s.size), devNames(h.devs))
			errs = append(errs, p.sys.Keep(what, func() error {
				for _, d := range h.devs {
					if err := d.Synchronize(); err != nil {
						return err
					}
				}
				return s.close()
			}))
		}
	}
	return errors.Join(errs...)
}

// devNames names devices, for errors.
func devNames(devs []*vmm.Device) string {
	names := make([]string, len(devs))
	for i, d := range devs {
		names[i] = d.String()
	}
	return strings.Join(names, ", ")
}

func newHostPool(sys *vmm.System) *hostPool { return &hostPool{sys: sys, idle: map[uint64][]*slot{}} }

func (p *hostPool) get(size uint64) *slot {
	p.mu.Lock()
	defer p.mu.Unlock()
	l := p.idle[size]
	if len(l) == 0 {
		return nil
	}
	s := l[len(l)-1]
	p.idle[size] = l[:len(l)-1]
	return s
}

// put pools slots. A staged slot is pinned first (see slot.pin), and freed instead when that fails:
// the pool holds registered slots only.
func (p *hostPool) put(slots ...*slot) {
	var ready, unpinned []*slot
	for _, s := range slots {
		switch {
		case s == nil:
		case s.pin() != nil:
			unpinned = append(unpinned, s)
		default:
			ready = append(ready, s)
		}
	}
	p.free(unpinned)
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, s := range ready {
		p.idle[s.size] = append(p.idle[s.size], s)
	}
}

// has reports whether the pool holds a slot of size.
func (p *hostPool) has(size uint64) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.idle[size]) > 0
}

// free unpins slots for good (a closed buffer's backup, a trimmed pool). A slot that fails to be
// freed (its unregistration failed twice, say) is handed to the System, whose RetryOrphans and Close
// retry it, so that no API loses it; trim reports the failure, saying so.
func (p *hostPool) free(slots []*slot) {
	for _, s := range slots {
		if s == nil {
			continue
		}
		if err := s.close(); err != nil {
			if p.sys != nil {
				err = errors.Join(err, p.sys.Keep(fmt.Sprintf("offload: pinned %s slot", units.FormatSize(s.size)), s.close))
			}
			p.mu.Lock()
			p.errs = append(p.errs, err)
			p.mu.Unlock()
		}
	}
}

func (p *hostPool) bytes() uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	var n uint64
	for size, l := range p.idle {
		n += size * uint64(len(l))
	}
	return n
}

// keepSizes frees the pooled slots whose size is not in keep.
func (p *hostPool) keepSizes(keep map[uint64]bool) {
	var drop []*slot
	p.mu.Lock()
	for size, l := range p.idle {
		if !keep[size] {
			drop = append(drop, l...)
			delete(p.idle, size)
		}
	}
	p.mu.Unlock()
	p.free(drop)
}

// trim frees every pooled slot and reports what could not be freed since the last trim.
func (p *hostPool) trim() error {
	p.mu.Lock()
	idle := p.idle
	p.idle = map[uint64][]*slot{}
	p.mu.Unlock()
	for _, l := range idle {
		p.free(l)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	err := errors.Join(p.errs...)
	p.errs = nil
	return err
}

// feed delivers n slots of one size in order: first those the pool has, at once, then new ones
// made by the populate and register stages (see registerWorkers) while the caller uses the earlier ones.
type feed struct {
	pool   *hostPool
	chans  []chan slotResult
	next   int
	cancel context.CancelFunc
	wg     sync.WaitGroup
	use    func(i int, s *slot) error
	pooled int // the first pooled slots came from the pool, the others were made
	// spent are slots use ran on (copies may be queued into them) that the caller did not take: the
	// one whose use failed, and those finish finds. finish leaves them to the caller, who pools them
	// once its stream is drained, or holds them when it cannot be (see keepOut).
	spent []*slot
}

type slotResult struct {
	s    *slot
	used bool // use has run on s (its error, if any, is err)
	err  error
}

func (p *hostPool) feed(ctx context.Context, dev *vmm.Device, n int, size uint64) *feed {
	return p.feedUsing(ctx, dev, n, size, nil, 1)
}

// populateWorkers is how many goroutines populate for each of share feeds running at once (one per
// device of a sleep): the cores left once every feed's registering goroutines have theirs, shared.
func populateWorkers(share int) int {
	share = max(share, 1)
	return max((runtime.GOMAXPROCS(0)-registerWorkers*share)/share, 1)
}

// feedUsing is feed whose register stage passes each slot it pins, with its index, to use before
// delivering it, in the goroutine that pinned it. A first sleep queues the slot's copies there: on
// the measured host a copy queued by another thread while registrations run waits for them (the
// copies then ran after the last registration, adding their whole time), while one queued by the
// thread that has just pinned the slot runs on the copy engine as the next slot is pinned. Slots
// from the pool are delivered unused. share is the number of feeds that run at once (see
// populateWorkers).
func (p *hostPool) feedUsing(ctx context.Context, dev *vmm.Device, n int, size uint64, use func(int, *slot) error, share int) *feed {
	ctx, cancel := context.WithCancel(ctx)
	f := &feed{pool: p, chans: make([]chan slotResult, n), cancel: cancel, use: use}
	var todo []int
	for i := range f.chans {
		f.chans[i] = make(chan slotResult, 1)
		if s := p.get(size); s != nil {
			f.chans[i] <- slotResult{s: s}
		} else {
			todo = append(todo, i)
		}
	}
	f.pooled = n - len(todo)
	if len(todo) == 0 {
		return f
	}
	mapped := make(chan mappedSlot, len(todo))
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		defer close(mapped)
		populateSlots(ctx, dev, todo, size, populateWorkers(share), mapped)
	}()
	for w := 0; w < min(registerWorkers, len(todo)); w++ {
		f.wg.Add(1)
		go func() {
			defer f.wg.Done()
			for m := range mapped {
				f.chans[m.i] <- f.register(ctx, dev, m, size)
			}
		}()
	}
	return f
}

// mappedSlot is slot i's memory, populated and waiting to be registered.
type mappedSlot struct {
	i   int
	mem []byte
	err error
}

// register turns populated memory into a slot, or unmaps it when the feed was cancelled.
func (f *feed) register(ctx context.Context, dev *vmm.Device, m mappedSlot, size uint64) slotResult {
	err := m.err
	if err == nil && ctx.Err() != nil {
		err = errors.Join(ctx.Err(), pinned.Unmap(m.mem))
	}
	var s *slot
	if err == nil {
		s, err = registerSlot(dev, m.mem, size)
	}
	if err != nil {
		return slotResult{err: fmt.Errorf("pin a %s backup slot: %w", units.FormatSize(size), err)}
	}
	if f.use == nil {
		return slotResult{s: s}
	}
	return slotResult{s: s, used: true, err: f.use(m.i, s)}
}

// populateSlots maps the memory of the slots todo names, then faults it in from workers
// goroutines, populateStep bytes at a time in slot order with no pause between slots, and sends
// each slot to out as soon as its last step is done. Slots not populated when ctx ends are
// unmapped and sent with the error. All the memory is mapped first: mapping takes the address-space
// lock for writing, which would stall the registrations running meanwhile.
func populateSlots(ctx context.Context, dev *vmm.Device, todo []int, size uint64, workers int, out chan<- mappedSlot) {
	mems, err := mapSlots(dev, len(todo), size)
	if err != nil {
		for _, i := range todo {
			out <- mappedSlot{i: i, err: err}
		}
		return
	}
	per := int((size + populateStep - 1) / populateStep)
	left := make([]atomic.Int64, len(todo))
	for k := range left {
		left[k].Store(int64(per))
	}
	var next atomic.Int64
	var wg sync.WaitGroup
	for w := 0; w < min(workers, per*len(todo)); w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for g := int(next.Add(1) - 1); g < per*len(todo) && ctx.Err() == nil; g = int(next.Add(1) - 1) {
				k, off := g/per, uint64(g%per)*populateStep
				hostmem.FaultIn(mems[k][off:min(off+populateStep, size)])
				if left[k].Add(-1) == 0 {
					out <- mappedSlot{i: todo[k], mem: mems[k]}
				}
			}
		}()
	}
	wg.Wait()
	for k := range left {
		if left[k].Load() > 0 {
			out <- mappedSlot{i: todo[k], err: errors.Join(ctx.Err(), pinned.Unmap(mems[k]))}
		}
	}
}

// mapSlots maps n slots of size bytes on the device's host NUMA node, or none.
func mapSlots(dev *vmm.Device, n int, size uint64) ([][]byte, error) {
	mems := make([][]byte, n)
	for k := range mems {
		mem, err := pinned.MapAnonymous(size)
		if err != nil {
			return nil, errors.Join(err, unmapAll(mems[:k]))
		}
		preferNode(mem, dev.HostNUMAID())
		mems[k] = mem
	}
	return mems, nil
}

// take returns the next slot, waiting for it to be pinned.
func (f *feed) take() (*slot, error) {
	s, _, err := f.takeUsed()
	return s, err
}

// takeUsed is take that also says whether use has run on the slot. A slot whose use failed goes to
// f.spent (some of its copies may be queued) and only the error is returned.
func (f *feed) takeUsed() (*slot, bool, error) {
	r := <-f.chans[f.next]
	f.next++
	if r.err != nil && r.s != nil {
		f.spent = append(f.spent, r.s)
		return nil, false, r.err
	}
	return r.s, r.used, r.err
}

// finish stops the workers and puts every slot that was made but not taken back in the pool, except
// those use ran on, which go to f.spent for the caller.
func (f *feed) finish() {
	f.cancel()
	f.wg.Wait()
	for _, ch := range f.chans[f.next:] {
		select {
		case r := <-ch:
			if r.used && r.s != nil {
				f.spent = append(f.spent, r.s)
			} else {
				f.pool.put(r.s)
			}
		default:
		}
	}
	f.next = len(f.chans)
}

// preferNode asks the kernel to place mem's pages on host NUMA node (the one closest to the GPU that
// copies into it) before they are faulted in: mbind with MPOL_PREFERRED, which falls back to other
// nodes when that one is full. It is advice: where the call is refused (a container without the
// permission, a kernel without NUMA), the pages go where the kernel puts them.
func preferNode(mem []byte, node int) {
	const mpolPreferred = 1
	if node < 0 || node >= 64 || len(mem) == 0 {
		return
	}
	mask := uint64(1) << node
	_, _, _ = unix.Syscall6(unix.SYS_MBIND, uintptr(unsafe.Pointer(&mem[0])), uintptr(len(mem)), mpolPreferred,
		uintptr(unsafe.Pointer(&mask)), 64, 0)
}
