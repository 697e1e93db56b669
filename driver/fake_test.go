//go:build cgo && linux

package driver

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"unsafe"

	"github.com/cuvmm/cuvmm/internal/kernels"
)

// fakeCUDA is a stand-in libcuda written in C and built with gcc when the tests run. It exports the
// same versioned symbols as the driver, with semantics chosen so that the Go side can check, without
// a GPU, what crosses the ABI: it encodes the fields of a CUmemAllocationProp into the handle it
// returns, keeps the last access descriptors, treats device addresses as host addresses (so copies,
// fills and the pattern kernels really run), and exports the plain legacy names (cuMemAlloc,
// cuMemGetInfo, cuMemcpyHtoD, ...) returning CUDA_ERROR_UNKNOWN, so a call that resolved a legacy
// name instead of the _v2 one fails. It exports cuEventElapsedTime but not cuEventElapsedTime_v2,
// to exercise the fallback. -DFAKE_STUB makes cuInit answer CUDA_ERROR_STUB_LIBRARY;
// -DFAKE_NO_DMABUF leaves out cuMemGetHandleForAddressRange.
const fakeCUDA = `
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef unsigned long long u64;
typedef struct { int type, id; } loc_t;
typedef struct { unsigned char comp, rdma; unsigned short usage; unsigned char reserved[4]; } aflags_t;
typedef struct { int type; int handles; loc_t loc; void *win32; aflags_t f; } prop_t;
typedef struct { loc_t loc; int flags; } acc_t;

_Static_assert(sizeof(prop_t) == 32, "prop");
_Static_assert(sizeof(acc_t) == 12, "acc");

#define LEGACY_TRAP(name) int name() { return 999; }
LEGACY_TRAP(cuDeviceTotalMem)
LEGACY_TRAP(cuMemGetInfo)
LEGACY_TRAP(cuMemAlloc)
LEGACY_TRAP(cuMemFree)
LEGACY_TRAP(cuMemHostRegister)
LEGACY_TRAP(cuMemHostGetDevicePointer)
LEGACY_TRAP(cuMemcpyHtoD)
LEGACY_TRAP(cuMemcpyDtoH)
LEGACY_TRAP(cuMemcpyDtoD)
LEGACY_TRAP(cuMemcpyHtoDAsync)
LEGACY_TRAP(cuMemcpyDtoHAsync)
LEGACY_TRAP(cuMemsetD8)
LEGACY_TRAP(cuMemsetD32)
LEGACY_TRAP(cuStreamDestroy)
LEGACY_TRAP(cuEventDestroy)
LEGACY_TRAP(cuDevicePrimaryCtxRelease)
LEGACY_TRAP(cuDeviceGetUuid)
LEGACY_TRAP(cuStreamBeginCapture)
LEGACY_TRAP(cuGraphInstantiate)

int cuInit(unsigned flags) {
#ifdef FAKE_STUB
	return 34;
#endif
	return flags == 0 ? 0 : 1;
}
int cuDriverGetVersion(int *v) { *v = 13000; return 0; }
int cuDeviceGetCount(int *n) { *n = 2; return 0; }
int cuDeviceGet(int *d, int ordinal) { if (ordinal < 0 || ordinal > 1) return 101; *d = ordinal; return 0; }
int cuDeviceGetName(char *name, int len, int dev) { snprintf(name, len, "Fake GPU %d", dev); return 0; }
int cuDeviceGetAttribute(int *v, int attr, int dev) { *v = attr * 10 + dev; return 0; }
int cuDeviceTotalMem_v2(size_t *b, int dev) { *b = (size_t)(dev + 1) << 34; return 0; }
int cuDeviceCanAccessPeer(int *can, int a, int b) { *can = a != b; return 0; }
int cuDeviceGetUuid_v2(unsigned char *u, int dev) { for (int i = 0; i < 16; i++) u[i] = (unsigned char)(i * 16 + dev); return 0; }
int cuDevicePrimaryCtxRetain(void **c, int dev) { *c = (void *)(uintptr_t)(0x1000 + dev); return 0; }
int cuDevicePrimaryCtxRelease_v2(int dev) { return dev == 0 || dev == 1 ? 0 : 101; }
static __thread void *current;
int cuCtxSetCurrent(void *c) { current = c; return 0; }
int cuCtxGetCurrent(void **c) { *c = current; return 0; }
int cuCtxSynchronize(void) { return current ? 0 : 201; }
int cuGetErrorName(int e, const char **s) {
	if (e == 1) { *s = "FAKE_ERROR_INVALID_VALUE"; return 0; }
	*s = NULL; return 1;
}
int cuGetErrorString(int e, const char **s) {
	if (e == 1) { *s = "fake invalid argument"; return 0; }
	*s = NULL; return 1;
}
int cuMemGetInfo_v2(size_t *f, size_t *t) { *f = (size_t)1 << 30; *t = (size_t)1 << 35; return 0; }

int cuMemCreate(u64 *h, size_t size, const prop_t *p, u64 flags) {
	if (p == NULL || flags != 0 || p->win32 != NULL || size % (2 << 20) != 0) return 1;
	for (int i = 0; i < 4; i++) if (p->f.reserved[i]) return 1;
	*h = (u64)(p->type & 0xff) | (u64)(p->handles & 0xff) << 8 | (u64)(p->loc.type & 0xff) << 16 |
	     (u64)(p->loc.id & 0xff) << 24 | (u64)p->f.comp << 32 | (u64)p->f.rdma << 40 | (u64)p->f.usage << 48;
	return 0;
}
int cuMemRelease(u64 h) { return h ? 0 : 400; }
int cuMemGetAllocationGranularity(size_t *g, const prop_t *p, int option) {
	if (p == NULL || p->type != 1) return 1;
	*g = option == 1 ? (4 << 20) : (2 << 20);
	return 0;
}
int cuMemGetAllocationPropertiesFromHandle(prop_t *p, u64 h) {
	memset(p, 0, sizeof *p);
	p->type = h & 0xff; p->handles = (h >> 8) & 0xff; p->loc.type = (h >> 16) & 0xff; p->loc.id = (h >> 24) & 0xff;
	p->f.comp = (h >> 32) & 0xff; p->f.rdma = (h >> 40) & 0xff; p->f.usage = (h >> 48) & 0xffff;
	return 0;
}
int cuMemRetainAllocationHandle(u64 *h, void *addr) { *h = (u64)(uintptr_t)addr ^ 0xabc; return 0; }
int cuMemAddressReserve(u64 *p, size_t size, size_t align, u64 hint, u64 flags) {
	if (flags) return 1;
	*p = hint ? hint : 0x7f0000000000ull + size + align;
	return 0;
}
int cuMemAddressFree(u64 p, size_t size) { return p && size ? 0 : 1; }
int cuMemMap(u64 p, size_t size, size_t off, u64 h, u64 flags) { if (off) return 801; return p && size && h && !flags ? 0 : 1; }
int cuMemUnmap(u64 p, size_t size) { return p && size ? 0 : 1; }
static acc_t accs[64];
static size_t naccs;
static u64 acc_ptr;
int cuMemSetAccess(u64 p, size_t size, const acc_t *d, size_t n) {
	if (n == 0 || n > 64 || !size) return 1;
	memcpy(accs, d, n * sizeof *d); naccs = n; acc_ptr = p;
	return 0;
}
int cuMemGetAccess(u64 *flags, const loc_t *loc, u64 p) {
	*flags = 0;
	if (p != acc_ptr) return 0;
	for (size_t i = 0; i < naccs; i++)
		if (accs[i].loc.type == loc->type && accs[i].loc.id == loc->id) *flags = (u64)accs[i].flags;
	return 0;
}
int cuMemExportToShareableHandle(void *out, u64 h, int type, u64 flags) {
	if (flags) return 1;
	if (type == 1) { *(int *)out = 1000 + (int)(h & 0xff); return 0; }
	if (type == 8) { for (int i = 0; i < 64; i++) ((unsigned char *)out)[i] = (unsigned char)(h + i); return 0; }
	return 1;
}
int cuMemImportFromShareableHandle(u64 *h, void *os, int type) {
	if (type != 1) return 1;
	*h = (u64)(intptr_t)os << 4;
	return 0;
}
#ifndef FAKE_NO_DMABUF
int cuMemGetHandleForAddressRange(void *out, u64 p, size_t size, int type, u64 flags) {
	if (type != 1 || flags || !p) return 1;
	*(int *)out = (int)(size >> 20);
	return 0;
}
#endif

static void *registered;
int cuMemHostRegister_v2(void *p, size_t size, unsigned flags) { if (!p || !size) return 1; registered = p; (void)flags; return 0; }
int cuMemHostUnregister(void *p) { if (p != registered) return 713; registered = NULL; return 0; }
int cuMemHostGetDevicePointer_v2(u64 *d, void *p, unsigned flags) { if (flags) return 1; *d = (u64)(uintptr_t)p; return 0; }
int cuMemHostAlloc(void **p, size_t size, unsigned flags) { (void)flags; *p = calloc(1, size); return *p ? 0 : 2; }
int cuMemFreeHost(void *p) { free(p); return 0; }
int cuMemAlloc_v2(u64 *d, size_t size) { void *p = calloc(1, size); *d = (u64)(uintptr_t)p; return p ? 0 : 2; }
int cuMemFree_v2(u64 d) { free((void *)(uintptr_t)d); return 0; }

#define DP(x) ((void *)(uintptr_t)(x))
int cuMemcpy(u64 d, u64 s, size_t n) { memmove(DP(d), DP(s), n); return 0; }
int cuMemcpyHtoD_v2(u64 d, const void *s, size_t n) { memmove(DP(d), s, n); return 0; }
int cuMemcpyDtoH_v2(void *d, u64 s, size_t n) { memmove(d, DP(s), n); return 0; }
int cuMemcpyDtoD_v2(u64 d, u64 s, size_t n) { memmove(DP(d), DP(s), n); return 0; }
int cuMemcpyAsync(u64 d, u64 s, size_t n, void *st) { (void)st; memmove(DP(d), DP(s), n); return 0; }
int cuMemcpyHtoDAsync_v2(u64 d, const void *s, size_t n, void *st) { (void)st; memmove(DP(d), s, n); return 0; }
int cuMemcpyDtoHAsync_v2(void *d, u64 s, size_t n, void *st) { (void)st; memmove(d, DP(s), n); return 0; }
int cuMemcpyPeerAsync(u64 d, void *dc, u64 s, void *sc, size_t n, void *st) {
	(void)st;
	if (!dc || !sc) return 201;
	memmove(DP(d), DP(s), n);
	return 0;
}
int cuMemsetD8_v2(u64 d, unsigned char v, size_t n) { memset(DP(d), v, n); return 0; }
int cuMemsetD32_v2(u64 d, unsigned v, size_t n) { unsigned *p = DP(d); for (size_t i = 0; i < n; i++) p[i] = v; return 0; }
int cuMemsetD8Async(u64 d, unsigned char v, size_t n, void *st) { (void)st; memset(DP(d), v, n); return 0; }

int cuStreamCreate(void **s, unsigned flags) { *s = DP(0x5000 + flags); return 0; }
int cuStreamDestroy_v2(void *s) { return s ? 0 : 400; }
int cuStreamSynchronize(void *s) { (void)s; return 0; }
int cuEventCreate(void **e, unsigned flags) { *e = DP(0x6000 + flags); return 0; }
int cuEventRecord(void *e, void *s) { (void)s; return e ? 0 : 400; }
int cuEventSynchronize(void *e) { return e ? 0 : 400; }
int cuEventElapsedTime(float *ms, void *a, void *b) { if (!a || !b) return 400; *ms = 1.5f; return 0; }
int cuEventDestroy_v2(void *e) { return e ? 0 : 400; }

// Stream-ordered allocation and event queries: an event made with BLOCKING_SYNC (0x6001) never
// completes, so NOT_READY is seen; the default pool keeps each attribute as the C type the header
// gives it (int for 1-3, cuuint64_t for the rest).
int cuStreamWaitEvent(void *s, void *e, unsigned flags) { (void)s; return e && flags == 0 ? 0 : 1; }
int cuEventQuery(void *e) { if (!e) return 400; return e == DP(0x6001) ? 600 : 0; }
int cuMemAllocAsync(u64 *d, size_t size, void *st) { (void)st; void *p = calloc(1, size); *d = (u64)(uintptr_t)p; return p ? 0 : 2; }
int cuMemFreeAsync(u64 d, void *st) { (void)st; if (!d) return 1; free(DP(d)); return 0; }
int cuDeviceGetDefaultMemPool(void **pool, int dev) { if (dev < 0 || dev > 1) return 101; *pool = DP(0x7000 + dev); return 0; }
static u64 pool_attr[9];
int cuMemPoolSetAttribute(void *pool, int attr, void *v) {
	if (!pool || attr < 1 || attr > 8) return 1;
	pool_attr[attr] = attr <= 3 ? (u64)*(int *)v : *(u64 *)v;
	return 0;
}
int cuMemPoolGetAttribute(void *pool, int attr, void *v) {
	if (!pool || attr < 1 || attr > 8) return 1;
	if (attr <= 3) *(int *)v = (int)pool_attr[attr]; else *(u64 *)v = pool_attr[attr];
	return 0;
}
int cuMemPoolTrimTo(void *pool, size_t keep) { if (!pool) return 400; pool_attr[5] = keep; return 0; }

int cuModuleLoadData(void **m, const void *image) {
	const char *s = image;
	if (strstr(s, ".entry") == NULL) return 218;
	*m = DP(strlen(s));
	return 0;
}
int cuModuleGetFunction(void **f, void *m, const char *name) {
	if (!m) return 400;
	size_t n = strlen(name);
	if (strcmp(name, "cuvmm_fill") == 0) *f = DP(1);
	else if (strcmp(name, "cuvmm_verify") == 0) *f = DP(2);
	else if (strcmp(name, "fake_echo") == 0) *f = DP(3);
	else if (n == 300 && strspn(name, "x") == 300) *f = DP(4);
	else return 500;
	return 0;
}
int cuModuleUnload(void *m) { return m ? 0 : 400; }

static u64 pattern(u64 w, u64 seed) { return ((w + 1) * 0x9E3779B97F4A7C15ull) ^ seed; }
#define ARG(i) (*(u64 *)params[i])
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned shmem, void *st, void **params, void **extra) {
	if (extra != NULL) return 1;
	switch ((uintptr_t)f) {
	case 1: {
		u64 *p = DP(ARG(0));
		for (u64 i = 0; i < ARG(1); i++) p[i] = pattern(ARG(2) + i, ARG(3));
		return 0;
	}
	case 2: {
		const u64 *p = DP(ARG(0));
		u64 bad = 0;
		for (u64 i = 0; i < ARG(1); i++) bad += p[i] != pattern(ARG(2) + i, ARG(3));
		*(u64 *)DP(ARG(4)) += bad;
		return 0;
	}
	case 3: {
		u64 *dst = DP(ARG(0)), n = ARG(1);
		dst[0] = gx; dst[1] = gy; dst[2] = gz; dst[3] = bx; dst[4] = by; dst[5] = bz; dst[6] = shmem;
		dst[7] = (u64)(uintptr_t)st;
		for (u64 i = 0; i < n; i++) dst[8 + i] = ARG(i);
		return 0;
	}
	}
	return 400;
}

// Graphs: the graph handle records the capture mode, the executable one the graph and the flags.
static void *capturing;
static int capture_mode;
int cuStreamBeginCapture_v2(void *s, int mode) {
	if (!s || mode < 0 || mode > 2) return 1;
	if (capturing) return 401;
	capturing = s; capture_mode = mode;
	return 0;
}
int cuStreamEndCapture(void *s, void **g) {
	if (s != capturing) return 401;
	capturing = NULL;
	*g = DP(0x7000 + capture_mode);
	return 0;
}
int cuGraphInstantiateWithFlags(void **e, void *g, u64 flags) {
	if (!g) return 400;
	*e = DP((uintptr_t)g + 0x100 + flags);
	return 0;
}
int cuGraphLaunch(void *e, void *s) { (void)s; return e ? 0 : 400; }
int cuGraphExecDestroy(void *e) { return e ? 0 : 400; }
int cuGraphDestroy(void *g) { return g ? 0 : 400; }
`

