package vmm

import (
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/cuvmm/cuvmm/driver"
)

// opCounters are one device's counts and times per operation.
type opCounters [numOps]struct {
	calls, errors, bytes, nanos atomic.Uint64
}

func (c *opCounters) add(op Op, bytes uint64, start time.Time, err error) {
	o := &c[op]
	o.calls.Add(1)
	if err != nil {
		o.errors.Add(1)
	}
	o.bytes.Add(bytes)
	o.nanos.Add(uint64(time.Since(start)))
}

func (c *opCounters) read(into map[Op]OpStats) {
	for i := range c {
		o := &c[i]
		into[Op(i)] = OpStats{Calls: o.calls.Load(), Errors: o.errors.Load(), Bytes: o.bytes.Load(),
			Time: time.Duration(o.nanos.Load())}
	}
}

// countingAPI is the driver.API that Device.do hands out: every call passes through to the driver;
// the calls that make, map, share or free memory, and copies, are also counted, timed and recorded
// in the System's statsTable for Stats.
type countingAPI struct {
	driver.API
	t       *statsTable
	ordinal int
	ops     opCounters
}

func newCountingAPI(api driver.API, t *statsTable, ordinal int) countingAPI {
	return countingAPI{API: api, t: t, ordinal: ordinal}
}

func (c *countingAPI) MemCreate(size uint64, prop *driver.AllocationProp, flags uint64) (driver.MemHandle, error) {
	start := time.Now()
	h, err := c.API.MemCreate(size, prop, flags)
	c.ops.add(OpCreate, size, start, err)
	if err == nil && prop != nil {
		c.t.addHandle(h, handleInfo{size: size, loc: prop.Location, counted: true, ordinal: c.ordinal})
	}
	return h, err
}

func (c *countingAPI) MemRelease(h driver.MemHandle) error {
	start := time.Now()
	err := c.API.MemRelease(h)
	c.ops.add(OpRelease, 0, start, err)
	if err == nil {
		c.t.release(h)
	}
	return err
}

func (c *countingAPI) MemRetainAllocationHandle(addr driver.DevicePtr) (driver.MemHandle, error) {
	h, err := c.API.MemRetainAllocationHandle(addr)
	if err == nil {
		c.t.retain(h, addr, c.ordinal)
	}
	return h, err
}

func (c *countingAPI) MemGetAllocationPropertiesFromHandle(h driver.MemHandle) (driver.AllocationProp, error) {
	p, err := c.API.MemGetAllocationPropertiesFromHandle(h)
	if err == nil {
		c.t.setHandleLocation(h, p.Location)
	}
	return p, err
}

func (c *countingAPI) MemAddressReserve(size, alignment uint64, hint driver.DevicePtr, flags uint64) (driver.DevicePtr, error) {
	start := time.Now()
	p, err := c.API.MemAddressReserve(size, alignment, hint, flags)
	c.ops.add(OpReserve, size, start, err)
	if err == nil {
		c.t.reserve(p, size, c.ordinal)
	}
	return p, err
}

func (c *countingAPI) MemAddressFree(ptr driver.DevicePtr, size uint64) error {
	start := time.Now()
	err := c.API.MemAddressFree(ptr, size)
	c.ops.add(OpFreeAddress, 0, start, err)
	if err == nil {
		c.t.freeAddress(ptr, size)
	}
	return err
}

func (c *countingAPI) MemMap(ptr driver.DevicePtr, size, offset uint64, h driver.MemHandle, flags uint64) error {
	start := time.Now()
	err := c.API.MemMap(ptr, size, offset, h, flags)
	c.ops.add(OpMap, size, start, err)
	if err == nil {
		c.t.mapRange(ptr, size, h, c.ordinal)
	}
	return err
}

func (c *countingAPI) MemUnmap(ptr driver.DevicePtr, size uint64) error {
	start := time.Now()
	err := c.API.MemUnmap(ptr, size)
	c.ops.add(OpUnmap, 0, start, err)
	if err == nil {
		c.t.unmap(ptr, size)
	}
	return err
}

