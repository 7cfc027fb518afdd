/* Four ways a client reaches the driver, one quota. Allocates CHUNK_MIB chunks until the driver
 * says CUDA_ERROR_OUT_OF_MEMORY and prints "total BYTES stopped RESULT"; then frees one chunk and
 * checks that a small allocation fits again ("after-free OK"), frees everything and checks the
 * memory came back (stream-ordered: after a synchronization point, where the pool lets it go).
 *
 * Built twice: with -DLINKED -lcuda (mode "link": calls the driver's exports directly), and
 * without (modes "dlsym": dlopen + dlsym on libcuda's handle; "gpa": cuGetProcAddress_v2 with base
 * names and cudaVersion 12000, as libcudart 12 does; "gpa_pt": the same with the per-thread
 * default stream flag). In the gpa modes it also checks, with dladdr, which library and which
 * exported name each resolved pointer is. Exit status 0 only when every check held. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef CUresult (*gpa_v2_t)(const char *, void **, int, unsigned long long, int *);

#define CHECK(cond, ...) do { if (!(cond)) { fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); fprintf(stderr, __VA_ARGS__); fprintf(stderr, "\n"); exit(1); } } while (0)
#define OK(call) do { CUresult r_ = (call); CHECK(r_ == 0, "%s returned %d", #call, r_); } while (0)

static CUresult (*p_cuInit)(unsigned);
static CUresult (*p_cuDeviceGet)(int *, int);
static CUresult (*p_retain)(void **, int);
static CUresult (*p_setCurrent)(void *);
static CUresult (*p_release)(int);
static CUresult (*p_memAlloc)(CUdeviceptr *, size_t);
static CUresult (*p_memFree)(CUdeviceptr);
static CUresult (*p_memGetInfo)(size_t *, size_t *);
static CUresult (*p_allocAsync)(CUdeviceptr *, size_t, void *);
static CUresult (*p_freeAsync)(CUdeviceptr, void *);
static CUresult (*p_streamSync)(void *);

/* `p` must be the export named `symbol` of the library whose file name contains `file`. */
static void expect_at(const char *what, void *p, const char *file, const char *symbol) {
    Dl_info info;
    CHECK(dladdr(p, &info) != 0 && info.dli_fname != NULL, "%s: dladdr found nothing", what);
    CHECK(strstr(info.dli_fname, file) != NULL, "%s is in %s, not %s", what, info.dli_fname, file);
    CHECK(info.dli_sname != NULL && strcmp(info.dli_sname, symbol) == 0 && info.dli_saddr == p,
          "%s is %s+%ld, not %s", what, info.dli_sname ? info.dli_sname : "?",
          (long)((char *)p - (char *)info.dli_saddr), symbol);
    printf("resolved %s -> %s in %s\n", what, symbol, file);
}

#ifdef LINKED
CUresult cuInit(unsigned);
CUresult cuDeviceGet(int *, int);
CUresult cuDevicePrimaryCtxRetain(void **, int);
CUresult cuCtxSetCurrent(void *);
CUresult cuDevicePrimaryCtxRelease_v2(int);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemGetInfo_v2(size_t *, size_t *);

static void resolve(const char *mode) {
    CHECK(strcmp(mode, "link") == 0, "this build only runs mode link, not %s", mode);
    p_cuInit = cuInit;
    p_cuDeviceGet = cuDeviceGet;
    p_retain = cuDevicePrimaryCtxRetain;
    p_setCurrent = cuCtxSetCurrent;
    p_release = cuDevicePrimaryCtxRelease_v2;
    p_memAlloc = cuMemAlloc_v2;
    p_memFree = cuMemFree_v2;
    p_memGetInfo = cuMemGetInfo_v2;
    /* The link-time binding reaches the preloaded wrapper, not the driver. */
    expect_at("linked cuMemAlloc_v2", (void *)p_memAlloc, "libcuvisor", "cuMemAlloc_v2");
    expect_at("linked cuInit", (void *)p_cuInit, "libcuda.so", "cuInit");
}
#else
static void *lib;
static gpa_v2_t gpa;

