package sim

import (
	"encoding/binary"
	"unsafe"

	"github.com/cuvmm/cuvmm/driver"
)

// hostPolicy says which plain host memory (outside the simulator's address space) an operation may
// touch.
type hostPolicy int

const (
	// anyHost: copies, which the driver stages through pinned buffers when the memory is pageable.
	anyHost hostPolicy = iota
	// pinnedHost: memsets and kernels, which reach host memory only when it is registered or from
	// cuMemHostAlloc (the device then uses the host pointer itself).
	pinnedHost
)

// resolve turns [addr, addr+n), as device d sees it, into byte slices to read (write=false) or write.
//
// Addresses in the simulator's reservations are VMM or cuMemAlloc memory: every byte must be mapped and
// d must have READ (READWRITE to write) on every mapping, including for host-NUMA memory; the slices
// are the allocations' own views, and each allocation is pinned (appended to pins) so that it outlives
// a concurrent unmap while the lock is not held. Other addresses are host memory, reached directly;
// host=true says the caller must guard against faults. ok=false means the access is not allowed.
func (s *Sim) resolve(d *device, addr, n uint64, write bool, policy hostPolicy, pins *[]*allocation) (bufs [][]byte, host, ok bool) {
	if n == 0 {
		return nil, false, true
	}
	if addr == 0 || addr+n < addr {
		return nil, false, false // a null pointer is an invalid value, as on the driver
	}
	if s.touchesRes(addr, n) {
		sp, ok := s.spans(addr, n)
		if !ok {
			return nil, false, false
		}
		for _, x := range sp {
			f := x.m.dev[d.ordinal]
			if f == driver.AccessNone || (write && f != driver.AccessReadWrite) {
				return nil, false, false
			}
			// cuMemAlloc and pool memory: peers reach it by copies (UVA), but a kernel or memset on
			// another device needs peer access (cuCtxEnablePeerAccess, cuMemPoolSetAccess), which
			// driver.API has no call for.
			if policy == pinnedHost && x.m.res.legacy && x.m.alloc.owner() != d.ordinal {
				return nil, false, false
			}
		}
		bufs = make([][]byte, 0, len(sp))
		for _, x := range sp {
			bufs = append(bufs, x.m.alloc.view[x.off:x.off+x.n])
			x.m.alloc.refs++
			*pins = append(*pins, x.m.alloc)
		}
		return bufs, false, true
	}
	end := addr + n
	covered := false
	for _, h := range s.hosts[s.hostFirst(addr):] {
		if h.base >= end {
			break
		}
		if write && h.readOnly() {
			return nil, false, false
		}
		if h.base <= addr && end <= h.end() {
			covered = true
		}
	}
	if !covered && policy == pinnedHost {
		return nil, false, false
	}
	return [][]byte{hostBytes(uintptr(addr), n)}, true, true
}

// pageable reports whether [addr, addr+n) is plain host memory: neither simulator memory nor
// registered or from cuMemHostAlloc. The caller holds s.mu.
func (s *Sim) pageable(addr, n uint64) bool {
	if n == 0 || s.touchesRes(addr, n) {
		return false
	}
	end := addr + n
	for _, h := range s.hosts[s.hostFirst(addr):] {
		if h.base >= end {
			break
		}
		if h.base <= addr && end <= h.end() {
			return false
		}
	}
	return true
}

// unpin drops the references resolve took.
func (s *Sim) unpin(pins []*allocation) {
	for _, a := range pins {
		s.unref(a)
	}
}

// copyBufs copies src to dst; both lists describe the same number of bytes, cut differently.
func copyBufs(dst, src [][]byte) {
	var d, sb []byte
	for {
		for len(d) == 0 && len(dst) > 0 {
			d, dst = dst[0], dst[1:]
		}
		for len(sb) == 0 && len(src) > 0 {
			sb, src = src[0], src[1:]
		}
		if len(d) == 0 || len(sb) == 0 {
			return
		}
		k := copy(d, sb)
		d, sb = d[k:], sb[k:]
	}
}

