// Trampolines: one small C function per driver entry point. Each takes the function pointer resolved
// with dlsym and calls it with the exact C prototype from docs/driver-facts.md, section 1, so that cgo
// never links against libcuda and a missing symbol can never abort the process.
//
// Conventions that keep the Go side to one cgo call and no allocation per driver call:
//   - opaque handles (CUcontext, CUstream, CUevent, CUmodule, CUfunction) cross as uintptr_t, so Go
//     never turns an integer into an unsafe.Pointer;
//   - out-parameters point at Go locals; the functions are declared #cgo noescape/nocallback in
//     cuda.go because none of them keeps a pointer past its return;
//   - any buffer the driver needs beyond the call's duration is C memory made here.
#ifndef CUVMM_CUDA_CALLS_H
#define CUVMM_CUDA_CALLS_H

#include "cuda_abi.h"

#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

#define CUVMM_ERROR_OUT_OF_MEMORY 2

// ---- loader ----

// cuvmm_dlopen opens path and, on failure, copies dlerror's text into err in the same call: dlerror
// is per thread, and the goroutine could move to another thread between two cgo calls.
static inline void *cuvmm_dlopen(const char *path, char *err, size_t errlen) {
	void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (h == NULL && errlen > 0) {
		const char *e = dlerror();
		if (e == NULL) e = "dlopen failed";
		strncpy(err, e, errlen - 1);
		err[errlen - 1] = 0;
	}
	return h;
}

static inline void *cuvmm_dlsym(void *h, const char *name) { return dlsym(h, name); }

// ---- error text ----

// cuvmm_error_text fills name and desc with the driver's static strings for code; 0 when either
// call fails (an unknown code).
static inline int cuvmm_error_text(void *name_fn, void *desc_fn, int code, const char **name, const char **desc) {
	*name = NULL;
	*desc = NULL;
	if (((CUresult_(*)(int, const char **))name_fn)(code, name) != 0 || *name == NULL) return 0;
	if (((CUresult_(*)(int, const char **))desc_fn)(code, desc) != 0 || *desc == NULL) return 0;
	return 1;
}

// ---- init, devices, contexts ----

static inline int cuvmm_Init(void *fn, unsigned int flags) {
	return ((CUresult_(*)(unsigned int))fn)(flags);
}

static inline int cuvmm_DriverGetVersion(void *fn, int *version) {
	return ((CUresult_(*)(int *))fn)(version);
}

static inline int cuvmm_DeviceGet(void *fn, int *dev, int ordinal) {
	return ((CUresult_(*)(CUdevice_ *, int))fn)(dev, ordinal);
}

static inline int cuvmm_DeviceGetCount(void *fn, int *count) {
	return ((CUresult_(*)(int *))fn)(count);
}

static inline int cuvmm_DeviceGetName(void *fn, char *name, int len, int dev) {
	return ((CUresult_(*)(char *, int, CUdevice_))fn)(name, len, dev);
}

static inline int cuvmm_DeviceGetAttribute(void *fn, int *value, int attr, int dev) {
	return ((CUresult_(*)(int *, int, CUdevice_))fn)(value, attr, dev);
}

static inline int cuvmm_DeviceTotalMem(void *fn, size_t *bytes, int dev) {
	return ((CUresult_(*)(size_t *, CUdevice_))fn)(bytes, dev);
}

static inline int cuvmm_DeviceCanAccessPeer(void *fn, int *can, int dev, int peer) {
	return ((CUresult_(*)(int *, CUdevice_, CUdevice_))fn)(can, dev, peer);
}

static inline int cuvmm_DeviceGetUuid(void *fn, unsigned char *uuid, int dev) {
	CUuuid_ u;
	int rc = ((CUresult_(*)(CUuuid_ *, CUdevice_))fn)(&u, dev);
	if (rc == 0) memcpy(uuid, u.bytes, sizeof u.bytes);
	return rc;
}

static inline int cuvmm_DevicePrimaryCtxRetain(void *fn, uintptr_t *ctx, int dev) {
	void *c = NULL;
	int rc = ((CUresult_(*)(void **, CUdevice_))fn)(&c, dev);
	*ctx = (uintptr_t)c;
	return rc;
}

static inline int cuvmm_DevicePrimaryCtxRelease(void *fn, int dev) {
	return ((CUresult_(*)(CUdevice_))fn)(dev);
}

static inline int cuvmm_CtxSetCurrent(void *fn, uintptr_t ctx) {
	return ((CUresult_(*)(void *))fn)((void *)ctx);
}

