// C declarations of the NCCL types cuvmm passes across the ABI, written from nccl.h 2.28 so that no
// NCCL headers are needed to build, and one trampoline per entry point: each takes the function
// pointer resolved with dlsym and calls it with the exact C prototype. Names end in "_" so that they
// never clash with <nccl.h>; abi_test.go checks every size, offset and value against the real header.
#ifndef CUVMM_NCCL_CALLS_H
#define CUVMM_NCCL_CALLS_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE // dladdr
#endif
#include <dlfcn.h>
#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int ncclResult_;   // ncclResult_t, an enum
typedef int ncclDataType_; // ncclDataType_t
typedef int ncclRedOp_;    // ncclRedOp_t

// ncclUniqueId: 128 opaque bytes, passed by value to ncclCommInitRankConfig.
typedef struct {
	char internal[128];
} ncclUniqueId_;

// ncclConfig_t as nccl.h 2.28 declares it (struct ncclConfig_v22800): 80 bytes, 8-byte aligned. The
// library reads the first `size` bytes and ignores fields newer than `version`, so this declaration
// works with older and newer libraries alike.
typedef struct {
	size_t size;
	unsigned int magic;   // NCCL_API_MAGIC 0xcafebeef
	unsigned int version; // NCCL_VERSION(2, 28, 0) of the header the struct comes from
	int blocking;
	int cgaClusterSize;
	int minCTAs;
	int maxCTAs;
	const char *netName;
	int splitShare;
	int trafficClass;
	const char *commName;
	int collnetEnable;
	int CTAPolicy;
	int shrinkShare;
	int nvlsCTAs;
	int nChannelsPerNetPeer;
	int nvlinkCentricSched;
} ncclConfig_;

#define CUVMM_NCCL_MAGIC 0xcafebeefu

// cuvmm_nccl_dlopen opens path and copies dlerror's text into err in the same call (dlerror is per
// thread, and the goroutine could move to another thread between two cgo calls).
static inline void *cuvmm_nccl_dlopen(const char *path, char *err, size_t errlen) {
	void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (h == NULL && errlen > 0) {
		const char *e = dlerror();
		if (e == NULL) e = "dlopen failed";
		strncpy(err, e, errlen - 1);
		err[errlen - 1] = 0;
	}
	return h;
}

static inline void *cuvmm_nccl_dlsym(void *h, const char *name) { return dlsym(h, name); }

// cuvmm_nccl_dlpath writes the file the library at h was loaded from (dlinfo is not portable:
// dladdr of one of its symbols).
static inline void cuvmm_nccl_dlpath(void *sym, char *out, size_t outlen) {
	Dl_info info;
	out[0] = 0;
	if (sym != NULL && dladdr(sym, &info) != 0 && info.dli_fname != NULL) {
		strncpy(out, info.dli_fname, outlen - 1);
		out[outlen - 1] = 0;
	}
}

static inline int cuvmm_ncclGetVersion(void *fn, int *v) { return ((ncclResult_(*)(int *))fn)(v); }

static inline const char *cuvmm_ncclGetErrorString(void *fn, int r) {
	return ((const char *(*)(ncclResult_))fn)(r);
}

static inline const char *cuvmm_ncclGetLastError(void *fn, uintptr_t comm) {
	return ((const char *(*)(void *))fn)((void *)comm);
}

static inline int cuvmm_ncclGetUniqueId(void *fn, ncclUniqueId_ *id) {
	return ((ncclResult_(*)(ncclUniqueId_ *))fn)(id);
}

// cuvmm_ncclCommInitRankConfig completes the caller's config as NCCL_CONFIG_INITIALIZER does (size,
// magic, version) and calls the function. NCCL copies the struct during the call; the strings it
// points at must outlive the communicator.
static inline int cuvmm_ncclCommInitRankConfig(void *fn, uintptr_t *comm, int nranks, const ncclUniqueId_ *id, int rank,
                                               const ncclConfig_ *user) {
	ncclConfig_ cfg = *user;
	cfg.size = sizeof(ncclConfig_);
	cfg.magic = CUVMM_NCCL_MAGIC;
	cfg.version = 22800;
	void *c = NULL;
	int rc = ((ncclResult_(*)(void **, int, ncclUniqueId_, int, ncclConfig_ *))fn)(&c, nranks, *id, rank, &cfg);
	*comm = (uintptr_t)c;
	return rc;
}