// TestMain removes the fake driver libraries built by the tests.
func TestMain(m *testing.M) {
	code := m.Run()
	if fakeDir != "" {
		os.RemoveAll(fakeDir)
	}
	os.Exit(code)
}

var (
	fakeOnce sync.Once
	fakeDir  string
	fakeErr  error
)

// fakeLibrary builds the fake driver variant named by defines (once per test binary) and returns
// its path; it skips the test when gcc is not available.
func fakeLibrary(t *testing.T, variant string, defines ...string) string {
	t.Helper()
	fakeOnce.Do(func() {
		fakeDir, fakeErr = os.MkdirTemp("", "cuvmm-fakecuda-")
		if fakeErr == nil {
			fakeErr = os.WriteFile(filepath.Join(fakeDir, "fakecuda.c"), []byte(fakeCUDA), 0o644)
		}
	})
	if fakeErr != nil {
		t.Fatal(fakeErr)
	}
	cc := os.Getenv("CC")
	if cc == "" {
		cc = "gcc"
	}
	if _, err := exec.LookPath(cc); err != nil {
		t.Skipf("the fake driver library needs a C compiler: %v", err)
	}
	out := filepath.Join(fakeDir, "libfakecuda-"+variant+".so")
	if _, err := os.Stat(out); err == nil {
		return out
	}
	args := append([]string{"-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-Wno-strict-prototypes", "-Wno-old-style-definition"}, defines...)
	args = append(args, "-o", out, filepath.Join(fakeDir, "fakecuda.c"))
	if b, err := exec.Command(cc, args...).CombinedOutput(); err != nil {
		t.Fatalf("building the fake driver: %v\n%s", err, b)
	}
	return out
}