static inline int cuvmm_CtxGetCurrent(void *fn, uintptr_t *ctx) {
	void *c = NULL;
	int rc = ((CUresult_(*)(void **))fn)(&c);
	*ctx = (uintptr_t)c;
	return rc;
}

static inline int cuvmm_CtxSynchronize(void *fn) {
	return ((CUresult_(*)(void))fn)();
}

static inline int cuvmm_MemGetInfo(void *fn, size_t *free_bytes, size_t *total_bytes) {
	return ((CUresult_(*)(size_t *, size_t *))fn)(free_bytes, total_bytes);
}

// ---- virtual memory management ----

static inline int cuvmm_MemCreate(void *fn, unsigned long long *handle, size_t size, const CUmemAllocationProp_ *prop,
                                  unsigned long long flags) {
	return ((CUresult_(*)(CUmemGenericAllocationHandle_ *, size_t, const CUmemAllocationProp_ *, unsigned long long))fn)(
	    handle, size, prop, flags);
}

static inline int cuvmm_MemRelease(void *fn, unsigned long long handle) {
	return ((CUresult_(*)(CUmemGenericAllocationHandle_))fn)(handle);
}

static inline int cuvmm_MemGetAllocationGranularity(void *fn, size_t *granularity, const CUmemAllocationProp_ *prop,
                                                    int option) {
	return ((CUresult_(*)(size_t *, const CUmemAllocationProp_ *, int))fn)(granularity, prop, option);
}

static inline int cuvmm_MemGetAllocationPropertiesFromHandle(void *fn, CUmemAllocationProp_ *prop,
                                                             unsigned long long handle) {
	return ((CUresult_(*)(CUmemAllocationProp_ *, CUmemGenericAllocationHandle_))fn)(prop, handle);
}

// The address is a device address passed as void*: cross as an integer, cast here.
static inline int cuvmm_MemRetainAllocationHandle(void *fn, unsigned long long *handle, unsigned long long addr) {
	return ((CUresult_(*)(CUmemGenericAllocationHandle_ *, void *))fn)(handle, (void *)(uintptr_t)addr);
}

static inline int cuvmm_MemAddressReserve(void *fn, unsigned long long *ptr, size_t size, size_t alignment,
                                          unsigned long long hint, unsigned long long flags) {
	return ((CUresult_(*)(CUdeviceptr_ *, size_t, size_t, CUdeviceptr_, unsigned long long))fn)(ptr, size, alignment,
	                                                                                            hint, flags);
}

static inline int cuvmm_MemAddressFree(void *fn, unsigned long long ptr, size_t size) {
	return ((CUresult_(*)(CUdeviceptr_, size_t))fn)(ptr, size);
}

static inline int cuvmm_MemMap(void *fn, unsigned long long ptr, size_t size, size_t offset, unsigned long long handle,
                               unsigned long long flags) {
	return ((CUresult_(*)(CUdeviceptr_, size_t, size_t, CUmemGenericAllocationHandle_, unsigned long long))fn)(
	    ptr, size, offset, handle, flags);
}

static inline int cuvmm_MemUnmap(void *fn, unsigned long long ptr, size_t size) {
	return ((CUresult_(*)(CUdeviceptr_, size_t))fn)(ptr, size);
}

// desc points straight at the caller's []driver.AccessDesc, whose Go layout equals CUmemAccessDesc
// (checked at compile time in cuda.go): no copy for any number of descriptors.
static inline int cuvmm_MemSetAccess(void *fn, unsigned long long ptr, size_t size, const CUmemAccessDesc_ *desc,
                                     size_t count) {
	return ((CUresult_(*)(CUdeviceptr_, size_t, const CUmemAccessDesc_ *, size_t))fn)(ptr, size, desc, count);
}

static inline int cuvmm_MemGetAccess(void *fn, unsigned long long *flags, int loc_type, int loc_id,
                                     unsigned long long ptr) {
	CUmemLocation_ loc = {loc_type, loc_id};
	return ((CUresult_(*)(unsigned long long *, const CUmemLocation_ *, CUdeviceptr_))fn)(flags, &loc, ptr);
}

// The export writes an int for POSIX_FILE_DESCRIPTOR, a pointer-sized HANDLE for the Win32 kinds and
// 64 bytes for FABRIC: give the driver room for the largest and return the int at its start.
static inline int cuvmm_MemExportToFD(void *fn, int *fd, unsigned long long handle, int type,
                                      unsigned long long flags) {
	union {
		int fd;
		void *win32;
		CUmemFabricHandle_ fabric;
	} out;
	memset(&out, 0xff, sizeof out); // an untouched result reads as fd -1
	int rc = ((CUresult_(*)(void *, CUmemGenericAllocationHandle_, int, unsigned long long))fn)(&out, handle, type,
	                                                                                            flags);
	*fd = out.fd;
	return rc;
}

