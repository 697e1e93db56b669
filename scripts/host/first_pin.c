/*
 * first_pin.c: how fast the host pins memory a process has never used, apart from cuvmm. A first
 * sleep pins its backup on the way: it faults the pages in, then registers them with the CUDA
 * driver (cuMemHostRegister). This times the two steps alone, pass after pass.
 *
 * Each pass maps --size bytes of anonymous memory (transparent huge pages advised, as offload's
 * backup is), has --threads threads write one word of each 4 KiB page (16 MiB at a time, taken in
 * turn), then, with --gpus N (N > 0), registers the whole range in a process holding the primary
 * contexts of GPUs 0..N-1, unregisters it and unmaps it. The first pass of the first process on a
 * freshly started machine is what the host costs when it backs, and maps for the GPUs, memory it
 * has not handed out before; the later passes are what the kernel and the driver cost alone. It
 * prints one line of JSON: each pass's touch and register seconds.
 *
 * With --mode stage (and --gpus 1 or more) it compares, pass after pass in alternating order, two
 * ways for a cold sleep to back up --size bytes of GPU 0's memory in such a process. "pin": fault
 * the backup in, register it, copy into it (the steps timed apart: touch, register and copy
 * seconds). "stage": copy through a ring of --ring pinned pieces of --piece bytes into backup
 * memory that is not registered, the --threads threads copying each piece out of the ring (and so
 * faulting the backup in) while the next pieces arrive (stage seconds, the ring's making
 * included), then register the backup (register-after seconds: what would follow in the
 * background) and copy it back (wake seconds). The staged backup's content is checked.
 *
 *   cc -O2 -o first_pin first_pin.c -ldl -lpthread
 *   ./first_pin [--size 16GiB] [--threads 30] [--passes 3] [--gpus 0] [--mode pin|stage]
 *               [--ring 8] [--piece 32MiB]
 *
 * libcuda.so.1 is opened at run time (only with --gpus), so no CUDA headers or toolkit are needed
 * to build it. It exits with 2 on a wrong command line and with 1 when the driver or a system call
 * fails.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define PIECE (16UL << 20)
#define PAGE 4096UL
#define FILL 0x5a5a5a5au /* the stage mode's device content */

struct pass {
	char *mem;
	size_t size;
	atomic_size_t next;
};

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUevent;
typedef unsigned long long CUdeviceptr;

