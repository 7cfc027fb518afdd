/* Linked with -lcuda; run with libcuvisor and the shim (tests/c/shim.c, path in $SHIM) preloaded
 * in either order. Calls the shim's cuMemAlloc_v2 (found on the shim's own handle) and prints
 * which object its RTLD_NEXT lookup returned, whether the allocation was charged (cuMemGetInfo),
 * and what the program's own RTLD_NEXT lookups return. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
CUresult cuInit(unsigned);
CUresult cuDevicePrimaryCtxRetain(void **, int);
CUresult cuCtxSetCurrent(void *);
CUresult cuMemGetInfo_v2(size_t *, size_t *);
CUresult cuMemFree_v2(CUdeviceptr);

#define CHECK(cond, ...) do { if (!(cond)) { fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); fprintf(stderr, __VA_ARGS__); fprintf(stderr, "\n"); exit(1); } } while (0)
#define OK(call) do { CUresult r_ = (call); CHECK(r_ == 0, "%s returned %d", #call, r_); } while (0)

/* "FILE-BASENAME SYMBOL" of an address. */
static void where(const char *label, void *p) {
    Dl_info info;
    CHECK(p != NULL, "%s: NULL", label);
    CHECK(dladdr(p, &info) && info.dli_fname && info.dli_sname, "%s: dladdr", label);
    const char *base = strrchr(info.dli_fname, '/');
    printf("%s %s %s\n", label, base ? base + 1 : info.dli_fname, info.dli_sname);
}

int main(void) {
    const char *shim_path = getenv("SHIM");
    CHECK(shim_path != NULL, "SHIM not set");
    void *shim = dlopen(shim_path, RTLD_NOW | RTLD_NOLOAD);
    CHECK(shim != NULL, "the shim is not loaded: %s", dlerror());
    CUresult (*shim_alloc)(CUdeviceptr *, size_t) = dlsym(shim, "cuMemAlloc_v2");
    void *(*shim_next)(void) = dlsym(shim, "shim_next");
    CHECK(shim_alloc && shim_next, "shim symbols");
    where("shim-own", (void *)shim_alloc);

    void *ctx;
    OK(cuInit(0));
    OK(cuDevicePrimaryCtxRetain(&ctx, 0));
    OK(cuCtxSetCurrent(ctx));
    size_t free0, free1, total;
    OK(cuMemGetInfo_v2(&free0, &total));
    CUdeviceptr p;
    OK(shim_alloc(&p, 1 << 20));
    OK(cuMemGetInfo_v2(&free1, &total));
    where("shim-next", shim_next());
    printf("shim-alloc charged %zu\n", free0 - free1);
    OK(cuMemFree_v2(p));

    where("main-next-alloc", dlsym(RTLD_NEXT, "cuMemAlloc_v2"));
    where("main-next-puts", dlsym(RTLD_NEXT, "puts"));
    return 0;
}
