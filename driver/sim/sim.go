package sim

import (
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/cuvmm/cuvmm/driver"
)

var _ driver.API = (*Sim)(nil)

// Defaults: the project's H200 host (docs/driver-facts.md).
const (
	// DefaultMemoryPerDevice is an H200's memory as cuDeviceTotalMem reports it (143771 MiB).
	DefaultMemoryPerDevice uint64 = 150754820096
	// DefaultGranularity is the measured allocation granularity, device and host-NUMA, minimum and
	// recommended.
	DefaultGranularity uint64 = 2 << 20
	// DefaultDriverVersion is cuDriverGetVersion on the H200 host (CUDA 13.0).
	DefaultDriverVersion = 13000
	// MaxReservation is the largest cuMemAddressReserve the simulator grants (measured: 64 TiB OK,
	// 1 PiB OUT_OF_MEMORY).
	MaxReservation uint64 = 64 << 40
	// DeviceName is what cuDeviceGetName answers, so logs never mistake the simulator for a GPU.
	DeviceName = "Simulated H200 (cuvmm sim)"
)

// pageTableDivisor turns bytes of host memory visible to a GPU into the GPU memory its page tables
// take: measured 2 MiB per GiB, that is 1/512.
const pageTableDivisor = 512

// Option configures a simulator made by New.
type Option func(*config)

type config struct {
	devices     int
	memory      uint64
	granularity uint64
	attrs       []attrOverride
	peers       []peerOverride
	fabric      bool
	version     int
	ctxMemory   uint64
	kernels     map[string]KernelFunc
	deferWork   bool // DeferWork (deferred.go)
	reuse       bool // ReuseHandles
	refuseHints bool // RefuseUngrantedHints
}

type attrOverride struct {
	dev   int
	attr  driver.DeviceAttribute
	value int
}

type peerOverride struct {
	a, b int
	ok   bool
}

// Devices sets the number of simulated GPUs (default 1). n may be 0: cuDeviceGetCount then reports 0,
// as on a machine without GPUs.
func Devices(n int) Option { return func(c *config) { c.devices = n } }

// MemoryPerDevice sets each device's total memory in bytes (default DefaultMemoryPerDevice). The
// memory is backed by sparse memfds, so a large value costs nothing until written.
func MemoryPerDevice(bytes uint64) Option { return func(c *config) { c.memory = bytes } }

// Granularity sets the allocation granularity, device and host-NUMA, minimum and recommended
// (default 2 MiB). It must be a power of two and a multiple of the host page size.
func Granularity(bytes uint64) Option { return func(c *config) { c.granularity = bytes } }

// Attribute overrides (or adds) one device attribute of device dev.
func Attribute(dev int, attr driver.DeviceAttribute, value int) Option {
	return func(c *config) { c.attrs = append(c.attrs, attrOverride{dev, attr, value}) }
}

// PeerAccess sets whether devices a and b can access each other's memory, in both directions. By
// default every pair can (the H200s are joined by NVLink).
func PeerAccess(a, b int, ok bool) Option {
	return func(c *config) { c.peers = append(c.peers, peerOverride{a, b, ok}) }
}

// EnableFabric lets cuMemCreate accept the FABRIC handle type and cuMemExportToShareableHandle export
// fabric handles, as on a system with an IMEX channel. By default FABRIC is refused with
// CUDA_ERROR_NOT_PERMITTED, alone or combined with POSIX_FD, as measured on the H200 host.
func EnableFabric() Option { return func(c *config) { c.fabric = true } }

// ReuseHandles makes cuStreamCreate and cuEventCreate hand out again the value of the stream or event
// destroyed last, as the driver may (its handles are addresses of its own structures, which it frees
// and allocates again). A stale handle then names the object made since instead of being refused with
// CUDA_ERROR_INVALID_HANDLE, which is what code that calls the driver with a handle its owner has
// destroyed does on a GPU. By default every handle is new.
func ReuseHandles() Option { return func(c *config) { c.reuse = true } }

// RefuseUngrantedHints makes cuMemAddressReserve refuse a hinted range it cannot grant at the hint
// with CUDA_ERROR_OUT_OF_MEMORY, instead of placing it elsewhere, as the driver does on some
// machines (see docs/driver-facts.md); that includes a hint at the end of a small reservation, which
// the driver never grants. By default a hint that cannot be granted is ignored.
func RefuseUngrantedHints() Option { return func(c *config) { c.refuseHints = true } }

