package vmm

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/lifetime"
)

// Device is one GPU with its retained primary context. Devices are owned by their System and released
// by System.Close.
type Device struct {
	sys     *System
	ordinal int
	dev     driver.Device
	ctx     driver.Context
	name    string
	total   uint64
	uuid    [16]byte

	// own counts the live objects that belong to this device (allocations made on it,
	// reservations, streams, events, registrations, plain buffers) by kind; System.Close refuses
	// while any remain.
	own      lifetime.Owner
	released atomic.Bool // do refuses: System.Close has begun releasing the device
	ctxGone  bool        // the primary context is released; guarded by the System's gate

	granMu sync.Mutex
	gran   map[granKey]uint64

	featMu sync.Mutex
	feats  map[Feature]error // capability checks, cached

	kernMu  sync.Mutex // serializes loading the kernels, never held across a launch
	kernels atomic.Pointer[kernelSet]
	lanes   lanePool

	counted countingAPI // the API do hands out: the driver, counted for Stats
}

type granKey struct {
	loc    driver.Location
	option driver.GranularityOption
}

func openDevice(s *System, ordinal int) (*Device, error) {
	api := s.api
	dev, err := api.DeviceGet(ordinal)
	if err != nil {
		return nil, fmt.Errorf("vmm: cuDeviceGet(%d): %w", ordinal, err)
	}
	name, err := api.DeviceGetName(dev)
	if err != nil {
		return nil, fmt.Errorf("vmm: device %d: cuDeviceGetName: %w", ordinal, err)
	}
	total, err := api.DeviceTotalMem(dev)
	if err != nil {
		return nil, fmt.Errorf("vmm: device %d: cuDeviceTotalMem: %w", ordinal, err)
	}
	uuid, err := api.DeviceGetUUID(dev)
	if err != nil {
		return nil, fmt.Errorf("vmm: device %d: cuDeviceGetUuid: %w", ordinal, err)
	}
	ctx, err := api.DevicePrimaryCtxRetain(dev)
	if err != nil {
		return nil, fmt.Errorf("vmm: device %d: cuDevicePrimaryCtxRetain: %w", ordinal, err)
	}
	return &Device{sys: s, ordinal: ordinal, dev: dev, ctx: ctx, name: name, total: total, uuid: uuid,
		gran: map[granKey]uint64{}, feats: map[Feature]error{},
		counted: newCountingAPI(api, &s.stats, ordinal)}, nil
}

// release frees the kernels and releases the primary context; the caller (System.Close) holds the
// System's gate for writing, so no call is in flight on the device. When the context's release
// fails the device keeps it, refusing calls, and a later release retries it.
func (d *Device) release() error {
	if d.ctxGone {
		return nil
	}
	d.released.Store(true)
	var errs []error
	// d.do refuses once released is set, so bind directly, through the counted API as d.do does,
	// so that Stats sees the frees.
	if err := bind(&d.counted, d.ctx, func(api driver.API) error {
		var errs []error
		if err := d.lanes.free(api); err != nil {
			errs = append(errs, err)
		}
		if ks := d.kernels.Swap(nil); ks != nil {
			errs = append(errs, ks.Unload(api))
		}
		return errors.Join(errs...)
	}); err != nil {
		errs = append(errs, fmt.Errorf("vmm: device %d: unload kernels: %w", d.ordinal, err))
	}
	if err := d.sys.api.DevicePrimaryCtxRelease(d.dev); err != nil {
		return errors.Join(append(errs, fmt.Errorf("vmm: device %d: cuDevicePrimaryCtxRelease: %w", d.ordinal, err))...)
	}
	d.ctxGone = true
	return errors.Join(errs...)
}

// do runs fn with this device's primary context bound on a locked OS thread, holding the System's
// gate for reading (System.Close waits for it). fn must not call do again.
func (d *Device) do(fn func(api driver.API) error) error {
	d.sys.gate.RLock()
	defer d.sys.gate.RUnlock()
	if d.released.Load() {
		return fmt.Errorf("vmm: device %d: %w", d.ordinal, ErrClosed)
	}
	return bind(&d.counted, d.ctx, fn)
}

// Raw runs fn with this device's primary context bound on a locked OS thread and gives it the driver
// API. It is the escape hatch for baselines (the raw driver sequence a benchmark compares with) and
// for calls this package does not wrap; objects fn creates are fn's to free. fn must not call this
// package's methods (System.Close waits for Raw to return).
func (d *Device) Raw(fn func(api driver.API) error) error { return d.do(fn) }

// AddDependent counts an object of another package that uses the device through Raw, holding
// something that vmm does not own (an NCCL communicator, say), as one of the device's objects of
// kind (such as "nccl communicator") until done is called: until then System.Close fails with an
// error wrapping ErrInUse that names it, as for the device's own objects. done is idempotent; call it
// once the object has freed what it holds. Add the dependent before the object takes anything of the
// device, so that no System.Close runs in between; on a closed System it fails with ErrClosed.
func (d *Device) AddDependent(kind string) (done func(), err error) {
	if d == nil {
		return nil, fmt.Errorf("vmm: add a dependent %s to a nil device: %w", kind, ErrInvalidValue)
	}
	o := new(lifetime.Owner)
	// Under the gate, as the device's own objects are made (no driver call is needed): Close's
	// check sees it, or Close ran first.
	d.sys.gate.RLock()
	defer d.sys.gate.RUnlock()
	if d.released.Load() {
		return nil, fmt.Errorf("vmm: device %d: add a dependent %s: %w", d.ordinal, kind, ErrClosed)
	}
	o.Init(&d.own, kind)
	return func() { o.Shut() }, nil
}

