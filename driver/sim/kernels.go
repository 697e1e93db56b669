package sim

import (
	"bytes"
	"errors"
	"fmt"
	"regexp"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/kernels"
)

// KernelFunc is the Go implementation of a simulated kernel. It runs once per launch (not per thread)
// on the calling goroutine and reaches memory only through k, which applies the launching device's
// access rights. It returns nil, or an error from k's methods (CUDA_ERROR_ILLEGAL_ADDRESS), which
// cuLaunchKernel passes on; any other error becomes CUDA_ERROR_LAUNCH_FAILED.
type KernelFunc func(k *KernelCall) error

// KernelCall is one launch of a simulated kernel: its arguments and the launching device's view of
// memory. Memory obtained from it is valid until the KernelFunc returns.
type KernelCall struct {
	Name        string        // the entry point's name
	Device      driver.Device // the device it runs on: the current context's
	Grid, Block driver.Dim3
	SharedMem   uint32
	Stream      driver.Stream
	Args        []uint64 // one 64-bit value per kernel parameter

	s    *Sim
	dev  *device
	pins []*allocation // appended under s.mu
	done bool
}

// Arg returns argument i (0 when there is no such argument).
func (k *KernelCall) Arg(i int) uint64 {
	if i < 0 || i >= len(k.Args) {
		return 0
	}
	return k.Args[i]
}

// Memory returns [ptr, ptr+n) as the device sees it, to read or (write=true) to write: one slice per
// mapping the range crosses, in address order. VMM memory must be mapped with READ access for the
// device (READWRITE to write); cuMemAlloc and cuMemAllocAsync memory must be the device's own (peer
// access is never enabled); host memory must be registered (not read-only, to write) or from
// cuMemHostAlloc. Anything else is CUDA_ERROR_ILLEGAL_ADDRESS.
func (k *KernelCall) Memory(ptr, n uint64, write bool) ([][]byte, error) {
	k.s.mu.Lock()
	defer k.s.mu.Unlock()
	if k.done || k.s.closed {
		return nil, driver.ErrorIllegalAddress
	}
	bufs, _, ok := k.s.resolve(k.dev, ptr, n, write, pinnedHost, &k.pins)
	if !ok {
		return nil, driver.ErrorIllegalAddress
	}
	return bufs, nil
}

// Words is Memory for nwords 64-bit words at ptr, which must be 8-byte aligned (a misaligned address
// is CUDA_ERROR_ILLEGAL_ADDRESS here).
func (k *KernelCall) Words(ptr, nwords uint64, write bool) ([][]uint64, error) {
	if ptr%8 != 0 || nwords > (^uint64(0))/8 {
		return nil, driver.ErrorIllegalAddress
	}
	bufs, err := k.Memory(ptr, nwords*8, write)
	if err != nil {
		return nil, err
	}
	ws := make([][]uint64, len(bufs))
	for i, b := range bufs {
		ws[i] = words(b)
	}
	return ws, nil
}

// word returns the 8-byte aligned word at ptr.
func (k *KernelCall) word(ptr uint64, write bool) (*uint64, error) {
	ws, err := k.Words(ptr, 1, write)
	if err != nil {
		return nil, err
	}
	return &ws[0][0], nil
}

// Load64 reads the 64-bit word at ptr (8-byte aligned).
func (k *KernelCall) Load64(ptr uint64) (uint64, error) {
	w, err := k.word(ptr, false)
	if err != nil {
		return 0, err
	}
	return atomic.LoadUint64(w), nil
}

// Store64 writes the 64-bit word at ptr (8-byte aligned).
func (k *KernelCall) Store64(ptr, v uint64) error {
	w, err := k.word(ptr, true)
	if err != nil {
		return err
	}
	atomic.StoreUint64(w, v)
	return nil
}

// AtomicAdd64 adds delta to the 64-bit word at ptr (8-byte aligned) atomically, like atomicAdd, and
// returns the new value.
func (k *KernelCall) AtomicAdd64(ptr, delta uint64) (uint64, error) {
	w, err := k.word(ptr, true)
	if err != nil {
		return 0, err
	}
	return atomic.AddUint64(w, delta), nil
}