// DriverVersion sets what cuDriverGetVersion reports (default 13000).
func DriverVersion(v int) Option { return func(c *config) { c.version = v } }

// ContextMemory sets the device memory each retained primary context takes in cuMemGetInfo (default
// 0; a real context takes about 524 MiB on the H200 host).
func ContextMemory(bytes uint64) Option { return func(c *config) { c.ctxMemory = bytes } }

// Kernel registers fn as the simulated implementation of the kernel called name. A module loaded with
// cuModuleLoadData yields the function only if its PTX has an entry of that name; the entry's parameter
// count is checked at launch. A registration replaces a built-in of the same name.
func Kernel(name string, fn KernelFunc) Option {
	return func(c *config) { c.kernels[name] = fn }
}

// Sim is a simulated driver. It implements driver.API and is safe for concurrent use. Make one with
// New and release everything it still holds with Close.
type Sim struct {
	cfg config

	mu          sync.Mutex
	closed      bool
	initialized bool
	devs        []*device
	threads     map[int]driver.Context // OS thread id → current context

	calls  map[string]int
	faults []*fault

	allocs     map[*allocation]struct{}
	handles    map[driver.MemHandle]*allocation
	imported   map[driver.MemHandle]bool // handles that an import made: they report no handle types
	res        []*reservation            // sorted by base, never overlapping
	hosts      []*hostRange              // registrations and host allocations, sorted by base
	hostPinned uint64                    // bytes registered or host-allocated: visible to every device
	legacy     map[driver.DevicePtr]*legacyAlloc
	streams    map[driver.Stream]*stream
	events     map[driver.Event]*event
	// destroyed streams' and events' values, which ReuseHandles hands out again
	freedStreams, freedEvents freeList
	eventsMade                map[uint32]int // events created so far, by flags
	modules                   map[driver.Module]*module
	funcs                     map[driver.Function]*function
	fds                       int // file descriptors the simulator holds open

	graphs graphTables // stream captures, graphs and executable graphs (graph.go)
	as     *asyncState // stream order and the default memory pools (async.go), made on first use
}

// handleCounter makes every opaque value (allocation handles, contexts, streams, events, modules,
// functions) unique across all simulators of the process, so a handle given to the wrong simulator
// is refused instead of naming something else. The base keeps them away from small integers such as
// the special streams 1 and 2.
var handleCounter atomic.Uint64

func newHandle() uint64 { return 0x5100_0000_0000 + handleCounter.Add(1)*16 }

// New makes a simulator. Like the real driver, it must be initialized with Init before use.
func New(opts ...Option) *Sim {
	cfg := config{
		devices:     1,
		memory:      DefaultMemoryPerDevice,
		granularity: DefaultGranularity,
		version:     DefaultDriverVersion,
		kernels:     builtinKernels(),
		deferWork:   deferFromEnv(),
	}
	for _, o := range opts {
		o(&cfg)
	}
	if cfg.devices < 0 {
		panic(fmt.Sprintf("sim: Devices(%d): negative count", cfg.devices))
	}
	page := uint64(unix.Getpagesize())
	if g := cfg.granularity; g == 0 || g&(g-1) != 0 || g%page != 0 {
		panic(fmt.Sprintf("sim: Granularity(%d): must be a power of two and a multiple of the page size", g))
	}
	s := &Sim{
		cfg:        cfg,
		threads:    make(map[int]driver.Context),
		calls:      make(map[string]int),
		allocs:     make(map[*allocation]struct{}),
		handles:    make(map[driver.MemHandle]*allocation),
		imported:   make(map[driver.MemHandle]bool),
		legacy:     make(map[driver.DevicePtr]*legacyAlloc),
		streams:    make(map[driver.Stream]*stream),
		events:     make(map[driver.Event]*event),
		eventsMade: make(map[uint32]int),
		modules:    make(map[driver.Module]*module),
		funcs:      make(map[driver.Function]*function),
	}
	for i := 0; i < cfg.devices; i++ {
		s.devs = append(s.devs, newDevice(i, cfg))
	}
	for _, p := range cfg.peers {
		if p.a < 0 || p.a >= cfg.devices || p.b < 0 || p.b >= cfg.devices {
			panic(fmt.Sprintf("sim: PeerAccess(%d, %d): no such device", p.a, p.b))
		}
		if p.a != p.b {
			s.devs[p.a].peers[p.b] = p.ok
			s.devs[p.b].peers[p.a] = p.ok
		}
	}
	for _, a := range cfg.attrs {
		if a.dev < 0 || a.dev >= cfg.devices {
			panic(fmt.Sprintf("sim: Attribute(%d, %d): no such device", a.dev, a.attr))
		}
		s.devs[a.dev].attrs[a.attr] = a.value
	}
	return s
}

