// touch: how fast a process faults in fresh anonymous memory (transparent huge pages) from several
// threads, without changing its bytes: the first cost of every pinned backup on a host.
//   gcc -O2 -pthread -o touch scripts/facts/touch.c && ./touch 16 30     (GiB, threads)
// docs/driver-facts.md quotes its figures.
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>

enum { HUGE = 2 << 20, PAGE = 4096, STEP = 64 << 20, MAX_THREADS = 256 };

static char *mem;
static size_t total;
static atomic_size_t next;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

// work faults in STEP bytes at a time, one atomic add of zero per page, until none is left.
static void *work(void *arg) {
  (void)arg;
  for (;;) {
    size_t off = atomic_fetch_add(&next, STEP);
    if (off >= total) return NULL;
    for (size_t p = off; p < off + STEP && p < total; p += PAGE)
      __atomic_fetch_add((int *)(mem + p), 0, __ATOMIC_RELAXED);
  }
}

int main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: touch GIB THREADS\n");
    return 2;
  }
  total = (size_t)(atof(argv[1]) * (double)(1ull << 30));
  int threads = atoi(argv[2]);
  if (total == 0 || threads < 1 || threads > MAX_THREADS) {
    fprintf(stderr, "touch: GIB must be positive and THREADS 1-%d\n", MAX_THREADS);
    return 2;
  }
  char *raw = mmap(NULL, total + HUGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) {
    perror("mmap");
    return 1;
  }
  mem = (char *)(((uintptr_t)raw + HUGE - 1) & ~(uintptr_t)(HUGE - 1));
  madvise(mem, total, MADV_HUGEPAGE);
  pthread_t th[MAX_THREADS];
  double start = now();
  for (int i = 0; i < threads; i++) pthread_create(&th[i], NULL, work, NULL);
  for (int i = 0; i < threads; i++) pthread_join(th[i], NULL);
  double secs = now() - start;
  printf("touch %s GiB, %d threads: %.3f s = %.1f GB/s\n", argv[1], threads, secs, total / secs / 1e9);
  return 0;
}