static void *by_dlsym(const char *name) {
    void *p = dlsym(lib, name);
    CHECK(p != NULL, "dlsym(libcuda, %s): %s", name, dlerror());
    return p;
}

static void *get(const char *name, int version, unsigned long long flags) {
    void *p = NULL;
    int status = -1;
    CUresult r = gpa(name, &p, version, flags, &status);
    CHECK(r == 0 && status == 0 && p != NULL, "cuGetProcAddress_v2(%s, %d, %llu) = %d status %d", name, version, flags, r, status);
    return p;
}

static void expect(const char *base, int version, unsigned long long flags, const char *file, const char *symbol) {
    char what[128];
    snprintf(what, sizeof what, "%s@%d/%llu", base, version, flags);
    expect_at(what, get(base, version, flags), file, symbol);
}

static void resolve(const char *mode) {
    lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    CHECK(lib != NULL, "dlopen: %s", dlerror());
    if (strcmp(mode, "dlsym") == 0) {
        p_cuInit = by_dlsym("cuInit");
        p_cuDeviceGet = by_dlsym("cuDeviceGet");
        p_retain = by_dlsym("cuDevicePrimaryCtxRetain");
        p_setCurrent = by_dlsym("cuCtxSetCurrent");
        p_release = by_dlsym("cuDevicePrimaryCtxRelease_v2");
        p_memAlloc = by_dlsym("cuMemAlloc_v2");
        p_memFree = by_dlsym("cuMemFree_v2");
        p_memGetInfo = by_dlsym("cuMemGetInfo_v2");
        expect_at("dlsym cuMemAlloc_v2", (void *)p_memAlloc, "libcuvisor", "cuMemAlloc_v2");
        expect_at("dlsym cuInit", (void *)p_cuInit, "libcuda.so", "cuInit");
        return;
    }
    unsigned long long flags;
    if (strcmp(mode, "gpa") == 0) flags = 0;
    else if (strcmp(mode, "gpa_pt") == 0) flags = 2; /* CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM */
    else { CHECK(0, "unknown mode %s", mode); }
    gpa = (gpa_v2_t)by_dlsym("cuGetProcAddress_v2");
    expect_at("dlsym cuGetProcAddress_v2", (void *)gpa, "libcuvisor", "cuGetProcAddress_v2");
    /* The program may fetch cuGetProcAddress itself this way: it must stay intercepted. */
    gpa = (gpa_v2_t)get("cuGetProcAddress", 12000, flags);
    p_cuInit = get("cuInit", 12000, flags);
    p_cuDeviceGet = get("cuDeviceGet", 12000, flags);
    p_retain = get("cuDevicePrimaryCtxRetain", 12000, flags);
    p_setCurrent = get("cuCtxSetCurrent", 12000, flags);
    p_release = get("cuDevicePrimaryCtxRelease", 12000, flags);
    p_memAlloc = get("cuMemAlloc", 12000, flags);
    p_memFree = get("cuMemFree", 12000, flags);
    p_memGetInfo = get("cuMemGetInfo", 12000, flags);
    p_allocAsync = get("cuMemAllocAsync", 12000, flags);
    p_freeAsync = get("cuMemFreeAsync", 12000, flags);
    p_streamSync = get("cuStreamSynchronize", 12000, flags);

    /* Wrapped entry points: our export of exactly the ABI version the driver chose. */
    expect("cuGetProcAddress", 12000, flags, "libcuvisor", "cuGetProcAddress_v2");
    expect("cuMemAlloc", 12000, flags, "libcuvisor", "cuMemAlloc_v2");
    expect("cuMemFree", 12000, flags, "libcuvisor", "cuMemFree_v2");
    expect("cuMemGetInfo", 12000, flags, "libcuvisor", "cuMemGetInfo_v2");
    expect("cuMemAlloc", 2000, 0, "libcuvisor", "cuMemAlloc"); /* the 32-bit v1 */
    expect("cuDevicePrimaryCtxRelease", 12000, flags, "libcuvisor", "cuDevicePrimaryCtxRelease_v2");
    if (flags == 2) {
        expect("cuMemAllocAsync", 12000, 2, "libcuvisor", "cuMemAllocAsync_ptsz");
        expect("cuMemFreeAsync", 12000, 2, "libcuvisor", "cuMemFreeAsync_ptsz");
        expect("cuStreamSynchronize", 12000, 2, "libcuvisor", "cuStreamSynchronize_ptsz");
        expect("cuLaunchKernel", 12000, 2, "libcuvisor", "cuLaunchKernel_ptsz");
    } else {
        expect("cuMemAllocAsync", 12000, 0, "libcuvisor", "cuMemAllocAsync");
        expect("cuMemFreeAsync", 12000, 0, "libcuvisor", "cuMemFreeAsync");
        expect("cuStreamSynchronize", 12000, 0, "libcuvisor", "cuStreamSynchronize");
        expect("cuLaunchKernel", 12000, 0, "libcuvisor", "cuLaunchKernel");
    }
    /* Not wrapped: the driver's own. */
    expect("cuInit", 12000, flags, "libcuda.so", "cuInit");
    expect("cuCtxSetCurrent", 12000, flags, "libcuda.so", "cuCtxSetCurrent");
    if (flags == 2) expect("cuMemcpyHtoD", 12000, 2, "libcuda.so", "cuMemcpyHtoD_v2_ptds");
}
#endif