// callMode says what a call needs before it runs.
type callMode int

const (
	anyTime  callMode = iota // no cuInit needed (cuInit, cuDriverGetVersion)
	initDone                 // cuInit must have run
	ctxBound                 // cuInit and a current context on the calling OS thread
)

// begin starts the call fn with s.mu held: it counts the call, fires an armed fault (before anything
// else, so a failing call has no side effect), and checks initialization and the calling thread's
// context. For ctxBound calls it returns the current context's device.
func (s *Sim) begin(fn string, mode callMode) (*device, error) {
	s.calls[fn]++
	if code, ok := s.fire(fn); ok {
		return nil, code
	}
	if s.closed {
		return nil, driver.ErrorDeinitialized
	}
	if mode == anyTime {
		return nil, nil
	}
	if !s.initialized {
		return nil, driver.ErrorNotInitialized
	}
	if mode == initDone {
		return nil, nil
	}
	d := s.currentDevice()
	if d == nil {
		return nil, driver.ErrorInvalidContext
	}
	return d, nil
}

// currentDevice is the device of the calling OS thread's current context, or nil when none is bound
// or the bound one has been released.
func (s *Sim) currentDevice() *device {
	c, ok := s.threads[unix.Gettid()]
	if !ok {
		return nil
	}
	d := s.ctxDevice(c)
	if d == nil || d.ctxRefs == 0 {
		return nil
	}
	return d
}

// ---- fault injection -------------------------------------------------------------------------------

type fault struct {
	fn        string
	remaining int
	code      driver.Result
}

// functions is every C base name the simulator answers to (FailNth and Calls accept these).
var functions = map[string]bool{}

func init() {
	for _, n := range []string{
		"cuInit", "cuDriverGetVersion", "cuDeviceGetCount", "cuDeviceGet", "cuDeviceGetName",
		"cuDeviceGetAttribute", "cuDeviceTotalMem", "cuDeviceCanAccessPeer", "cuDeviceGetUuid",
		"cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRelease", "cuCtxSetCurrent", "cuCtxGetCurrent",
		"cuCtxSynchronize", "cuMemGetInfo", "cuMemCreate", "cuMemRelease", "cuMemGetAllocationGranularity",
		"cuMemGetAllocationPropertiesFromHandle", "cuMemRetainAllocationHandle", "cuMemAddressReserve",
		"cuMemAddressFree", "cuMemMap", "cuMemUnmap", "cuMemSetAccess", "cuMemGetAccess",
		"cuMemExportToShareableHandle", "cuMemImportFromShareableHandle", "cuMemGetHandleForAddressRange",
		"cuMemHostRegister", "cuMemHostUnregister", "cuMemHostGetDevicePointer", "cuMemHostAlloc",
		"cuMemFreeHost", "cuMemAlloc", "cuMemFree", "cuMemcpy", "cuMemcpyHtoD", "cuMemcpyDtoH",
		"cuMemcpyDtoD", "cuMemcpyAsync", "cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync", "cuMemcpyPeerAsync",
		"cuMemsetD8", "cuMemsetD32", "cuMemsetD8Async", "cuStreamCreate", "cuStreamDestroy",
		"cuStreamSynchronize", "cuEventCreate", "cuEventRecord", "cuEventSynchronize",
		"cuEventElapsedTime", "cuEventDestroy", "cuModuleLoadData", "cuModuleGetFunction",
		"cuModuleUnload", "cuLaunchKernel",
		// Graphs
		"cuStreamBeginCapture", "cuStreamEndCapture", "cuGraphInstantiateWithFlags", "cuGraphLaunch",
		"cuGraphExecDestroy", "cuGraphDestroy",
		// Stream-ordered allocation and event queries (async.go).
		"cuStreamWaitEvent", "cuEventQuery", "cuMemAllocAsync", "cuMemFreeAsync",
		"cuDeviceGetDefaultMemPool", "cuMemPoolSetAttribute", "cuMemPoolGetAttribute", "cuMemPoolTrimTo",
	} {
		functions[n] = true
	}
}