// ---- modules ---------------------------------------------------------------------------------------

type module struct {
	dev     *device
	entries map[string]int // entry name → parameter count
	funcs   map[string]driver.Function
}

type function struct {
	mod    *module
	name   string
	params int
	fn     KernelFunc
}

// entryRE finds a PTX entry and its parameter list: ".visible .entry cuvmm_fill(\n .param .u64 a, ...)".
var entryRE = regexp.MustCompile(`\.entry\s+([A-Za-z_$%][\w$]*)\s*(\(([^)]*)\))?`)

// parsePTX returns the entries of a PTX text, or ok=false when image is not PTX.
func parsePTX(image []byte) (map[string]int, bool) {
	text := string(bytes.TrimRight(image, "\x00"))
	if !strings.Contains(text, ".version") || !strings.Contains(text, ".target") {
		return nil, false
	}
	entries := make(map[string]int)
	for _, m := range entryRE.FindAllStringSubmatch(text, -1) {
		entries[m[1]] = strings.Count(m[3], ".param")
	}
	return entries, true
}

// ModuleLoadData calls cuModuleLoadData. The image must be PTX text (CUDA_ERROR_INVALID_IMAGE
// otherwise: the simulator cannot run cubins); the module belongs to the current context.
func (s *Sim) ModuleLoadData(image []byte) (driver.Module, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	d, err := s.begin("cuModuleLoadData", ctxBound)
	if err != nil {
		return 0, err
	}
	entries, ok := parsePTX(image)
	if !ok {
		return 0, driver.ErrorInvalidImage
	}
	h := driver.Module(newHandle())
	s.modules[h] = &module{dev: d, entries: entries, funcs: make(map[string]driver.Function)}
	return h, nil
}

// ModuleGetFunction calls cuModuleGetFunction. The name must be an entry of the module's PTX and have
// a Go implementation (the built-ins cuvmm_fill, cuvmm_verify and cuvmm_read, or one given with the
// Kernel option), else CUDA_ERROR_NOT_FOUND. An unknown module is CUDA_ERROR_INVALID_HANDLE.
func (s *Sim) ModuleGetFunction(m driver.Module, name string) (driver.Function, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.begin("cuModuleGetFunction", ctxBound); err != nil {
		return 0, err
	}
	mod, ok := s.modules[m]
	if !ok {
		return 0, driver.ErrorInvalidHandle
	}
	if f, ok := mod.funcs[name]; ok {
		return f, nil
	}
	params, inImage := mod.entries[name]
	impl, implemented := s.cfg.kernels[name]
	if !inImage || !implemented {
		return 0, driver.ErrorNotFound
	}
	f := driver.Function(newHandle())
	s.funcs[f] = &function{mod: mod, name: name, params: params, fn: impl}
	mod.funcs[name] = f
	return f, nil
}

// ModuleUnload calls cuModuleUnload; its functions become invalid. An unknown module is
// CUDA_ERROR_INVALID_HANDLE.
func (s *Sim) ModuleUnload(m driver.Module) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.begin("cuModuleUnload", ctxBound); err != nil {
		return err
	}
	mod, ok := s.modules[m]
	if !ok {
		return driver.ErrorInvalidHandle
	}
	s.unloadModule(m, mod)
	return nil
}

func (s *Sim) unloadModule(h driver.Module, mod *module) {
	for _, f := range mod.funcs {
		delete(s.funcs, f)
	}
	delete(s.modules, h)
}

// LaunchKernel calls cuLaunchKernel and runs the kernel to completion before returning. f must come
// from a module of the current context (CUDA_ERROR_INVALID_CONTEXT otherwise) and st must be a stream
// of that context (CUDA_ERROR_INVALID_HANDLE otherwise); grid and block must be
// non-empty and within the device's limits, sharedMem at most MAX_SHARED_MEMORY_PER_BLOCK, and
// len(args) must be the entry's parameter count (CUDA_ERROR_INVALID_VALUE). A kernel that touches memory its device may not access, or writes
// read-only memory, makes the launch fail with CUDA_ERROR_ILLEGAL_ADDRESS. (The real driver reports
// that asynchronously and the context is unusable afterwards; the simulator's stays usable.)
func (s *Sim) LaunchKernel(f driver.Function, grid, block driver.Dim3, sharedMem uint32, st driver.Stream, args ...uint64) error {
	return s.launch("cuLaunchKernel", f, grid, block, sharedMem, st, args)
}

