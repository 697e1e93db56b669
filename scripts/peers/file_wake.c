/*
 * file_wake.c: the bare file wake, apart from cuvmm. The peer that offload's File mode is compared
 * with: the same pipeline written straight against the CUDA driver API, to show what the host
 * itself gives.
 *
 * For each GPU it writes a file of --size bytes (left in the page cache, as a sleep leaves it),
 * allocates --size bytes of device memory (cuMemAlloc) and gives each of --threads threads
 * --buffers pinned staging buffers (cuMemHostAlloc) of --part bytes. Then, for --rounds rounds,
 * every GPU at once, in this order:
 *   h2d   copies from the staging buffers to the device, part after part, no reads;
 *   read  the threads read their GPU's file into their buffers, part after part, nothing else;
 *   wake  the same reads, and each part is copied to the device (cuMemcpyHtoDAsync on the GPU's
 *         stream) as soon as it is read; a buffer is read into again only after its last copy
 *         (a blocking event).
 * Parts go to the threads of a GPU in file order, each thread taking the next as soon as it is
 * done. After the last wake it checks every byte of each device against its file, and prints one
 * line of JSON: per-round GB/s of all GPUs together, their medians, wake / read, and verified.
 *
 *   cc -O2 -o file_wake file_wake.c -ldl -lpthread
 *   ./file_wake --gpus 2 --size 16GiB [--threads 8] [--part 4MiB] [--buffers 2] [--rounds 5]
 *               [--sub 1MiB] [--dir $TMPDIR]
 *
 * With --sub, each part is read (and, in a wake, copied) in pieces of that many bytes, each piece
 * copied as soon as it is read, with one event per part: the copy engine then reads bytes the CPU
 * has just written.
 *
 * libcuda.so.1 is opened at run time, so no CUDA headers or toolkit are needed to build it. It
 * exits with 2 on a wrong command line and with 1 when the driver or a system call fails.
 * TestFileWakePeer in package measure builds it and runs it on one GPU.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext, *CUstream, *CUevent;
typedef unsigned long long CUdeviceptr;

#define MAXGPUS 8
#define MAXROUNDS 64
#define EVENT_BLOCKING_SYNC 0x1
#define EVENT_DISABLE_TIMING 0x2
#define STREAM_NON_BLOCKING 0x1
#define HOSTALLOC_PORTABLE 0x1

static struct {
	CUresult (*Init)(unsigned);
	CUresult (*DeviceGet)(CUdevice *, int);
	CUresult (*PrimaryCtxRetain)(CUcontext *, CUdevice);
	CUresult (*CtxSetCurrent)(CUcontext);
	CUresult (*MemAlloc)(CUdeviceptr *, size_t);
	CUresult (*MemHostAlloc)(void **, size_t, unsigned);
	CUresult (*StreamCreate)(CUstream *, unsigned);
	CUresult (*StreamSynchronize)(CUstream);
	CUresult (*EventCreate)(CUevent *, unsigned);
	CUresult (*EventRecord)(CUevent, CUstream);
	CUresult (*EventSynchronize)(CUevent);
	CUresult (*MemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
	CUresult (*MemcpyDtoH)(void *, CUdeviceptr, size_t);
} cu;

static void die(const char *what, long code) {
	fprintf(stderr, "file_wake: %s failed (%ld)\n", what, code);
	exit(1);
}

/* bad reports a wrong command line and exits with 2. */
static void bad(const char *what, const char *arg) {
	fprintf(stderr, "file_wake: %s%s (see the comment at the top of file_wake.c)\n", what, arg);
	exit(2);
}

#define CK(call) do { CUresult r_ = (call); if (r_ != 0) die(#call, r_); } while (0)

static void *sym(void *lib, const char *name) {
	void *p = dlsym(lib, name);
	if (!p)
		die(name, -1);
	return p;
}

