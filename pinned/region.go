package pinned

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"os"
	"runtime"
	"sort"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/hostmem"
	"github.com/cuvmm/cuvmm/internal/lifetime"
	"github.com/cuvmm/cuvmm/internal/memfd"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/vmm"
)

// Region is pinned host memory with a []byte view for the CPU (Bytes) and an address the devices
// that can reach it use (Ptr). Make one with New (HostNUMA or SharedMemory), Register (memory the
// caller owns) or Receive (a region another process shared). It is safe for concurrent use; the bytes
// themselves are the caller's to synchronise.
type Region struct {
	kind     Kind
	dev      *vmm.Device // the device whose context made the driver calls
	sys      *vmm.System
	size     uint64
	ptr      driver.DevicePtr
	mem      []byte
	readOnly bool       // devices may only read
	imported bool       // opened from another process's descriptor
	impl     regionImpl // what the kind does its own way (kinds.go)

	// closed is set by the first Close, before it frees any memory, for the copies (checkRange)
	// and Bytes, which read it under use's read lock instead of own's lock, so that they never wait
	// for a slow Grant or Revoke. Close sets it and frees the memory with use held for writing (and
	// own's lock): a copy being queued then finishes first, and one that comes later finds the
	// region closed, even when that Close failed halfway and own is not closed yet. The calls that
	// hold own's lock (Chunks, Devices, Grant, Revoke, PrepareShare, NewPool) test it too.
	use    sync.RWMutex
	closed bool // written with both locks held; read under either

	own     lifetime.Owner             // its lock guards the fields below; closed once Close freed all
	granted map[int]driver.AccessFlags // HostNUMA: device ordinal → access
	pools   []span                     // the ranges of the open pools carved from the region, by offset
}

// track names the region's owner and reports the region as a leak if it becomes unreachable open.
func (r *Region) track() {
	r.own.Init(nil, "pinned region")
	lifetime.Track(r, &r.own)
}

// span is the range [off, end) of the region a pool holds.
type span struct{ off, end uint64 }

// New makes a pinned host region of at least size bytes for dev, of opts.Kind (Auto: HostNUMA where
// SupportsHostNUMA(dev), else SharedMemory). The size is rounded up in this one place, to the
// allocation granularity for HostNUMA (2 MiB on current GPUs) and to the host page size for
// SharedMemory; Len reports it. On failure nothing is left behind.
func New(dev *vmm.Device, size uint64, opts Options) (*Region, error) {
	if dev == nil {
		return nil, fmt.Errorf("pinned: new region: nil device: %w", ErrInvalidValue)
	}
	if size == 0 {
		return nil, fmt.Errorf("pinned: new region: size 0: %w", ErrInvalidValue)
	}
	kind := opts.Kind
	if kind == Auto {
		var err error
		if kind, err = autoKind(dev); err != nil {
			return nil, err
		}
	}
	switch kind {
	case HostNUMA:
		return newHostNUMA(dev, size, opts)
	case SharedMemory:
		return newSharedMemory(dev, size, opts)
	case Registered:
		return nil, fmt.Errorf("pinned: new region: kind %s: use Register for memory the caller owns: %w", kind, ErrInvalidValue)
	}
	return nil, fmt.Errorf("pinned: new region: unknown kind %d: %w", int(kind), ErrInvalidValue)
}

// hostNUMAAttrVersion is the first driver version that knows the host-NUMA support attribute (141);
// drivers from 12.2 to 12.8 make host-NUMA allocations but cannot be asked whether they may.
const hostNUMAAttrVersion = 12090

// autoKind is HostNUMA where dev supports it, SharedMemory where it reports no support or where
// the driver is too old to be asked (hostNUMAAttrVersion); any other failed query is an error,
// not a reason to fall back.
func autoKind(dev *vmm.Device) (Kind, error) {
	err := dev.Check(vmm.FeatureHostNUMA)
	if err == nil {
		err = dev.Check(vmm.FeaturePosixFDHandles)
	}
	switch {
	case err == nil:
		return HostNUMA, nil
	case errors.Is(err, ErrNotSupported):
		return SharedMemory, nil
	case errors.Is(err, driver.ErrorInvalidValue) && dev.System().DriverVersion() < hostNUMAAttrVersion:
		return SharedMemory, nil
	}
	return Auto, fmt.Errorf("pinned: new region: cannot tell whether %s supports host-NUMA regions (choose the kind explicitly): %w", dev, err)
}

