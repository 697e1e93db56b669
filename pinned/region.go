package pinned

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"sort"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/memfd"
	"github.com/cuvmm/cuvmm/internal/units"
	"github.com/cuvmm/cuvmm/ipc"
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
	readOnly bool // devices may only read
	imported bool // opened from another process's descriptor

	// HostNUMA: made here (res, maps) or opened from another process (remote).
	res    *vmm.Reservation
	maps   []*vmm.Mapping    // by chunk
	allocs []*vmm.Allocation // by chunk: released after the unmap
	remote *ipc.Buffer

	// SharedMemory and Registered.
	memfd  *os.File
	ownMem bool // mem is this region's mmap: unmapped on Close
	reg    *vmm.HostRegistration

	mu      sync.Mutex
	granted map[int]driver.AccessFlags // HostNUMA: device ordinal → access
	closed  bool
	carved  uint64 // bytes handed to pools, from the start
	pools   int    // open pools carved from the region
}

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
		kind = SharedMemory
		if SupportsHostNUMA(dev) {
			kind = HostNUMA
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
	c := max(units.GiB, total/64)
	c, _ = units.RoundUp(c, g)
	return min(c, total), nil
}

func newHostNUMA(dev *vmm.Device, size uint64, opts Options) (*Region, error) {
	node := dev.HostNUMAID()
	if node < 0 || !dev.Supports(driver.AttrHostNUMAVirtualMemoryManagementSupported) {
		return nil, fmt.Errorf("pinned: host-NUMA region on %s: the driver reports no host-NUMA VMM support or no host NUMA node (needs CUDA 12.2+; use SharedMemory): %w", dev, ErrNotSupported)
	}
	grants, err := opts.grants(dev)
	if err != nil {
		return nil, err
	}
	sys := dev.System()
	aopts := vmm.AllocOptions{Location: driver.HostNUMALocation(node), HandleTypes: driver.HandleTypePosixFD}
	g, err := dev.Granularity(aopts.Location, driver.GranularityMinimum)
	if err != nil {
		return nil, err
	}
	sg, err := sys.Granularity()
	if err != nil {
		return nil, err
	}
	g = max(g, sg) // both are powers of two: chunks and offsets must be multiples of both
	total, err := roundUp("host-NUMA region", size, g)
	if err != nil {
		return nil, err
	}
	chunk, err := chunkSize(opts.ChunkSize, total, g)
	if err != nil {
		return nil, err
	}
	res, err := sys.Reserve(total, vmm.ReserveOptions{})
	if err != nil {
		return nil, fmt.Errorf("pinned: host-NUMA region of %s: %w", units.FormatSize(total), err)
	}
	res.SetKind("pinned")
	access := hostNUMAAccess(grants, opts.ReadOnly)
	nchunks := int((total + chunk - 1) / chunk)
	allocs := make([]*vmm.Allocation, nchunks)
	var maps []*vmm.Mapping
	undo := func(cause error) error {
		errs := []error{cause}
		for i := len(maps) - 1; i >= 0; i-- {
			if err := maps[i].Close(); err != nil {
				errs = append(errs, fmt.Errorf("undo: %w", err))
			}
		}
		for _, a := range allocs {
			if err := a.Close(); err != nil {
				errs = append(errs, fmt.Errorf("undo: %w", err))
			}
		}
		if err := res.Close(); err != nil {
			errs = append(errs, fmt.Errorf("undo: %w", err))
		}
		return errors.Join(errs...)
	}
	where := func(i int) string {
		return fmt.Sprintf("pinned: host-NUMA region of %s on node %d, chunk at offset %s", units.FormatSize(total), node, units.FormatSize(uint64(i)*chunk))
	}
	// Creating the physical memory (the driver allocates and pins host pages) is the slow part: it
	// runs on several threads, one chunk each. Mapping and granting access follow in order.
	opts.progress(0, total)
	if err := createChunks(dev, aopts, allocs, chunk, total, opts.progress); err != nil {
		return nil, undo(fmt.Errorf("%s: %w", where(err.chunk), err.err))
	}
	for i, a := range allocs {
		m, err := res.MapAccess(uint64(i)*chunk, a, access...)
		if err != nil {
			return nil, undo(fmt.Errorf("%s: %w", where(i), err))
		}
		maps = append(maps, m)
	}
	opts.progress(total, total)
	r := &Region{kind: HostNUMA, dev: dev, sys: sys, size: total, ptr: res.Ptr(), res: res, maps: maps, allocs: allocs,
		readOnly: opts.ReadOnly, granted: map[int]driver.AccessFlags{}}
	for _, a := range access[1:] {
		r.granted[int(a.Location.ID)] = a.Flags
	}
	r.mem = vmm.HostView(res.Ptr(), total)
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
		if !dev.Supports(driver.AttrReadOnlyHostRegisterSupported) {
			return 0, fmt.Errorf("pinned: read-only registration on %s: the device reports no support (attribute 113): %w", dev, ErrNotSupported)
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
	total, err := roundUp("shared-memory region", size, pageSize)
	if err != nil {
		return nil, err
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
	r := &Region{kind: SharedMemory, dev: dev, sys: dev.System(), size: total, mem: mem, memfd: f, ownMem: true,
		readOnly: opts.ReadOnly, ptr: devicePtrOf(mem)}
	if len(grants) > 0 {
		if err := r.register(opts.ReadOnly, opts.Progress); err != nil {
			return nil, errors.Join(err, r.release())
		}
	} else {
		opts.progress(total, total)
	}
	return r, nil
}

// register pins r.mem with cuMemHostRegister. The pages are populated first, in parallel (see
// populate), so that registration finds them present; that is most of the time pinning takes.
func (r *Region) register(readOnly bool, progress func(done, total uint64)) error {
	flags, err := registerFlags(r.dev, readOnly)
	if err != nil {
		return err
	}
	populate(r.mem, readOnly, progress)
	reg, err := r.dev.HostRegister(r.mem, flags)
	if err != nil {
		return fmt.Errorf("pinned: register %s region of %s: %w", r.kind, units.FormatSize(r.size), classify(err))
	}
	r.reg = reg
	r.ptr = reg.Ptr()
	registryAdd(r)
	return nil
}

// populate faults mem in before registration, from several threads at once: the kernel zeroes a
// fresh page in the faulting thread, so one thread (cuMemHostRegister faulting the pages itself)
// zeroes about 6 GB/s while the machine's cores together go many times faster. Each worker takes
// 64 MiB steps with MADV_POPULATE_WRITE (or _READ for read-only registrations, whose memory may be
// mapped read-only), Linux 5.14+; older kernels get a read of each page instead. The bytes never
// change. progress, when set, is called as steps complete.
func populate(mem []byte, readOnly bool, progress func(done, total uint64)) {
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
				if err := unix.Madvise(mem[off:off+n], advice); err != nil {
					var sum byte
					for p := off; p < off+n; p += pageSize {
						sum += mem[p]
					}
					populateSink.Add(uint32(sum))
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
}

// populateSink keeps the page reads of populate from being optimised away.
var populateSink atomic.Uint32

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
		readOnly: opts.ReadOnly, ptr: driver.DevicePtr(addr)}
	if err := r.register(opts.ReadOnly, opts.Progress); err != nil {
		return nil, err
	}
	return r, nil
}

// MapAnonymous maps size bytes (rounded up to 2 MiB) of private anonymous memory aligned to 2 MiB
// and advises transparent huge pages: memory that registers fast. Free it with Unmap after closing
// any region registered over it.
func MapAnonymous(size uint64) ([]byte, error) {
	const huge = 2 << 20
	total, err := roundUp("map anonymous", size, huge)
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
	err := dev.Raw(func(api driver.API) error { return api.MemHostUnregister(p) })
	if err != nil {
		return fmt.Errorf("pinned: cuMemHostUnregister %#x: %w", uintptr(p), classify(err))
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

// Bytes is the CPU's view of the region. It must not be used after Close.
func (r *Region) Bytes() []byte { return r.mem }

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
// have none. The allocations belong to the region.
func (r *Region) Chunks() []vmm.Chunk {
	if r.remote != nil {
		return r.remote.Chunks()
	}
	var out []vmm.Chunk
	for _, m := range r.maps {
		out = append(out, vmm.Chunk{Offset: m.Offset(), Allocation: m.Allocation()})
	}
	return out
}

var _ vmm.Chunked = (*Region)(nil)

// Devices lists the ordinals of the devices that can reach the region: every device of the system
// for a registered region, the granted devices for a HostNUMA region, none for a CPU-only one.
func (r *Region) Devices() []int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.devicesLocked()
}

func (r *Region) devicesLocked() []int {
	var out []int
	switch {
	case r.closed:
	case r.reg != nil:
		for i := 0; i < r.sys.DeviceCount(); i++ {
			out = append(out, i)
		}
	case r.kind == HostNUMA:
		for o, f := range r.granted {
			if f != driver.AccessNone {
				out = append(out, o)
			}
		}
		sort.Ints(out)
	}
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
// region take in this process: 2 MiB per GiB on each device the region is visible to (every device
// for a registration, the granted ones for HostNUMA), 0 elsewhere and for CPU-only regions.
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
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return fmt.Errorf("pinned: %s on %s: %w", op, r, ErrClosed)
	}
	if r.kind != HostNUMA {
		return fmt.Errorf("pinned: %s on %s: only host-NUMA regions have per-device access (a registration is visible to every device): %w", op, r, ErrNotSupported)
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
	if r.remote != nil {
		err = r.remote.SetAccess(acc...)
	} else {
		err = r.res.SetAccess(0, r.size, acc...)
	}
	if err != nil {
		return fmt.Errorf("pinned: %s %v on %s: %w", op, acc, r, err)
	}
	for _, d := range devs {
		r.granted[d.Ordinal()] = flags
	}
	return nil
}

// checkRange validates [off, off+n) of the region for a copy.
func (r *Region) checkRange(op string, off, n uint64) error {
	r.mu.Lock()
	closed := r.closed
	r.mu.Unlock()
	if closed {
		return fmt.Errorf("pinned: %s on %s: %w", op, r, ErrClosed)
	}
	if n == 0 || off > r.size || n > r.size-off {
		return fmt.Errorf("pinned: %s %s at offset %#x of %s: empty or past the end: %w", op, units.FormatSize(n), off, r, ErrInvalidValue)
	}
	return nil
}

// CopyToDevice queues a copy of n bytes at offset off of the region to device address dst on stream
// s (cuMemcpyHtoDAsync on s's device). The copy is asynchronous: the bytes must not change, and the
// region must not be closed, until s has passed it.
func (r *Region) CopyToDevice(s *vmm.Stream, dst driver.DevicePtr, off, n uint64) error {
	if s == nil {
		return fmt.Errorf("pinned: copy to device: nil stream: %w", ErrInvalidValue)
	}
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
	if err := r.checkRange("copy from device", off, n); err != nil {
		return err
	}
	return s.Device().CopyDtoHAsync(unsafe.Pointer(&r.mem[off]), src, n, s)
}

// Close frees everything the region made: it unmaps and releases a HostNUMA region's chunks and
// frees its address range; unregisters registered memory; unmaps and closes a SharedMemory region's
// memfd. Memory the caller registered stays mapped. Close fails with an error wrapping ErrInUse,
// freeing nothing, while pools carved from the region are open. Copies queued on streams must be
// complete. Close is idempotent and safe on nil.
func (r *Region) Close() error {
	if r == nil {
		return nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil
	}
	if r.pools > 0 {
		return fmt.Errorf("pinned: close %s: %d pools carved from it are open (close them first): %w", r, r.pools, ErrInUse)
	}
	if err := r.release(); err != nil {
		return err
	}
	r.closed = true
	return nil
}

// release frees what the region holds, in teardown order; the caller holds r.mu (or owns r alone).
// On an error it keeps what it could not free so that Close can be retried, except that memory
// found already unregistered (ErrNotRegistered) is freed anyway.
func (r *Region) release() error {
	var errs []error
	if r.remote != nil {
		if err := r.remote.Close(); err != nil {
			return fmt.Errorf("pinned: close %s: %w", r, err)
		}
		r.remote = nil
	}
	if r.res != nil {
		for len(r.maps) > 0 {
			m := r.maps[len(r.maps)-1]
			if err := m.Close(); err != nil {
				return fmt.Errorf("pinned: close %s: %w", r, err)
			}
			r.maps = r.maps[:len(r.maps)-1]
		}
		for len(r.allocs) > 0 {
			a := r.allocs[len(r.allocs)-1]
			if err := a.Close(); err != nil {
				return fmt.Errorf("pinned: close %s: %w", r, err)
			}
			r.allocs = r.allocs[:len(r.allocs)-1]
		}
		if err := r.res.Close(); err != nil {
			return fmt.Errorf("pinned: close %s: %w", r, err)
		}
		r.res = nil
	}
	if r.reg != nil {
		if err := r.reg.Close(); err != nil {
			err = classify(err)
			if !errors.Is(err, ErrNotRegistered) {
				return fmt.Errorf("pinned: close %s: %w", r, err)
			}
			errs = append(errs, fmt.Errorf("pinned: close %s: someone else unregistered the memory: %w", r, err))
		}
		registryRemove(r)
		r.reg = nil
	}
	if r.ownMem && r.mem != nil {
		if err := unix.Munmap(r.mem); err != nil {
			return fmt.Errorf("pinned: close %s: munmap: %w", r, err)
		}
		r.mem = nil
	}
	if r.memfd != nil {
		if err := r.memfd.Close(); err != nil {
			errs = append(errs, fmt.Errorf("pinned: close %s: memfd: %w", r, err))
		}
		r.memfd = nil
	}
	return errors.Join(errs...)
}