// launch is LaunchKernel under the name fn (a graph replays its kernels under another).
func (s *Sim) launch(fn string, f driver.Function, grid, block driver.Dim3, sharedMem uint32, st driver.Stream, args []uint64) error {
	s.mu.Lock()
	d, err := s.beginOp(fn)
	if err != nil {
		s.mu.Unlock()
		return err
	}
	kf, ok := s.funcs[f]
	switch {
	case !ok:
		err = driver.ErrorInvalidHandle
	case kf.mod.dev != d:
		err = driver.ErrorInvalidContext
	case !d.launchShapeOK(grid, block, sharedMem) || len(args) != kf.params:
		err = driver.ErrorInvalidValue
	case s.streamDevice(st, d) != kf.mod.dev:
		err = driver.ErrorInvalidHandle // unknown, or a stream of another context
	case s.legacyDuringCapture(fn, &st, d):
		err = driver.ErrorStreamCaptureImplicit
	}
	if err != nil {
		s.mu.Unlock()
		return err
	}
	if capturing, err := s.captureNode(st, fn, graphNode{kind: nodeKernel, f: f, grid: grid, block: block, shared: sharedMem, args: append([]uint64(nil), args...)}); capturing {
		s.mu.Unlock()
		return err
	}
	k := &KernelCall{
		Name: kf.name, Device: driver.Device(d.ordinal), Grid: grid, Block: block, SharedMem: sharedMem,
		Stream: st, Args: append([]uint64(nil), args...), s: s, dev: d,
	}
	if s.deferring(&st) {
		s.enqueue(st, d, fn+" "+kf.name+fmt.Sprintf(" args %#x", k.Args), func() error { return s.runKernel(kf, k) })
		s.mu.Unlock()
		return nil
	}
	s.mu.Unlock()
	return s.runKernel(kf, k)
}

// runKernel runs one launch, without s.mu held.
func (s *Sim) runKernel(kf *function, k *KernelCall) error {
	var kerr error
	ok := guard(func() { kerr = kf.fn(k) })

	s.mu.Lock()
	k.done = true
	s.unpin(k.pins)
	k.pins = nil
	s.mu.Unlock()
	if !ok {
		return driver.ErrorIllegalAddress
	}
	if kerr != nil {
		var r driver.Result
		if errors.As(kerr, &r) {
			return r
		}
		return driver.ErrorLaunchFailed
	}
	return nil
}

// launchShapeOK checks grid, block and dynamic shared memory against the device's limits. More
// shared memory than MAX_SHARED_MEMORY_PER_BLOCK needs an opt-in (cuFuncSetAttribute) that
// driver.API does not have, so it is refused as the driver refuses it without one.
func (d *device) launchShapeOK(grid, block driver.Dim3, sharedMem uint32) bool {
	if grid.X == 0 || grid.Y == 0 || grid.Z == 0 || block.X == 0 || block.Y == 0 || block.Z == 0 {
		return false
	}
	limit := func(attr driver.DeviceAttribute, v uint32) bool {
		l, ok := d.attrs[attr]
		return !ok || uint64(v) <= uint64(l)
	}
	threads := uint64(block.X) * uint64(block.Y) * uint64(block.Z)
	return limit(1, uint32(min(threads, 1<<32-1))) &&
		limit(2, block.X) && limit(3, block.Y) && limit(4, block.Z) &&
		limit(5, grid.X) && limit(6, grid.Y) && limit(7, grid.Z) && limit(8, sharedMem)
}

// ---- built-in kernels (internal/kernels) -----------------------------------------------------------

func builtinKernels() map[string]KernelFunc {
	return map[string]KernelFunc{
		kernels.Fill:   fillKernel,
		kernels.Verify: verifyKernel,
		kernels.Read:   readKernel,
	}
}