// hostNUMAAccess is the access list of a HostNUMA mapping: the CPU read-write plus each device.
func hostNUMAAccess(devs []*vmm.Device, readOnly bool) []vmm.Access {
	acc := []vmm.Access{vmm.HostReadWrite()}
	for _, d := range devs {
		if readOnly {
			acc = append(acc, vmm.ReadOnly(d))
		} else {
			acc = append(acc, vmm.ReadWrite(d))
		}
	}
	return acc
}

// chunkSize picks the size of each physical allocation of a HostNUMA region.
func chunkSize(want, total, g uint64) (uint64, error) {
	if want != 0 {
		if want%g != 0 {
			return 0, fmt.Errorf("pinned: chunk size %s is not a multiple of the granularity %s: %w", units.FormatSize(want), units.FormatSize(g), ErrInvalidValue)
		}
		return min(want, total), nil
	}
	c, err := vmm.RoundUp("pinned: chunk size", max(units.GiB, total/64), g)
	return min(c, total), err
}

func newHostNUMA(dev *vmm.Device, size uint64, opts Options) (*Region, error) {
	if err := dev.Check(vmm.FeatureHostNUMA); err != nil {
		return nil, fmt.Errorf("pinned: host-NUMA region on %s (use SharedMemory where it is not supported): %w", dev, err)
	}
	node, err := dev.HostNUMANode()
	if err != nil {
		return nil, fmt.Errorf("pinned: host-NUMA region on %s: %w", dev, err)
	}
	grants, err := opts.grants(dev)
	if err != nil {
		return nil, err
	}
	sys := dev.System()
	aopts := vmm.AllocOptions{Location: driver.HostNUMALocation(node), HandleTypes: driver.HandleTypePosixFD}
	g, err := sys.CommonGranularity(aopts.Location, dev)
	if err != nil {
		return nil, err
	}
	total, err := vmm.RoundUp("pinned: host-NUMA region", size, g)
	if err != nil {
		return nil, err
	}
	chunk, err := chunkSize(opts.ChunkSize, total, g)
	if err != nil {
		return nil, err
	}
	access := hostNUMAAccess(grants, opts.ReadOnly)
	allocs := make([]*vmm.Allocation, int((total+chunk-1)/chunk))
	where := func(i int) string {
		return fmt.Sprintf("pinned: host-NUMA region of %s on node %d, chunk at offset %s", units.FormatSize(total), node, units.FormatSize(uint64(i)*chunk))
	}
	// Creating the physical memory (the driver allocates and pins host pages) is the slow part: it
	// runs on several threads, one chunk each. Mapping and granting access follow in order, all or
	// nothing (vmm.System.ReserveChunks), each mapping owning its chunk.
	opts.progress(0, total)
	if cerr := createChunks(dev, aopts, allocs, chunk, total, opts.progress); cerr != nil {
		errs := []error{fmt.Errorf("%s: %w", where(cerr.chunk), cerr.err)}
		for _, a := range allocs {
			errs = append(errs, vmm.UndoClose(a))
		}
		return nil, errors.Join(errs...)
	}
	specs := make([]vmm.ChunkSpec, len(allocs))
	for i, a := range allocs {
		specs[i] = vmm.ChunkSpec{Offset: uint64(i) * chunk, Allocation: a, Own: true, Access: access}
	}
	res, maps, err := sys.ReserveChunks(total, vmm.ReserveOptions{}, specs)
	if err != nil {
		return nil, fmt.Errorf("pinned: host-NUMA region of %s on node %d: %w", units.FormatSize(total), node, err)
	}
	res.SetKind("pinned")
	opts.progress(total, total)
	r := &Region{kind: HostNUMA, dev: dev, sys: sys, size: total, ptr: res.Ptr(), impl: &hostNUMARegion{res: res, maps: maps},
		readOnly: opts.ReadOnly, granted: map[int]driver.AccessFlags{}}
	for _, a := range access[1:] {
		r.granted[int(a.Location.ID)] = a.Flags
	}
	r.mem = vmm.HostView(res.Ptr(), total)
	r.track()
	return r, nil
}

// chunkError is the first failure of createChunks.
type chunkError struct {
	chunk int
	err   error
}

