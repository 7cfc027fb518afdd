/* Resolves the driver through dlsym bound to one glibc symbol version: dlsym@GLIBC_2.34 (built
 * normally against glibc >= 2.34) or, with -DCOMPAT, the first version of the architecture,
 * dlsym@GLIBC_2.2.5 (GLIBC_2.17 on aarch64), which programs linked before glibc 2.34 carry.
 * Checks with dladdr that cuMemAlloc_v2 on libcuda's handle is libcuvisor's export, then fills
 * the quota with 256 MiB chunks and prints "total BYTES". */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef COMPAT
void *dlsym_compat(void *, const char *);
#ifdef __aarch64__
__asm__(".symver dlsym_compat, dlsym@GLIBC_2.17");
#else
__asm__(".symver dlsym_compat, dlsym@GLIBC_2.2.5");
#endif
#define LOOKUP dlsym_compat
#else
#define LOOKUP dlsym
#endif

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

#define CHECK(cond, ...) do { if (!(cond)) { fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); fprintf(stderr, __VA_ARGS__); fprintf(stderr, "\n"); exit(1); } } while (0)
#define OK(call) do { CUresult r_ = (call); CHECK(r_ == 0, "%s returned %d", #call, r_); } while (0)

static void *lib;
static void *get(const char *name) {
    void *p = LOOKUP(lib, name);
    CHECK(p != NULL, "no %s", name);
    return p;
}

int main(void) {
    lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    CHECK(lib != NULL, "dlopen: %s", dlerror());
    CUresult (*cuInit)(unsigned) = get("cuInit");
    CUresult (*retain)(void **, int) = get("cuDevicePrimaryCtxRetain");
    CUresult (*setCurrent)(void *) = get("cuCtxSetCurrent");
    CUresult (*memAlloc)(CUdeviceptr *, size_t) = get("cuMemAlloc_v2");
    CUresult (*memFree)(CUdeviceptr) = get("cuMemFree_v2");

    Dl_info info;
    CHECK(dladdr((void *)memAlloc, &info) && info.dli_sname && info.dli_fname, "dladdr");
    CHECK(strstr(info.dli_fname, "libcuvisor") && strcmp(info.dli_sname, "cuMemAlloc_v2") == 0,
          "cuMemAlloc_v2 is %s in %s", info.dli_sname, info.dli_fname);
    printf("cuMemAlloc_v2 is libcuvisor's\n");

    void *ctx;
    OK(cuInit(0));
    OK(retain(&ctx, 0));
    OK(setCurrent(ctx));
    CUdeviceptr p[256];
    int n = 0;
    CUresult r;
    while (n < 256 && (r = memAlloc(&p[n], 256 << 20)) == 0) n++;
    CHECK(r == 2, "stopped with %d", r);
    printf("total %llu\n", (unsigned long long)n << 28);
    while (n > 0) OK(memFree(p[--n]));
    return 0;
}