// openFake loads the complete fake driver and locks the test to its OS thread, since the fake's
// current context is per thread, as the driver's is.
func openFake(t *testing.T) *cudaLib {
	t.Helper()
	a, err := OpenLibrary(fakeLibrary(t, "full"))
	if err != nil {
		t.Fatal(err)
	}
	runtime.LockOSThread()
	t.Cleanup(runtime.UnlockOSThread)
	return a.(*cudaLib)
}

func TestFakeResolvesVersionedSymbols(t *testing.T) {
	l := openFake(t)
	if m := l.missingSymbols(); len(m) != 0 {
		t.Fatalf("missing symbols in the fake: %v", m)
	}
	for i, s := range symbols {
		want := s.name
		if symbol(i) == symEventElapsedTime {
			want = "cuEventElapsedTime" // the fake has no _v2: the fallback must be taken
		}
		if l.resolved[i] != want {
			t.Errorf("symbol %d resolved as %q, want %q", i, l.resolved[i], want)
		}
	}
}

// TestFakeEveryMethod runs every API method against the fake: each must reach its own versioned
// entry point (the legacy names answer CUDA_ERROR_UNKNOWN) and succeed.
func TestFakeEveryMethod(t *testing.T) {
	l := openFake(t)
	env := newCallEnv(t, l)
	for _, c := range apiCalls {
		if err := c.call(l, env); err != nil {
			t.Errorf("%s (%s): %v", c.method, c.symbol, err)
		}
	}
}