// createChunks makes allocs[i] (chunk bytes at offset i*chunk, the last one shorter) on up to 8
// threads, reporting the bytes made (up to, not including, total). On failure it stops starting new chunks and returns the first
// error; the allocations made stay in allocs for the caller to release.
func createChunks(dev *vmm.Device, opts vmm.AllocOptions, allocs []*vmm.Allocation, chunk, total uint64,
	progress func(done, total uint64)) *chunkError {
	var (
		mu    sync.Mutex
		first *chunkError
		done  uint64
		next  int
		wg    sync.WaitGroup
	)
	workers := min(len(allocs), runtime.GOMAXPROCS(0), 8)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				mu.Lock()
				i := next
				next++
				stop := first != nil || i >= len(allocs)
				mu.Unlock()
				if stop {
					return
				}
				n := min(chunk, total-uint64(i)*chunk)
				a, err := dev.Allocate(n, opts)
				mu.Lock()
				if err != nil {
					if first == nil {
						first = &chunkError{i, err}
					}
				} else {
					allocs[i] = a
					done += n
					if done < total { // total is reported once mapped
						progress(done, total)
					}
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return first
}

// registerFlags are the cuMemHostRegister flags of a region: PORTABLE (pinned for every context),
// DEVICEMAP (a device address), READ_ONLY on request.
func registerFlags(dev *vmm.Device, readOnly bool) (uint32, error) {
	flags := driver.HostRegisterPortable | driver.HostRegisterDeviceMap
	if readOnly {
		if err := dev.Check(vmm.FeatureReadOnlyHostRegister); err != nil {
			return 0, fmt.Errorf("pinned: read-only registration on %s: %w", dev, err)
		}
		flags |= driver.HostRegisterReadOnly
	}
	return flags, nil
}

// mapMemfd maps a memfd of size bytes (a multiple of the page size) read-write and shared.
func mapMemfd(f *os.File, size uint64) ([]byte, error) {
	mem, err := unix.Mmap(int(f.Fd()), 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("pinned: mmap %s of %s: %w", units.FormatSize(size), f.Name(), err)
	}
	return mem, nil
}

func newSharedMemory(dev *vmm.Device, size uint64, opts Options) (*Region, error) {
	grants, err := opts.grants(dev)
	if err != nil {
		return nil, err
	}
	total, err := vmm.RoundUp("pinned: shared-memory region", size, pageSize)
	if err != nil {
		return nil, err
	}
	if total > math.MaxInt64 {
		return nil, fmt.Errorf("pinned: shared-memory region of %d bytes: larger than a file can be: %w", size, ErrInvalidValue)
	}
	name := opts.Name
	if name == "" {
		name = "cuvmm-pinned"
	}
	// Sealed against resizing: the memfd is what Share hands to other processes.
	f, err := memfd.Create(name, int64(total))
	if err != nil {
		return nil, fmt.Errorf("pinned: %w", err)
	}
	mem, err := mapMemfd(f, total)
	if err != nil {
		f.Close()
		return nil, err
	}
	r := &Region{kind: SharedMemory, dev: dev, sys: dev.System(), size: total, mem: mem, impl: &sharedMemoryRegion{memfd: f},
		readOnly: opts.ReadOnly, ptr: devicePtrOf(mem)}
	if len(grants) > 0 {
		if err := r.register(opts.ReadOnly, opts.Progress); err != nil {
			return nil, errors.Join(err, r.undo())
		}
	} else {
		opts.progress(total, total)
	}
	r.track()
	return r, nil
}

// undo frees what a region being made holds; what cannot be freed is handed to the System (when
// there is one), which retries it.
func (r *Region) undo() error {
	err := r.impl.release(r)
	if err != nil && r.sys != nil {
		err = errors.Join(err, r.sys.Keep(r.String(), func() error { return r.impl.release(r) }))
	}
	return err
}

// register registers a SharedMemory or Registered region's memory (registration.register).
func (r *Region) register(readOnly bool, progress func(done, total uint64)) error {
	switch impl := r.impl.(type) {
	case *sharedMemoryRegion:
		return impl.register(r, readOnly, progress)
	case *registeredRegion:
		return impl.register(r, readOnly, progress)
	}
	return fmt.Errorf("pinned: register %s: a %s region is not registered: %w", r, r.kind, ErrInvalidValue)
}

// populate faults mem in before registration, from several threads at once: the kernel zeroes a
// fresh page in the faulting thread, so one thread (cuMemHostRegister faulting the pages itself)
// zeroes about 6 GB/s while the machine's cores together go many times faster. Each worker takes
// 64 MiB steps with MADV_POPULATE_WRITE (or _READ for read-only registrations, whose memory may be
// mapped read-only), Linux 5.14+; older kernels (EINVAL, populateKnown) get a read of each page instead. The bytes
// never change. progress, when set, is called as steps complete. Memory the advice cannot fault in
// (not mapped, PROT_NONE, a file mapping past its file's end) is an error wrapping ErrInvalidValue,
// never read: a read would kill the process (SIGSEGV, SIGBUS). On a kernel without the advice such
// memory is read all the same, and kills the process: there Register needs memory it can read.
func populate(mem []byte, readOnly bool, progress func(done, total uint64)) error {
	total := uint64(len(mem))
	advice := unix.MADV_POPULATE_WRITE
	if readOnly {
		advice = unix.MADV_POPULATE_READ
	}
	const step = 64 << 20
	steps := (total + step - 1) / step
	workers := min(uint64(runtime.GOMAXPROCS(0)), 16, steps)
	var next, done atomic.Uint64
	var mu sync.Mutex
	var wg sync.WaitGroup
	var failed error // the first step the advice could not fault in; guarded by mu
	for w := uint64(0); w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1) - 1
				if i >= steps {
					return
				}
				off := i * step
				n := min(step, total-off)
				if err := unix.Madvise(mem[off:off+n], advice); errors.Is(err, unix.EINVAL) && !populateKnown() {
					hostmem.ReadIn(mem[off : off+n]) // a kernel without the advice
				} else if err != nil {
					mu.Lock()
					failed = cmp.Or(failed, fmt.Errorf("pinned: fault in bytes %#x-%#x of the memory to register: %w (the memory is not mapped, not accessible, or a file mapping past its file's end): %w",
						off, off+n, err, ErrInvalidValue))
					mu.Unlock()
					next.Store(steps) // stop the other workers
					return
				}
				d := done.Add(n)
				if progress != nil {
					mu.Lock()
					progress(d, total)
					mu.Unlock()
				}
			}
		}()
	}
	wg.Wait()
	return failed
}

