// Counts OpenMP parallel regions (libgomp's GOMP_parallel) in a process: with
// OMP_WAIT_POLICY=passive every region wakes sleeping threads (tens of
// microseconds), so a small torch op that opens one (repeat_interleave,
// max_pool1d) costs far more than its work. Build and preload:
//
//   gcc -O2 -shared -fPIC scripts/measure/omp_regions.c -o /tmp/omp_regions.so -ldl
//   LD_PRELOAD=/tmp/omp_regions.so python ...
//
// and read the count from Python around the code in question:
//
//   lib = ctypes.CDLL("/tmp/omp_regions.so"); lib.gomp_regions.restype = ctypes.c_uint64
//   before = lib.gomp_regions(); f(); opened = lib.gomp_regions() - before
//
// (fifty-fourth session: `physical_view`'s repeat_interleave opened one a step;
// docs/results.md, "Compaction in fewer ops".)
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>

static volatile uint64_t regions = 0;
typedef void (*gomp_parallel_fn)(void (*)(void*), void*, unsigned, unsigned);

void GOMP_parallel(void (*fn)(void*), void* data, unsigned threads, unsigned flags) {
  static gomp_parallel_fn real = 0;
  if (!real) real = (gomp_parallel_fn)dlsym(RTLD_NEXT, "GOMP_parallel");
  __atomic_add_fetch(&regions, 1, __ATOMIC_RELAXED);
  real(fn, data, threads, flags);
}

uint64_t gomp_regions(void) { return regions; }