static void load(void) {
	void *lib = dlopen("libcuda.so.1", RTLD_NOW);
	if (!lib) {
		fprintf(stderr, "file_wake: cannot load the CUDA driver: %s\n", dlerror());
		exit(1);
	}
	*(void **)&cu.Init = sym(lib, "cuInit");
	*(void **)&cu.DeviceGet = sym(lib, "cuDeviceGet");
	*(void **)&cu.PrimaryCtxRetain = sym(lib, "cuDevicePrimaryCtxRetain");
	*(void **)&cu.CtxSetCurrent = sym(lib, "cuCtxSetCurrent");
	*(void **)&cu.MemAlloc = sym(lib, "cuMemAlloc_v2");
	*(void **)&cu.MemHostAlloc = sym(lib, "cuMemHostAlloc");
	*(void **)&cu.StreamCreate = sym(lib, "cuStreamCreate");
	*(void **)&cu.StreamSynchronize = sym(lib, "cuStreamSynchronize");
	*(void **)&cu.EventCreate = sym(lib, "cuEventCreate");
	*(void **)&cu.EventRecord = sym(lib, "cuEventRecord");
	*(void **)&cu.EventSynchronize = sym(lib, "cuEventSynchronize");
	*(void **)&cu.MemcpyHtoDAsync = sym(lib, "cuMemcpyHtoDAsync_v2");
	*(void **)&cu.MemcpyDtoH = sym(lib, "cuMemcpyDtoH_v2");
}

enum mode { READ, WAKE, H2D };
static const char *mode_name[] = {"read", "wake", "h2d"};

struct opts {
	int gpus, threads, buffers, rounds;
	size_t size, part, sub;
	const char *dir;
};

struct gpu {
	CUcontext ctx;
	CUstream stream;
	CUdeviceptr dev;
	int fd;
	size_t next; /* the next part, taken atomically */
};

struct worker {
	struct gpu *g;
	const struct opts *o;
	enum mode mode;
	void **buf;
	CUevent *ev;
	int *used;
};