// populateKnown reports whether the kernel knows MADV_POPULATE_WRITE (Linux 5.14+), tried once on a
// page of its own: where it does, EINVAL for the memory to register means that memory cannot be
// faulted in (PROT_NONE, device memory), not an old kernel.
var populateKnown = sync.OnceValue(func() bool {
	mem, err := unix.Mmap(-1, 0, os.Getpagesize(), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return false
	}
	defer func() { _ = unix.Munmap(mem) }()
	return unix.Madvise(mem, unix.MADV_POPULATE_WRITE) == nil
})

// RegisterOptions tunes Register.
type RegisterOptions struct {
	// ReadOnly registers with CU_MEMHOSTREGISTER_READ_ONLY: devices may read the memory, not write it
	// (needs attribute 113).
	ReadOnly bool
	// HugePages advises transparent huge pages (madvise MADV_HUGEPAGE) before registering, which makes
	// registration about twice as fast (measured 26 vs 57 ms per GiB). Meaningful for anonymous
	// memory; ignored where the kernel refuses the advice (shared memory, THP disabled).
	HugePages bool
	// Progress, when set, is called as the pages are faulted in before registration.
	Progress func(done, total uint64)
}

// Register pins memory the caller owns (cuMemHostRegister with PORTABLE and DEVICEMAP), which makes
// it visible to every device of the system. mem must start and end on a page boundary and not be
// empty; it must stay mapped until the region is closed, and must not be Go heap memory the program
// might free (use mmap, or MapAnonymous). Registering memory that is already registered fails with
// an error wrapping ErrAlreadyRegistered. Close unregisters the memory and leaves it mapped.
func Register(dev *vmm.Device, mem []byte, opts RegisterOptions) (*Region, error) {
	if dev == nil {
		return nil, fmt.Errorf("pinned: register: nil device: %w", ErrInvalidValue)
	}
	if len(mem) == 0 {
		return nil, fmt.Errorf("pinned: register: zero-length memory: %w", ErrInvalidValue)
	}
	addr := uintptr(unsafe.Pointer(&mem[0]))
	if uint64(addr)%pageSize != 0 || uint64(len(mem))%pageSize != 0 {
		return nil, fmt.Errorf("pinned: register %#x+%d: start and length must be multiples of the %s page: %w", addr, len(mem), units.FormatSize(pageSize), ErrInvalidValue)
	}
	if opts.HugePages {
		_ = unix.Madvise(mem, unix.MADV_HUGEPAGE) // advice only
	}
	r := &Region{kind: Registered, dev: dev, sys: dev.System(), size: uint64(len(mem)), mem: mem,
		readOnly: opts.ReadOnly, ptr: driver.DevicePtr(addr), impl: &registeredRegion{}}
	if err := r.register(opts.ReadOnly, opts.Progress); err != nil {
		return nil, err
	}
	r.track()
	return r, nil
}

