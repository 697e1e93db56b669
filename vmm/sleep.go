package vmm

import (
	"errors"
	"fmt"

	"github.com/cuvmm/cuvmm/driver"
)

// Putting an allocation to sleep: its physical memory is released while the Allocation value, the
// Mapping values that refer to it and the reservation stay, so that the buffer that owns them
// (growbuf.Buffer, stripe.Range, a reservation's mappings) keeps working once the memory is
// recreated at the same address. Package offload builds sleep and wake of whole buffers on it.

// ErrAsleep is returned for an operation that needs the physical memory of an allocation released
// to sleep: ReleaseAt again, Export, ExportFabric, or mapping it.
var ErrAsleep = errors.New("vmm: allocation asleep")

// ErrExported is returned by ReleaseAt for an allocation that was exported as a shareable handle:
// other processes may hold it, so releasing it here would not free the memory.
var ErrExported = errors.New("vmm: allocation exported to other processes")

// sleepState is an Allocation's sleep and export state, guarded by its owner's lock.
type sleepState struct {
	asleep   bool
	exported bool
	onClose  func() // run (under the owner's lock) when the allocation is closed while asleep
}

// closeAsleep is Close's free step for an allocation asleep: it releases the memory that a failed
// ReleaseAt kept, if any, and the owner of the sleep hears of it. The caller holds the owner's lock.
// It reports whether a was asleep, and why the kept memory could not be released (then a stays
// asleep with it, for a later Close).
func (a *Allocation) closeAsleep() (bool, error) {
	if !a.sleep.asleep {
		return false, nil
	}
	if h := a.handle; h != 0 {
		if err := a.dev.do(func(api driver.API) error { return api.MemRelease(h) }); err != nil {
			return true, fmt.Errorf("vmm: release %s, kept by a failed release to sleep: %w", a, err)
		}
		a.handle = 0
	}
	if f := a.sleep.onClose; f != nil {
		a.sleep.onClose = nil
		f()
	}
	return true, nil
}

// Asleep reports whether the allocation's physical memory is released (ReleaseAt) and not yet
// recreated (RecreateAt).
func (a *Allocation) Asleep() bool {
	a.own.Lock()
	defer a.own.Unlock()
	return a.sleep.asleep
}

// Exported reports whether the allocation was ever exported as a shareable handle (Export,
// ExportFabric, and so ipc.Export).
func (a *Allocation) Exported() bool {
	a.own.Lock()
	defer a.own.Unlock()
	return a.sleep.exported
}

// ReleaseAt puts the allocation to sleep: it unmaps it from ptr, where it must be mapped once and
// whole, and releases its physical memory (cuMemUnmap, cuMemRelease). The Allocation and its
// mappings stay valid values; their memory is gone until RecreateAt. Either both calls happen or
// neither: when the release fails, the memory is mapped again at ptr with access. When that fails
// too, the allocation is asleep with its memory kept, unmapped (the error says so): RecreateAt maps
// that memory, content and all, and Close releases it. (Only if granting access and then unmapping
// both fail does it stay mapped, awake without that access.) ptr must be the
// address of the allocation's one Mapping (ErrInvalidValue otherwise). Imported allocations are
// refused (their exporter owns the memory), exported ones (ErrExported) unless force is set, and
// held ones (Hold), and while its mapping is being unmapped, with ErrInUse. onClose, when not nil, runs if the allocation is closed while asleep (with the
// allocation locked: it must not call into this package). The caller must not use the memory, or Handle, until RecreateAt.
func (a *Allocation) ReleaseAt(ptr driver.DevicePtr, access []Access, force bool, onClose func()) error {
	if err := a.check("release to sleep"); err != nil {
		return err
	}
	a.own.Lock()
	defer a.own.Unlock()
	// First: from here no mapping of a starts an unmap, and none is half done, so the mapping
	// checked below is still there when the memory goes.
	end, err := a.beginRemap("release to sleep")
	if err != nil {
		return err
	}
	defer end()
	switch {
	case a.sleep.asleep:
		return fmt.Errorf("vmm: release %s at %#x: already released: %w", a, uint64(ptr), ErrAsleep)
	case a.imported:
		return fmt.Errorf("vmm: release %s at %#x: it is imported, its exporter owns the memory: %w", a, uint64(ptr), ErrInvalidValue)
	case a.sleep.exported && !force:
		return fmt.Errorf("vmm: release %s at %#x: %w", a, uint64(ptr), ErrExported)
	case !a.mappings.onlyAt(ptr):
		return fmt.Errorf("vmm: release %s at %#x: it must have one mapping, at that address (it has %d mappings): %w", a, uint64(ptr), a.mappings.count(), ErrInvalidValue)
	}
	if err := a.checkHeld("release to sleep"); err != nil {
		return err
	}
	mapped := true // where the memory is when the call fails
	err = a.dev.do(func(api driver.API) error {
		if err := api.MemUnmap(ptr, a.size); err != nil {
			return fmt.Errorf("cuMemUnmap: %w", err)
		}
		if err := api.MemRelease(a.handle); err != nil {
			err = fmt.Errorf("cuMemRelease: %w", err)
			stillMapped, rerr := mapGrant(api, ptr, a.size, a.handle, access)
			if mapped = rerr == nil || stillMapped; rerr != nil {
				rerr = fmt.Errorf("undo cuMemUnmap: %w", rerr)
			}
			return errors.Join(err, rerr)
		}
		return nil
	})
	switch {
	case err == nil:
		a.handle = 0
	case mapped:
		return fmt.Errorf("vmm: release %s at %#x: %w", a, uint64(ptr), err)
	default:
		// Neither released nor mapped again: the memory, with its content, stays with the
		// allocation, which is asleep; RecreateAt maps it again, and Close releases it.
		err = fmt.Errorf("vmm: release %s at %#x: unmapped but not released, so it is asleep with its memory kept: %w", a, uint64(ptr), err)
	}
	a.sleep.asleep = true
	a.sleep.onClose = onClose
	return err
}