// baseName accepts "cuMemCreate" as well as a versioned symbol such as "cuMemcpyHtoD_v2", and panics on
// a name the simulator does not implement: a misspelt fault that never fires would make a test pass
// for the wrong reason.
func baseName(function string) string {
	n := function
	if i := strings.LastIndex(n, "_v"); i > 0 {
		n = n[:i]
	}
	if !functions[n] {
		panic(fmt.Sprintf("sim: unknown driver function %q (use the C base name, e.g. \"cuMemCreate\")", function))
	}
	return n
}

// FailNth arms a fault: the n-th call from now (1 = the next one) of function fails with code and does
// nothing else. function is the C base name ("cuMemCreate", "cuMemMap", "cuMemSetAccess",
// "cuMemImportFromShareableHandle", ...; a versioned symbol such as "cuMemcpyHtoD_v2" is accepted).
// cuMemExportToShareableHandle covers both MemExportToShareableHandle and MemExportToFabricHandle, as
// both call that C function. Several faults may be armed at once; when two come due on the same call,
// the one armed first fires and the other fires on the next call.
func (s *Sim) FailNth(function string, n int, code driver.Result) {
	fn := baseName(function)
	if n < 1 {
		panic(fmt.Sprintf("sim: FailNth(%q, %d): n counts from 1", function, n))
	}
	if code == driver.Success {
		panic("sim: FailNth with CUDA_SUCCESS is not a fault")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.faults = append(s.faults, &fault{fn: fn, remaining: n, code: code})
}

// ClearFaults disarms every fault armed with FailNth.
func (s *Sim) ClearFaults() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.faults = nil
}

// Calls reports how many calls of function (a C base name, as for FailNth) were made so far,
// including failed ones.
func (s *Sim) Calls(function string) int {
	fn := baseName(function)
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.calls[fn]
}

// EventsCreated reports how many events were created so far with exactly these flags
// (cuEventCreate; driver.EventBlockingSync, driver.EventDisableTiming): how a test tells whether a
// wait on them would spin or sleep on the real driver.
func (s *Sim) EventsCreated(flags uint32) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.eventsMade[flags]
}

// CallCounts reports how many calls of each function were made so far (C base names; functions never
// called are absent). The difference of two snapshots is what an operation called, which is how a
// fault-injection test finds every call it can make fail.
func (s *Sim) CallCounts() map[string]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string]int, len(s.calls))
	for k, v := range s.calls {
		out[k] = v
	}
	return out
}

func (s *Sim) fire(fn string) (driver.Result, bool) {
	hit := -1
	for i, f := range s.faults {
		if f.fn != fn {
			continue
		}
		f.remaining--
		if f.remaining <= 0 && hit < 0 {
			hit = i
		}
	}
	if hit < 0 {
		return 0, false
	}
	code := s.faults[hit].code
	s.faults = append(s.faults[:hit], s.faults[hit+1:]...)
	return code, true
}

// ---- live objects and Close ------------------------------------------------------------------------

// Live counts the objects a simulator holds, for leak checks at the end of a test.
type Live struct {
	Contexts          int // primary contexts with a reference count above zero
	Allocations       int // physical allocations (cuMemCreate or imported) not yet freed: a released one stays until its last unmap
	Reservations      int // cuMemAddressReserve ranges
	Mappings          int // cuMemMap mappings
	HostRegistrations int // cuMemHostRegister ranges
	HostAllocs        int // cuMemHostAlloc buffers
	LegacyAllocs      int // cuMemAlloc buffers
	AsyncAllocs       int // cuMemAllocAsync buffers, live or cached in a pool (trim the pool to free those)
	Streams           int
	Events            int
	Modules           int
	OpenFDs           int // file descriptors the simulator holds beyond one per live allocation (0 unless it leaks)
	Graphs            int // graphs (cuStreamEndCapture) and executable graphs (cuGraphInstantiateWithFlags); open captures count too
}