static struct {
	CUresult (*Init)(unsigned);
	CUresult (*DeviceGet)(CUdevice *, int);
	CUresult (*PrimaryCtxRetain)(CUcontext *, CUdevice);
	CUresult (*CtxSetCurrent)(CUcontext);
	CUresult (*HostRegister)(void *, size_t, unsigned);
	CUresult (*HostUnregister)(void *);
	CUresult (*MemAlloc)(CUdeviceptr *, size_t);
	CUresult (*MemsetD32)(CUdeviceptr, unsigned, size_t);
	CUresult (*StreamCreate)(CUstream *, unsigned);
	CUresult (*EventCreate)(CUevent *, unsigned);
	CUresult (*EventRecord)(CUevent, CUstream);
	CUresult (*EventSynchronize)(CUevent);
	CUresult (*MemcpyDtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
	CUresult (*MemcpyDtoH)(void *, CUdeviceptr, size_t);
	CUresult (*MemcpyHtoD)(CUdeviceptr, const void *, size_t);
} cu;

static CUcontext gpu0; /* the context of GPU 0, which the stage mode copies from */

/* check exits when a driver call failed, naming it. */
static void check(CUresult r, const char *call) {
	if (r != 0) {
		fprintf(stderr, "first_pin: %s: CUDA error %d\n", call, r);
		exit(1);
	}
}

/* open_gpus loads the driver and retains the primary contexts of GPUs 0..n-1, the first current. */
static void open_gpus(int n) {
	void *lib = dlopen("libcuda.so.1", RTLD_NOW);
	if (!lib) {
		fprintf(stderr, "first_pin: %s\n", dlerror());
		exit(1);
	}
	*(void **)&cu.Init = dlsym(lib, "cuInit");
	*(void **)&cu.DeviceGet = dlsym(lib, "cuDeviceGet");
	*(void **)&cu.PrimaryCtxRetain = dlsym(lib, "cuDevicePrimaryCtxRetain");
	*(void **)&cu.CtxSetCurrent = dlsym(lib, "cuCtxSetCurrent");
	*(void **)&cu.HostRegister = dlsym(lib, "cuMemHostRegister_v2");
	*(void **)&cu.HostUnregister = dlsym(lib, "cuMemHostUnregister");
	*(void **)&cu.MemAlloc = dlsym(lib, "cuMemAlloc_v2");
	*(void **)&cu.MemsetD32 = dlsym(lib, "cuMemsetD32_v2");
	*(void **)&cu.StreamCreate = dlsym(lib, "cuStreamCreate");
	*(void **)&cu.EventCreate = dlsym(lib, "cuEventCreate");
	*(void **)&cu.EventRecord = dlsym(lib, "cuEventRecord");
	*(void **)&cu.EventSynchronize = dlsym(lib, "cuEventSynchronize");
	*(void **)&cu.MemcpyDtoHAsync = dlsym(lib, "cuMemcpyDtoHAsync_v2");
	*(void **)&cu.MemcpyDtoH = dlsym(lib, "cuMemcpyDtoH_v2");
	*(void **)&cu.MemcpyHtoD = dlsym(lib, "cuMemcpyHtoD_v2");
	if (!cu.Init || !cu.DeviceGet || !cu.PrimaryCtxRetain || !cu.CtxSetCurrent || !cu.HostRegister || !cu.HostUnregister ||
	    !cu.MemAlloc || !cu.MemsetD32 || !cu.StreamCreate || !cu.EventCreate || !cu.EventRecord || !cu.EventSynchronize ||
	    !cu.MemcpyDtoHAsync || !cu.MemcpyDtoH || !cu.MemcpyHtoD) {
		fprintf(stderr, "first_pin: libcuda.so.1 lacks a symbol it needs\n");
		exit(1);
	}
	check(cu.Init(0), "cuInit");
	for (int i = n - 1; i >= 0; i--) {
		CUdevice d;
		CUcontext c;
		check(cu.DeviceGet(&d, i), "cuDeviceGet");
		check(cu.PrimaryCtxRetain(&c, d), "cuDevicePrimaryCtxRetain");
		check(cu.CtxSetCurrent(c), "cuCtxSetCurrent");
		gpu0 = c;
	}
}

static double now(void) {
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void *touch(void *arg) {
	struct pass *p = arg;
	for (;;) {
		size_t off = atomic_fetch_add(&p->next, PIECE);
		if (off >= p->size)
			return NULL;
		size_t end = off + PIECE < p->size ? off + PIECE : p->size;
		for (size_t o = off; o < end; o += PAGE)
			((volatile char *)p->mem)[o] = 1;
	}
}

/* parse_size reads a count of bytes with an optional KiB, MiB or GiB suffix; 0 when malformed. */
static size_t parse_size(const char *s) {
	char *end;
	unsigned long long n = strtoull(s, &end, 10);
	if (end == s)
		return 0;
	if (strcmp(end, "GiB") == 0)
		return n << 30;
	if (strcmp(end, "MiB") == 0)
		return n << 20;
	if (strcmp(end, "KiB") == 0)
		return n << 10;
	return *end ? 0 : n;
}

/* parse_int reads a whole decimal number; -1 when malformed. */
static int parse_int(const char *s) {
	char *end;
	long n = strtol(s, &end, 10);
	return end == s || *end || n < 0 || n > 1 << 20 ? -1 : (int)n;
}

/* map_thp maps size bytes of anonymous memory, transparent huge pages advised; NULL on failure. */
static char *map_thp(size_t size) {
	char *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (m == MAP_FAILED) {
		perror("mmap");
		return NULL;
	}
	madvise(m, size, MADV_HUGEPAGE);
	return m;
}

/* run_threads runs fn(arg) in threads threads and waits for them. */
static void run_threads(int threads, void *(*fn)(void *), void *arg) {
	pthread_t tid[256];
	for (int i = 0; i < threads; i++)
		if (pthread_create(&tid[i], NULL, fn, arg) != 0) {
			perror("pthread_create");
			exit(1);
		}
	for (int i = 0; i < threads; i++)
		pthread_join(tid[i], NULL);
}

struct args {
	size_t size, piece;
	int threads, passes, gpus, stage, ring;
};

/* times are one pass's seconds; those a mode does not take stay 0. */
struct times {
	double touch, reg, copy, stage, reg_after, wake;
};

/* pin_pass maps a.size bytes, touches them from a.threads threads and, with GPUs, registers them
 * and (in stage mode) copies dev into them, then unmaps them; -1 when a system call failed. */
static int pin_pass(const struct args *a, CUdeviceptr dev, struct times *t) {
	struct pass p = {.size = a->size, .mem = map_thp(a->size)};
	if (!p.mem)
		return -1;
	double t0 = now();
	run_threads(a->threads, touch, &p);
	t->touch = now() - t0;
	if (a->gpus > 0) {
		t0 = now();
		check(cu.HostRegister(p.mem, a->size, 0), "cuMemHostRegister");
		t->reg = now() - t0;
		if (a->stage) {
			t0 = now();
			check(cu.MemcpyDtoH(p.mem, dev, a->size), "cuMemcpyDtoH");
			t->copy = now() - t0;
		}
		check(cu.HostUnregister(p.mem), "cuMemHostUnregister");
	}
	munmap(p.mem, a->size);
	return 0;
}

/* stage is one staged copy: the device's bytes come piece by piece into a ring of pinned pieces,
 * each slot's event recorded after its copy, and the threads copy each piece out into the backup
 * in SUB-byte parts taken in order. A slot is reused once every part of its piece is out. */
#define SUB (2UL << 20)
struct stage {
	const struct args *a;
	char *ring, *backup;
	CUdeviceptr dev;
	CUstream stream;
	CUevent ev[64];
	atomic_size_t next;     /* the next part to copy out */
	atomic_int left[64];    /* parts of each slot's piece not yet out */
	pthread_mutex_t mu;
	pthread_cond_t cv;
	size_t issued;          /* pieces whose copy into the ring is queued; guarded by mu */
	char *done;             /* done[k]: piece k is out; guarded by mu */
};

static void *copy_out(void *arg) {
	struct stage *g = arg;
	size_t per = g->a->piece / SUB, parts = g->a->size / SUB;
	check(cu.CtxSetCurrent(gpu0), "cuCtxSetCurrent");
	for (size_t i; (i = atomic_fetch_add(&g->next, 1)) < parts;) {
		size_t k = i / per, off = i % per * SUB;
		int slot = k % g->a->ring;
		pthread_mutex_lock(&g->mu);
		while (g->issued <= k)
			pthread_cond_wait(&g->cv, &g->mu);
		pthread_mutex_unlock(&g->mu);
		check(cu.EventSynchronize(g->ev[slot]), "cuEventSynchronize");
		memcpy(g->backup + k * g->a->piece + off, g->ring + slot * g->a->piece + off, SUB);
		if (atomic_fetch_sub(&g->left[slot], 1) == 1) {
			pthread_mutex_lock(&g->mu);
			g->done[k] = 1;
			pthread_cond_broadcast(&g->cv);
			pthread_mutex_unlock(&g->mu);
		}
	}
	return NULL;
}

static void *stage_threads(void *arg) {
	struct stage *g = arg;
	run_threads(g->a->threads, copy_out, g);
	return NULL;
}

/* queue_pieces queues each piece's copy into its ring slot once the slot's last piece is out. */
static void queue_pieces(struct stage *g) {
	size_t n = g->a->size / g->a->piece;
	for (size_t k = 0; k < n; k++) {
		int slot = k % g->a->ring;
		pthread_mutex_lock(&g->mu);
		while (k >= (size_t)g->a->ring && !g->done[k - g->a->ring])
			pthread_cond_wait(&g->cv, &g->mu);
		pthread_mutex_unlock(&g->mu);
		atomic_store(&g->left[slot], (int)(g->a->piece / SUB));
		check(cu.MemcpyDtoHAsync(g->ring + slot * g->a->piece, g->dev + k * g->a->piece, g->a->piece, g->stream), "cuMemcpyDtoHAsync");
		check(cu.EventRecord(g->ev[slot], g->stream), "cuEventRecord");
		pthread_mutex_lock(&g->mu);
		g->issued = k + 1;
		pthread_cond_broadcast(&g->cv);
		pthread_mutex_unlock(&g->mu);
	}
}

/* staged reports whether the backup holds the device's fill (one word of each 4 KiB page). */
static int staged(const char *backup, size_t size) {
	for (size_t o = 0; o < size; o += PAGE)
		if (*(const unsigned *)(backup + o) != FILL)
			return 0;
	return 1;
}

/* stage_pass makes the ring, stages the device's bytes into fresh backup memory, then registers the
 * backup and copies it back; -1 when a system call failed or the content differs. */
static int stage_pass(const struct args *a, struct stage *g, struct times *t) {
	size_t ring = (size_t)a->ring * a->piece;
	double t0 = now();
	if (!(g->ring = map_thp(ring)) || !(g->backup = map_thp(a->size)))
		return -1;
	memset(g->ring, 0, ring);
	check(cu.HostRegister(g->ring, ring, 0), "cuMemHostRegister");
	g->done = calloc(a->size / a->piece, 1);
	g->issued = 0;
	atomic_store(&g->next, 0);
	pthread_t tid;
	if (!g->done || pthread_create(&tid, NULL, stage_threads, g) != 0)
		return -1;
	queue_pieces(g);
	pthread_join(tid, NULL);
	t->stage = now() - t0;
	int ok = staged(g->backup, a->size);
	t0 = now();
	check(cu.HostRegister(g->backup, a->size, 0), "cuMemHostRegister");
	t->reg_after = now() - t0;
	t0 = now();
	check(cu.MemcpyHtoD(g->dev, g->backup, a->size), "cuMemcpyHtoD");
	t->wake = now() - t0;
	check(cu.HostUnregister(g->backup), "cuMemHostUnregister");
	check(cu.HostUnregister(g->ring), "cuMemHostUnregister");
	munmap(g->backup, a->size);
	munmap(g->ring, ring);
	free(g->done);
	if (!ok)
		fprintf(stderr, "first_pin: the staged backup differs from the device's memory\n");
	return ok ? 0 : -1;
}

/* stage_setup fills --size bytes of GPU 0's memory and makes the ring's stream and events. */
static void stage_setup(const struct args *a, struct stage *g) {
	*g = (struct stage){.a = a, .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
	check(cu.CtxSetCurrent(gpu0), "cuCtxSetCurrent");
	check(cu.MemAlloc(&g->dev, a->size), "cuMemAlloc");
	check(cu.MemsetD32(g->dev, FILL, a->size / 4), "cuMemsetD32");
	check(cu.StreamCreate(&g->stream, 1), "cuStreamCreate"); /* non-blocking */
	for (int i = 0; i < a->ring; i++)
		check(cu.EventCreate(&g->ev[i], 1 | 2), "cuEventCreate"); /* blocking sync, no timing */
}

/* usage reports a wrong command line, naming what is wrong, and returns 2. */
static int usage(const char *what, const char *arg) {
	fprintf(stderr, "first_pin: %s%s\n", what, arg);
	fprintf(stderr, "usage: first_pin [--size N[KiB|MiB|GiB]] [--threads 1-256] [--passes 1-100] [--gpus 0-64] [--mode pin|stage] [--ring 2-64] [--piece N[KiB|MiB|GiB]]\n");
	return 2;
}

/* int_flag sets *v from s when it is a number from lo to hi; else it reports the flag, returning 2. */
static int int_flag(const char *flag, const char *s, int lo, int hi, int *v) {
	int n = parse_int(s);
	if (n < lo || n > hi) {
		fprintf(stderr, "first_pin: %s wants %d-%d, not %s\n", flag, lo, hi, s);
		return 2;
	}
	*v = n;
	return 0;
}

/* one_flag reads flag f's value v into a; it returns 0, or 2 after reporting what is wrong. */
static int one_flag(const char *f, const char *v, struct args *a) {
	if (strcmp(f, "--size") == 0 || strcmp(f, "--piece") == 0) {
		size_t n = parse_size(v);
		if (n == 0)
			return usage(strcmp(f, "--size") == 0 ? "--size wants a positive size such as 16GiB, not " : "--piece wants a positive size such as 32MiB, not ", v);
		*(strcmp(f, "--size") == 0 ? &a->size : &a->piece) = n;
		return 0;
	}
	if (strcmp(f, "--mode") == 0) {
		if (strcmp(v, "pin") != 0 && strcmp(v, "stage") != 0)
			return usage("--mode wants pin or stage, not ", v);
		a->stage = strcmp(v, "stage") == 0;
		return 0;
	}
	if (strcmp(f, "--threads") == 0)
		return int_flag(f, v, 1, 256, &a->threads);
	if (strcmp(f, "--passes") == 0)
		return int_flag(f, v, 1, 100, &a->passes);
	if (strcmp(f, "--ring") == 0)
		return int_flag(f, v, 2, 64, &a->ring);
	if (strcmp(f, "--gpus") == 0)
		return int_flag(f, v, 0, 64, &a->gpus);
	return usage("unknown flag ", f);
}

/* parse_args reads the command line into a; it returns 0, or 2 after reporting what is wrong. */
static int parse_args(int argc, char **argv, struct args *a) {
	for (int i = 1; i < argc; i += 2) {
		if (i + 1 >= argc)
			return strncmp(argv[i], "--", 2) == 0 ? usage("every flag takes a value: ", argv[i]) : usage("unknown flag ", argv[i]);
		int bad = one_flag(argv[i], argv[i + 1], a);
		if (bad)
			return bad;
	}
	if (a->stage && a->gpus == 0)
		return usage("--mode stage copies from GPU 0: it needs --gpus 1 or more", "");
	if (a->stage && (a->piece % SUB || a->size % a->piece))
		return usage("--mode stage wants --piece a multiple of 2MiB that divides --size", "");
	return 0;
}

/* print_list prints "name": [each pass's field] for the JSON line. */
static void print_list(const char *name, const struct times *t, int n, size_t field) {
	printf(", \"%s\": [", name);
	for (int i = 0; i < n; i++)
		printf("%s%.4f", i ? ", " : "", *(const double *)((const char *)&t[i] + field));
	printf("]");
}

int main(int argc, char **argv) {
	struct args a = {.size = 16UL << 30, .threads = 30, .passes = 3, .gpus = 0, .ring = 8, .piece = 32UL << 20};
	int bad = parse_args(argc, argv, &a);
	if (bad)
		return bad;
	struct stage g = {.a = &a};
	if (a.gpus > 0)
		open_gpus(a.gpus);
	if (a.stage)
		stage_setup(&a, &g);
	struct times t[100] = {0};
	for (int i = 0; i < a.passes; i++) {
		int stage_first = a.stage && i % 2; /* alternate, so that neither always gets the memory freed just before */
		if ((stage_first && stage_pass(&a, &g, &t[i]) < 0) || pin_pass(&a, g.dev, &t[i]) < 0 ||
		    (a.stage && !stage_first && stage_pass(&a, &g, &t[i]) < 0))
			return 1;
	}
	printf("{\"size_bytes\": %zu, \"threads\": %d, \"gpus\": %d, \"mode\": \"%s\"", a.size, a.threads, a.gpus, a.stage ? "stage" : "pin");
	print_list("touch_seconds", t, a.passes, offsetof(struct times, touch));
	print_list("register_seconds", t, a.passes, offsetof(struct times, reg));
	if (a.stage) {
		print_list("copy_seconds", t, a.passes, offsetof(struct times, copy));
		print_list("stage_seconds", t, a.passes, offsetof(struct times, stage));
		print_list("register_after_seconds", t, a.passes, offsetof(struct times, reg_after));
		print_list("wake_seconds", t, a.passes, offsetof(struct times, wake));
	}
	printf("}\n");
	return 0;
}