static inline int cuvmm_MemExportToFabric(void *fn, unsigned char *fabric, unsigned long long handle,
                                          unsigned long long flags) {
	CUmemFabricHandle_ out;
	memset(&out, 0, sizeof out);
	int rc = ((CUresult_(*)(void *, CUmemGenericAllocationHandle_, int, unsigned long long))fn)(&out, handle,
	                                                                                            8 /* FABRIC */, flags);
	memcpy(fabric, out.data, sizeof out.data);
	return rc;
}

// A POSIX file descriptor is passed by value in the pointer argument, not by address.
static inline int cuvmm_MemImportFromFD(void *fn, unsigned long long *handle, int fd, int type) {
	return ((CUresult_(*)(CUmemGenericAllocationHandle_ *, void *, int))fn)(handle, (void *)(intptr_t)fd, type);
}

static inline int cuvmm_MemGetHandleForAddressRange(void *fn, int *fd, unsigned long long ptr, size_t size, int type,
                                                    unsigned long long flags) {
	union {
		int fd;
		unsigned long long pad[2];
	} out;
	memset(&out, 0xff, sizeof out);
	int rc = ((CUresult_(*)(void *, CUdeviceptr_, size_t, int, unsigned long long))fn)(&out, ptr, size, type, flags);
	*fd = out.fd;
	return rc;
}

// ---- host memory ----

static inline int cuvmm_MemHostRegister(void *fn, void *p, size_t size, unsigned int flags) {
	return ((CUresult_(*)(void *, size_t, unsigned int))fn)(p, size, flags);
}

static inline int cuvmm_MemHostUnregister(void *fn, void *p) {
	return ((CUresult_(*)(void *))fn)(p);
}

static inline int cuvmm_MemHostGetDevicePointer(void *fn, unsigned long long *dptr, void *p, unsigned int flags) {
	return ((CUresult_(*)(CUdeviceptr_ *, void *, unsigned int))fn)(dptr, p, flags);
}

static inline int cuvmm_MemHostAlloc(void *fn, void **p, size_t size, unsigned int flags) {
	return ((CUresult_(*)(void **, size_t, unsigned int))fn)(p, size, flags);
}

static inline int cuvmm_MemFreeHost(void *fn, void *p) {
	return ((CUresult_(*)(void *))fn)(p);
}

static inline int cuvmm_MemAlloc(void *fn, unsigned long long *dptr, size_t size) {
	return ((CUresult_(*)(CUdeviceptr_ *, size_t))fn)(dptr, size);
}

static inline int cuvmm_MemFree(void *fn, unsigned long long dptr) {
	return ((CUresult_(*)(CUdeviceptr_))fn)(dptr);
}

// ---- copies and fills ----

static inline int cuvmm_Memcpy(void *fn, unsigned long long dst, unsigned long long src, size_t n) {
	return ((CUresult_(*)(CUdeviceptr_, CUdeviceptr_, size_t))fn)(dst, src, n);
}

static inline int cuvmm_MemcpyHtoD(void *fn, unsigned long long dst, const void *src, size_t n) {
	return ((CUresult_(*)(CUdeviceptr_, const void *, size_t))fn)(dst, src, n);
}

static inline int cuvmm_MemcpyDtoH(void *fn, void *dst, unsigned long long src, size_t n) {
	return ((CUresult_(*)(void *, CUdeviceptr_, size_t))fn)(dst, src, n);
}

static inline int cuvmm_MemcpyDtoD(void *fn, unsigned long long dst, unsigned long long src, size_t n) {
	return ((CUresult_(*)(CUdeviceptr_, CUdeviceptr_, size_t))fn)(dst, src, n);
}

static inline int cuvmm_MemcpyAsync(void *fn, unsigned long long dst, unsigned long long src, size_t n, uintptr_t s) {
	return ((CUresult_(*)(CUdeviceptr_, CUdeviceptr_, size_t, void *))fn)(dst, src, n, (void *)s);
}

static inline int cuvmm_MemcpyHtoDAsync(void *fn, unsigned long long dst, const void *src, size_t n, uintptr_t s) {
	return ((CUresult_(*)(CUdeviceptr_, const void *, size_t, void *))fn)(dst, src, n, (void *)s);
}

