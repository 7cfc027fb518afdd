/* Resolves the driver exactly like libcudart 12 does: dlopen("libcuda.so.1"), dlsym
 * "cuGetProcAddress_v2", then every entry point by base name with cudaVersion 12000.
 * Also checks cuGetProcAddress's documented edge cases against dlsym of the exact symbols. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef CUresult (*gpa_v2_t)(const char *, void **, int, unsigned long long, int *);
typedef CUresult (*gpa_v1_t)(const char *, void **, int, unsigned long long);

#define CHECK(cond, ...) do { if (!(cond)) { fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); fprintf(stderr, __VA_ARGS__); fprintf(stderr, "\n"); exit(1); } } while (0)
#define OK(call) do { CUresult r_ = (call); CHECK(r_ == 0, "%s returned %d", #call, r_); } while (0)

static void *lib;
static gpa_v2_t gpa;

static void *get(const char *name, int version, unsigned long long flags) {
    void *p = NULL;
    int status = -1;
    CUresult r = gpa(name, &p, version, flags, &status);
    CHECK(r == 0 && status == 0 && p != NULL, "cuGetProcAddress_v2(%s, %d, %llu) = %d status %d", name, version, flags, r, status);
    return p;
}

static void expect_symbol(const char *base, int version, unsigned long long flags, const char *symbol) {
    void *want = dlsym(lib, symbol);
    CHECK(want != NULL, "libcuda.so.1 does not export %s", symbol);
    CHECK(get(base, version, flags) == want, "%s@%d flags %llu is not %s", base, version, flags, symbol);
}

static void expect_missing(const char *name, int version, unsigned long long flags, int want_status) {
    void *p = (void *)1;
    int status = -1;
    CUresult r = gpa(name, &p, version, flags, &status);
    CHECK(r == 500 && p == NULL && status == want_status, "%s@%d: result %d pfn %p status %d (want 500, NULL, %d)", name, version, r, p, status, want_status);
}

int main(void) {
    lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    CHECK(lib != NULL, "dlopen: %s", dlerror());
    gpa = (gpa_v2_t)dlsym(lib, "cuGetProcAddress_v2");
    CHECK(gpa != NULL, "no cuGetProcAddress_v2");

    /* Working functions, as libcudart 12 gets them. */
    CUresult (*cuInit)(unsigned) = get("cuInit", 12000, 0);
    CUresult (*cuDeviceGet)(int *, int) = get("cuDeviceGet", 12000, 0);
    CUresult (*retain)(void **, int) = get("cuDevicePrimaryCtxRetain", 12000, 0);
    CUresult (*setCurrent)(void *) = get("cuCtxSetCurrent", 12000, 0);
    CUresult (*memAlloc)(CUdeviceptr *, size_t) = get("cuMemAlloc", 12000, 0);
    CUresult (*memFree)(CUdeviceptr) = get("cuMemFree", 12000, 0);
    CUresult (*memGetInfo)(size_t *, size_t *) = get("cuMemGetInfo", 12000, 0);
    CUresult (*totalMem)(size_t *, int) = get("cuDeviceTotalMem", 12000, 0);
    CUresult (*htod)(CUdeviceptr, const void *, size_t) = get("cuMemcpyHtoD", 12000, 0);
    CUresult (*dtoh)(void *, CUdeviceptr, size_t) = get("cuMemcpyDtoH", 12000, 0);
    CUresult (*loadData)(void **, const void *) = get("cuModuleLoadData", 12000, 0);
    CUresult (*getFunction)(void **, void *, const char *) = get("cuModuleGetFunction", 12000, 0);
    CUresult (*launch)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **, void **) = get("cuLaunchKernel", 12000, 0);
    CUresult (*streamSync)(void *) = get("cuStreamSynchronize", 12000, 0);

    int dev;
    void *ctx, *mod, *fn;
    OK(cuInit(0));
    OK(cuDeviceGet(&dev, 0));
    OK(retain(&ctx, dev));
    OK(setCurrent(ctx));
    size_t total, free0, free1, dtotal;
    OK(totalMem(&dtotal, dev));
    OK(memGetInfo(&free0, &total));
    CHECK(total == dtotal, "cuMemGetInfo total %zu != cuDeviceTotalMem %zu", total, dtotal);
    CUdeviceptr d;
    OK(memAlloc(&d, 1 << 20));
    OK(memGetInfo(&free1, &total));
    CHECK(free0 - free1 == 1 << 20, "free dropped by %zu", free0 - free1);
    char in[256], out[256];
    for (int i = 0; i < 256; i++) in[i] = (char)i;
    OK(htod(d, in, sizeof in));
    OK(dtoh(out, d, sizeof out));
    CHECK(memcmp(in, out, sizeof in) == 0, "copy round trip");
    OK(loadData(&mod, "image"));
    OK(getFunction(&fn, mod, "sim_busy_kernel"));
    unsigned long long ns = 1000000;
    void *args[] = { &ns };
    OK(launch(fn, 1, 1, 1, 32, 1, 1, 0, NULL, args, NULL));
    OK(streamSync(NULL));
    OK(memFree(d));
    CHECK(memFree(d) == 1, "double free is CUDA_ERROR_INVALID_VALUE");

    /* Versioned entry points: the ABI of the requested version. */
    expect_symbol("cuMemAlloc", 2000, 0, "cuMemAlloc");
    expect_symbol("cuMemAlloc", 3020, 0, "cuMemAlloc_v2");
    expect_symbol("cuMemAlloc", 12000, 0, "cuMemAlloc_v2");
    expect_symbol("cuCtxCreate", 3020, 0, "cuCtxCreate_v2");
    expect_symbol("cuCtxCreate", 11040, 0, "cuCtxCreate_v3");
    expect_symbol("cuCtxCreate", 12080, 0, "cuCtxCreate_v4");
    expect_symbol("cuGetProcAddress", 12000, 0, "cuGetProcAddress_v2");
    expect_symbol("cuGetProcAddress", 11030, 0, "cuGetProcAddress");
    /* CUDA 13.0's forms that take their context, which libcudart 13 asks for. */
    expect_symbol("cuCtxGetDevice", 12090, 0, "cuCtxGetDevice");
    expect_symbol("cuCtxGetDevice", 13000, 0, "cuCtxGetDevice_v2");
    expect_symbol("cuCtxSynchronize", 13000, 0, "cuCtxSynchronize_v2");
    expect_symbol("cuStreamGetCtx", 12050, 0, "cuStreamGetCtx_v2");
    expect_symbol("cuStreamGetCaptureInfo", 12030, 2, "cuStreamGetCaptureInfo_v3_ptsz");
    /* Per-thread default stream: _ptsz for stream work, _ptds for synchronous copies. */
    expect_symbol("cuLaunchKernel", 12000, 0, "cuLaunchKernel");
    expect_symbol("cuLaunchKernel", 12000, 1, "cuLaunchKernel");
    expect_symbol("cuLaunchKernel", 12000, 2, "cuLaunchKernel_ptsz");
    expect_symbol("cuMemAllocAsync", 12000, 2, "cuMemAllocAsync_ptsz");
    expect_symbol("cuGraphLaunch", 12000, 2, "cuGraphLaunch_ptsz");
    expect_symbol("cuMemcpyHtoD", 12000, 2, "cuMemcpyHtoD_v2_ptds");
    expect_symbol("cuMemAlloc", 12000, 2, "cuMemAlloc_v2"); /* no per-thread form */

    /* Failures: NULL pointer, CUDA_ERROR_NOT_FOUND, and the status that says why. */
    expect_missing("cuNoSuchFunction", 12000, 0, 1);
    expect_missing("", 12000, 0, 1);
    expect_missing("cuMemAlloc_v2", 12000, 0, 1);      /* suffixed names are not base names */
    expect_missing("cuMemAllocAsync", 11000, 0, 2);    /* exists since 11.2 */
    expect_missing("cuLaunchKernel", 6000, 2, 2);      /* per-thread form exists since 7.0 */
    void *p = (void *)1;
    int status = -1;
    CHECK(gpa("cuInit", &p, 13010, 0, &status) == 1, "a version newer than the driver (13.0) is CUDA_ERROR_INVALID_VALUE");
    CHECK(gpa("cuInit", &p, 12000, 4, &status) == 1, "unknown flags are CUDA_ERROR_INVALID_VALUE");
    CHECK(gpa("cuInit", NULL, 12000, 0, &status) == 1, "NULL pfn is CUDA_ERROR_INVALID_VALUE");
    CHECK(gpa("cuInit", &p, 12000, 0, NULL) == 0 && p != NULL, "symbolStatus may be NULL");
    gpa_v1_t v1 = (gpa_v1_t)dlsym(lib, "cuGetProcAddress");
    CHECK(v1 && v1("cuMemGetInfo", &p, 11030, 0) == 0 && p == dlsym(lib, "cuMemGetInfo_v2"), "v1 cuGetProcAddress");
    CUresult (*exportTable)(const void **, const void *) = get("cuGetExportTable", 12000, 0);
    const void *table;
    char uuid[16] = {0};
    CHECK(exportTable(&table, uuid) == 1 && table == NULL, "cuGetExportTable refuses an unknown id");
    /* CUDART_INTERFACE (6bd5fb6c-5bf4-e74a-8987-d93912fd9df9): slot 0 is its size in bytes. */
    const unsigned char cudart_interface[16] = {0x6b, 0xd5, 0xfb, 0x6c, 0x5b, 0xf4, 0xe7, 0x4a,
                                                0x89, 0x87, 0xd9, 0x39, 0x12, 0xfd, 0x9d, 0xf9};
    CHECK(exportTable(&table, cudart_interface) == 0 && table && ((const size_t *)table)[0] == 13 * 8,
          "cuGetExportTable answers the table libcudart asks for");
    printf("OK\n");
    return 0;
}