// validStream reports whether st names a stream: 0 (the legacy default stream), the special handles
// CU_STREAM_LEGACY (1) and CU_STREAM_PER_THREAD (2), or one made by StreamCreate.
func (s *Sim) validStream(st driver.Stream) bool {
	if st == 0 || st == 1 || st == 2 {
		return true
	}
	_, ok := s.streams[st]
	return ok
}

// streamDevice is the device whose context owns st: the current context's device cur for the legacy
// and per-thread streams (0, 1, 2), which every context has, else the device the stream was made on;
// nil for an unknown stream.
func (s *Sim) streamDevice(st driver.Stream, cur *device) *device {
	if st == 0 || st == 1 || st == 2 {
		return cur
	}
	if x, ok := s.streams[st]; ok {
		return x.dev
	}
	return nil
}

// copyArgs describes one copy call.
type copyArgs struct {
	fn             string
	dst, src, n    uint64
	stream         *driver.Stream // nil for synchronous calls
	dstCtx, srcCtx driver.Context // cuMemcpyPeerAsync only
	peer           bool
}

// memcpy runs every copy call. The device that reads the source and the one that writes the
// destination are the current context's device (for cuMemcpyPeerAsync, the given contexts'); a
// side they may not access is CUDA_ERROR_INVALID_VALUE, never a crash. The bytes move without the lock
// held, with the allocations involved pinned; an asynchronous copy is complete when it returns, which
// keeps stream order.
func (s *Sim) memcpy(c copyArgs) error {
	s.mu.Lock()
	d, err := s.beginOp(c.fn)
	if err != nil {
		s.mu.Unlock()
		return err
	}
	if c.stream != nil && !s.validStream(*c.stream) {
		s.mu.Unlock()
		return driver.ErrorInvalidHandle
	}
	if s.legacyDuringCapture(c.fn, c.stream, d) {
		s.mu.Unlock()
		return driver.ErrorStreamCaptureImplicit
	}
	dd, sd := d, d
	if c.peer {
		dd, sd = s.ctxDevice(c.dstCtx), s.ctxDevice(c.srcCtx)
		if dd == nil || sd == nil || dd.ctxRefs == 0 || sd.ctxRefs == 0 {
			s.mu.Unlock()
			return driver.ErrorInvalidContext
		}
	}
	if c.stream != nil {
		if capturing, err := s.captureNode(*c.stream, c.fn, graphNode{kind: nodeCopy, copy: c}); capturing {
			s.mu.Unlock()
			return err
		}
	}
	if s.deferring(c.stream) && (s.pageable(c.dst, c.n) || s.pageable(c.src, c.n)) {
		// The driver stages pageable memory: it synchronizes the stream first and returns once the
		// host side is done with, so the copy runs now, after the stream's earlier work, which for
		// the legacy stream and blocking streams includes each other's (implicit synchronization).
		st := *c.stream
		s.waitAside(func() bool {
			if !s.streamIdle(st) {
				return false
			}
			if s.blocking(st) {
				for _, x := range s.blockingPeers(st, d) {
					if !s.streamIdle(x) {
						return false
					}
				}
			}
			return true
		})
		return s.copyLocked(dd, sd, c)
	}
	if s.deferring(c.stream) {
		var pins []*allocation
		_, _, ok1 := s.resolve(dd, c.dst, c.n, true, anyHost, &pins)
		_, _, ok2 := s.resolve(sd, c.src, c.n, false, anyHost, &pins)
		s.unpin(pins)
		if !ok1 || !ok2 {
			s.mu.Unlock()
			return driver.ErrorInvalidValue
		}
		s.enqueue(*c.stream, d, c.fn, func() error {
			s.mu.Lock()
			if err := s.copyLocked(dd, sd, c); err != nil {
				return driver.ErrorIllegalAddress // the memory went away before the stream got here
			}
			return nil
		})
		s.mu.Unlock()
		return nil
	}
	if c.stream == nil {
		s.waitBlocking(d) // DeferWork: a synchronous copy comes after the blocking streams' work
	}
	return s.copyLocked(dd, sd, c)
}