// RecreateAt wakes an allocation released with ReleaseAt: it creates physical memory with the same
// properties and size (cuMemCreate), maps it at ptr and grants access (cuMemMap, cuMemSetAccess).
// Either all happen or none: on failure the allocation stays asleep and the error wraps the
// driver's (driver.ErrOutOfMemory when someone else took the memory), so the call can be retried.
// The new memory's content is undefined; memory that a failed ReleaseAt kept is mapped again instead,
// with its content. ptr must be where the allocation's Mapping still is: once
// that Mapping is closed, or for an awake allocation, RecreateAt fails with ErrInvalidValue; while
// that Mapping is being closed or unmapped, with ErrInUse (retry: it then fails as closed or works). In the
// one case where the undo fails too (granting access fails, then unmapping fails), the memory stays
// mapped: the error says so, the allocation is awake without that access, and ReleaseAt releases
// it.
func (a *Allocation) RecreateAt(ptr driver.DevicePtr, access []Access) error {
	if err := a.check("recreate"); err != nil {
		return err
	}
	a.own.Lock()
	defer a.own.Unlock()
	if !a.sleep.asleep {
		return fmt.Errorf("vmm: recreate %s at %#x: it is awake: %w", a, uint64(ptr), ErrInvalidValue)
	}
	// Before the check below: a mapping closed meanwhile is either wholly gone or not begun.
	end, err := a.beginRemap("recreate")
	if err != nil {
		return err
	}
	defer end()
	if !a.mappings.onlyAt(ptr) {
		// Its mapping was closed while asleep (or ptr is not where it was): memory mapped now would
		// belong to no Mapping, and its reservation could never be freed.
		return fmt.Errorf("vmm: recreate %s at %#x: no mapping of it is left at that address: %w", a, uint64(ptr), ErrInvalidValue)
	}
	h, stillMapped := a.handle, false // memory that a failed ReleaseAt kept
	err = a.dev.do(func(api driver.API) error {
		var err error
		if h != 0 {
			stillMapped, err = mapGrant(api, ptr, a.size, h, access)
			return err
		}
		h, stillMapped, err = createMapped(api, ptr, a.size, &a.prop, access)
		return err
	})
	if err != nil && !stillMapped {
		// Asleep as before; memory whose release failed is kept, unmapped, for the next RecreateAt
		// to map and for Close to release, as after a ReleaseAt whose undo failed.
		a.handle = h
		return fmt.Errorf("vmm: recreate %s at %#x: %w", a, uint64(ptr), err)
	}
	if err != nil {
		// Granting access failed and so did the unmap: the new memory stays mapped at ptr, so the
		// allocation is awake (without that access); ReleaseAt puts it back to sleep.
		err = fmt.Errorf("vmm: recreate %s at %#x: mapped, but without the access asked: %w", a, uint64(ptr), err)
	}
	a.handle = h
	a.sleep.asleep = false
	a.sleep.onClose = nil
	return err
}

// createMapped creates memory of size bytes with prop, maps it at ptr and grants access: all or
// nothing, except when an undo fails too. When granting access and then unmapping both fail, the
// memory stays mapped (stillMapped) and is not released, since releasing memory still mapped would
// leave the range unusable; when mapping fails and so does the release, the memory is kept,
// unmapped. h is the memory still held after a failure (0 when none is).
func createMapped(api driver.API, ptr driver.DevicePtr, size uint64, prop *driver.AllocationProp, access []Access) (h driver.MemHandle, stillMapped bool, err error) {
	if h, err = api.MemCreate(size, prop, 0); err != nil {
		return 0, false, fmt.Errorf("cuMemCreate: %w", err)
	}
	if stillMapped, err = mapGrant(api, ptr, size, h, access); err != nil && !stillMapped {
		if rerr := api.MemRelease(h); rerr != nil {
			return h, false, errors.Join(err, fmt.Errorf("undo cuMemCreate: %w", rerr))
		}
		return 0, false, err
	}
	return h, stillMapped, err
}