// System is the system the device belongs to.
func (d *Device) System() *System { return d.sys }

// Ordinal is the device's index, 0 to DeviceCount-1.
func (d *Device) Ordinal() int { return d.ordinal }

// Handle is the driver's CUdevice.
func (d *Device) Handle() driver.Device { return d.dev }

// Context is the device's retained primary context.
func (d *Device) Context() driver.Context { return d.ctx }

// Name is the device's name (cuDeviceGetName).
func (d *Device) Name() string { return d.name }

// TotalMemory is the device's memory in bytes (cuDeviceTotalMem).
func (d *Device) TotalMemory() uint64 { return d.total }

// UUID is the device's UUID (cuDeviceGetUuid).
func (d *Device) UUID() [16]byte { return d.uuid }

// Location is the memory location of this device.
func (d *Device) Location() driver.Location { return driver.DeviceLocation(d.dev) }

func (d *Device) String() string { return fmt.Sprintf("device %d (%s)", d.ordinal, d.name) }

// Attribute reads a device attribute (cuDeviceGetAttribute).
func (d *Device) Attribute(attr driver.DeviceAttribute) (int, error) {
	v, err := d.sys.api.DeviceGetAttribute(attr, d.dev)
	if err != nil {
		return 0, fmt.Errorf("vmm: device %d: cuDeviceGetAttribute(%d): %w", d.ordinal, attr, err)
	}
	return v, nil
}

// Supports reads a boolean attribute; an attribute the driver does not know counts as unsupported.
// Prefer Check, which tells a missing feature from a failed query.
func (d *Device) Supports(attr driver.DeviceAttribute) bool {
	v, err := d.Attribute(attr)
	return err == nil && v != 0
}

// HostNUMAID is the NUMA node of the host memory closest to the device (attribute 134), or -1 (also
// when the query fails: use HostNUMANode to tell).
func (d *Device) HostNUMAID() int {
	v, err := d.Attribute(driver.AttrHostNUMAID)
	if err != nil {
		return -1
	}
	return v
}

// HostNUMANode is the NUMA node of the host memory closest to the device (attribute 134): -1 when
// the device has none, an error when the query fails.
func (d *Device) HostNUMANode() (int, error) { return d.Attribute(driver.AttrHostNUMAID) }

// Granularity is the allocation granularity (cuMemGetAllocationGranularity) for a PINNED allocation
// at loc made through this device. It is cached.
func (d *Device) Granularity(loc driver.Location, option driver.GranularityOption) (uint64, error) {
	k := granKey{loc, option}
	d.granMu.Lock()
	g, ok := d.gran[k]
	d.granMu.Unlock()
	if ok {
		return g, nil
	}
	prop := driver.AllocationProp{Type: driver.AllocationTypePinned, Location: loc}
	err := d.do(func(api driver.API) error {
		var err error
		g, err = api.MemGetAllocationGranularity(&prop, option)
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("vmm: device %d: granularity for %s: %w", d.ordinal, loc, err)
	}
	if g == 0 {
		return 0, fmt.Errorf("vmm: device %d: driver reported granularity 0 for %s: %w", d.ordinal, loc, ErrInvalidValue)
	}
	d.granMu.Lock()
	d.gran[k] = g
	d.granMu.Unlock()
	return g, nil
}

// DeviceGranularity is the minimum granularity of this device's own memory.
func (d *Device) DeviceGranularity() (uint64, error) {
	if d == nil {
		return 0, fmt.Errorf("vmm: granularity of a nil device: %w", ErrInvalidValue)
	}
	return d.Granularity(d.Location(), driver.GranularityMinimum)
}

// MemInfo is cuMemGetInfo for this device: free and total bytes.
func (d *Device) MemInfo() (free, total uint64, err error) {
	err = d.do(func(api driver.API) error {
		var err error
		free, total, err = api.MemGetInfo()
		return err
	})
	if err != nil {
		err = fmt.Errorf("vmm: device %d: cuMemGetInfo: %w", d.ordinal, err)
	}
	return
}

// Synchronize waits for all work queued on the device's primary context (cuCtxSynchronize).
func (d *Device) Synchronize() error {
	if err := d.do(func(api driver.API) error { return api.CtxSynchronize() }); err != nil {
		return fmt.Errorf("vmm: device %d: cuCtxSynchronize: %w", d.ordinal, err)
	}
	return nil
}

// CanAccessPeer reports whether this device can access memory on peer (cuDeviceCanAccessPeer). A
// device can always access itself.
func (d *Device) CanAccessPeer(peer *Device) (bool, error) {
	if peer == nil {
		return false, fmt.Errorf("vmm: device %d: peer check with a nil device: %w", d.ordinal, ErrInvalidValue)
	}
	if peer.dev == d.dev {
		return true, nil
	}
	ok, err := d.sys.api.DeviceCanAccessPeer(d.dev, peer.dev)
	if err != nil {
		return false, fmt.Errorf("vmm: cuDeviceCanAccessPeer(%d, %d): %w", d.ordinal, peer.ordinal, err)
	}
	return ok, nil
}