// copyLocked moves the bytes of c from sd's view to dd's; it is called with s.mu held and returns
// with it released.
func (s *Sim) copyLocked(dd, sd *device, c copyArgs) error {
	var pins []*allocation
	dbufs, _, ok1 := s.resolve(dd, c.dst, c.n, true, anyHost, &pins)
	sbufs, _, ok2 := s.resolve(sd, c.src, c.n, false, anyHost, &pins)
	if !ok1 || !ok2 {
		s.unpin(pins)
		s.mu.Unlock()
		return driver.ErrorInvalidValue
	}
	s.mu.Unlock()

	// Always guarded: host memory may be unreadable, and an allocation imported from another
	// process is a file that process could have truncated (a fault past its end is SIGBUS).
	ok := guard(func() { copyBufs(dbufs, sbufs) })

	s.mu.Lock()
	s.unpin(pins)
	s.mu.Unlock()
	if !ok {
		return driver.ErrorInvalidValue
	}
	return nil
}

// Memcpy calls cuMemcpy: either side may be device memory (a simulator address) or host memory.
func (s *Sim) Memcpy(dst, src driver.DevicePtr, n uint64) error {
	return s.memcpy(copyArgs{fn: "cuMemcpy", dst: uint64(dst), src: uint64(src), n: n})
}

// MemcpyHtoD calls cuMemcpyHtoD_v2.
func (s *Sim) MemcpyHtoD(dst driver.DevicePtr, src unsafe.Pointer, n uint64) error {
	return s.memcpy(copyArgs{fn: "cuMemcpyHtoD", dst: uint64(dst), src: uint64(uintptr(src)), n: n})
}

// MemcpyDtoH calls cuMemcpyDtoH_v2.
func (s *Sim) MemcpyDtoH(dst unsafe.Pointer, src driver.DevicePtr, n uint64) error {
	return s.memcpy(copyArgs{fn: "cuMemcpyDtoH", dst: uint64(uintptr(dst)), src: uint64(src), n: n})
}

// MemcpyDtoD calls cuMemcpyDtoD_v2.
func (s *Sim) MemcpyDtoD(dst, src driver.DevicePtr, n uint64) error {
	return s.memcpy(copyArgs{fn: "cuMemcpyDtoD", dst: uint64(dst), src: uint64(src), n: n})
}

// MemcpyAsync calls cuMemcpyAsync; the copy is done when it returns.
func (s *Sim) MemcpyAsync(dst, src driver.DevicePtr, n uint64, st driver.Stream) error {
	return s.memcpy(copyArgs{fn: "cuMemcpyAsync", dst: uint64(dst), src: uint64(src), n: n, stream: &st})
}

// MemcpyHtoDAsync calls cuMemcpyHtoDAsync_v2; the copy is done when it returns.
func (s *Sim) MemcpyHtoDAsync(dst driver.DevicePtr, src unsafe.Pointer, n uint64, st driver.Stream) error {
	return s.memcpy(copyArgs{fn: "cuMemcpyHtoDAsync", dst: uint64(dst), src: uint64(uintptr(src)), n: n, stream: &st})
}

// MemcpyDtoHAsync calls cuMemcpyDtoHAsync_v2; the copy is done when it returns.
func (s *Sim) MemcpyDtoHAsync(dst unsafe.Pointer, src driver.DevicePtr, n uint64, st driver.Stream) error {
	return s.memcpy(copyArgs{fn: "cuMemcpyDtoHAsync", dst: uint64(uintptr(dst)), src: uint64(src), n: n, stream: &st})
}

// MemcpyPeerAsync calls cuMemcpyPeerAsync: dstCtx's device writes dst and srcCtx's device reads src
// (both retained contexts of this simulator, else CUDA_ERROR_INVALID_CONTEXT); the copy is done when it
// returns.
func (s *Sim) MemcpyPeerAsync(dst driver.DevicePtr, dstCtx driver.Context, src driver.DevicePtr, srcCtx driver.Context, n uint64, st driver.Stream) error {
	return s.memcpy(copyArgs{fn: "cuMemcpyPeerAsync", dst: uint64(dst), src: uint64(src), n: n, stream: &st,
		dstCtx: dstCtx, srcCtx: srcCtx, peer: true})
}