// TestFakeStreamOrdered checks what crosses the ABI for the stream-ordered allocation and event
// query calls: NOT_READY becomes (false, nil), pool attributes keep their 64-bit values, and the
// pool handle and stream reach the driver.
func TestFakeStreamOrdered(t *testing.T) {
	l := openFake(t)
	pending, err := l.EventCreate(EventBlockingSync) // the fake never completes this one
	if err != nil {
		t.Fatal(err)
	}
	if done, err := l.EventQuery(pending); err != nil || done {
		t.Errorf("EventQuery(pending) = %v, %v; want false, nil", done, err)
	}
	if done, err := l.EventQuery(0x6002); err != nil || !done {
		t.Errorf("EventQuery(complete) = %v, %v; want true, nil", done, err)
	}
	if _, err := l.EventQuery(0); !errors.Is(err, ErrInvalidHandle) {
		t.Errorf("EventQuery(0) = %v, want CUDA_ERROR_INVALID_HANDLE", err)
	}
	if err := l.StreamWaitEvent(0x5001, pending, 1); !errors.Is(err, ErrInvalidValue) {
		t.Errorf("StreamWaitEvent(flags 1) = %v, want the flags to reach the driver", err)
	}
	pool, err := l.DeviceGetDefaultMemPool(1)
	if err != nil || pool != 0x7001 {
		t.Fatalf("DeviceGetDefaultMemPool(1) = %#x, %v", pool, err)
	}
	const big = 1<<40 + 3
	if err := l.MemPoolSetAttribute(pool, MemPoolReleaseThreshold, big); err != nil {
		t.Fatal(err)
	}
	if v, err := l.MemPoolGetAttribute(pool, MemPoolReleaseThreshold); err != nil || v != big {
		t.Errorf("release threshold = %d, %v; want %d (a 64-bit value)", v, err, uint64(big))
	}
	if err := l.MemPoolSetAttribute(pool, MemPoolReuseAllowOpportunistic, 1); err != nil {
		t.Fatal(err)
	}
	if v, err := l.MemPoolGetAttribute(pool, MemPoolReuseAllowOpportunistic); err != nil || v != 1 {
		t.Errorf("reuse opportunistic = %d, %v; want 1", v, err)
	}
	if err := l.MemPoolTrimTo(pool, 12345); err != nil {
		t.Fatal(err)
	}
	if v, _ := l.MemPoolGetAttribute(pool, MemPoolReservedMemCurrent); v != 12345 {
		t.Errorf("TrimTo passed %d, want 12345", v)
	}
	d, err := l.MemAllocAsync(4096, 0x5000)
	if err != nil || d == 0 {
		t.Fatalf("MemAllocAsync = %#x, %v", d, err)
	}
	if err := l.MemsetD8(d, 7, 4096); err != nil {
		t.Fatal(err)
	}
	if err := l.MemFreeAsync(d, 0x5000); err != nil {
		t.Fatal(err)
	}
	if err := l.MemFreeAsync(0, 0); !errors.Is(err, ErrInvalidValue) {
		t.Errorf("MemFreeAsync(0) = %v", err)
	}
	must(t, "EventDestroy", l.EventDestroy(pending))
}

