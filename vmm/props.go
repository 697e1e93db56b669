package vmm

import (
	"fmt"

	"github.com/cuvmm/cuvmm/driver"
)

// AccessAt reads the access description of the mapping of a at ptr: for every device of the system
// and, for host memory (host-NUMA or host), the host, the flags cuMemGetAccess reports, keeping the locations that
// have any access. Together with Properties and Size it is what it takes to recreate the mapping
// exactly (RecreateAt). Devices that were never opened are asked too (cuMemGetAccess needs no
// context of theirs), so a grant made outside this package is not lost.
func (a *Allocation) AccessAt(ptr driver.DevicePtr) ([]Access, error) {
	if err := a.check("get access"); err != nil {
		return nil, err
	}
	locs := make([]driver.Location, 0, a.dev.sys.count+1)
	for i := 0; i < a.dev.sys.count; i++ {
		locs = append(locs, driver.DeviceLocation(driver.Device(i)))
	}
	if t := a.prop.Location.Type; t == driver.LocationHostNUMA || t == driver.LocationHost {
		locs = append(locs, driver.HostLocation())
	}
	var out []Access
	err := a.dev.do(func(api driver.API) error {
		for _, loc := range locs {
			f, err := api.MemGetAccess(loc, ptr)
			if err != nil {
				return fmt.Errorf("cuMemGetAccess(%s): %w", loc, err)
			}
			if f != driver.AccessNone {
				out = append(out, Access{Location: loc, Flags: f})
			}
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("vmm: access of %s at %#x: %w", a, uint64(ptr), err)
	}
	return out, nil
}

// QueryProperties asks the driver for the allocation's properties
// (cuMemGetAllocationPropertiesFromHandle): what was granted, which Properties (what was asked for)
// may not show for an imported allocation.
func (a *Allocation) QueryProperties() (driver.AllocationProp, error) {
	var p driver.AllocationProp
	if err := a.check("query properties"); err != nil {
		return p, err
	}
	a.own.Lock()
	defer a.own.Unlock()
	if a.sleep.asleep {
		return a.prop, nil
	}
	err := a.dev.do(func(api driver.API) error {
		var err error
		p, err = api.MemGetAllocationPropertiesFromHandle(a.handle)
		return err
	})
	if err != nil {
		return p, fmt.Errorf("vmm: properties of %s: %w", a, err)
	}
	return p, nil
}
