package ipc

import (
	"errors"
	"fmt"

	"github.com/cuvmm/cuvmm/driver"
	"github.com/cuvmm/cuvmm/vmm"
)

// fabricRefused reports whether a cuMemCreate error with FABRIC requested means "not here" (no IMEX
// channel: NOT_PERMITTED, measured on the H200 host; NOT_SUPPORTED or INVALID_VALUE for locations or
// drivers that do not take it) rather than a failure that asking for POSIX_FD alone would meet too.
func fabricRefused(err error) bool {
	return errors.Is(err, driver.ErrNotPermitted) || errors.Is(err, driver.ErrNotSupported) || errors.Is(err, driver.ErrInvalidValue)
}

// fabricCandidate reports whether the device says it supports FABRIC handles (attribute 128).
func fabricCandidate(dev *vmm.Device) bool {
	return dev.Supports(driver.AttrHandleTypeFabricSupported)
}

// HandleTypes is the handle types to request at creation for shareable memory at loc made through
// dev: FABRIC|POSIX_FD when the device reports fabric support (attribute 128) and the driver grants
// it, else POSIX_FD alone. The device attribute is not enough (the H200 host reports 1 but, without an
// IMEX channel, refuses FABRIC with NOT_PERMITTED), so it probes: it creates one granule with
// FABRIC|POSIX_FD and releases it. A refused probe leaves nothing behind. loc's zero value means the
// device's own memory.
func HandleTypes(dev *vmm.Device, loc driver.Location) (driver.HandleType, error) {
	if dev == nil {
		return 0, fmt.Errorf("ipc: handle types: nil device: %w", vmm.ErrInvalidValue)
	}
	if !fabricCandidate(dev) {
		return driver.HandleTypePosixFD, nil
	}
	opts := vmm.AllocOptions{Location: loc, HandleTypes: driver.HandleTypeFabric | driver.HandleTypePosixFD}
	a, err := dev.Allocate(1, opts)
	if err != nil {
		if fabricRefused(err) {
			return driver.HandleTypePosixFD, nil
		}
		return 0, fmt.Errorf("ipc: handle types: probe: %w", err)
	}
	if err := a.Close(); err != nil {
		return 0, fmt.Errorf("ipc: handle types: release the probe: %w", err)
	}
	return opts.HandleTypes, nil
}

// Allocate makes shareable physical memory of at least size bytes at loc through dev (the zero
// location means the device's own memory; driver.HostNUMALocation(dev.HostNUMAID()) is pinned host
// memory). When the device reports fabric support it asks for FABRIC|POSIX_FD and, when the driver
// refuses that, for POSIX_FD alone; Allocation.HandleTypes says which was granted. Either way the
// allocation can be exported as a file (Export).
func Allocate(dev *vmm.Device, size uint64, loc driver.Location) (*vmm.Allocation, error) {
	if dev == nil {
		return nil, fmt.Errorf("ipc: allocate: nil device: %w", vmm.ErrInvalidValue)
	}
	opts := vmm.AllocOptions{Location: loc, HandleTypes: driver.HandleTypePosixFD}
	if fabricCandidate(dev) {
		fopts := opts
		fopts.HandleTypes |= driver.HandleTypeFabric
		a, err := dev.Allocate(size, fopts)
		if err == nil {
			return a, nil
		}
		if !fabricRefused(err) {
			return nil, fmt.Errorf("ipc: allocate: %w", err)
		}
		a, err2 := dev.Allocate(size, opts)
		if err2 != nil {
			return nil, fmt.Errorf("ipc: allocate: %w (after fabric|posix-fd was refused: %v)", err2, err)
		}
		return a, nil
	}
	a, err := dev.Allocate(size, opts)
	if err != nil {
		return nil, fmt.Errorf("ipc: allocate: %w", err)
	}
	return a, nil
}
