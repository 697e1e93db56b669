package sim

import (
	"github.com/cuvmm/cuvmm/driver"
)

type device struct {
	ordinal int
	attrs   map[driver.DeviceAttribute]int
	peers   []bool // peers[j]: this device can access device j's memory
	uuid    [16]byte
	ctx     driver.Context // the primary context's handle, fixed for the device's life
	ctxRefs int

	used        uint64 // bytes of device memory allocated on this device by this process
	hostVisible uint64 // bytes of host-NUMA/host VMM mappings this device was granted access to
}

// pciBusIDs are the bus numbers of the eight GPUs of an HGX H100/H200 board, so that tools showing
// them look familiar; more devices continue past them.
var pciBusIDs = []int{0x18, 0x2a, 0x3a, 0x5d, 0x9a, 0xab, 0xba, 0xdb}

// h200Attributes are the device attributes of the project's H200 host (docs/driver-facts.md, section 1)
// plus the launch limits every CUDA device of compute capability 9.0 has.
var h200Attributes = map[driver.DeviceAttribute]int{
	1:  1024,       // MAX_THREADS_PER_BLOCK
	2:  1024,       // MAX_BLOCK_DIM_X
	3:  1024,       // MAX_BLOCK_DIM_Y
	4:  64,         // MAX_BLOCK_DIM_Z
	5:  2147483647, // MAX_GRID_DIM_X
	6:  65535,      // MAX_GRID_DIM_Y
	7:  65535,      // MAX_GRID_DIM_Z
	8:  49152,      // MAX_SHARED_MEMORY_PER_BLOCK
	9:  65536,      // TOTAL_CONSTANT_MEMORY
	10: 32,         // WARP_SIZE
	13: 1980000,    // CLOCK_RATE (kHz)
	19: 1,          // CAN_MAP_HOST_MEMORY
	38: 52428800,   // L2_CACHE_SIZE
	39: 2048,       // MAX_THREADS_PER_MULTIPROCESSOR

	driver.AttrMultiprocessorCount:                      132,
	driver.AttrPCIDeviceID:                              0,
	driver.AttrPCIDomainID:                              0,
	driver.AttrUnifiedAddressing:                        1,
	driver.AttrComputeCapabilityMajor:                   9,
	driver.AttrComputeCapabilityMinor:                   0,
	driver.AttrCanUseHostPointerForRegisteredMem:        1,
	driver.AttrHostRegisterSupported:                    1,
	driver.AttrVirtualMemoryManagementSupported:         1,
	driver.AttrHandleTypePosixFDSupported:               1,
	driver.AttrGenericCompressionSupported:              1,
	driver.AttrGPUDirectRDMAWithCUDAVMMSupported:        1,
	driver.AttrReadOnlyHostRegisterSupported:            1,
	driver.AttrDMABufSupported:                          1,
	driver.AttrHandleTypeFabricSupported:                1, // supported by the device; creation still needs an IMEX channel
	driver.AttrNUMAConfig:                               0,
	driver.AttrNUMAID:                                   -1,
	driver.AttrHostNUMAID:                               0,
	driver.AttrHostNUMAVirtualMemoryManagementSupported: 1,
	driver.AttrHostVirtualMemoryManagementSupported:     1,
}

func newDevice(i int, cfg config) *device {
	d := &device{
		ordinal: i,
		attrs:   make(map[driver.DeviceAttribute]int, len(h200Attributes)+1),
		peers:   make([]bool, cfg.devices),
		ctx:     driver.Context(newHandle()),
	}
	for k, v := range h200Attributes {
		d.attrs[k] = v
	}
	bus := 0xdb + 0x10*(i-len(pciBusIDs)+1)
	if i < len(pciBusIDs) {
		bus = pciBusIDs[i]
	}
	d.attrs[driver.AttrPCIBusID] = bus
	for j := range d.peers {
		d.peers[j] = j != i // cuDeviceCanAccessPeer(d, d) is 0 on the real driver
	}
	// Deterministic UUIDs: the same ordinal has the same UUID in every process, as the same GPU does,
	// so two processes' simulators agree on which device an imported allocation lives on.
	copy(d.uuid[:], "cuvmm-sim-gpu\x00\x00\x00")
	d.uuid[14] = byte(i >> 8)
	d.uuid[15] = byte(i)
	return d
}

// device returns the device for an ordinal, or nil.
func (s *Sim) device(dev driver.Device) *device {
	if dev < 0 || int(dev) >= len(s.devs) {
		return nil
	}
	return s.devs[dev]
}

// ctxDevice returns the device whose primary context is c, or nil.
func (s *Sim) ctxDevice(c driver.Context) *device {
	for _, d := range s.devs {
		if d.ctx == c {
			return d
		}
	}
	return nil
}

// canAccess reports whether device d may be granted access to memory located on device owner.
func (d *device) canAccess(owner int) bool { return owner == d.ordinal || d.peers[owner] }

// Init calls cuInit. flags must be 0.
func (s *Sim) Init(flags uint32) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.begin("cuInit", anyTime); err != nil {
		return err
	}
	if flags != 0 {
		return driver.ErrorInvalidValue
	}
	s.initialized = true
	return nil
}