static inline int cuvmm_ncclCommGetAsyncError(void *fn, uintptr_t comm, int *state) {
	return ((ncclResult_(*)(void *, ncclResult_ *))fn)((void *)comm, state);
}

static inline int cuvmm_nccl_comm(void *fn, uintptr_t comm) { return ((ncclResult_(*)(void *))fn)((void *)comm); }

static inline int cuvmm_nccl_comm_int(void *fn, uintptr_t comm, int *v) {
	return ((ncclResult_(*)(void *, int *))fn)((void *)comm, v);
}

static inline int cuvmm_ncclCommRegister(void *fn, uintptr_t comm, uint64_t ptr, size_t size, uintptr_t *handle) {
	void *h = NULL;
	int rc = ((ncclResult_(*)(void *, void *, size_t, void **))fn)((void *)comm, (void *)(uintptr_t)ptr, size, &h);
	*handle = (uintptr_t)h;
	return rc;
}

static inline int cuvmm_ncclCommDeregister(void *fn, uintptr_t comm, uintptr_t handle) {
	return ((ncclResult_(*)(void *, void *))fn)((void *)comm, (void *)handle);
}

// win must stay valid until a non-blocking registration completes: NCCL writes it from its own thread.
static inline int cuvmm_ncclCommWindowRegister(void *fn, uintptr_t comm, uint64_t ptr, size_t size, uintptr_t *win,
                                               int flags) {
	return ((ncclResult_(*)(void *, void *, size_t, void **, int))fn)((void *)comm, (void *)(uintptr_t)ptr, size,
	                                                                   (void **)win, flags);
}

static inline int cuvmm_ncclCommWindowDeregister(void *fn, uintptr_t comm, uintptr_t win) {
	return ((ncclResult_(*)(void *, void *))fn)((void *)comm, (void *)win);
}

static inline int cuvmm_nccl_void(void *fn) { return ((ncclResult_(*)(void))fn)(); }

static inline int cuvmm_nccl_p2p(void *fn, uint64_t buf, size_t count, int dt, int peer, uintptr_t comm,
                                 uintptr_t stream) {
	return ((ncclResult_(*)(void *, size_t, ncclDataType_, int, void *, void *))fn)(
	    (void *)(uintptr_t)buf, count, dt, peer, (void *)comm, (void *)stream);
}

static inline int cuvmm_ncclAllReduce(void *fn, uint64_t send, uint64_t recv, size_t count, int dt, int op,
                                      uintptr_t comm, uintptr_t stream) {
	return ((ncclResult_(*)(const void *, void *, size_t, ncclDataType_, ncclRedOp_, void *, void *))fn)(
	    (const void *)(uintptr_t)send, (void *)(uintptr_t)recv, count, dt, op, (void *)comm, (void *)stream);
}

static inline int cuvmm_ncclAllGather(void *fn, uint64_t send, uint64_t recv, size_t count, int dt, uintptr_t comm,
                                      uintptr_t stream) {
	return ((ncclResult_(*)(const void *, void *, size_t, ncclDataType_, void *, void *))fn)(
	    (const void *)(uintptr_t)send, (void *)(uintptr_t)recv, count, dt, (void *)comm, (void *)stream);
}

static inline int cuvmm_ncclBroadcast(void *fn, uint64_t send, uint64_t recv, size_t count, int dt, int root,
                                      uintptr_t comm, uintptr_t stream) {
	return ((ncclResult_(*)(const void *, void *, size_t, ncclDataType_, int, void *, void *))fn)(
	    (const void *)(uintptr_t)send, (void *)(uintptr_t)recv, count, dt, root, (void *)comm, (void *)stream);
}

#endif