#define MAX_CHUNKS 4096

/* Fills the quota with `alloc`, then checks free-one-and-allocate-small; returns the total. */
static unsigned long long fill(const char *label, size_t chunk,
                               CUresult (*alloc)(CUdeviceptr *, size_t), CUresult (*release)(CUdeviceptr)) {
    static CUdeviceptr p[MAX_CHUNKS];
    int n = 0;
    CUresult r = 0;
    while (n < MAX_CHUNKS && (r = alloc(&p[n], chunk)) == 0) n++;
    unsigned long long total = (unsigned long long)n * chunk;
    printf("%s total %llu stopped %d\n", label, total, r);
    CHECK(r == 2, "%s: stopped with %d, not CUDA_ERROR_OUT_OF_MEMORY", label, r);
    CHECK(n > 0, "%s: nothing fitted", label);
    OK(release(p[--n]));
    CUdeviceptr small;
    OK(alloc(&small, 1 << 20));
    printf("%s after-free OK\n", label);
    OK(release(small));
    while (n > 0) OK(release(p[--n]));
    return total;
}

static CUresult async_alloc(CUdeviceptr *p, size_t n) { return p_allocAsync(p, n, NULL); }
static CUresult async_free(CUdeviceptr p) { return p_freeAsync(p, NULL); }

int main(int argc, char **argv) {
    CHECK(argc == 3, "usage: %s MODE CHUNK_MIB", argv[0]);
    const char *mode = argv[1];
    size_t chunk = (size_t)atol(argv[2]) << 20;
    resolve(mode);

    int dev;
    void *ctx;
    OK(p_cuInit(0));
    OK(p_cuDeviceGet(&dev, 0));
    OK(p_retain(&ctx, dev));
    OK(p_setCurrent(ctx));
    size_t free0, free1, total;
    OK(p_memGetInfo(&free0, &total));
    printf("start free %zu total %zu\n", free0, total);

    fill("sync", chunk, p_memAlloc, p_memFree);
    if (p_allocAsync != NULL) {
        fill("async", chunk, async_alloc, async_free);
        /* A pool keeps freed memory (and cuvisor its charge) until a synchronization point. */
        OK(p_streamSync(NULL));
    }

    OK(p_memGetInfo(&free1, &total));
    printf("end free %zu total %zu\n", free1, total);
    CHECK(free1 == free0, "free %zu at the end, %zu at the start", free1, free0);
    OK(p_release(dev));
    printf("OK\n");
    return 0;
}
