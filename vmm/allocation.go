package vmm

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"

	"github.com/cuvmm/cuvmm/driver"
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

// Allocation is physical memory made by cuMemCreate (or imported from a shareable handle). It is
// reachable by the GPU only once mapped into a Reservation and granted access.
type Allocation struct {
	dev      *Device
	handle   driver.MemHandle
	size     uint64
	prop     driver.AllocationProp
	imported bool

	mappings atomic.Int64 // live Mappings of this allocation
	mu       sync.Mutex
	closed   bool
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
	var h driver.MemHandle
	err = d.do(func(api driver.API) error {
		var err error
		h, err = api.MemCreate(rounded, &p, 0)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("vmm: device %d: create %s at %s (handle types %s): %w", d.ordinal, units.FormatSize(rounded), p.Location, p.RequestedHandleTypes, err)
	}
	return d.newAllocation(h, rounded, p, false), nil
}

func (d *Device) newAllocation(h driver.MemHandle, size uint64, p driver.AllocationProp, imported bool) *Allocation {
	d.children.Add(1)
	return &Allocation{dev: d, handle: h, size: size, prop: p, imported: imported}
}

// Device is the device the allocation was made or imported through.
func (a *Allocation) Device() *Device { return a.dev }

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
func (a *Allocation) Handle() driver.MemHandle { return a.handle }

func (a *Allocation) String() string {
	return fmt.Sprintf("allocation of %s at %s", units.FormatSize(a.size), a.prop.Location)
}

func (a *Allocation) check(op string) error {
	if a == nil {
		return fmt.Errorf("vmm: %s: nil allocation: %w", op, ErrInvalidValue)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
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
	err := a.dev.do(func(api driver.API) error {
		var err error
		fd, err = api.MemExportToShareableHandle(a.handle, typ, 0)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("vmm: export %s as %s: %w", a, typ, err)
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
	err := a.dev.do(func(api driver.API) error {
		var err error
		fh, err = api.MemExportToFabricHandle(a.handle, 0)
		return err
	})
	if err != nil {
		return fh, fmt.Errorf("vmm: export %s as fabric: %w", a, err)
	}
	return fh, nil
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
	var h driver.MemHandle
	var prop driver.AllocationProp
	err := d.do(func(api driver.API) error {
		var err error
		if h, err = api.MemImportFromShareableHandle(int(f.Fd()), typ); err != nil {
			return err
		}
		if prop, err = api.MemGetAllocationPropertiesFromHandle(h); err != nil {
			if rerr := api.MemRelease(h); rerr != nil {
				return errors.Join(err, fmt.Errorf("release after failed property query: %w", rerr))
			}
			return fmt.Errorf("cuMemGetAllocationPropertiesFromHandle: %w", err)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("vmm: import %s (%s, %s): %w", f.Name(), typ, units.FormatSize(size), err)
	}
	g, err := d.Granularity(prop.Location, driver.GranularityMinimum)
	if err == nil && size%g != 0 {
		err = fmt.Errorf("vmm: import %s: size %d is not a multiple of the granularity %s: %w", f.Name(), size, units.FormatSize(g), ErrInvalidValue)
	}
	if err != nil {
		_ = d.do(func(api driver.API) error { return api.MemRelease(h) })
		return nil, err
	}
	return d.newAllocation(h, size, prop, true), nil
}

// Close releases the allocation (cuMemRelease). It fails with ErrInUse while the allocation is
// mapped: close the mappings first. Close is idempotent and safe on nil.
func (a *Allocation) Close() error {
	if a == nil {
		return nil
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return nil
	}
	if n := a.mappings.Load(); n > 0 {
		return fmt.Errorf("vmm: close %s: %d mappings still use it: %w", a, n, ErrInUse)
	}
	if err := a.checkHeld("close"); err != nil {
		return err
	}
	err := a.dev.do(func(api driver.API) error { return api.MemRelease(a.handle) })
	if err != nil {
		return fmt.Errorf("vmm: release %s: %w", a, err)
	}
	a.closed = true
	a.dev.children.Add(-1)
	return nil
}