// piece is a run of words and the global index of its first word.
type piece struct {
	w     []uint64
	first uint64
}

// pieceWords bounds the work of one worker step (2 MiB), so that big fills spread over all CPUs.
const pieceWords = 1 << 18

func split(ws [][]uint64, first uint64) []piece {
	var ps []piece
	for _, w := range ws {
		for len(w) > 0 {
			n := min(len(w), pieceWords)
			ps = append(ps, piece{w[:n], first})
			w = w[n:]
			first += uint64(n)
		}
	}
	return ps
}

// forPieces runs f over the pieces on up to GOMAXPROCS goroutines. Each worker guards against memory
// faults (registered host memory that was unmapped behind the driver's back); ok is false if one
// happened.
func forPieces(ps []piece, f func(piece)) (ok bool) {
	workers := min(runtime.GOMAXPROCS(0), len(ps))
	if workers <= 1 {
		return guard(func() {
			for _, p := range ps {
				f(p)
			}
		})
	}
	var next atomic.Int64
	var faulted atomic.Bool
	var wg sync.WaitGroup
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if !guard(func() {
				for i := next.Add(1) - 1; i < int64(len(ps)); i = next.Add(1) - 1 {
					f(ps[i])
				}
			}) {
				faulted.Store(true)
			}
		}()
	}
	wg.Wait()
	return !faulted.Load()
}

// fillKernel is cuvmm_fill(ptr, nwords, firstWord, seed).
func fillKernel(k *KernelCall) error {
	ptr, n, first, seed := k.Args[0], k.Args[1], k.Args[2], k.Args[3]
	ws, err := k.Words(ptr, n, true)
	if err != nil {
		return err
	}
	if !forPieces(split(ws, first), func(p piece) {
		w := p.w
		for i := range w {
			w[i] = kernels.Pattern(p.first+uint64(i), seed)
		}
	}) {
		return driver.ErrorIllegalAddress
	}
	return nil
}

// verifyKernel is cuvmm_verify(ptr, nwords, firstWord, seed, counterPtr): it adds the number of
// mismatching words to the word at counterPtr, which it touches only when there are mismatches, like
// the GPU kernel.
func verifyKernel(k *KernelCall) error {
	ptr, n, first, seed, counter := k.Args[0], k.Args[1], k.Args[2], k.Args[3], k.Args[4]
	ws, err := k.Words(ptr, n, false)
	if err != nil {
		return err
	}
	var bad atomic.Uint64
	if !forPieces(split(ws, first), func(p piece) {
		var b uint64
		w := p.w
		for i := range w {
			if w[i] != kernels.Pattern(p.first+uint64(i), seed) {
				b++
			}
		}
		bad.Add(b)
	}) {
		return driver.ErrorIllegalAddress
	}
	if b := bad.Load(); b != 0 {
		if _, err := k.AtomicAdd64(counter, b); err != nil {
			return err
		}
	}
	return nil
}

// readMarker is the fold value at which cuvmm_read writes its sink (never, in practice).
const readMarker = 0x0123456789abcdef

// readKernel is cuvmm_read(ptr, nwords, sinkPtr): it reads nwords words (rounded down to even, from a
// 16-byte aligned ptr, as the GPU kernel's 16-byte loads need) and folds them.
func readKernel(k *KernelCall) error {
	ptr, n, sink := k.Args[0], k.Args[1], k.Args[2]
	if ptr%16 != 0 {
		return driver.ErrorIllegalAddress
	}
	ws, err := k.Words(ptr, n&^1, false)
	if err != nil {
		return err
	}
	var acc atomic.Uint64
	if !forPieces(split(ws, 0), func(p piece) {
		var x uint64
		for _, v := range p.w {
			x ^= v
		}
		for {
			old := acc.Load()
			if acc.CompareAndSwap(old, old^x) {
				return
			}
		}
	}) {
		return driver.ErrorIllegalAddress
	}
	if acc.Load() == readMarker {
		return k.Store64(sink, acc.Load())
	}
	return nil
}