static inline int cuvmm_MemcpyDtoHAsync(void *fn, void *dst, unsigned long long src, size_t n, uintptr_t s) {
	return ((CUresult_(*)(void *, CUdeviceptr_, size_t, void *))fn)(dst, src, n, (void *)s);
}

static inline int cuvmm_MemcpyPeerAsync(void *fn, unsigned long long dst, uintptr_t dst_ctx, unsigned long long src,
                                        uintptr_t src_ctx, size_t n, uintptr_t s) {
	return ((CUresult_(*)(CUdeviceptr_, void *, CUdeviceptr_, void *, size_t, void *))fn)(
	    dst, (void *)dst_ctx, src, (void *)src_ctx, n, (void *)s);
}

static inline int cuvmm_MemsetD8(void *fn, unsigned long long dst, unsigned char value, size_t n) {
	return ((CUresult_(*)(CUdeviceptr_, unsigned char, size_t))fn)(dst, value, n);
}

static inline int cuvmm_MemsetD32(void *fn, unsigned long long dst, unsigned int value, size_t n) {
	return ((CUresult_(*)(CUdeviceptr_, unsigned int, size_t))fn)(dst, value, n);
}

static inline int cuvmm_MemsetD8Async(void *fn, unsigned long long dst, unsigned char value, size_t n, uintptr_t s) {
	return ((CUresult_(*)(CUdeviceptr_, unsigned char, size_t, void *))fn)(dst, value, n, (void *)s);
}

// ---- streams and events ----

static inline int cuvmm_StreamCreate(void *fn, uintptr_t *s, unsigned int flags) {
	void *h = NULL;
	int rc = ((CUresult_(*)(void **, unsigned int))fn)(&h, flags);
	*s = (uintptr_t)h;
	return rc;
}

// cuvmm_handle_call serves every call that takes one opaque handle: StreamDestroy,
// StreamSynchronize, EventSynchronize, EventDestroy, ModuleUnload.
static inline int cuvmm_handle_call(void *fn, uintptr_t h) {
	return ((CUresult_(*)(void *))fn)((void *)h);
}

static inline int cuvmm_EventCreate(void *fn, uintptr_t *e, unsigned int flags) {
	void *h = NULL;
	int rc = ((CUresult_(*)(void **, unsigned int))fn)(&h, flags);
	*e = (uintptr_t)h;
	return rc;
}

static inline int cuvmm_EventRecord(void *fn, uintptr_t e, uintptr_t s) {
	return ((CUresult_(*)(void *, void *))fn)((void *)e, (void *)s);
}

static inline int cuvmm_EventElapsedTime(void *fn, float *ms, uintptr_t start, uintptr_t end) {
	return ((CUresult_(*)(float *, void *, void *))fn)(ms, (void *)start, (void *)end);
}

// ---- stream-ordered allocation and event queries ----

static inline int cuvmm_StreamWaitEvent(void *fn, uintptr_t s, uintptr_t e, unsigned int flags) {
	return ((CUresult_(*)(void *, void *, unsigned int))fn)((void *)s, (void *)e, flags);
}

static inline int cuvmm_MemAllocAsync(void *fn, unsigned long long *dptr, size_t size, uintptr_t s) {
	return ((CUresult_(*)(CUdeviceptr_ *, size_t, void *))fn)(dptr, size, (void *)s);
}

static inline int cuvmm_MemFreeAsync(void *fn, unsigned long long dptr, uintptr_t s) {
	return ((CUresult_(*)(CUdeviceptr_, void *))fn)(dptr, (void *)s);
}

static inline int cuvmm_DeviceGetDefaultMemPool(void *fn, uintptr_t *pool, int dev) {
	void *p = NULL;
	int rc = ((CUresult_(*)(void **, CUdevice_))fn)(&p, dev);
	*pool = (uintptr_t)p;
	return rc;
}

// The REUSE_* attributes (1 to 3) are ints; the others (RELEASE_THRESHOLD and the memory counters)
// are cuuint64_t. The value always crosses as a 64-bit integer.
static inline int cuvmm_MemPoolSetAttribute(void *fn, uintptr_t pool, int attr, unsigned long long value) {
	if (attr >= 1 && attr <= 3) {
		int v = value != 0; // a boolean: any non-zero value is true, never wrapped to 0
		return ((CUresult_(*)(void *, int, void *))fn)((void *)pool, attr, &v);
	}
	unsigned long long v = value;
	return ((CUresult_(*)(void *, int, void *))fn)((void *)pool, attr, &v);
}