func TestFakeDevices(t *testing.T) {
	l := openFake(t)
	if err := l.Init(0); err != nil {
		t.Fatal(err)
	}
	if err := l.Init(1); !errors.Is(err, ErrInvalidValue) {
		t.Errorf("Init(1) = %v, want CUDA_ERROR_INVALID_VALUE", err)
	}
	if v, err := l.DriverGetVersion(); err != nil || v != 13000 {
		t.Errorf("DriverGetVersion = %d, %v", v, err)
	}
	if n, err := l.DeviceGetCount(); err != nil || n != 2 {
		t.Errorf("DeviceGetCount = %d, %v", n, err)
	}
	if _, err := l.DeviceGet(2); !errors.Is(err, ErrNoDevice) {
		t.Errorf("DeviceGet(2) = %v, want CUDA_ERROR_INVALID_DEVICE", err)
	}
	if name, err := l.DeviceGetName(1); err != nil || name != "Fake GPU 1" {
		t.Errorf("DeviceGetName(1) = %q, %v", name, err)
	}
	if v, err := l.DeviceGetAttribute(AttrHostVirtualMemoryManagementSupported, 1); err != nil || v != 1451 {
		t.Errorf("DeviceGetAttribute(145, 1) = %d, %v (attribute and device swapped?)", v, err)
	}
	if b, err := l.DeviceTotalMem(1); err != nil || b != 2<<34 {
		t.Errorf("DeviceTotalMem(1) = %d, %v", b, err)
	}
	if can, err := l.DeviceCanAccessPeer(0, 1); err != nil || !can {
		t.Errorf("DeviceCanAccessPeer(0, 1) = %v, %v", can, err)
	}
	if can, err := l.DeviceCanAccessPeer(1, 1); err != nil || can {
		t.Errorf("DeviceCanAccessPeer(1, 1) = %v, %v", can, err)
	}
	u, err := l.DeviceGetUUID(1)
	if err != nil {
		t.Fatal(err)
	}
	for i, b := range u {
		if b != byte(i*16+1) {
			t.Fatalf("DeviceGetUUID(1) = %x", u)
		}
	}
	ctx, err := l.DevicePrimaryCtxRetain(1)
	if err != nil || ctx != 0x1001 {
		t.Fatalf("DevicePrimaryCtxRetain(1) = %#x, %v", ctx, err)
	}
	if err := l.CtxSetCurrent(0); err != nil {
		t.Fatal(err)
	}
	if err := l.CtxSynchronize(); !errors.Is(err, ErrInvalidContext) {
		t.Errorf("CtxSynchronize without a context = %v", err)
	}
	if err := l.CtxSetCurrent(ctx); err != nil {
		t.Fatal(err)
	}
	if cur, err := l.CtxGetCurrent(); err != nil || cur != ctx {
		t.Errorf("CtxGetCurrent = %#x, %v", cur, err)
	}
	if err := l.CtxSynchronize(); err != nil {
		t.Error(err)
	}
	if free, total, err := l.MemGetInfo(); err != nil || free != 1<<30 || total != 1<<35 {
		t.Errorf("MemGetInfo = %d, %d, %v", free, total, err)
	}
	if err := l.DevicePrimaryCtxRelease(5); !errors.Is(err, ErrNoDevice) {
		t.Errorf("DevicePrimaryCtxRelease(5) = %v", err)
	}
	_ = l.CtxSetCurrent(0)
}

// TestFakeAllocationPropLayout checks that every field of AllocationProp lands at its offset: the
// fake packs them into the handle, and decodes the handle back into a CUmemAllocationProp.
func TestFakeAllocationPropLayout(t *testing.T) {
	l := openFake(t)
	prop := AllocationProp{
		Type:                 AllocationTypePinned,
		RequestedHandleTypes: HandleTypePosixFD | HandleTypeFabric,
		Location:             HostNUMALocation(5),
		Compression:          CompressionGeneric,
		GPUDirectRDMACapable: true,
		Usage:                0xbeef,
	}
	h, err := l.MemCreate(2<<20, &prop, 0)
	if err != nil {
		t.Fatal(err)
	}
	const want = MemHandle(1 | 9<<8 | 3<<16 | 5<<24 | 1<<32 | 1<<40 | 0xbeef<<48)
	if h != want {
		t.Fatalf("MemCreate handle %#x, want %#x", uint64(h), uint64(want))
	}
	got, err := l.MemGetAllocationPropertiesFromHandle(h)
	if err != nil || got != prop {
		t.Fatalf("MemGetAllocationPropertiesFromHandle = %+v, %v; want %+v", got, err, prop)
	}
	if _, err := l.MemCreate(2<<20, nil, 0); !errors.Is(err, ErrInvalidValue) {
		t.Errorf("MemCreate(nil prop) = %v", err)
	}
	if _, err := l.MemCreate(2<<20, &prop, 1); !errors.Is(err, ErrInvalidValue) {
		t.Errorf("MemCreate(flags 1) = %v", err)
	}
	for opt, want := range map[GranularityOption]uint64{GranularityMinimum: 2 << 20, GranularityRecommended: 4 << 20} {
		if g, err := l.MemGetAllocationGranularity(&prop, opt); err != nil || g != want {
			t.Errorf("MemGetAllocationGranularity(%d) = %d, %v", opt, g, err)
		}
	}
	if h, err := l.MemRetainAllocationHandle(0x1000); err != nil || h != 0x1000^0xabc {
		t.Errorf("MemRetainAllocationHandle = %#x, %v", uint64(h), err)
	}
	if p, err := l.MemAddressReserve(2<<20, 1<<21, 0, 0); err != nil || p != 0x7f0000000000+2<<20+1<<21 {
		t.Errorf("MemAddressReserve = %#x, %v", uint64(p), err)
	}
	if p, err := l.MemAddressReserve(2<<20, 0, 0x7f1234000000, 0); err != nil || p != 0x7f1234000000 {
		t.Errorf("MemAddressReserve with hint = %#x, %v", uint64(p), err)
	}
	if err := l.MemMap(0x7f0000000000, 2<<20, 2<<20, h, 0); !errors.Is(err, ErrNotSupported) {
		t.Errorf("MemMap at offset 2 MiB = %v (the offset argument is misplaced)", err)
	}
}

