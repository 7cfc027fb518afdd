/* A shim library of the kind tools interpose: defines cuMemAlloc_v2 itself and forwards to the
 * next definition with dlsym(RTLD_NEXT, ...). shim_next() tells which function that was. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef CUresult (*alloc_t)(CUdeviceptr *, size_t);

static void *next;

CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
    next = dlsym(RTLD_NEXT, "cuMemAlloc_v2");
    if (next == NULL) return 999; /* CUDA_ERROR_UNKNOWN */
    return ((alloc_t)next)(p, n);
}

void *shim_next(void) { return next; }
