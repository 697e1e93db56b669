//go:build cgo && linux

package driver

// #include "cuda_abi.h"
import "C"

import "unsafe"

// cLayout reports the sizes and offsets of the C declarations in cuda_abi.h, keyed the way the ABI
// test prints the same quantities from the real <cuda.h> (the C expression, with the header's type
// names). Test files cannot use cgo, so this lives in the package.
func cLayout() map[string]int64 {
	var loc C.CUmemLocation_
	var prop C.CUmemAllocationProp_
	var acc C.CUmemAccessDesc_
	flags := unsafe.Offsetof(prop.allocFlags)
	return map[string]int64{
		"sizeof(CUmemLocation)":                                          int64(unsafe.Sizeof(loc)),
		"offsetof(CUmemLocation, type)":                                  int64(unsafe.Offsetof(loc._type)),
		"offsetof(CUmemLocation, id)":                                    int64(unsafe.Offsetof(loc.id)),
		"sizeof(CUmemAllocationProp)":                                    int64(unsafe.Sizeof(prop)),
		"_Alignof(CUmemAllocationProp)":                                  int64(unsafe.Alignof(prop)),
		"offsetof(CUmemAllocationProp, type)":                            int64(unsafe.Offsetof(prop._type)),
		"offsetof(CUmemAllocationProp, requestedHandleTypes)":            int64(unsafe.Offsetof(prop.requestedHandleTypes)),
		"offsetof(CUmemAllocationProp, location)":                        int64(unsafe.Offsetof(prop.location)),
		"offsetof(CUmemAllocationProp, location.id)":                     int64(unsafe.Offsetof(prop.location) + unsafe.Offsetof(prop.location.id)),
		"offsetof(CUmemAllocationProp, win32HandleMetaData)":             int64(unsafe.Offsetof(prop.win32HandleMetaData)),
		"offsetof(CUmemAllocationProp, allocFlags)":                      int64(flags),
		"sizeof(((CUmemAllocationProp *)0)->allocFlags)":                 int64(unsafe.Sizeof(prop.allocFlags)),
		"offsetof(CUmemAllocationProp, allocFlags.compressionType)":      int64(flags + unsafe.Offsetof(prop.allocFlags.compressionType)),
		"offsetof(CUmemAllocationProp, allocFlags.gpuDirectRDMACapable)": int64(flags + unsafe.Offsetof(prop.allocFlags.gpuDirectRDMACapable)),
		"offsetof(CUmemAllocationProp, allocFlags.usage)":                int64(flags + unsafe.Offsetof(prop.allocFlags.usage)),
		"offsetof(CUmemAllocationProp, allocFlags.reserved)":             int64(flags + unsafe.Offsetof(prop.allocFlags.reserved)),
		"sizeof(((CUmemAllocationProp *)0)->allocFlags.reserved)":        int64(unsafe.Sizeof(prop.allocFlags.reserved)),
		"sizeof(CUmemAccessDesc)":                                        int64(unsafe.Sizeof(acc)),
		"offsetof(CUmemAccessDesc, location)":                            int64(unsafe.Offsetof(acc.location)),
		"offsetof(CUmemAccessDesc, flags)":                               int64(unsafe.Offsetof(acc.flags)),
		"sizeof(CUmemFabricHandle)":                                      int64(C.sizeof_CUmemFabricHandle_),
		"sizeof(CUuuid)":                                                 int64(C.sizeof_CUuuid_),
		"sizeof(CUresult)":                                               int64(C.sizeof_CUresult_),
		"sizeof(CUdevice)":                                               int64(C.sizeof_CUdevice_),
		"sizeof(CUdeviceptr)":                                            int64(C.sizeof_CUdeviceptr_),
		"sizeof(CUmemGenericAllocationHandle)":                           int64(C.sizeof_CUmemGenericAllocationHandle_),
	}
}