func TestFakeAccessDescriptors(t *testing.T) {
	l := openFake(t)
	for _, n := range []int{1, 3, 8, 9, 40} {
		desc := make([]AccessDesc, n)
		for i := range desc {
			desc[i] = AccessDesc{Location: DeviceLocation(Device(i)), Flags: AccessFlags([]AccessFlags{AccessRead, AccessReadWrite}[i%2])}
		}
		desc[0].Location = HostNUMALocation(7)
		ptr := DevicePtr(0x7f0000000000 + uint64(n)<<21)
		if err := l.MemSetAccess(ptr, 2<<20, desc); err != nil {
			t.Fatalf("%d descriptors: %v", n, err)
		}
		for _, d := range desc {
			if f, err := l.MemGetAccess(d.Location, ptr); err != nil || f != d.Flags {
				t.Errorf("%d descriptors: MemGetAccess(%v) = %v, %v; want %v", n, d.Location, f, err, d.Flags)
			}
		}
		if f, err := l.MemGetAccess(DeviceLocation(99), ptr); err != nil || f != AccessNone {
			t.Errorf("MemGetAccess(device 99) = %v, %v", f, err)
		}
	}
	if err := l.MemSetAccess(0x1000, 2<<20, nil); !errors.Is(err, ErrInvalidValue) {
		t.Errorf("MemSetAccess with no descriptors = %v", err)
	}
}

func TestFakeShareableHandles(t *testing.T) {
	l := openFake(t)
	fd, err := l.MemExportToShareableHandle(0x42, HandleTypePosixFD, 0)
	if err != nil || fd != 1000+0x42 {
		t.Errorf("MemExportToShareableHandle = %d, %v", fd, err)
	}
	if fd, err := l.MemExportToShareableHandle(0x42, HandleTypeWin32, 0); !errors.Is(err, ErrInvalidValue) || fd != -1 {
		t.Errorf("MemExportToShareableHandle(win32) = %d, %v", fd, err)
	}
	if _, err := l.MemExportToShareableHandle(0x42, HandleTypeFabric, 0); !errors.Is(err, ErrInvalidValue) {
		t.Errorf("MemExportToShareableHandle(fabric) = %v, want a refusal", err)
	}
	fh, err := l.MemExportToFabricHandle(0x42, 0)
	if err != nil {
		t.Fatal(err)
	}
	for i, b := range fh {
		if b != byte(0x42+i) {
			t.Fatalf("fabric handle %x", fh)
		}
	}
	for _, fd := range []int{0, 7, 1234, 1 << 30} {
		if h, err := l.MemImportFromShareableHandle(fd, HandleTypePosixFD); err != nil || h != MemHandle(fd)<<4 {
			t.Errorf("MemImportFromShareableHandle(%d) = %#x, %v (the FD must be passed by value)", fd, uint64(h), err)
		}
	}
	if _, err := l.MemImportFromShareableHandle(3, HandleTypeFabric); !errors.Is(err, ErrInvalidValue) {
		t.Errorf("MemImportFromShareableHandle(fabric) = %v, want a refusal", err)
	}
	if fd, err := l.MemGetHandleForAddressRange(0x1000, 64<<20, RangeHandleTypeDMABufFD, 0); err != nil || fd != 64 {
		t.Errorf("MemGetHandleForAddressRange = %d, %v", fd, err)
	}
}

func TestFakeKernels(t *testing.T) {
	l := openFake(t)
	m, err := l.ModuleLoadData(kernels.PTX)
	if err != nil {
		t.Fatal(err)
	}
	if m != Module(len(kernels.PTX)) {
		t.Errorf("the driver saw %d bytes of PTX, want %d: the image must be NUL-terminated", m, len(kernels.PTX))
	}
	if _, err := l.ModuleLoadData([]byte("not ptx")); err != ErrorInvalidPTX {
		t.Errorf("ModuleLoadData(garbage) = %v", err)
	}
	if _, err := l.ModuleLoadData(nil); err != ErrorInvalidPTX {
		t.Errorf("ModuleLoadData(nil) = %v", err)
	}
	fill, err := l.ModuleGetFunction(m, kernels.Fill)
	if err != nil {
		t.Fatal(err)
	}
	verify, err := l.ModuleGetFunction(m, kernels.Verify)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := l.ModuleGetFunction(m, "nope"); err != ErrorNotFound {
		t.Errorf("ModuleGetFunction(nope) = %v", err)
	}
	if f, err := l.ModuleGetFunction(m, strings.Repeat("x", 300)); err != nil || f != 4 {
		t.Errorf("ModuleGetFunction(300-byte name) = %v, %v", f, err)
	}
	if _, err := l.ModuleGetFunction(m, "cuvmm_fill\x00junk"); !errors.Is(err, ErrInvalidValue) {
		t.Errorf("ModuleGetFunction(name with NUL) = %v", err)
	}

	const nwords = 4096
	host, err := l.MemHostAlloc(nwords*8+8, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer l.MemFreeHost(host)
	buf := DevicePtr(uintptr(host))
	counter := buf + nwords*8
	const seed = 0x1234
	grid, block := Dim3{4, 1, 1}, Dim3{128, 1, 1}
	if err := l.LaunchKernel(fill, grid, block, 0, 0, uint64(buf), nwords, 100, seed); err != nil {
		t.Fatal(err)
	}
	words := unsafe.Slice((*uint64)(host), nwords+1)
	for i := 0; i < nwords; i++ {
		if words[i] != kernels.Pattern(uint64(100+i), seed) {
			t.Fatalf("word %d = %#x, want %#x", i, words[i], kernels.Pattern(uint64(100+i), seed))
		}
	}
	if err := l.LaunchKernel(verify, grid, block, 0, 0, uint64(buf), nwords, 100, seed, uint64(counter)); err != nil {
		t.Fatal(err)
	}
	if words[nwords] != 0 {
		t.Errorf("verify with the right seed: %d mismatches", words[nwords])
	}
	if err := l.LaunchKernel(verify, grid, block, 0, 0, uint64(buf), nwords, 100, seed+1, uint64(counter)); err != nil {
		t.Fatal(err)
	}
	if words[nwords] != nwords {
		t.Errorf("verify with a wrong seed: %d mismatches, want %d", words[nwords], nwords)
	}

	echo, err := l.ModuleGetFunction(m, "fake_echo")
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []int{2, 8, 32, 33, 40} {
		args := make([]uint64, n)
		args[0], args[1] = uint64(buf), uint64(n)
		for i := 2; i < n; i++ {
			args[i] = 0xabc0000 + uint64(i)
		}
		if err := l.LaunchKernel(echo, Dim3{1, 2, 3}, Dim3{4, 5, 6}, 7, 8, args...); err != nil {
			t.Fatal(err)
		}
		want := append([]uint64{1, 2, 3, 4, 5, 6, 7, 8}, args...)
		if got := words[:len(want)]; !equalU64(got, want) {
			t.Errorf("%d kernel arguments: the kernel saw %v, want %v", n, got, want)
		}
	}
	if err := l.ModuleUnload(m); err != nil {
		t.Error(err)
	}
}

func equalU64(a, b []uint64) bool {
	return bytes.Equal(unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(a))), len(a)*8),
		unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(b))), len(b)*8))
}

