package vmm

import (
	"errors"
	"fmt"
	"os"
	"runtime"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/internal/lifetime"
	"github.com/cuvmm/cuvmm/internal/units"
)

// AllocOptions describes a physical allocation. The zero value is device memory on the allocating
// device, not shareable, uncompressed.
type AllocOptions struct {
	// Location is where the memory lives: the zero value means the allocating device; otherwise a
	// device location or driver.HostNUMALocation(node) for pinned host memory (CUDA 12.2+).
	Location driver.Location
	// HandleTypes are the shareable handle types the allocation can later be exported as (for
	// example driver.HandleTypePosixFD). Export of a type not requested here fails.
	HandleTypes driver.HandleType
	// Compression requests generic compression (device memory only).
	Compression bool
	// GPUDirectRDMA marks the memory usable by third-party devices through GPUDirect RDMA.
	GPUDirectRDMA bool
}

// CheckHandleTypes refuses handle-type bits that the driver defines no type for, with an error
// naming them and wrapping ErrInvalidValue, so that a type that builds memory out of many
// allocations (growbuf, stripe) can refuse them before it reserves anything.
func CheckHandleTypes(t driver.HandleType) error {
	if bad := t &^ driver.HandleTypeKnown; bad != 0 {
		return fmt.Errorf("handle types %s: unknown bits %#x: %w", t, int32(bad), ErrInvalidValue)
	}
	return nil
}

// Allocation is physical memory made by cuMemCreate (or imported from a shareable handle). It is
// reachable by the GPU only once mapped into a Reservation and granted access.
type Allocation struct {
	dev      *Device
	handle   driver.MemHandle
	size     uint64
	prop     driver.AllocationProp
	imported bool

	mappings mappedAt // where its live Mappings are
	own      lifetime.Owner
	sleep    sleepState // released while asleep, exported (sleep.go); guarded by own's lock
	hold     holdCount  // holders outside vmm, such as NCCL registrations (hold.go)
}

func (o AllocOptions) prop(d *Device) driver.AllocationProp {
	loc := o.Location
	if loc.Type == driver.LocationInvalid {
		loc = d.Location()
	}
	p := driver.AllocationProp{Type: driver.AllocationTypePinned, RequestedHandleTypes: o.HandleTypes, Location: loc,
		GPUDirectRDMACapable: o.GPUDirectRDMA}
	if o.Compression {
		p.Compression = driver.CompressionGeneric
	}
	return p
}

// AllocationSize is the size Allocate would make for a request of size bytes with opts: size rounded
// up to the location's minimum granularity.
func (d *Device) AllocationSize(size uint64, opts AllocOptions) (uint64, error) {
	p := opts.prop(d)
	g, err := d.Granularity(p.Location, driver.GranularityMinimum)
	if err != nil {
		return 0, err
	}
	return roundUp("allocate", size, g)
}

