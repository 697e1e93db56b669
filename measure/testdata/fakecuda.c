/*
 * fakecuda.c: the driver calls that scripts/peers/file_wake.c and scripts/host/first_pin.c make,
 * over host memory, built as a libcuda.so.1 of its own so that the tests can run their whole
 * pipelines on a machine without a GPU. Device memory is malloc'd; every copy is a memcpy done at once, so streams and
 * events have nothing to wait for. FAKECUDA_FLIP_AT=N flips byte N of the first allocation in
 * every copy back to the host that covers it, for the test that the peer's check catches a
 * difference. Host registration remembers the ranges registered, so that registering one twice
 * or unregistering another fails as the driver would.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

#define FAKE_MAX_DEVICES 8

static char *first_alloc;

CUresult cuInit(unsigned flags) { return flags == 0 ? 0 : 1; }

CUresult cuDeviceGet(int *dev, int ordinal) {
	if (ordinal < 0 || ordinal >= FAKE_MAX_DEVICES)
		return 101; /* CUDA_ERROR_INVALID_DEVICE */
	*dev = ordinal;
	return 0;
}

CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) {
	*ctx = (void *)(uintptr_t)(dev + 1);
	return 0;
}

CUresult cuCtxSetCurrent(void *ctx) { return ctx ? 0 : 1; }

CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
	char *m = malloc(n);
	if (!m)
		return 2; /* CUDA_ERROR_OUT_OF_MEMORY */
	if (!first_alloc)
		first_alloc = m;
	*p = (CUdeviceptr)(uintptr_t)m;
	return 0;
}

CUresult cuMemHostAlloc(void **p, size_t n, unsigned flags) {
	(void)flags;
	*p = malloc(n);
	return *p ? 0 : 2;
}

CUresult cuStreamCreate(void **s, unsigned flags) {
	(void)flags;
	*s = malloc(1);
	return 0;
}

CUresult cuStreamSynchronize(void *s) { return s ? 0 : 1; }

CUresult cuEventCreate(void **e, unsigned flags) {
	(void)flags;
	*e = malloc(1);
	return 0;
}

CUresult cuEventRecord(void *e, void *s) { return e && s ? 0 : 1; }

CUresult cuEventSynchronize(void *e) { return e ? 0 : 1; }

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, void *s) {
	(void)s;
	memcpy((void *)(uintptr_t)dst, src, n);
	return 0;
}

CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
	memcpy(dst, (const void *)(uintptr_t)src, n);
	const char *at = getenv("FAKECUDA_FLIP_AT");
	if (at && first_alloc) {
		uintptr_t flip = (uintptr_t)first_alloc + strtoull(at, NULL, 10);
		if (flip >= src && flip - src < n)
			((char *)dst)[flip - src] ^= 1;
	}
	return 0;
}

CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, void *s) {
	(void)s;
	return cuMemcpyDtoH_v2(dst, src, n);
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
	memcpy((void *)(uintptr_t)dst, src, n);
	return 0;
}

CUresult cuMemsetD32_v2(CUdeviceptr dst, unsigned v, size_t n) {
	unsigned *p = (unsigned *)(uintptr_t)dst;
	for (size_t i = 0; i < n; i++)
		p[i] = v;
	return 0;
}

/* registered holds the ranges registered now, so that registering one twice or unregistering one
 * never registered fails as the driver would. */
#define FAKE_MAX_REGISTERED 8
static void *registered[FAKE_MAX_REGISTERED];

CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned flags) {
	(void)flags;
	if (!p || n == 0)
		return 1; /* CUDA_ERROR_INVALID_VALUE */
	int free_at = -1;
	for (int i = 0; i < FAKE_MAX_REGISTERED; i++) {
		if (registered[i] == p)
			return 712; /* CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED */
		if (!registered[i] && free_at < 0)
			free_at = i;
	}
	if (free_at < 0)
		return 2;
	registered[free_at] = p;
	return 0;
}

CUresult cuMemHostUnregister(void *p) {
	for (int i = 0; p && i < FAKE_MAX_REGISTERED; i++)
		if (registered[i] == p) {
			registered[i] = NULL;
			return 0;
		}
	return 713; /* CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED */
}
