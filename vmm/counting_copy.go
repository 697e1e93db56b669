package vmm

import (
	"time"
	"unsafe"

	"github.com/cuvmm/cuvmm/driver"
)

// The copies, memsets, streams and events of countingAPI.

func (c *countingAPI) copied(n uint64, start time.Time, err error) error {
	c.ops.add(OpCopy, n, start, err)
	return err
}

func (c *countingAPI) Memcpy(dst, src driver.DevicePtr, n uint64) error {
	start := time.Now()
	return c.copied(n, start, c.API.Memcpy(dst, src, n))
}

func (c *countingAPI) MemcpyHtoD(dst driver.DevicePtr, src unsafe.Pointer, n uint64) error {
	start := time.Now()
	return c.copied(n, start, c.API.MemcpyHtoD(dst, src, n))
}

func (c *countingAPI) MemcpyDtoH(dst unsafe.Pointer, src driver.DevicePtr, n uint64) error {
	start := time.Now()
	return c.copied(n, start, c.API.MemcpyDtoH(dst, src, n))
}

func (c *countingAPI) MemcpyDtoD(dst, src driver.DevicePtr, n uint64) error {
	start := time.Now()
	return c.copied(n, start, c.API.MemcpyDtoD(dst, src, n))
}

func (c *countingAPI) MemcpyAsync(dst, src driver.DevicePtr, n uint64, s driver.Stream) error {
	start := time.Now()
	return c.copied(n, start, c.API.MemcpyAsync(dst, src, n, s))
}

func (c *countingAPI) MemcpyHtoDAsync(dst driver.DevicePtr, src unsafe.Pointer, n uint64, s driver.Stream) error {
	start := time.Now()
	return c.copied(n, start, c.API.MemcpyHtoDAsync(dst, src, n, s))
}

func (c *countingAPI) MemcpyDtoHAsync(dst unsafe.Pointer, src driver.DevicePtr, n uint64, s driver.Stream) error {
	start := time.Now()
	return c.copied(n, start, c.API.MemcpyDtoHAsync(dst, src, n, s))
}

func (c *countingAPI) MemcpyPeerAsync(dst driver.DevicePtr, dstCtx driver.Context, src driver.DevicePtr, srcCtx driver.Context, n uint64, s driver.Stream) error {
	start := time.Now()
	return c.copied(n, start, c.API.MemcpyPeerAsync(dst, dstCtx, src, srcCtx, n, s))
}

func (c *countingAPI) MemsetD8(ptr driver.DevicePtr, value uint8, n uint64) error {
	start := time.Now()
	err := c.API.MemsetD8(ptr, value, n)
	c.ops.add(OpMemset, n, start, err)
	return err
}

func (c *countingAPI) MemsetD32(ptr driver.DevicePtr, value uint32, n uint64) error {
	start := time.Now()
	err := c.API.MemsetD32(ptr, value, n)
	c.ops.add(OpMemset, 4*n, start, err)
	return err
}

func (c *countingAPI) MemsetD8Async(ptr driver.DevicePtr, value uint8, n uint64, s driver.Stream) error {
	start := time.Now()
	err := c.API.MemsetD8Async(ptr, value, n, s)
	c.ops.add(OpMemset, n, start, err)
	return err
}

func (c *countingAPI) StreamCreate(flags uint32) (driver.Stream, error) {
	s, err := c.API.StreamCreate(flags)
	if err == nil {
		c.t.addStream(s, c.ordinal)
	}
	return s, err
}

func (c *countingAPI) StreamDestroy(s driver.Stream) error {
	err := c.API.StreamDestroy(s)
	if err == nil {
		c.t.delStream(s)
	}
	return err
}

func (c *countingAPI) EventCreate(flags uint32) (driver.Event, error) {
	e, err := c.API.EventCreate(flags)
	if err == nil {
		c.t.addEvent(e, c.ordinal)
	}
	return e, err
}

func (c *countingAPI) EventDestroy(e driver.Event) error {
	err := c.API.EventDestroy(e)
	if err == nil {
		c.t.delEvent(e)
	}
	return err
}