static inline int cuvmm_MemPoolGetAttribute(void *fn, uintptr_t pool, int attr, unsigned long long *value) {
	if (attr >= 1 && attr <= 3) {
		int v = 0;
		int rc = ((CUresult_(*)(void *, int, void *))fn)((void *)pool, attr, &v);
		*value = (unsigned long long)(unsigned int)v;
		return rc;
	}
	unsigned long long v = 0;
	int rc = ((CUresult_(*)(void *, int, void *))fn)((void *)pool, attr, &v);
	*value = v;
	return rc;
}

static inline int cuvmm_MemPoolTrimTo(void *fn, uintptr_t pool, size_t keep) {
	return ((CUresult_(*)(void *, size_t))fn)((void *)pool, keep);
}

// ---- modules and kernels ----

// The driver reads the image as a NUL-terminated string when it is PTX: copy it into C memory with
// the terminator rather than require one in the caller's slice.
static inline int cuvmm_ModuleLoadData(void *fn, uintptr_t *mod, const void *image, size_t len) {
	char *copy = (char *)malloc(len + 1);
	if (copy == NULL) return CUVMM_ERROR_OUT_OF_MEMORY;
	if (len > 0) memcpy(copy, image, len);
	copy[len] = 0;
	void *m = NULL;
	int rc = ((CUresult_(*)(void **, const void *))fn)(&m, copy);
	free(copy);
	*mod = (uintptr_t)m;
	return rc;
}

static inline int cuvmm_ModuleGetFunction(void *fn, uintptr_t *fun, uintptr_t mod, const char *name, size_t len) {
	char small[256];
	char *cname = small;
	if (len >= sizeof small) {
		cname = (char *)malloc(len + 1);
		if (cname == NULL) return CUVMM_ERROR_OUT_OF_MEMORY;
	}
	if (len > 0) memcpy(cname, name, len);
	cname[len] = 0;
	void *f = NULL;
	int rc = ((CUresult_(*)(void **, void *, const char *))fn)(&f, (void *)mod, cname);
	if (cname != small) free(cname);
	*fun = (uintptr_t)f;
	return rc;
}

#define CUVMM_INLINE_KERNEL_PARAMS 32

// Every kernel parameter is one 8-byte value: args is the caller's []uint64 and params[i] points at
// args[i]. cuLaunchKernel copies the values before it returns, so neither array outlives the call.
static inline int cuvmm_LaunchKernel(void *fn, uintptr_t f, unsigned int gx, unsigned int gy, unsigned int gz,
                                     unsigned int bx, unsigned int by, unsigned int bz, unsigned int shared_mem,
                                     uintptr_t s, unsigned long long *args, size_t nargs) {
	void *small[CUVMM_INLINE_KERNEL_PARAMS];
	void **params = NULL;
	if (nargs > 0) {
		params = small;
		if (nargs > CUVMM_INLINE_KERNEL_PARAMS) {
			params = (void **)malloc(nargs * sizeof(void *));
			if (params == NULL) return CUVMM_ERROR_OUT_OF_MEMORY;
		}
		for (size_t i = 0; i < nargs; i++) params[i] = &args[i];
	}
	int rc = ((CUresult_(*)(void *, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int,
	                        unsigned int, void *, void **, void **))fn)((void *)f, gx, gy, gz, bx, by, bz, shared_mem,
	                                                                   (void *)s, params, NULL);
	if (params != NULL && params != small) free(params);
	return rc;
}

// ---- graphs ----

static inline int cuvmm_StreamBeginCapture(void *fn, uintptr_t s, int mode) {
	return ((CUresult_(*)(void *, int))fn)((void *)s, mode);
}

static inline int cuvmm_StreamEndCapture(void *fn, uintptr_t s, uintptr_t *graph) {
	void *g = NULL;
	int rc = ((CUresult_(*)(void *, void **))fn)((void *)s, &g);
	*graph = (uintptr_t)g;
	return rc;
}

static inline int cuvmm_GraphInstantiate(void *fn, uintptr_t *exec, uintptr_t graph, unsigned long long flags) {
	void *e = NULL;
	int rc = ((CUresult_(*)(void **, void *, unsigned long long))fn)(&e, (void *)graph, flags);
	*exec = (uintptr_t)e;
	return rc;
}

static inline int cuvmm_GraphLaunch(void *fn, uintptr_t exec, uintptr_t s) {
	return ((CUresult_(*)(void *, void *))fn)((void *)exec, (void *)s);
}

#endif
