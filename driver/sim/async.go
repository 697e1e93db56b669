package sim

import (
	"fmt"
	"sort"
	"sync"

	"github.com/cuvmm/cuvmm/driver"
)

// Stream order in the simulator.
//
// Queued work (copies, fills, kernels) waits in its stream's queue and runs when something needs it
// complete (deferred.go), each operation being a gate below; with the Eager option it runs before
// the queuing call returns, so data is always in place. What the simulator models on top is completion: a stream can be held (HoldStream) at its
// current point, and then nothing queued on it from then on counts as complete until ReleaseStream.
// Events recorded on a held stream answer CUDA_ERROR_NOT_READY to cuEventQuery and make
// cuEventSynchronize wait; cuStreamWaitEvent makes a stream depend on an incomplete event, so its later
// events wait too; a cuMemFreeAsync queued on a held stream returns the memory to the pool for that
// stream at once, and for other streams only once the free has completed. This is what stream-ordered
// allocators need tested: which memory may be reused by whom, and when.

// gate is one reason work is not complete yet: a hold on a stream, until it is released, or (with
// DeferWork) a queued operation, until it has run.
type gate struct {
	done bool
	op   *deferred // the queued operation, nil for a hold
}

// asyncState is the simulator's stream-order and memory-pool state. The caller holds s.mu.
type asyncState struct {
	cond   *sync.Cond                // signalled when a gate opens; L is &s.mu
	waits  map[driver.Stream][]*gate // what each stream's newly queued work waits for
	holds  map[driver.Stream]*gate   // the open hold of each held stream
	events map[driver.Event][]*gate  // what each recorded event waits for
	pools  map[*device]*memPool      // the default pool of each device, made on first use
	byPtr  map[driver.DevicePtr]*asyncBuf
	handle map[driver.MemPool]*memPool   // pool handles
	queue  map[driver.Stream][]*deferred // DeferWork: each stream's work not yet run, in order
	err    error                         // DeferWork: the first failure of deferred work not yet reported
}

// memPool is a device's default CUmemoryPool.
type memPool struct {
	dev       *device
	handle    driver.MemPool
	threshold uint64 // CU_MEMPOOL_ATTR_RELEASE_THRESHOLD
	reserved  uint64 // bytes backed by allocations: live plus cached buffers
	used      uint64 // bytes of live buffers
	resHigh   uint64
	usedHigh  uint64
	cached    []*asyncBuf // freed buffers, in free order
	reuse     [4]uint64   // the REUSE_* attributes (index 1-3), all 1 by default as in the driver
}

// asyncBuf is one cuMemAllocAsync buffer: live, or cached in its pool after cuMemFreeAsync.
type asyncBuf struct {
	pool    *memPool
	buf     *legacyAlloc
	size    uint64 // rounded to the granularity
	freedOn driver.Stream
	after   []*gate // what the free waits for
	live    bool
}

func (s *Sim) async() *asyncState {
	if s.as == nil {
		s.as = &asyncState{
			cond:   sync.NewCond(&s.mu),
			waits:  map[driver.Stream][]*gate{},
			holds:  map[driver.Stream]*gate{},
			events: map[driver.Event][]*gate{},
			pools:  map[*device]*memPool{},
			byPtr:  map[driver.DevicePtr]*asyncBuf{},
			handle: map[driver.MemPool]*memPool{},
			queue:  map[driver.Stream][]*deferred{},
		}
	}
	return s.as
}

// open drops the gates that are done and reports whether none is left.
func open(gs []*gate) ([]*gate, bool) {
	out := gs[:0]
	for _, g := range gs {
		if !g.done {
			out = append(out, g)
		}
	}
	return out, len(out) == 0
}

// pending is what work queued on st now waits for.
func (a *asyncState) pending(st driver.Stream) []*gate {
	gs, _ := open(a.waits[st])
	a.waits[st] = gs
	return append([]*gate(nil), gs...)
}

// recorded notes an event record on st: the event completes when what st waits for now is done.
func (s *Sim) recorded(e driver.Event, st driver.Stream, d *device) {
	a := s.async()
	a.events[e] = a.pending(st)
	if s.cfg.deferWork && s.blocking(st) {
		// The legacy stream and blocking streams wait for each other (deferred.go).
		for _, x := range s.blockingPeers(st, d) {
			a.events[e] = append(a.events[e], a.pending(x)...)
		}
	}
}

