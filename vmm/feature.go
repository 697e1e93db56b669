package vmm

import (
	"errors"
	"fmt"

	"github.com/cuvmm/cuvmm/driver"
)

// Feature is an optional capability that a device and its driver may lack. Device.Check tells
// whether a device has one.
type Feature int

// The features this library checks before using them.
const (
	// FeatureVMM: the cuMem* virtual memory management calls (attribute 102, CUDA 10.2).
	FeatureVMM Feature = iota + 1
	// FeaturePosixFDHandles: allocations exportable as file descriptors (attribute 103, CUDA 10.2).
	FeaturePosixFDHandles
	// FeatureHostNUMA: host-NUMA VMM allocations (attribute 141, allocation from CUDA 12.2, the
	// attribute from 12.9) and a host NUMA node for the device (attribute 134).
	FeatureHostNUMA
	// FeatureReadOnlyHostRegister: cuMemHostRegister with CU_MEMHOSTREGISTER_READ_ONLY (attribute
	// 113, CUDA 11.1).
	FeatureReadOnlyHostRegister
	// FeatureDMABuf: dma-buf export of address ranges (attribute 124, CUDA 11.7).
	FeatureDMABuf
)

type featureInfo struct {
	name       string
	attr       driver.DeviceAttribute
	minVersion int
}

var features = map[Feature]featureInfo{
	FeatureVMM:                  {"virtual memory management", driver.AttrVirtualMemoryManagementSupported, 10020},
	FeaturePosixFDHandles:       {"posix-fd shareable handles", driver.AttrHandleTypePosixFDSupported, 10020},
	FeatureHostNUMA:             {"host-NUMA VMM allocations", driver.AttrHostNUMAVirtualMemoryManagementSupported, 12020},
	FeatureReadOnlyHostRegister: {"read-only host registration", driver.AttrReadOnlyHostRegisterSupported, 11010},
	FeatureDMABuf:               {"dma-buf export", driver.AttrDMABufSupported, 11070},
}

func (f Feature) String() string {
	if i, ok := features[f]; ok {
		return i.name
	}
	return fmt.Sprintf("feature(%d)", int(f))
}

// UnsupportedError says a device or its driver lacks a feature. It matches driver.ErrNotSupported
// with errors.Is.
type UnsupportedError struct {
	Feature    Feature
	Device     int    // the device's ordinal
	MinVersion int    // the driver version that introduced the feature, for example 12020 for 12.2
	Reason     string // what the driver reported
}

func (e *UnsupportedError) Error() string {
	return fmt.Sprintf("vmm: device %d: %s not supported (needs CUDA %d.%d or later): %s", e.Device, e.Feature,
		e.MinVersion/1000, e.MinVersion%1000/10, e.Reason)
}

// Is makes errors.Is(err, driver.ErrNotSupported) true.
func (e *UnsupportedError) Is(target error) bool { return target == driver.ErrNotSupported }

// Check reports whether the device has feature f: nil when it has, an *UnsupportedError (matching
// driver.ErrNotSupported) when the driver is older than the feature or the device reports it
// missing, and any other error when the answer could not be had (a failed or unknown attribute
// query is an error, never "unsupported"). The answer is cached per device.
func (d *Device) Check(f Feature) error {
	info, ok := features[f]
	if !ok {
		return fmt.Errorf("vmm: device %d: check %s: unknown feature: %w", d.ordinal, f, ErrInvalidValue)
	}
	d.featMu.Lock()
	err, cached := d.feats[f]
	d.featMu.Unlock()
	if cached {
		return err
	}
	err = d.check(f, info)
	var unsupported *UnsupportedError
	if err == nil || errors.As(err, &unsupported) {
		d.featMu.Lock()
		d.feats[f] = err
		d.featMu.Unlock()
	}
	return err
}

func (d *Device) check(f Feature, info featureInfo) error {
	unsupported := func(reason string) error {
		return &UnsupportedError{Feature: f, Device: d.ordinal, MinVersion: info.minVersion, Reason: reason}
	}
	if v := d.sys.version; v < info.minVersion {
		return unsupported(fmt.Sprintf("the driver is version %d", v))
	}
	v, err := d.Attribute(info.attr)
	if err != nil {
		return fmt.Errorf("vmm: device %d: check %s: %w", d.ordinal, f, err)
	}
	if v == 0 {
		return unsupported(fmt.Sprintf("attribute %d is 0", info.attr))
	}
	if f == FeatureHostNUMA {
		node, err := d.Attribute(driver.AttrHostNUMAID)
		if err != nil {
			return fmt.Errorf("vmm: device %d: check %s: %w", d.ordinal, f, err)
		}
		if node < 0 {
			return unsupported(fmt.Sprintf("the device has no host NUMA node (attribute %d is %d)", driver.AttrHostNUMAID, node))
		}
	}
	return nil
}