// memset runs the fill calls: the current context's device writes count elements of len(pattern)
// bytes at ptr. It needs READWRITE there (a read-only peer is CUDA_ERROR_INVALID_VALUE, as measured);
// host memory must be registered (not read-only) or from cuMemHostAlloc.
func (s *Sim) memset(fn string, ptr driver.DevicePtr, pattern []byte, count uint64, stream *driver.Stream) error {
	s.mu.Lock()
	d, err := s.beginOp(fn)
	if err != nil {
		s.mu.Unlock()
		return err
	}
	if stream != nil && !s.validStream(*stream) {
		s.mu.Unlock()
		return driver.ErrorInvalidHandle
	}
	if s.legacyDuringCapture(fn, stream, d) {
		s.mu.Unlock()
		return driver.ErrorStreamCaptureImplicit
	}
	if stream != nil {
		if capturing, err := s.captureNode(*stream, fn, graphNode{kind: nodeMemset, fn: fn, ptr: ptr, pattern: pattern, count: count}); capturing {
			s.mu.Unlock()
			return err
		}
	}
	size := uint64(len(pattern))
	n := count * size
	if uint64(ptr)%size != 0 || n/size != count {
		s.mu.Unlock()
		return driver.ErrorInvalidValue
	}
	if s.deferring(stream) {
		var pins []*allocation
		_, _, ok := s.resolve(d, uint64(ptr), n, true, pinnedHost, &pins)
		s.unpin(pins)
		if !ok {
			s.mu.Unlock()
			return driver.ErrorInvalidValue
		}
		s.enqueue(*stream, d, fn, func() error {
			s.mu.Lock()
			if err := s.fillLocked(d, ptr, pattern, n); err != nil {
				return driver.ErrorIllegalAddress // the memory went away before the stream got here
			}
			return nil
		})
		s.mu.Unlock()
		return nil
	}
	if stream == nil {
		s.waitBlocking(d) // DeferWork: a synchronous fill comes after the blocking streams' work
	}
	return s.fillLocked(d, ptr, pattern, n)
}

// fillLocked writes pattern over the n bytes at ptr as d sees them; it is called with s.mu held and
// returns with it released.
func (s *Sim) fillLocked(d *device, ptr driver.DevicePtr, pattern []byte, n uint64) error {
	var pins []*allocation
	bufs, _, ok := s.resolve(d, uint64(ptr), n, true, pinnedHost, &pins)
	if !ok {
		s.unpin(pins)
		s.mu.Unlock()
		return driver.ErrorInvalidValue
	}
	s.mu.Unlock()

	fill := func() {
		for _, b := range bufs {
			fillPattern(b, pattern)
		}
	}
	ok = guard(fill) // guarded whatever the memory, as in memcpy

	s.mu.Lock()
	s.unpin(pins)
	s.mu.Unlock()
	if !ok {
		return driver.ErrorInvalidValue
	}
	return nil
}

// fillPattern repeats pattern over b (len(b) a multiple of len(pattern)), doubling the copied part.
func fillPattern(b, pattern []byte) {
	if len(b) == 0 {
		return
	}
	n := copy(b, pattern)
	for n < len(b) {
		n += copy(b[n:], b[:n])
	}
}

// MemsetD8 calls cuMemsetD8_v2.
func (s *Sim) MemsetD8(ptr driver.DevicePtr, value uint8, n uint64) error {
	return s.memset("cuMemsetD8", ptr, []byte{value}, n, nil)
}

// MemsetD32 calls cuMemsetD32_v2 (n words of 4 bytes; ptr must be 4-byte aligned).
func (s *Sim) MemsetD32(ptr driver.DevicePtr, value uint32, n uint64) error {
	var w [4]byte
	binary.NativeEndian.PutUint32(w[:], value)
	return s.memset("cuMemsetD32", ptr, w[:], n, nil)
}

// MemsetD8Async calls cuMemsetD8Async; the fill is done when it returns.
func (s *Sim) MemsetD8Async(ptr driver.DevicePtr, value uint8, n uint64, st driver.Stream) error {
	return s.memset("cuMemsetD8Async", ptr, []byte{value}, n, &st)
}