// eventDone reports whether the event's last record has completed.
func (s *Sim) eventDone(e driver.Event) bool {
	if s.as == nil {
		return true
	}
	s.drive(s.as.events[e]) // runs deferred work the record waits for
	if s.as == nil {
		return true
	}
	gs, done := open(s.as.events[e])
	s.as.events[e] = gs
	return done
}

// waitFor blocks, with s.mu released while waiting, until done reports true.
func (s *Sim) waitFor(done func() bool) {
	for !done() {
		s.async().cond.Wait()
	}
}

// HoldStream stops stream st at its current point: nothing queued on it from now on (event records,
// asynchronous frees, and through cuStreamWaitEvent other streams' later work) completes until
// ReleaseStream. Queued copies and kernels wait for the release too (with Eager they still move their
// data at once). st must be a stream made
// by cuStreamCreate; holding a held stream is CUDA_ERROR_INVALID_VALUE.
func (s *Sim) HoldStream(st driver.Stream) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.streams[st]; !ok {
		return fmt.Errorf("sim: hold stream %#x: not a stream made by cuStreamCreate: %w", uintptr(st), driver.ErrorInvalidHandle)
	}
	a := s.async()
	if a.holds[st] != nil {
		return fmt.Errorf("sim: hold stream %#x: already held: %w", uintptr(st), driver.ErrorInvalidValue)
	}
	g := &gate{}
	a.holds[st] = g
	a.waits[st] = append(a.waits[st], g)
	return nil
}

// ReleaseStream lets a stream held by HoldStream complete its work: its events and asynchronous
// frees complete, and whatever waits on them proceeds.
func (s *Sim) ReleaseStream(st driver.Stream) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	a := s.async()
	g := a.holds[st]
	if g == nil {
		return fmt.Errorf("sim: release stream %#x: not held: %w", uintptr(st), driver.ErrorInvalidValue)
	}
	g.done = true
	delete(a.holds, st)
	a.cond.Broadcast()
	return nil
}

// streamIdle reports whether everything queued on st so far has completed.
func (s *Sim) streamIdle(st driver.Stream) bool {
	if s.as == nil {
		return true
	}
	s.drive(s.as.waits[st]) // runs the stream's deferred work
	if s.as == nil {
		return true
	}
	gs, done := open(s.as.waits[st])
	s.as.waits[st] = gs
	return done
}

// StreamWaitEvent calls cuStreamWaitEvent: work queued on st from now on completes only after e's
// last record has (flags must be 0). The event may belong to another context, even of another device:
// the driver allows cross-device dependencies.
func (s *Sim) StreamWaitEvent(st driver.Stream, e driver.Event, flags uint32) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	d, err := s.begin("cuStreamWaitEvent", ctxBound)
	if err != nil {
		return err
	}
	if _, ok := s.events[e]; !ok || !s.validStream(st) {
		return driver.ErrorInvalidHandle
	}
	if flags != 0 {
		return driver.ErrorInvalidValue
	}
	if s.legacyDuringCapture("cuStreamWaitEvent", &st, d) {
		return driver.ErrorStreamCaptureImplicit
	}
	a := s.async()
	gs, _ := open(a.events[e])
	a.waits[st] = append(a.waits[st], gs...)
	return nil
}

// EventQuery calls cuEventQuery: true once the event's last record has completed, or when it was
// never recorded.
func (s *Sim) EventQuery(e driver.Event) (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.begin("cuEventQuery", ctxBound); err != nil {
		return false, err
	}
	if _, ok := s.events[e]; !ok {
		return false, driver.ErrorInvalidHandle
	}
	return s.eventDone(e), nil
}

// ---- the default memory pool ----

// poolOf returns d's default pool, making it on first use.
func (s *Sim) poolOf(d *device) *memPool {
	a := s.async()
	p := a.pools[d]
	if p == nil {
		p = &memPool{dev: d, handle: driver.MemPool(newHandle()), reuse: [4]uint64{0, 1, 1, 1}}
		a.pools[d] = p
		a.handle[p.handle] = p
	}
	return p
}