func TestFakeCopiesAndEvents(t *testing.T) {
	l := openFake(t)
	host, err := l.MemHostAlloc(4096, HostAllocPortable)
	if err != nil {
		t.Fatal(err)
	}
	defer l.MemFreeHost(host)
	dev := DevicePtr(uintptr(host))
	b := unsafe.Slice((*byte)(host), 4096)
	if err := l.MemsetD32(dev, 0x01020304, 4); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(b[:16], bytes.Repeat([]byte{4, 3, 2, 1}, 4)) || b[16] != 0 {
		t.Errorf("MemsetD32 wrote %x", b[:20])
	}
	if err := l.MemsetD8(dev+100, 0xee, 3); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(b[99:104], []byte{0, 0xee, 0xee, 0xee, 0}) {
		t.Errorf("MemsetD8 wrote %x", b[99:104])
	}
	src := []byte("hello, device")
	if err := l.MemcpyHtoD(dev+1000, unsafe.Pointer(&src[0]), uint64(len(src))); err != nil {
		t.Fatal(err)
	}
	dst := make([]byte, len(src))
	if err := l.MemcpyDtoH(unsafe.Pointer(&dst[0]), dev+1000, uint64(len(src))); err != nil {
		t.Fatal(err)
	}
	if string(dst) != string(src) {
		t.Errorf("MemcpyHtoD/DtoH round trip: %q", dst)
	}
	if err := l.MemcpyPeerAsync(dev+2000, 0x1000, dev+1000, 0x1001, 5, 0); err != nil || string(b[2000:2005]) != "hello" {
		t.Errorf("MemcpyPeerAsync: %v, %q", err, b[2000:2005])
	}
	if err := l.MemcpyPeerAsync(dev+2000, 0, dev+1000, 0x1001, 5, 0); !errors.Is(err, ErrInvalidContext) {
		t.Errorf("MemcpyPeerAsync without a destination context = %v (argument order?)", err)
	}
	s, err := l.StreamCreate(StreamNonBlocking)
	if err != nil || s != 0x5001 {
		t.Errorf("StreamCreate = %#x, %v", s, err)
	}
	e, err := l.EventCreate(EventDisableTiming)
	if err != nil || e != 0x6002 {
		t.Errorf("EventCreate = %#x, %v", e, err)
	}
	if ms, err := l.EventElapsedTime(e, e); err != nil || ms != 1.5 {
		t.Errorf("EventElapsedTime = %v, %v", ms, err)
	}
	if err := l.EventDestroy(0); !errors.Is(err, ErrInvalidHandle) {
		t.Errorf("EventDestroy(0) = %v", err)
	}
	p := unsafe.Add(host, 2048)
	if err := l.MemHostRegister(p, 1024, HostRegisterDeviceMap); err != nil {
		t.Fatal(err)
	}
	if d, err := l.MemHostGetDevicePointer(p, 0); err != nil || d != DevicePtr(uintptr(p)) {
		t.Errorf("MemHostGetDevicePointer = %#x, %v", uint64(d), err)
	}
	if err := l.MemHostUnregister(p); err != nil {
		t.Error(err)
	}
	if err := l.MemHostUnregister(p); err != ErrorHostMemoryNotRegistered {
		t.Errorf("second MemHostUnregister = %v", err)
	}
	d, err := l.MemAlloc(64)
	if err != nil || d == 0 {
		t.Fatalf("MemAlloc = %#x, %v", uint64(d), err)
	}
	if err := l.MemFree(d); err != nil {
		t.Error(err)
	}
}