// MapAnonymous maps size bytes (rounded up to 2 MiB) of private anonymous memory aligned to 2 MiB
// and advises transparent huge pages: memory that registers fast. Free it with Unmap after closing
// any region registered over it.
func MapAnonymous(size uint64) ([]byte, error) {
	const huge = 2 << 20
	total, err := vmm.RoundUp("pinned: map anonymous", size, huge)
	if err != nil {
		return nil, err
	}
	if total+huge < total {
		return nil, fmt.Errorf("pinned: map anonymous %d bytes: too large: %w", size, ErrInvalidValue)
	}
	p, err := unix.MmapPtr(-1, 0, nil, uintptr(total+huge), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, fmt.Errorf("pinned: mmap %s anonymous: %w", units.FormatSize(total), err)
	}
	base := uintptr(p)
	skip := (huge - base%huge) % huge
	// Trim the unaligned head and the tail: the mapping becomes exactly [base+skip, base+skip+total).
	if skip > 0 {
		_ = unix.MunmapPtr(p, skip)
	}
	_ = unix.MunmapPtr(addrPtr(base+skip+uintptr(total)), huge-skip)
	mem := bytesAt(base+skip, total)
	_ = unix.Madvise(mem, unix.MADV_HUGEPAGE)
	return mem, nil
}

// Unmap unmaps memory from MapAnonymous.
func Unmap(mem []byte) error {
	if len(mem) == 0 {
		return nil
	}
	if err := unix.MunmapPtr(unsafe.Pointer(&mem[0]), uintptr(len(mem))); err != nil {
		return fmt.Errorf("pinned: munmap %s: %w", units.FormatSize(uint64(len(mem))), err)
	}
	return nil
}

// registry records the regions that registered memory in this process, so that Unregister refuses
// to pull the registration out from under a live region.
var registry = struct {
	sync.Mutex
	m map[uintptr]*Region
}{m: map[uintptr]*Region{}}

func registryAdd(r *Region) {
	registry.Lock()
	registry.m[uintptr(unsafe.Pointer(&r.mem[0]))] = r
	registry.Unlock()
}

func registryRemove(r *Region) {
	registry.Lock()
	delete(registry.m, uintptr(unsafe.Pointer(&r.mem[0])))
	registry.Unlock()
}

// Unregister unregisters host memory that other code registered (cuMemHostUnregister), for example
// a C library sharing the process. mem must start where a registration starts. Memory that is not
// registered gives an error wrapping ErrNotRegistered; memory a live Region registered gives
// ErrInUse (close the region instead).
func Unregister(dev *vmm.Device, mem []byte) error {
	if dev == nil {
		return fmt.Errorf("pinned: unregister: nil device: %w", ErrInvalidValue)
	}
	if len(mem) == 0 {
		return fmt.Errorf("pinned: unregister: zero-length memory: %w", ErrInvalidValue)
	}
	p := unsafe.Pointer(&mem[0])
	registry.Lock()
	r := registry.m[uintptr(p)]
	registry.Unlock()
	if r != nil {
		return fmt.Errorf("pinned: unregister %#x: the memory belongs to a live %s region; close it instead: %w", uintptr(p), r.kind, ErrInUse)
	}
	if err := dev.HostUnregister(mem); err != nil {
		return fmt.Errorf("pinned: unregister %#x: %w", uintptr(p), classify(err))
	}
	return nil
}

// Kind is how the region is pinned.
func (r *Region) Kind() Kind { return r.kind }

// Len is the region's size in bytes (the size asked for, rounded up as New documents).
func (r *Region) Len() uint64 { return r.size }

// Ptr is the address devices use for the region's first byte. For HostNUMA regions and, on every
// current GPU (CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM), for registered memory, it equals the CPU
// address. Only devices the region is visible to (Devices) may use it; for a CPU-only region it is
// the CPU address.
func (r *Region) Ptr() driver.DevicePtr { return r.ptr }