// MemAllocAsync calls cuMemAllocAsync: a buffer from the default pool of the stream's device (for
// the legacy and per-thread streams, the current context's; the driver allocates from the pool
// current to the stream's device). A cached
// buffer is reused when its free was queued on st, or has completed (opportunistic reuse), and it is
// at least the rounded size and at most twice it; otherwise the pool grows by a new buffer, charged to
// the device (CUDA_ERROR_OUT_OF_MEMORY when the device is full even after dropping completed cached
// buffers).
func (s *Sim) MemAllocAsync(size uint64, st driver.Stream) (driver.DevicePtr, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	d, err := s.begin("cuMemAllocAsync", ctxBound)
	if err != nil {
		return 0, err
	}
	if !s.validStream(st) {
		return 0, driver.ErrorInvalidHandle
	}
	if size == 0 {
		return 0, driver.ErrorInvalidValue
	}
	if s.legacyDuringCapture("cuMemAllocAsync", &st, d) {
		return 0, driver.ErrorStreamCaptureImplicit
	}
	pd := s.streamDevice(st, d)
	p := s.poolOf(pd)
	n := roundUp(size, s.gran())
	if b := p.reusable(n, st); b != nil {
		return p.take(b), nil
	}
	l, err := s.newLegacyBuffer(pd, size)
	if err == driver.ErrorOutOfMemory {
		s.trimPool(p, 0)
		l, err = s.newLegacyBuffer(pd, size)
	}
	if err != nil {
		return 0, err
	}
	b := &asyncBuf{pool: p, buf: l, size: n}
	s.async().byPtr[driver.DevicePtr(l.res.base)] = b
	p.reserved += n
	p.resHigh = max(p.resHigh, p.reserved)
	return p.take(b), nil
}

// reusable picks the smallest cached buffer that fits n and may be used on st.
func (p *memPool) reusable(n uint64, st driver.Stream) *asyncBuf {
	var best *asyncBuf
	for _, b := range p.cached {
		if b.size < n || b.size > 2*n {
			continue
		}
		_, done := open(b.after)
		if b.freedOn != st && !(done && p.reuse[driver.MemPoolReuseAllowOpportunistic] != 0) {
			continue
		}
		if best == nil || b.size < best.size {
			best = b
		}
	}
	return best
}

// take hands b out.
func (p *memPool) take(b *asyncBuf) driver.DevicePtr {
	if i := indexOf(p.cached, b); i >= 0 {
		p.cached = append(p.cached[:i], p.cached[i+1:]...)
	}
	b.live, b.after = true, nil
	p.used += b.size
	p.usedHigh = max(p.usedHigh, p.used)
	return driver.DevicePtr(b.buf.res.base)
}

func indexOf(list []*asyncBuf, b *asyncBuf) int {
	for i, x := range list {
		if x == b {
			return i
		}
	}
	return -1
}

// MemFreeAsync calls cuMemFreeAsync: the buffer goes back to its pool when st passes this point.
// ptr must be a live cuMemAllocAsync buffer, else CUDA_ERROR_INVALID_VALUE.
func (s *Sim) MemFreeAsync(ptr driver.DevicePtr, st driver.Stream) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	d, err := s.begin("cuMemFreeAsync", ctxBound)
	if err != nil {
		return err
	}
	if !s.validStream(st) {
		return driver.ErrorInvalidHandle
	}
	if s.legacyDuringCapture("cuMemFreeAsync", &st, d) {
		return driver.ErrorStreamCaptureImplicit
	}
	a := s.async()
	b := a.byPtr[ptr]
	if b == nil || !b.live {
		return driver.ErrorInvalidValue
	}
	b.live, b.freedOn, b.after = false, st, a.pending(st)
	b.pool.used -= b.size
	b.pool.cached = append(b.pool.cached, b)
	return nil
}