// DriverGetVersion calls cuDriverGetVersion; like the driver's, it works before cuInit.
func (s *Sim) DriverGetVersion() (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.begin("cuDriverGetVersion", anyTime); err != nil {
		return 0, err
	}
	return s.cfg.version, nil
}

// DeviceGetCount calls cuDeviceGetCount.
func (s *Sim) DeviceGetCount() (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.begin("cuDeviceGetCount", initDone); err != nil {
		return 0, err
	}
	return len(s.devs), nil
}

// DeviceGet calls cuDeviceGet: the handle is the ordinal; an ordinal out of range is
// CUDA_ERROR_INVALID_DEVICE.
func (s *Sim) DeviceGet(ordinal int) (driver.Device, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.begin("cuDeviceGet", initDone); err != nil {
		return 0, err
	}
	if ordinal < 0 || ordinal >= len(s.devs) {
		return 0, driver.ErrorInvalidDevice
	}
	return driver.Device(ordinal), nil
}

// lookupDevice is the common prologue of the device queries.
func (s *Sim) lookupDevice(fn string, dev driver.Device) (*device, error) {
	if _, err := s.begin(fn, initDone); err != nil {
		return nil, err
	}
	d := s.device(dev)
	if d == nil {
		return nil, driver.ErrorInvalidDevice
	}
	return d, nil
}

// DeviceGetName calls cuDeviceGetName: DeviceName for every device.
func (s *Sim) DeviceGetName(dev driver.Device) (string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.lookupDevice("cuDeviceGetName", dev); err != nil {
		return "", err
	}
	return DeviceName, nil
}

// DeviceGetAttribute calls cuDeviceGetAttribute. The simulator knows the H200's values of the
// attributes the project reads (see Attribute to change or add one); others, and those newer than
// the driver version (attrSince), are CUDA_ERROR_INVALID_VALUE.
func (s *Sim) DeviceGetAttribute(attr driver.DeviceAttribute, dev driver.Device) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	d, err := s.lookupDevice("cuDeviceGetAttribute", dev)
	if err != nil {
		return 0, err
	}
	v, ok := d.attrs[attr]
	if since, newer := attrSince[attr]; !ok || newer && s.cfg.version < since {
		return 0, driver.ErrorInvalidValue
	}
	return v, nil
}

// attrSince is the first driver version that knows an attribute, for the attributes newer than the
// oldest driver with VMM: a simulator set to an older DriverVersion answers them
// CUDA_ERROR_INVALID_VALUE, as such a driver does.
var attrSince = map[driver.DeviceAttribute]int{
	driver.AttrHostNUMAVirtualMemoryManagementSupported: 12090,
	driver.AttrHostVirtualMemoryManagementSupported:     13000,
}

// DeviceTotalMem calls cuDeviceTotalMem_v2 (MemoryPerDevice).
func (s *Sim) DeviceTotalMem(dev driver.Device) (uint64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.lookupDevice("cuDeviceTotalMem", dev); err != nil {
		return 0, err
	}
	return s.cfg.memory, nil
}

// DeviceCanAccessPeer calls cuDeviceCanAccessPeer (see PeerAccess); a device is not its own peer.
func (s *Sim) DeviceCanAccessPeer(dev, peer driver.Device) (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	d, err := s.lookupDevice("cuDeviceCanAccessPeer", dev)
	if err != nil {
		return false, err
	}
	if s.device(peer) == nil {
		return false, driver.ErrorInvalidDevice
	}
	return d.peers[peer], nil
}

// DeviceGetUUID calls cuDeviceGetUuid_v2. UUIDs are distinct per ordinal and the same in every
// process.
func (s *Sim) DeviceGetUUID(dev driver.Device) ([16]byte, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	d, err := s.lookupDevice("cuDeviceGetUuid", dev)
	if err != nil {
		return [16]byte{}, err
	}
	return d.uuid, nil
}

// DevicePrimaryCtxRetain calls cuDevicePrimaryCtxRetain: it counts a reference to dev's primary
// context and returns it. The handle is the same on every retain.
func (s *Sim) DevicePrimaryCtxRetain(dev driver.Device) (driver.Context, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	d, err := s.lookupDevice("cuDevicePrimaryCtxRetain", dev)
	if err != nil {
		return 0, err
	}
	d.ctxRefs++
	return d.ctx, nil
}

// DevicePrimaryCtxRelease calls cuDevicePrimaryCtxRelease_v2. Releasing a context that is not
// retained is CUDA_ERROR_INVALID_CONTEXT. The last release destroys the context's streams, events and
// modules and frees its cuMemAlloc and cuMemAllocAsync memory (live or cached in the default pool), as
// the driver does: the pointers become invalid (copies and kernels touching them fail, cuMemFree and
// cuMemFreeAsync answer CUDA_ERROR_INVALID_VALUE). Threads that still have it current get
// CUDA_ERROR_INVALID_CONTEXT from then on. VMM allocations (cuMemCreate) belong to the process, not to
// the context, and stay.
func (s *Sim) DevicePrimaryCtxRelease(dev driver.Device) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	d, err := s.lookupDevice("cuDevicePrimaryCtxRelease", dev)
	if err != nil {
		return err
	}
	if d.ctxRefs == 0 {
		return driver.ErrorInvalidContext
	}
	d.ctxRefs--
	if d.ctxRefs == 0 {
		s.destroyContextObjects(d)
	}
	return nil
}