// Bytes is the CPU's view of the region: nil once Close has been called, even a Close that
// failed. It must not be used after Close.
func (r *Region) Bytes() []byte {
	r.use.RLock()
	defer r.use.RUnlock()
	if r.closed {
		return nil
	}
	return r.mem
}

// ReadOnly reports whether devices may only read the region.
func (r *Region) ReadOnly() bool { return r.readOnly }

// Imported reports whether the region was opened from another process's descriptor (Receive).
func (r *Region) Imported() bool { return r.imported }

// Device is the device whose context made the region's driver calls.
func (r *Region) Device() *vmm.Device { return r.dev }

func (r *Region) String() string {
	return fmt.Sprintf("%s region of %s at %#x", r.kind, units.FormatSize(r.size), uint64(r.ptr))
}

// Chunks lists a HostNUMA region's allocations (vmm.Chunked, what package ipc exports); other kinds
// have none, and neither has a closed region. The allocations belong to the region.
func (r *Region) Chunks() []vmm.Chunk {
	r.own.Lock()
	defer r.own.Unlock()
	if r.closed {
		return nil
	}
	return r.impl.chunks()
}

// lockedChunks is a region's vmm.Chunked view for a caller that holds its lock (Share's export).
type lockedChunks struct{ r *Region }

func (v lockedChunks) Ptr() driver.DevicePtr { return v.r.ptr }
func (v lockedChunks) Len() uint64           { return v.r.size }
func (v lockedChunks) Chunks() []vmm.Chunk   { return v.r.impl.chunks() }

var _ vmm.Chunked = (*Region)(nil)

// Devices lists the ordinals of the devices that can reach the region: every device opened in the
// System (whose context the process holds; one opened later reaches it too) for a registered
// region, the granted devices for a HostNUMA region, none for a CPU-only one.
func (r *Region) Devices() []int {
	r.own.Lock()
	defer r.own.Unlock()
	if r.closed {
		return nil
	}
	return r.impl.visible(r)
}

// grantedDevices lists the devices granted access, in order; the caller holds the lock.
func (r *Region) grantedDevices() []int {
	var out []int
	for o, f := range r.granted {
		if f != driver.AccessNone {
			out = append(out, o)
		}
	}
	sort.Ints(out)
	return out
}

// VisibleTo reports whether dev can reach the region.
func (r *Region) VisibleTo(dev *vmm.Device) bool {
	if dev == nil || dev.System() != r.sys {
		return false
	}
	for _, o := range r.Devices() {
		if o == dev.Ordinal() {
			return true
		}
	}
	return false
}

// PageTableCost is the estimated GPU memory, per device ordinal (index), that page tables for this
// region take in this process: 2 MiB per GiB on each device the region is visible to (every opened
// device for a registration, the granted ones for HostNUMA), 0 elsewhere and for CPU-only regions.
// It is what vmm.Stats counts in PageTableBytes.
func (r *Region) PageTableCost() []uint64 {
	if r.sys == nil {
		return nil // opened for the CPU without a driver
	}
	out := make([]uint64, r.sys.DeviceCount())
	for _, o := range r.Devices() {
		out[o] = PageTableCost(r.size)
	}
	return out
}

// TotalPageTableCost is PageTableCost summed over the devices.
func (r *Region) TotalPageTableCost() uint64 {
	var n uint64
	for _, c := range r.PageTableCost() {
		n += c
	}
	return n
}

// Grant gives devs access to a HostNUMA region (cuMemSetAccess over every chunk), read-only when the
// region is. Each device then pays the region's page-table cost. Registered regions are visible to
// every device already: Grant fails with ErrNotSupported for them, and for a CPU-only SharedMemory
// region (register it by opening it with a grant instead).
func (r *Region) Grant(devs ...*vmm.Device) error {
	flags := driver.AccessReadWrite
	if r.readOnly {
		flags = driver.AccessRead
	}
	return r.setAccess("grant", devs, flags)
}

// Revoke removes devs' access to a HostNUMA region; the page tables are freed.
func (r *Region) Revoke(devs ...*vmm.Device) error {
	return r.setAccess("revoke", devs, driver.AccessNone)
}