// trimPool releases completed cached buffers, largest first, until the pool holds at most keep bytes.
func (s *Sim) trimPool(p *memPool, keep uint64) {
	sort.SliceStable(p.cached, func(i, j int) bool { return p.cached[i].size > p.cached[j].size })
	kept := p.cached[:0]
	for _, b := range p.cached {
		if _, done := open(b.after); done && p.reserved > keep {
			s.dropLegacyBuffer(b.buf)
			delete(s.as.byPtr, driver.DevicePtr(b.buf.res.base))
			p.reserved -= b.size
			continue
		}
		kept = append(kept, b)
	}
	p.cached = kept
}

// syncPoint releases, as the driver does at a synchronization, what each pool of d caches above its
// release threshold.
func (s *Sim) syncPoint(d *device) {
	if s.as == nil {
		return
	}
	if p := s.as.pools[d]; p != nil && p.reserved > p.threshold {
		s.trimPool(p, p.threshold)
	}
}

// DeviceGetDefaultMemPool calls cuDeviceGetDefaultMemPool.
func (s *Sim) DeviceGetDefaultMemPool(dev driver.Device) (driver.MemPool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	d, err := s.lookupDevice("cuDeviceGetDefaultMemPool", dev)
	if err != nil {
		return 0, err
	}
	return s.poolOf(d).handle, nil
}

func (s *Sim) memPool(fn string, h driver.MemPool) (*memPool, error) {
	if _, err := s.begin(fn, initDone); err != nil {
		return nil, err
	}
	p := s.async().handle[h]
	if p == nil {
		return nil, driver.ErrorInvalidValue
	}
	return p, nil
}

// MemPoolSetAttribute calls cuMemPoolSetAttribute: the REUSE flags (0 or 1), the release threshold,
// and 0 into a high-water mark resets it; the current counters are read-only (INVALID_VALUE).
func (s *Sim) MemPoolSetAttribute(h driver.MemPool, attr driver.MemPoolAttribute, value uint64) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	p, err := s.memPool("cuMemPoolSetAttribute", h)
	if err != nil {
		return err
	}
	switch attr {
	case driver.MemPoolReuseFollowEventDependencies, driver.MemPoolReuseAllowOpportunistic, driver.MemPoolReuseAllowInternalDependencies:
		p.reuse[attr] = min(value, 1)
	case driver.MemPoolReleaseThreshold:
		p.threshold = value
	case driver.MemPoolReservedMemHigh, driver.MemPoolUsedMemHigh:
		if value != 0 {
			return driver.ErrorInvalidValue
		}
		if attr == driver.MemPoolReservedMemHigh {
			p.resHigh = p.reserved
		} else {
			p.usedHigh = p.used
		}
	default:
		return driver.ErrorInvalidValue
	}
	return nil
}

// MemPoolGetAttribute calls cuMemPoolGetAttribute.
func (s *Sim) MemPoolGetAttribute(h driver.MemPool, attr driver.MemPoolAttribute) (uint64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	p, err := s.memPool("cuMemPoolGetAttribute", h)
	if err != nil {
		return 0, err
	}
	switch attr {
	case driver.MemPoolReuseFollowEventDependencies, driver.MemPoolReuseAllowOpportunistic, driver.MemPoolReuseAllowInternalDependencies:
		return p.reuse[attr], nil
	case driver.MemPoolReleaseThreshold:
		return p.threshold, nil
	case driver.MemPoolReservedMemCurrent:
		return p.reserved, nil
	case driver.MemPoolReservedMemHigh:
		return p.resHigh, nil
	case driver.MemPoolUsedMemCurrent:
		return p.used, nil
	case driver.MemPoolUsedMemHigh:
		return p.usedHigh, nil
	}
	return 0, driver.ErrorInvalidValue
}

// MemPoolTrimTo calls cuMemPoolTrimTo: completed cached buffers are released until the pool holds at
// most minBytesToKeep.
func (s *Sim) MemPoolTrimTo(h driver.MemPool, minBytesToKeep uint64) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	p, err := s.memPool("cuMemPoolTrimTo", h)
	if err != nil {
		return err
	}
	s.trimPool(p, minBytesToKeep)
	return nil
}

// asyncLive counts cuMemAllocAsync buffers, live or cached in a pool.
func (s *Sim) asyncLive() int {
	if s.as == nil {
		return 0
	}
	return len(s.as.byPtr)
}
