package vmm

import (
	"errors"
	"fmt"
	"runtime"
	"unsafe"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/lifetime"
	"github.com/cuvmm/cuvmm/internal/units"
)

// PlainBuffer is device memory from the legacy allocator (cuMemAlloc): not growable, not shareable
// by FD. The project uses it as the baseline that the VMM-based types are measured against.
type PlainBuffer struct {
	owner
	ptr  driver.DevicePtr
	size uint64
}

// AllocPlain allocates size bytes with cuMemAlloc.
func (d *Device) AllocPlain(size uint64) (*PlainBuffer, error) {
	if d == nil {
		return nil, fmt.Errorf("vmm: cuMemAlloc on a nil device: %w", ErrInvalidValue)
	}
	if size == 0 {
		return nil, fmt.Errorf("vmm: device %d: cuMemAlloc: size 0: %w", d.ordinal, ErrInvalidValue)
	}
	b := &PlainBuffer{owner: owner{dev: d}, size: size}
	if err := d.create(&b.own, "plain buffer", func(api driver.API) error {
		var err error
		b.ptr, err = api.MemAlloc(size)
		return err
	}); err != nil {
		return nil, fmt.Errorf("vmm: device %d: cuMemAlloc %s: %w", d.ordinal, units.FormatSize(size), err)
	}
	lifetime.Track(b, &b.own)
	return b, nil
}

// Ptr is the buffer's device address.
func (b *PlainBuffer) Ptr() driver.DevicePtr { return b.ptr }

// Size is the buffer's size.
func (b *PlainBuffer) Size() uint64 { return b.size }

// Close frees the buffer (cuMemFree). Idempotent, nil-safe.
func (b *PlainBuffer) Close() error {
	if b == nil {
		return nil
	}
	return b.close("cuMemAlloc buffer of "+units.FormatSize(b.size)+" (cuMemFree)", func(api driver.API) error { return api.MemFree(b.ptr) })
}

// HostBuffer is pinned host memory from cuMemHostAlloc, visible to every device.
type HostBuffer struct {
	owner
	p    unsafe.Pointer
	size uint64
}

// HostAlloc allocates size bytes of pinned host memory (cuMemHostAlloc with flags, for example
// driver.HostAllocPortable|driver.HostAllocDeviceMap).
func (d *Device) HostAlloc(size uint64, flags uint32) (*HostBuffer, error) {
	if size == 0 {
		return nil, fmt.Errorf("vmm: cuMemHostAlloc: size 0: %w", ErrInvalidValue)
	}
	b := &HostBuffer{owner: owner{dev: d}, size: size}
	if err := d.create(&b.own, "host buffer", func(api driver.API) error {
		var err error
		b.p, err = api.MemHostAlloc(size, flags)
		return err
	}); err != nil {
		return nil, fmt.Errorf("vmm: cuMemHostAlloc %s: %w", units.FormatSize(size), err)
	}
	lifetime.Track(b, &b.own)
	return b, nil
}

// Bytes is the buffer as a byte slice; it must not be used after Close.
func (b *HostBuffer) Bytes() []byte { return unsafe.Slice((*byte)(b.p), b.size) }

// Pointer is the buffer's host address.
func (b *HostBuffer) Pointer() unsafe.Pointer { return b.p }

// Ptr is the buffer's unified address (equal to the host address on devices that can use host
// pointers for registered memory).
func (b *HostBuffer) Ptr() driver.DevicePtr { return driver.DevicePtr(uintptr(b.p)) }

// Size is the buffer's size.
func (b *HostBuffer) Size() uint64 { return b.size }

// Close frees the buffer (cuMemFreeHost). Idempotent, nil-safe.
func (b *HostBuffer) Close() error {
	if b == nil {
		return nil
	}
	return b.close("cuMemHostAlloc buffer of "+units.FormatSize(b.size)+" (cuMemFreeHost)", func(api driver.API) error { return api.MemFreeHost(b.p) })
}

// HostRegistration is caller-owned host memory page-locked and made visible to the devices
// (cuMemHostRegister). The memory must outlive the registration.
type HostRegistration struct {
	owner
	p    unsafe.Pointer
	size uint64
	dptr driver.DevicePtr
}

// HostRegister registers mem (page-aligned start and length) with flags (driver.HostRegister*). The
// device pointer is looked up with cuMemHostGetDevicePointer.
func (d *Device) HostRegister(mem []byte, flags uint32) (*HostRegistration, error) {
	if len(mem) == 0 {
		return nil, fmt.Errorf("vmm: host register: empty range: %w", ErrInvalidValue)
	}
	p := unsafe.Pointer(&mem[0])
	const page = 4096
	if uintptr(p)%page != 0 || len(mem)%page != 0 {
		return nil, fmt.Errorf("vmm: host register %#x+%d: start and length must be multiples of the 4 KiB page: %w", uintptr(p), len(mem), ErrInvalidValue)
	}
	size := uint64(len(mem))
	r := &HostRegistration{owner: owner{dev: d}, p: p, size: size}
	unregFailed := false
	err := d.do(func(api driver.API) error {
		if err := api.MemHostRegister(p, size, flags); err != nil {
			return fmt.Errorf("cuMemHostRegister: %w", err)
		}
		var err error
		if r.dptr, err = api.MemHostGetDevicePointer(p, 0); err != nil {
			err = fmt.Errorf("cuMemHostGetDevicePointer: %w", err)
			if uerr := api.MemHostUnregister(p); uerr != nil {
				// Still registered: the registration is kept (by the System) so that it can be undone.
				unregFailed = true
				r.own.Init(&d.own, "host registration")
				err = errors.Join(err, fmt.Errorf("undo cuMemHostUnregister: %w", uerr))
			}
			return err
		}
		r.own.Init(&d.own, "host registration")
		return nil
	})
	runtime.KeepAlive(mem)
	if err != nil {
		if unregFailed {
			err = errors.Join(err, d.sys.adopt(r.what(), &r.own, r.Close))
		}
		return nil, fmt.Errorf("vmm: host register %s at %#x: %w", units.FormatSize(size), uintptr(p), err)
	}
	lifetime.Track(r, &r.own)
	return r, nil
}

// Ptr is the registration's device address.
func (r *HostRegistration) Ptr() driver.DevicePtr { return r.dptr }

// Size is the registered length.
func (r *HostRegistration) Size() uint64 { return r.size }

func (r *HostRegistration) what() string {
	return fmt.Sprintf("host registration of %s at %#x", units.FormatSize(r.size), uintptr(r.p))
}

// Close unregisters the memory (cuMemHostUnregister). Idempotent, nil-safe.
func (r *HostRegistration) Close() error {
	if r == nil {
		return nil
	}
	return r.close(r.what()+" (cuMemHostUnregister)", func(api driver.API) error { return api.MemHostUnregister(r.p) })
}

// HostUnregister unregisters host memory that other code registered (cuMemHostUnregister): for
// example a C library sharing the process. mem must start where a registration starts. Memory
// registered through HostRegister is unregistered by closing its HostRegistration instead.
func (d *Device) HostUnregister(mem []byte) error {
	if len(mem) == 0 {
		return fmt.Errorf("vmm: host unregister: empty range: %w", ErrInvalidValue)
	}
	p := unsafe.Pointer(&mem[0])
	err := d.do(func(api driver.API) error { return api.MemHostUnregister(p) })
	runtime.KeepAlive(mem)
	if err != nil {
		return fmt.Errorf("vmm: device %d: cuMemHostUnregister %#x: %w", d.ordinal, uintptr(p), err)
	}
	return nil
}