// TestFakeHotPathAllocs checks that the VMM calls a growing buffer makes per chunk allocate nothing
// on the Go side (the driver's own cost is what remains).
func TestFakeHotPathAllocs(t *testing.T) {
	l := openFake(t)
	prop := AllocationProp{Type: AllocationTypePinned, RequestedHandleTypes: HandleTypePosixFD, Location: DeviceLocation(0)}
	desc := make([]AccessDesc, 8)
	for i := range desc {
		desc[i] = AccessDesc{Location: DeviceLocation(Device(i)), Flags: AccessReadWrite}
	}
	var one [1]AccessDesc
	one[0] = desc[0]
	const ptr = DevicePtr(0x7f0000000000)
	allocs := testing.AllocsPerRun(200, func() {
		h, err := l.MemCreate(2<<20, &prop, 0)
		if err != nil {
			panic(err)
		}
		p, err := l.MemAddressReserve(2<<20, 0, ptr, 0)
		if err != nil {
			panic(err)
		}
		if err := l.MemMap(p, 2<<20, 0, h, 0); err != nil {
			panic(err)
		}
		if err := l.MemSetAccess(p, 2<<20, one[:]); err != nil {
			panic(err)
		}
		if err := l.MemSetAccess(p, 2<<20, desc); err != nil {
			panic(err)
		}
		if _, err := l.MemGetAccess(DeviceLocation(0), p); err != nil {
			panic(err)
		}
		if err := l.MemUnmap(p, 2<<20); err != nil {
			panic(err)
		}
		if err := l.MemRelease(h); err != nil {
			panic(err)
		}
		if err := l.MemAddressFree(p, 2<<20); err != nil {
			panic(err)
		}
		if _, err := l.MemGetAllocationGranularity(&prop, GranularityMinimum); err != nil {
			panic(err)
		}
		if err := l.LaunchKernel(1, Dim3{1, 1, 1}, Dim3{1, 1, 1}, 0, 0, uint64(ptr), 0, 0, 0); err != nil {
			panic(err)
		}
	})
	if allocs != 0 {
		t.Errorf("the VMM hot path allocates %v times per chunk, want 0", allocs)
	}
}

func TestFakeErrorText(t *testing.T) {
	l := openFake(t)
	saved := errorTextLib.Load()
	defer errorTextLib.Store(saved)
	l.useForErrorText()
	if got := ErrorInvalidValue.Error(); got != "FAKE_ERROR_INVALID_VALUE: fake invalid argument" {
		t.Errorf("with the library's text: %q", got)
	}
	// Codes the library does not name fall back to the built-in table.
	if got := ErrorOutOfMemory.Error(); got != "CUDA_ERROR_OUT_OF_MEMORY: out of memory" {
		t.Errorf("fallback: %q", got)
	}
	if got := Result(12345).Name(); got != "CUDA_ERROR_12345" {
		t.Errorf("unknown code: %q", got)
	}
}

// TestFakeStubLibrary: the toolkit's stub libcuda loads, but cuInit answers
// CUDA_ERROR_STUB_LIBRARY, which is ErrNoDriver.
func TestFakeStubLibrary(t *testing.T) {
	a, err := OpenLibrary(fakeLibrary(t, "stub", "-DFAKE_STUB"))
	if err != nil {
		t.Fatal(err)
	}
	err = a.Init(0)
	if err != ErrorStubLibrary || !errors.Is(err, ErrNoDriver) {
		t.Errorf("Init on the stub = %v, want CUDA_ERROR_STUB_LIBRARY matching ErrNoDriver", err)
	}
}

// TestFakeOldDriver: a driver without cuMemGetHandleForAddressRange (before 11.7) fails only that
// call.
func TestFakeOldDriver(t *testing.T) {
	a, err := OpenLibrary(fakeLibrary(t, "nodmabuf", "-DFAKE_NO_DMABUF"))
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Init(0); err != nil {
		t.Fatal(err)
	}
	_, err = a.MemGetHandleForAddressRange(0x1000, 2<<20, RangeHandleTypeDMABufFD, 0)
	var se *SymbolError
	if !errors.As(err, &se) || se.Symbol != "cuMemGetHandleForAddressRange" || se.Since != "11.7" || !errors.Is(err, ErrNotSupported) {
		t.Errorf("MemGetHandleForAddressRange on an old driver = %v", err)
	}
	if !strings.Contains(err.Error(), "11.7") {
		t.Errorf("the error does not say which version is needed: %v", err)
	}
	if m := a.(*cudaLib).missingSymbols(); len(m) != 1 {
		t.Errorf("missing %v, want only cuMemGetHandleForAddressRange", m)
	}
}

// TestFakeGraphs checks what crosses the ABI for the graph calls: the capture mode, the handles
// passed back through out-parameters, and the instantiate flags.
func TestFakeGraphs(t *testing.T) {
	l := openFake(t)
	if err := l.StreamBeginCapture(0x5001, CaptureModeRelaxed); err != nil {
		t.Fatal(err)
	}
	if err := l.StreamBeginCapture(0x5001, CaptureModeGlobal); !errors.Is(err, ErrorIllegalState) {
		t.Errorf("second begin: %v, want CUDA_ERROR_ILLEGAL_STATE", err)
	}
	g, err := l.StreamEndCapture(0x5001)
	if err != nil || g != 0x7002 {
		t.Fatalf("StreamEndCapture = %#x, %v; want 0x7002 (relaxed mode crossed as 2)", g, err)
	}
	e, err := l.GraphInstantiate(g, 0)
	if err != nil || e != 0x7102 {
		t.Fatalf("GraphInstantiate = %#x, %v; want 0x7102", e, err)
	}
	if err := l.GraphLaunch(e, 0x5001); err != nil {
		t.Error(err)
	}
	if err := l.GraphLaunch(0, 0x5001); !errors.Is(err, ErrInvalidHandle) {
		t.Errorf("launch of a nil graph: %v", err)
	}
	if err := l.GraphExecDestroy(e); err != nil {
		t.Error(err)
	}
	if err := l.GraphDestroy(g); err != nil {
		t.Error(err)
	}
	if _, err := l.StreamEndCapture(0x5001); !errors.Is(err, ErrorIllegalState) {
		t.Errorf("end without a capture: %v, want CUDA_ERROR_ILLEGAL_STATE", err)
	}
}