func (r *Region) setAccess(op string, devs []*vmm.Device, flags driver.AccessFlags) error {
	r.own.Lock()
	defer r.own.Unlock()
	if r.closed {
		return fmt.Errorf("pinned: %s on %s: %w", op, r, ErrClosed)
	}
	if r.kind != HostNUMA { // before the devices are checked: a region received without a device has no System
		return fmt.Errorf("pinned: %s on %s: only a host-NUMA region's access is granted or revoked (a %s region is registered for every device, or opened again with a grant): %w",
			op, r, r.kind, ErrNotSupported)
	}
	devs, err := uniqueDevices(r.sys, devs)
	if err != nil {
		return err
	}
	if len(devs) == 0 {
		return fmt.Errorf("pinned: %s on %s: no devices: %w", op, r, ErrInvalidValue)
	}
	acc := make([]vmm.Access, len(devs))
	for i, d := range devs {
		acc[i] = vmm.Access{Location: d.Location(), Flags: flags}
	}
	if err = r.impl.setAccess(r, acc); err != nil {
		return fmt.Errorf("pinned: %s %v on %s: %w", op, acc, r, err)
	}
	for _, d := range devs {
		r.granted[d.Ordinal()] = flags
	}
	return nil
}

// checkRange validates [off, off+n) of the region for a copy; the caller holds use.
func (r *Region) checkRange(op string, off, n uint64) error {
	if r.closed {
		return fmt.Errorf("pinned: %s on %s: %w", op, r, ErrClosed)
	}
	if n == 0 || off > r.size || n > r.size-off {
		return fmt.Errorf("pinned: %s %s at offset %#x of %s: empty or past the end: %w", op, units.FormatSize(n), off, r, ErrInvalidValue)
	}
	return nil
}

// CopyToDevice queues a copy of n bytes at offset off of the region to device address dst on stream
// s (cuMemcpyHtoDAsync on s's device). The copy is asynchronous: the bytes must not change, and the
// region must not be closed, until s has passed it. A copy called while Close runs is queued before
// the memory goes, or fails with ErrClosed.
func (r *Region) CopyToDevice(s *vmm.Stream, dst driver.DevicePtr, off, n uint64) error {
	if s == nil {
		return fmt.Errorf("pinned: copy to device: nil stream: %w", ErrInvalidValue)
	}
	r.use.RLock()
	defer r.use.RUnlock()
	if err := r.checkRange("copy to device", off, n); err != nil {
		return err
	}
	return s.Device().CopyHtoDAsync(dst, unsafe.Pointer(&r.mem[off]), n, s)
}

// CopyFromDevice queues a copy of n bytes from device address src into offset off of the region on
// stream s (cuMemcpyDtoHAsync on s's device). The bytes are there once s has passed the copy.
func (r *Region) CopyFromDevice(s *vmm.Stream, src driver.DevicePtr, off, n uint64) error {
	if s == nil {
		return fmt.Errorf("pinned: copy from device: nil stream: %w", ErrInvalidValue)
	}
	r.use.RLock()
	defer r.use.RUnlock()
	if err := r.checkRange("copy from device", off, n); err != nil {
		return err
	}
	return s.Device().CopyDtoHAsync(unsafe.Pointer(&r.mem[off]), src, n, s)
}

// Close frees everything the region made: it unmaps and releases a HostNUMA region's chunks and
// frees its address range; unregisters registered memory; unmaps and closes a SharedMemory region's
// memfd. Memory the caller registered stays mapped. Close fails with an error wrapping ErrInUse,
// freeing nothing, while pools carved from the region are open. Copies queued on streams must be
// complete. Close is idempotent and safe on nil; when a step fails the region keeps what it could
// not free and a later Close retries, but the region can no longer be used: part of its memory may
// be gone, so Bytes is nil, Chunks empty, and copies fail with ErrClosed.
func (r *Region) Close() error {
	if r == nil {
		return nil
	}
	r.own.Lock()
	defer r.own.Unlock()
	if r.own.Closed() {
		return nil
	}
	if len(r.pools) > 0 {
		return fmt.Errorf("pinned: close %s: %d pools carved from it are open (close them first): %w", r, len(r.pools), ErrInUse)
	}
	r.use.Lock()
	defer r.use.Unlock()
	r.closed = true // from now on no copy, view or chunk: part of the memory may go below
	if err := r.impl.release(r); err != nil {
		return fmt.Errorf("pinned: close %s: %w", r, err)
	}
	r.own.MarkClosed()
	return nil
}