static double now(void) {
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static size_t parse_size(const char *s) {
	char *end;
	double v = strtod(s, &end);
	if (!strcmp(end, "KiB")) v *= 1 << 10;
	else if (!strcmp(end, "MiB")) v *= 1 << 20;
	else if (!strcmp(end, "GiB")) v *= 1 << 30;
	else if (*end || end == s) bad("want a size such as 4MiB or 16GiB (suffix KiB, MiB or GiB), not ", s);
	return (size_t)v;
}

/* fill writes a byte pattern that differs per GPU and per 8-byte word of the file. */
static void fill(unsigned char *p, size_t n, size_t off, int gpu) {
	for (size_t i = 0; i < n; i += 8) {
		uint64_t w = ((off + i) / 8) * 0x9E3779B97F4A7C15ull + (uint64_t)gpu;
		memcpy(p + i, &w, 8);
	}
}

static void pread_all(int fd, void *p, size_t n, size_t off) {
	while (n > 0) {
		ssize_t got = pread(fd, p, n, (off_t)off);
		if (got <= 0)
			die("pread", got < 0 ? errno : 0);
		p = (char *)p + got, n -= (size_t)got, off += (size_t)got;
	}
}

static void *work(void *arg) {
	struct worker *w = arg;
	struct gpu *g = w->g;
	size_t part = w->o->part;
	CK(cu.CtxSetCurrent(g->ctx));
	for (int i = 0;; i++) {
		size_t off = __atomic_fetch_add(&g->next, part, __ATOMIC_RELAXED);
		if (off >= w->o->size)
			break;
		size_t n = w->o->size - off < part ? w->o->size - off : part;
		int b = i % w->o->buffers;
		if (w->used[b])
			CK(cu.EventSynchronize(w->ev[b]));
		size_t sub = w->o->sub ? w->o->sub : n;
		for (size_t s = 0; s < n; s += sub) {
			size_t m = n - s < sub ? n - s : sub;
			char *p = (char *)w->buf[b] + s;
			if (w->mode != H2D)
				pread_all(g->fd, p, m, off + s);
			if (w->mode != READ)
				CK(cu.MemcpyHtoDAsync(g->dev + off + s, p, m, g->stream));
		}
		if (w->mode == READ)
			continue;
		CK(cu.EventRecord(w->ev[b], g->stream));
		w->used[b] = 1;
	}
	return NULL;
}

/* round runs one mode on every GPU at once and returns GB/s of all GPUs together. */
static double round_of(struct gpu *gs, struct worker *ws, const struct opts *o, enum mode m) {
	int n = o->gpus * o->threads;
	pthread_t tid[n];
	for (int i = 0; i < o->gpus; i++)
		gs[i].next = 0;
	double t0 = now();
	for (int i = 0; i < n; i++) {
		ws[i].mode = m;
		memset(ws[i].used, 0, sizeof(int) * o->buffers);
		if (pthread_create(&tid[i], NULL, work, &ws[i]))
			die("pthread_create", -1);
	}
	for (int i = 0; i < n; i++)
		pthread_join(tid[i], NULL);
	for (int i = 0; i < o->gpus; i++) {
		CK(cu.CtxSetCurrent(gs[i].ctx));
		CK(cu.StreamSynchronize(gs[i].stream));
	}
	return (double)o->size * o->gpus / (now() - t0) / 1e9;
}

static void write_file(struct gpu *g, const struct opts *o, int gpu, void *scratch) {
	char path[4096];
	snprintf(path, sizeof path, "%s/file_wake.%d.%d", o->dir, (int)getpid(), gpu);
	g->fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
	if (g->fd < 0)
		die(path, errno);
	unlink(path); /* gone once the process ends */
	for (size_t off = 0; off < o->size; off += o->part) {
		size_t n = o->size - off < o->part ? o->size - off : o->part;
		fill(scratch, n, off, gpu);
		if (pwrite(g->fd, scratch, n, (off_t)off) != (ssize_t)n)
			die("pwrite", errno);
	}
}

static void setup_gpu(struct gpu *g, const struct opts *o, int gpu) {
	CUdevice d;
	CK(cu.DeviceGet(&d, gpu));
	CK(cu.PrimaryCtxRetain(&g->ctx, d));
	CK(cu.CtxSetCurrent(g->ctx));
	CK(cu.StreamCreate(&g->stream, STREAM_NON_BLOCKING));
	CK(cu.MemAlloc(&g->dev, o->size));
}

static void setup_worker(struct worker *w, struct gpu *g, const struct opts *o) {
	w->g = g, w->o = o;
	w->buf = calloc(o->buffers, sizeof *w->buf);
	w->ev = calloc(o->buffers, sizeof *w->ev);
	w->used = calloc(o->buffers, sizeof *w->used);
	CK(cu.CtxSetCurrent(g->ctx));
	for (int b = 0; b < o->buffers; b++) {
		CK(cu.MemHostAlloc(&w->buf[b], o->part, HOSTALLOC_PORTABLE));
		CK(cu.EventCreate(&w->ev[b], EVENT_BLOCKING_SYNC | EVENT_DISABLE_TIMING));
	}
}

/* verify compares every part of each device with its file after the last wake, through the
 * device's first pinned staging buffer, and names the first part that differs. */
static int verify(struct gpu *gs, struct worker *ws, const struct opts *o) {
	unsigned char *want = malloc(o->part);
	int ok = 1;
	for (int i = 0; i < o->gpus && ok; i++) {
		unsigned char *got = ws[i * o->threads].buf[0];
		CK(cu.CtxSetCurrent(gs[i].ctx));
		for (size_t off = 0; off < o->size && ok; off += o->part) {
			size_t n = o->size - off < o->part ? o->size - off : o->part;
			CK(cu.MemcpyDtoH(got, gs[i].dev + off, n));
			fill(want, n, off, i);
			if (memcmp(got, want, n)) {
				fprintf(stderr, "file_wake: GPU %d differs from its file in the part at byte %zu\n", i, off);
				ok = 0;
			}
		}
	}
	free(want);
	return ok;
}

static int cmp(const void *a, const void *b) {
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

static double median(const double *v, int n) {
	double s[MAXROUNDS];
	memcpy(s, v, sizeof(double) * n);
	qsort(s, n, sizeof(double), cmp);
	return n % 2 ? s[n / 2] : (s[n / 2 - 1] + s[n / 2]) / 2;
}

static void print_list(const char *key, const double *v, int n) {
	printf("\"%s\": [", key);
	for (int i = 0; i < n; i++)
		printf("%s%.2f", i ? ", " : "", v[i]);
	printf("], ");
}

static void parse(struct opts *o, int argc, char **argv) {
	const char *tmp = getenv("TMPDIR");
	*o = (struct opts){.gpus = 1, .threads = 8, .buffers = 2, .rounds = 5,
			   .size = 1ull << 30, .part = 4 << 20, .dir = tmp && *tmp ? tmp : "/tmp"};
	for (int i = 1; i + 1 < argc; i += 2) {
		const char *k = argv[i], *v = argv[i + 1];
		if (!strcmp(k, "--gpus")) o->gpus = atoi(v);
		else if (!strcmp(k, "--threads")) o->threads = atoi(v);
		else if (!strcmp(k, "--buffers")) o->buffers = atoi(v);
		else if (!strcmp(k, "--rounds")) o->rounds = atoi(v);
		else if (!strcmp(k, "--size")) o->size = parse_size(v);
		else if (!strcmp(k, "--part")) o->part = parse_size(v);
		else if (!strcmp(k, "--sub")) o->sub = parse_size(v);
		else if (!strcmp(k, "--dir")) o->dir = v;
		else bad("unknown flag ", k);
	}
	if (argc % 2 == 0)
		bad("every flag takes a value: ", argv[argc - 1]);
	if (o->gpus < 1 || o->gpus > MAXGPUS || o->threads < 1 || o->buffers < 1 || o->rounds < 1 ||
	    o->rounds > MAXROUNDS)
		bad("want 1-8 GPUs, 1-64 rounds, and at least 1 thread and 1 buffer", "");
	if (o->part == 0 || o->part % 4096 || o->size == 0)
		bad("want a part that is a multiple of 4 KiB and a size above 0", "");
	if (o->sub % 4096 || o->sub > o->part)
		bad("want a --sub that is a multiple of 4 KiB, at most the part", "");
}

int main(int argc, char **argv) {
	struct opts o;
	parse(&o, argc, argv);
	load();
	CK(cu.Init(0));
	struct gpu gs[MAXGPUS];
	struct worker *ws = calloc((size_t)o.gpus * o.threads, sizeof *ws);
	void *scratch = malloc(o.part);
	for (int i = 0; i < o.gpus; i++) {
		setup_gpu(&gs[i], &o, i);
		write_file(&gs[i], &o, i, scratch);
		for (int t = 0; t < o.threads; t++)
			setup_worker(&ws[i * o.threads + t], &gs[i], &o);
	}
	double r[3][MAXROUNDS], ratio[MAXROUNDS];
	for (int k = 0; k < o.rounds; k++) {
		r[H2D][k] = round_of(gs, ws, &o, H2D); /* first: the wake must be the round's last */
		r[READ][k] = round_of(gs, ws, &o, READ);
		r[WAKE][k] = round_of(gs, ws, &o, WAKE);
		ratio[k] = r[WAKE][k] / r[READ][k];
	}
	printf("{\"gpus\": %d, \"size_bytes\": %zu, \"threads\": %d, \"part_bytes\": %zu, \"sub_bytes\": %zu, ",
	       o.gpus, o.size, o.threads, o.part, o.sub ? o.sub : o.part);
	printf("\"buffers\": %d, ", o.buffers);
	for (int m = READ; m <= H2D; m++) {
		char key[32];
		snprintf(key, sizeof key, "%s_gbps", mode_name[m]);
		print_list(key, r[m], o.rounds);
	}
	print_list("wake_vs_read", ratio, o.rounds);
	printf("\"median_read_gbps\": %.2f, \"median_wake_gbps\": %.2f, \"median_h2d_gbps\": %.2f, ",
	       median(r[READ], o.rounds), median(r[WAKE], o.rounds), median(r[H2D], o.rounds));
	printf("\"median_wake_vs_read\": %.3f, \"verified\": %s}\n", median(ratio, o.rounds),
	       verify(gs, ws, &o) ? "true" : "false");
	return 0;
}