// CtxSetCurrent calls cuCtxSetCurrent: it binds ctx to the calling OS thread (0 unbinds). The context
// must be a retained primary context of this simulator, else CUDA_ERROR_INVALID_CONTEXT.
func (s *Sim) CtxSetCurrent(ctx driver.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.begin("cuCtxSetCurrent", initDone); err != nil {
		return err
	}
	tid := currentThread()
	if ctx == 0 {
		delete(s.threads, tid)
		return nil
	}
	d := s.ctxDevice(ctx)
	if d == nil || d.ctxRefs == 0 {
		return driver.ErrorInvalidContext
	}
	s.threads[tid] = ctx
	return nil
}

// CtxGetCurrent calls cuCtxGetCurrent: the context bound to the calling OS thread, or 0.
func (s *Sim) CtxGetCurrent() (driver.Context, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.begin("cuCtxGetCurrent", initDone); err != nil {
		return 0, err
	}
	return s.threads[currentThread()], nil
}

// CtxSynchronize calls cuCtxSynchronize: it waits for the work of every stream of the current
// context. While one of them captures, synchronizing the context is invalid in every capture mode:
// CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, and the captures are invalidated, as for cuStreamSynchronize
// of the capturing stream.
func (s *Sim) CtxSynchronize() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	d, err := s.begin("cuCtxSynchronize", ctxBound)
	if err != nil {
		return err
	}
	if s.invalidateCapturesOf(d, nil) {
		return driver.ErrorStreamCaptureUnsupported
	}
	s.waitFor(func() bool { return s.deviceIdle(d) })
	s.syncPoint(d)
	return s.asyncErr()
}

// deviceIdle reports whether every stream of d (and the default streams) has completed its work.
func (s *Sim) deviceIdle(d *device) bool {
	for _, st := range []driver.Stream{0, 1, 2} {
		if !s.streamIdle(st) {
			return false
		}
	}
	var mine []driver.Stream // streamIdle may release s.mu: not while ranging over the map
	for h, st := range s.streams {
		if st.dev == d {
			mine = append(mine, h)
		}
	}
	for _, h := range mine {
		if !s.streamIdle(h) {
			return false
		}
	}
	return true
}

// MemGetInfo calls cuMemGetInfo_v2 for the current context's device: total is MemoryPerDevice; free
// is total less the device memory this process allocated there (cuMemCreate, cuMemAlloc; imported
// allocations are paid by their exporter), ContextMemory for each retained context of the device, and
// the page tables for host memory visible to the device: 2 MiB per GiB of host-NUMA mappings it was
// granted plus, while this process holds a context on the device, every registered or
// cuMemHostAlloc'ed range (those are visible in every context of the process).
func (s *Sim) MemGetInfo() (free, total uint64, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	d, err := s.begin("cuMemGetInfo", ctxBound)
	if err != nil {
		return 0, 0, err
	}
	return s.free(d), s.cfg.memory, nil
}

// free is the device's free memory as cuMemGetInfo reports it.
func (s *Sim) free(d *device) uint64 {
	used := d.used + d.hostVisible/pageTableDivisor
	if d.ctxRefs > 0 {
		// Registered and cuMemHostAlloc'ed memory is mapped into every context of the process: a
		// device pays for it while this process holds a context on it (measured: a process whose only
		// context is on device 0 adds nothing to device 1).
		used += s.hostPinned/pageTableDivisor + s.cfg.ctxMemory
	}
	if used >= s.cfg.memory {
		return 0
	}
	return s.cfg.memory - used
}

// destroyContextObjects frees what belongs to d's primary context when its last reference goes.
func (s *Sim) destroyContextObjects(d *device) {
	for h, st := range s.streams {
		if st.dev == d {
			delete(s.streams, h)
			delete(s.graphs.captures, h)
			if s.as != nil {
				delete(s.as.waits, h)
				delete(s.as.holds, h)
			}
			s.streamGone(h)
		}
	}
	for h, e := range s.events {
		if e.dev == d {
			delete(s.events, h)
			if s.as != nil {
				delete(s.as.events, h)
			}
			s.freedEvents.keep(uint64(h), s.cfg.reuse)
		}
	}
	for h, m := range s.modules {
		if m.dev == d {
			s.unloadModule(h, m)
		}
	}
	for p, l := range s.legacy {
		if l.m.alloc.owner() == d.ordinal {
			delete(s.legacy, p)
			s.dropLegacyBuffer(l)
		}
	}
	if s.as == nil {
		return
	}
	for p, b := range s.as.byPtr {
		if b.pool.dev == d {
			delete(s.as.byPtr, p)
			s.dropLegacyBuffer(b.buf)
		}
	}
	if pool := s.as.pools[d]; pool != nil {
		pool.cached, pool.reserved, pool.used = nil, 0, 0
	}
}