// Zero reports whether nothing is live.
func (l Live) Zero() bool { return l == Live{} }

// String lists the non-zero counters, for example "allocations=2 mappings=2", or "none".
func (l Live) String() string {
	var parts []string
	add := func(name string, n int) {
		if n != 0 {
			parts = append(parts, fmt.Sprintf("%s=%d", name, n))
		}
	}
	add("contexts", l.Contexts)
	add("allocations", l.Allocations)
	add("reservations", l.Reservations)
	add("mappings", l.Mappings)
	add("host-registrations", l.HostRegistrations)
	add("host-allocs", l.HostAllocs)
	add("legacy-allocs", l.LegacyAllocs)
	add("async-allocs", l.AsyncAllocs)
	add("streams", l.Streams)
	add("events", l.Events)
	add("modules", l.Modules)
	add("open-fds", l.OpenFDs)
	add("graphs", l.Graphs)
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, " ")
}

// Live counts what the simulator holds now.
func (s *Sim) Live() Live {
	s.mu.Lock()
	defer s.mu.Unlock()
	var l Live
	for _, d := range s.devs {
		if d.ctxRefs > 0 {
			l.Contexts++
		}
	}
	for a := range s.allocs {
		if !a.legacy {
			l.Allocations++
		}
	}
	for _, r := range s.res {
		if !r.legacy {
			l.Reservations++
			l.Mappings += len(r.maps)
		}
	}
	for _, h := range s.hosts {
		if h.alloc {
			l.HostAllocs++
		} else {
			l.HostRegistrations++
		}
	}
	l.LegacyAllocs = len(s.legacy)
	l.AsyncAllocs = s.asyncLive()
	l.Streams = len(s.streams)
	l.Events = len(s.events)
	l.Modules = len(s.modules)
	l.OpenFDs = s.fds - len(s.allocs)
	l.Graphs = len(s.graphs.captures) + len(s.graphs.graphs) + len(s.graphs.execs)
	return l
}

// Close frees everything the simulator still holds (mappings, reservations, allocations, host
// memory, contexts) and closes its file descriptors; later calls answer CUDA_ERROR_DEINITIALIZED. It
// is meant for test cleanup and must not run concurrently with other calls on s. Host memory from
// cuMemHostAlloc is unmapped, so pointers to it must no longer be used. Close is idempotent.
func (s *Sim) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	s.closed = true
	var errs []error
	for _, r := range s.res {
		errs = append(errs, releaseVA(r.base, r.size))
	}
	s.res = nil
	for a := range s.allocs {
		errs = append(errs, a.free())
		s.fds--
	}
	s.allocs = nil
	for _, h := range s.hosts {
		if h.alloc {
			errs = append(errs, munmap(uintptr(h.base), h.pinned))
		}
	}
	s.hosts = nil
	for _, d := range s.devs {
		d.ctxRefs = 0
	}
	clear(s.handles)
	clear(s.imported)
	clear(s.legacy)
	clear(s.streams)
	clear(s.events)
	clear(s.modules)
	clear(s.funcs)
	clear(s.threads)
	s.graphs = graphTables{}
	s.as = nil
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("sim: close: %w", err)
	}
	return nil
}

// ---- small helpers ---------------------------------------------------------------------------------

func (s *Sim) gran() uint64 { return s.cfg.granularity }

// aligned reports whether v is a multiple of the granularity.
func (s *Sim) aligned(v uint64) bool { return v%s.cfg.granularity == 0 }

func roundUp(v, to uint64) uint64 { return (v + to - 1) / to * to }

// insertSorted inserts x into the slice sorted by key.
func insertSorted[T any](list []T, x T, key func(T) uint64) []T {
	i := sort.Search(len(list), func(i int) bool { return key(list[i]) > key(x) })
	list = append(list, x)
	copy(list[i+1:], list[i:])
	list[i] = x
	return list
}

// removeItem removes x from list (by identity).
func removeItem[T comparable](list []T, x T) []T {
	if i := slices.Index(list, x); i >= 0 {
		return slices.Delete(list, i, i+1)
	}
	return list
}
