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
 *   cc -O2 -o first_pin first_pin.c -ldl -lpthread
 *   ./first_pin [--size 16GiB] [--threads 30] [--passes 3] [--gpus 0]
 *
 * libcuda.so.1 is opened at run time (only with --gpus), so no CUDA headers or toolkit are needed
 * to build it. It exits with 2 on a wrong command line and with 1 when the driver or a system call
 * fails.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define PIECE (16UL << 20)
#define PAGE 4096UL

struct pass {
	char *mem;
	size_t size;
	atomic_size_t next;
};

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;

static struct {
	CUresult (*Init)(unsigned);
	CUresult (*DeviceGet)(CUdevice *, int);
	CUresult (*PrimaryCtxRetain)(CUcontext *, CUdevice);
	CUresult (*CtxSetCurrent)(CUcontext);
	CUresult (*HostRegister)(void *, size_t, unsigned);
	CUresult (*HostUnregister)(void *);
} cu;

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
	if (!cu.Init || !cu.DeviceGet || !cu.PrimaryCtxRetain || !cu.CtxSetCurrent || !cu.HostRegister || !cu.HostUnregister) {
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

/* one_pass maps size bytes, touches them from threads threads, registers them when reg is set,
 * and unmaps them; it sets the seconds the touching and the registering took, and returns -1 when
 * a system call failed. */
static int one_pass(size_t size, int threads, int reg, double *touch_s, double *reg_s) {
	struct pass p = {.size = size};
	p.mem = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (p.mem == MAP_FAILED) {
		perror("mmap");
		return -1;
	}
	madvise(p.mem, size, MADV_HUGEPAGE);
	pthread_t tid[256];
	double t0 = now();
	for (int i = 0; i < threads; i++)
		if (pthread_create(&tid[i], NULL, touch, &p) != 0) {
			perror("pthread_create");
			exit(1);
		}
	for (int i = 0; i < threads; i++)
		pthread_join(tid[i], NULL);
	*touch_s = now() - t0;
	*reg_s = 0;
	if (reg) {
		t0 = now();
		check(cu.HostRegister(p.mem, size, 0), "cuMemHostRegister");
		*reg_s = now() - t0;
		check(cu.HostUnregister(p.mem), "cuMemHostUnregister");
	}
	munmap(p.mem, size);
	return 0;
}

struct args {
	size_t size;
	int threads, passes, gpus;
};

/* usage reports a wrong command line, naming what is wrong, and returns 2. */
static int usage(const char *what, const char *arg) {
	fprintf(stderr, "first_pin: %s%s\n", what, arg);
	fprintf(stderr, "usage: first_pin [--size N[KiB|MiB|GiB]] [--threads 1-256] [--passes 1-100] [--gpus 0-64]\n");
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

/* parse_args reads the command line into a; it returns 0, or 2 after reporting what is wrong. */
static int parse_args(int argc, char **argv, struct args *a) {
	for (int i = 1; i < argc; i += 2) {
		const char *f = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
		int bad = 0;
		if (strcmp(f, "--size") != 0 && strcmp(f, "--threads") != 0 && strcmp(f, "--passes") != 0 && strcmp(f, "--gpus") != 0)
			return usage("unknown flag ", f);
		if (!v)
			return usage("every flag takes a value: ", f);
		if (strcmp(f, "--size") == 0) {
			a->size = parse_size(v);
			if (a->size == 0)
				return usage("--size wants a positive size such as 16GiB, not ", v);
		} else if (strcmp(f, "--threads") == 0)
			bad = int_flag(f, v, 1, 256, &a->threads);
		else if (strcmp(f, "--passes") == 0)
			bad = int_flag(f, v, 1, 100, &a->passes);
		else
			bad = int_flag(f, v, 0, 64, &a->gpus);
		if (bad)
			return bad;
	}
	return 0;
}

int main(int argc, char **argv) {
	struct args a = {.size = 16UL << 30, .threads = 30, .passes = 3, .gpus = 0};
	int bad = parse_args(argc, argv, &a);
	if (bad)
		return bad;
	if (a.gpus > 0)
		open_gpus(a.gpus);
	double touch_s[100], reg_s[100];
	for (int i = 0; i < a.passes; i++)
		if (one_pass(a.size, a.threads, a.gpus > 0, &touch_s[i], &reg_s[i]) < 0)
			return 1;
	printf("{\"size_bytes\": %zu, \"threads\": %d, \"gpus\": %d, \"touch_seconds\": [", a.size, a.threads, a.gpus);
	for (int i = 0; i < a.passes; i++)
		printf("%s%.4f", i ? ", " : "", touch_s[i]);
	printf("], \"register_seconds\": [");
	for (int i = 0; i < a.passes; i++)
		printf("%s%.4f", i ? ", " : "", reg_s[i]);
	printf("]}\n");
	return 0;
}