func (c *countingAPI) MemSetAccess(ptr driver.DevicePtr, size uint64, desc []driver.AccessDesc) error {
	start := time.Now()
	err := c.API.MemSetAccess(ptr, size, desc)
	c.ops.add(OpSetAccess, size, start, err)
	if err == nil {
		c.t.setAccess(ptr, size, desc)
	}
	return err
}

func (c *countingAPI) MemExportToShareableHandle(h driver.MemHandle, typ driver.HandleType, flags uint64) (int, error) {
	start := time.Now()
	fd, err := c.API.MemExportToShareableHandle(h, typ, flags)
	c.ops.add(OpExport, 0, start, err)
	return fd, err
}

func (c *countingAPI) MemExportToFabricHandle(h driver.MemHandle, flags uint64) (driver.FabricHandle, error) {
	start := time.Now()
	fh, err := c.API.MemExportToFabricHandle(h, flags)
	c.ops.add(OpExport, 0, start, err)
	return fh, err
}

func (c *countingAPI) MemGetHandleForAddressRange(ptr driver.DevicePtr, size uint64, typ driver.RangeHandleType, flags uint64) (int, error) {
	start := time.Now()
	fd, err := c.API.MemGetHandleForAddressRange(ptr, size, typ, flags)
	c.ops.add(OpExport, 0, start, err)
	return fd, err
}

func (c *countingAPI) MemImportFromShareableHandle(fd int, typ driver.HandleType) (driver.MemHandle, error) {
	start := time.Now()
	h, err := c.API.MemImportFromShareableHandle(fd, typ)
	c.ops.add(OpImport, 0, start, err)
	if err == nil {
		c.t.addHandle(h, handleInfo{imported: true, ordinal: c.ordinal})
	}
	return h, err
}

func (c *countingAPI) MemHostRegister(p unsafe.Pointer, size uint64, flags uint32) error {
	start := time.Now()
	err := c.API.MemHostRegister(p, size, flags)
	c.ops.add(OpHostRegister, size, start, err)
	if err == nil {
		sizedAdd(c.t, func() map[uintptr]sized { return c.t.registered }, uintptr(p), size, c.ordinal)
	}
	return err
}

func (c *countingAPI) MemHostUnregister(p unsafe.Pointer) error {
	start := time.Now()
	err := c.API.MemHostUnregister(p)
	c.ops.add(OpHostUnregister, 0, start, err)
	if err == nil {
		sizedDel(c.t, func() map[uintptr]sized { return c.t.registered }, uintptr(p))
	}
	return err
}

func (c *countingAPI) MemHostAlloc(size uint64, flags uint32) (unsafe.Pointer, error) {
	start := time.Now()
	p, err := c.API.MemHostAlloc(size, flags)
	c.ops.add(OpHostAlloc, size, start, err)
	if err == nil {
		sizedAdd(c.t, func() map[uintptr]sized { return c.t.hostAllocs }, uintptr(p), size, c.ordinal)
	}
	return p, err
}

func (c *countingAPI) MemFreeHost(p unsafe.Pointer) error {
	start := time.Now()
	err := c.API.MemFreeHost(p)
	c.ops.add(OpFreeHost, 0, start, err)
	if err == nil {
		sizedDel(c.t, func() map[uintptr]sized { return c.t.hostAllocs }, uintptr(p))
	}
	return err
}

func (c *countingAPI) MemAlloc(size uint64) (driver.DevicePtr, error) {
	start := time.Now()
	p, err := c.API.MemAlloc(size)
	c.ops.add(OpAlloc, size, start, err)
	if err == nil {
		sizedAdd(c.t, func() map[driver.DevicePtr]sized { return c.t.plain }, p, size, c.ordinal)
	}
	return p, err
}

func (c *countingAPI) MemFree(ptr driver.DevicePtr) error {
	start := time.Now()
	err := c.API.MemFree(ptr)
	c.ops.add(OpFree, 0, start, err)
	if err == nil {
		sizedDel(c.t, func() map[driver.DevicePtr]sized { return c.t.plain }, ptr)
	}
	return err
}
