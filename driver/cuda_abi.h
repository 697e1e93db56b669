// C declarations of the CUDA driver types cuvmm passes across the ABI, written from docs/driver-facts.md
// section 1 so that no CUDA toolkit is needed to build. Names end in "_" so that they can never clash
// with <cuda.h>. abi_test.go compares every size and offset here with the real header where one is
// installed.
#ifndef CUVMM_CUDA_ABI_H
#define CUVMM_CUDA_ABI_H

#include <stddef.h>
#include <stdint.h>

typedef int CUresult_;                                  // every enum and CUresult: a 4-byte int
typedef int CUdevice_;                                  // the ordinal
typedef unsigned long long CUdeviceptr_;                // a unified virtual address
typedef unsigned long long CUmemGenericAllocationHandle_;

// CUmemLocation: 8 bytes.
typedef struct {
	int type; // CUmemLocationType
	int id;
} CUmemLocation_;

// The anonymous allocFlags struct inside CUmemAllocationProp: 8 bytes at offset 24.
typedef struct {
	unsigned char compressionType;
	unsigned char gpuDirectRDMACapable;
	unsigned short usage;
	unsigned char reserved[4];
} CUmemAllocFlags_;

// CUmemAllocationProp: 32 bytes, 8-byte aligned.
typedef struct {
	int type;                 // CUmemAllocationType, PINNED = 1
	int requestedHandleTypes; // CUmemAllocationHandleType bitmask
	CUmemLocation_ location;
	void *win32HandleMetaData; // always NULL on Linux
	CUmemAllocFlags_ allocFlags;
} CUmemAllocationProp_;

// CUmemAccessDesc: 12 bytes.
typedef struct {
	CUmemLocation_ location;
	int flags; // CUmemAccess_flags
} CUmemAccessDesc_;

// CUmemFabricHandle: 64 opaque bytes.
typedef struct {
	unsigned char data[64];
} CUmemFabricHandle_;

// CUuuid: 16 bytes.
typedef struct {
	char bytes[16];
} CUuuid_;

// The layout is the ABI: refuse to build if the compiler lays these out differently.
_Static_assert(sizeof(CUmemLocation_) == 8, "CUmemLocation is 8 bytes");
_Static_assert(sizeof(CUmemAllocFlags_) == 8, "allocFlags is 8 bytes");
_Static_assert(sizeof(CUmemAllocationProp_) == 32, "CUmemAllocationProp is 32 bytes");
_Static_assert(_Alignof(CUmemAllocationProp_) == 8, "CUmemAllocationProp is 8-byte aligned");
_Static_assert(offsetof(CUmemAllocationProp_, requestedHandleTypes) == 4, "requestedHandleTypes at 4");
_Static_assert(offsetof(CUmemAllocationProp_, location) == 8, "location at 8");
_Static_assert(offsetof(CUmemAllocationProp_, win32HandleMetaData) == 16, "win32HandleMetaData at 16");
_Static_assert(offsetof(CUmemAllocationProp_, allocFlags) == 24, "allocFlags at 24");
_Static_assert(offsetof(CUmemAllocFlags_, gpuDirectRDMACapable) == 1, "gpuDirectRDMACapable at 25");
_Static_assert(offsetof(CUmemAllocFlags_, usage) == 2, "usage at 26");
_Static_assert(offsetof(CUmemAllocFlags_, reserved) == 4, "reserved at 28");
_Static_assert(sizeof(CUmemAccessDesc_) == 12, "CUmemAccessDesc is 12 bytes");
_Static_assert(offsetof(CUmemAccessDesc_, flags) == 8, "CUmemAccessDesc.flags at 8");
_Static_assert(sizeof(CUmemFabricHandle_) == 64, "CUmemFabricHandle is 64 bytes");
_Static_assert(sizeof(CUuuid_) == 16, "CUuuid is 16 bytes");
_Static_assert(sizeof(void *) == 8, "cuvmm supports 64-bit targets only");

#endif