// Allocate makes physical memory (cuMemCreate) of at least size bytes: the size is rounded up to the
// minimum granularity of the location (Size reports it).
func (d *Device) Allocate(size uint64, opts AllocOptions) (*Allocation, error) {
	if d == nil {
		return nil, fmt.Errorf("vmm: allocate on a nil device: %w", ErrInvalidValue)
	}
	p := opts.prop(d)
	rounded, err := d.AllocationSize(size, opts)
	if err != nil {
		return nil, err
	}
	var a *Allocation
	err = d.do(func(api driver.API) error {
		h, err := api.MemCreate(rounded, &p, 0)
		if err == nil {
			a = d.newAllocation(h, rounded, p, false)
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("vmm: device %d: create %s at %s (handle types %s): %w", d.ordinal, units.FormatSize(rounded), p.Location, p.RequestedHandleTypes, err)
	}
	return a, nil
}

// newAllocation makes the owner of handle h, counted as the device's child. It is called with the
// device's context bound (inside do), so that System.Close cannot miss it.
func (d *Device) newAllocation(h driver.MemHandle, size uint64, p driver.AllocationProp, imported bool) *Allocation {
	a := &Allocation{dev: d, handle: h, size: size, prop: p, imported: imported}
	a.own.Init(&d.own, "allocation")
	lifetime.Track(a, &a.own)
	return a
}

// Device is the device the allocation was made or imported through.
func (a *Allocation) Device() *Device { return a.dev }

// Closed reports whether the allocation was closed (by Close, or by closing the mapping that owns
// it). It takes the allocation's lock, so a callback that runs under that lock must not call it.
func (a *Allocation) Closed() bool { return a.own.IsClosed() }

// Size is the allocation's size in bytes (a multiple of the granularity).
func (a *Allocation) Size() uint64 { return a.size }

// Location is where the memory lives.
func (a *Allocation) Location() driver.Location { return a.prop.Location }

// HandleTypes are the shareable handle types requested at creation.
func (a *Allocation) HandleTypes() driver.HandleType { return a.prop.RequestedHandleTypes }

// Properties are the allocation's properties as created (or, for an import, as the driver reports).
func (a *Allocation) Properties() driver.AllocationProp { return a.prop }

// Imported reports whether the allocation came from a shareable handle.
func (a *Allocation) Imported() bool { return a.imported }

// Handle is the raw CUmemGenericAllocationHandle. Like os.File.Fd, it is valid only until Close;
// callers using it must keep a alive (runtime.KeepAlive) until they are done.
func (a *Allocation) Handle() driver.MemHandle {
	a.own.Lock()
	defer a.own.Unlock()
	return a.handle
}

// withHandle runs fn with the allocation's handle under its lock, so that the allocation is neither
// released to sleep nor closed meanwhile. A closed allocation is refused with ErrClosed, one asleep
// with ErrAsleep (its memory is gone until RecreateAt).
func (a *Allocation) withHandle(op string, fn func(driver.MemHandle) error) error {
	a.own.Lock()
	defer a.own.Unlock()
	if err := a.usable(op); err != nil {
		return err
	}
	return fn(a.handle)
}

// usable refuses, naming op, a closed allocation with ErrClosed and one asleep with ErrAsleep; the
// caller holds a's lock.
func (a *Allocation) usable(op string) error {
	switch {
	case a.own.Closed():
		return fmt.Errorf("vmm: %s: %s: %w", op, a, ErrClosed)
	case a.sleep.asleep:
		return fmt.Errorf("vmm: %s: %s is released to sleep: %w", op, a, ErrAsleep)
	}
	return nil
}

func (a *Allocation) String() string {
	return fmt.Sprintf("allocation of %s at %s", units.FormatSize(a.size), a.prop.Location)
}

func (a *Allocation) check(op string) error {
	if a == nil {
		return fmt.Errorf("vmm: %s: nil allocation: %w", op, ErrInvalidValue)
	}
	if a.own.IsClosed() {
		return fmt.Errorf("vmm: %s: %s: %w", op, a, ErrClosed)
	}
	return nil
}

// Export returns the allocation as a shareable handle of type typ: for driver.HandleTypePosixFD a
// file descriptor that another process imports (cuMemExportToShareableHandle). The allocation must
// have been created with typ in HandleTypes. The caller owns the returned file.
func (a *Allocation) Export(typ driver.HandleType) (*os.File, error) {
	if err := a.check("export"); err != nil {
		return nil, err
	}
	if typ != driver.HandleTypePosixFD {
		return nil, fmt.Errorf("vmm: export %s as %s: only posix-fd handles are files: %w", a, typ, driver.ErrNotSupported)
	}
	if a.prop.RequestedHandleTypes&typ == 0 {
		return nil, fmt.Errorf("vmm: export %s as %s: the allocation was created with handle types %s: %w", a, typ, a.prop.RequestedHandleTypes, ErrInvalidValue)
	}
	var fd int
	err := a.withHandle("export as "+typ.String(), func(h driver.MemHandle) error {
		if err := a.dev.do(func(api driver.API) error {
			var err error
			fd, err = api.MemExportToShareableHandle(h, typ, 0)
			return err
		}); err != nil {
			return fmt.Errorf("vmm: export %s as %s: %w", a, typ, err)
		}
		a.sleep.exported = true
		return nil
	})
	if err != nil {
		return nil, err
	}
	return os.NewFile(uintptr(fd), fmt.Sprintf("cuvmm-%s-%s", typ, units.FormatSize(a.size))), nil
}

// ExportFabric returns the allocation's FABRIC handle (multi-node NVLink). The allocation must have
// been created with driver.HandleTypeFabric.
func (a *Allocation) ExportFabric() (driver.FabricHandle, error) {
	var fh driver.FabricHandle
	if err := a.check("export fabric handle"); err != nil {
		return fh, err
	}
	if a.prop.RequestedHandleTypes&driver.HandleTypeFabric == 0 {
		return fh, fmt.Errorf("vmm: export %s as fabric: the allocation was created with handle types %s: %w", a, a.prop.RequestedHandleTypes, ErrInvalidValue)
	}
	err := a.withHandle("export as fabric", func(h driver.MemHandle) error {
		if err := a.dev.do(func(api driver.API) error {
			var err error
			fh, err = api.MemExportToFabricHandle(h, 0)
			return err
		}); err != nil {
			return fmt.Errorf("vmm: export %s as fabric: %w", a, err)
		}
		a.sleep.exported = true
		return nil
	})
	return fh, err
}

// Import makes an Allocation from a shareable handle file (cuMemImportFromShareableHandle) exported by
// this or another process. size is the exported allocation's size, which the handle does not carry
// (the sender sends it along). The caller keeps ownership of f; the returned Allocation stays valid
// after f is closed.
func (d *Device) Import(f *os.File, size uint64, typ driver.HandleType) (*Allocation, error) {
	if d == nil {
		return nil, fmt.Errorf("vmm: import on a nil device: %w", ErrInvalidValue)
	}
	if f == nil {
		return nil, fmt.Errorf("vmm: import: nil file: %w", ErrInvalidValue)
	}
	if typ != driver.HandleTypePosixFD {
		return nil, fmt.Errorf("vmm: import %s: only posix-fd handles are files: %w", typ, driver.ErrNotSupported)
	}
	if size == 0 {
		return nil, fmt.Errorf("vmm: import %s: size 0: %w", f.Name(), ErrInvalidValue)
	}
	var a *Allocation
	err := d.do(func(api driver.API) error {
		h, err := api.MemImportFromShareableHandle(int(f.Fd()), typ)
		if err != nil {
			return err
		}
		prop, err := api.MemGetAllocationPropertiesFromHandle(h)
		a = d.newAllocation(h, size, prop, true)
		if err != nil {
			return fmt.Errorf("cuMemGetAllocationPropertiesFromHandle: %w", err)
		}
		return nil
	})
	// f.Fd() is a raw descriptor: f must stay open (not finalized) until the driver has used it.
	runtime.KeepAlive(f)
	if err == nil {
		g, gerr := d.Granularity(a.prop.Location, driver.GranularityMinimum)
		if err = gerr; err == nil && size%g != 0 {
			err = fmt.Errorf("vmm: import %s: size %d is not a multiple of the granularity %s: %w", f.Name(), size, units.FormatSize(g), ErrInvalidValue)
		}
	}
	if err != nil {
		err = fmt.Errorf("vmm: import %s (%s, %s): %w", f.Name(), typ, units.FormatSize(size), err)
		if a != nil {
			err = errors.Join(err, a.undo())
		}
		return nil, err
	}
	return a, nil
}

// undo closes an allocation an operation made and is giving up; when that fails the System keeps it
// (to retry in its Close) and the error says so.
func (a *Allocation) undo() error {
	if err := a.release(); err != nil {
		return errors.Join(fmt.Errorf("undo: %w", err), a.dev.sys.adopt(a.String(), &a.own, a.Close))
	}
	return nil
}

// Close releases the allocation (cuMemRelease). It fails with ErrInUse while the allocation is
// mapped: close the mappings first. (A mapping of it that a failed undo left, or a range that holds
// one, kept by the System, is retried first: see RetryOrphansMapping.) Close is idempotent and safe on nil; when the release
// fails the allocation stays open and a later Close retries.
func (a *Allocation) Close() error {
	if a == nil {
		return nil
	}
	a.unblockRelease(0)
	return a.release()
}

// unblockRelease retries closing the orphaned mappings of a, and freeing the ranges the System
// keeps that still map it (RetryOrphansMapping), when a has more than mine mappings, so that its release is not refused for a mapping that no
// caller holds. What still fails stays the System's, listed in Orphans. The caller holds no lock of
// this package: freeing those ranges takes their reservations' locks.
func (a *Allocation) unblockRelease(mine int) {
	if a.mappings.count() > mine {
		_ = a.dev.sys.RetryOrphansMapping(a)
	}
}

// release is Close without unblockRelease, for callers holding a reservation's lock.
func (a *Allocation) release() error {
	return a.own.Close("vmm: close "+a.String(), func() error {
		if n := a.mappings.count(); n > 0 {
			return fmt.Errorf("vmm: close %s: %d mappings still use it: %w", a, n, ErrInUse)
		}
		if err := a.checkHeld("close"); err != nil {
			return err
		}
		if asleep, err := a.closeAsleep(); asleep {
			return err
		}
		if err := a.dev.do(func(api driver.API) error { return api.MemRelease(a.handle) }); err != nil {
			return fmt.Errorf("vmm: release %s: %w", a, err)
		}
		return nil
	})
}
