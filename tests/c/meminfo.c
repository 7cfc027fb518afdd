/* What a program is shown, asked every way at once: cuMemGetInfo_v2, cuDeviceTotalMem_v2 and
 * NVML's nvmlDeviceGetMemoryInfo (v1 and v2), after each step of a sequence of allocations and
 * frees given as arguments ("+N" allocates N MiB, "-I" frees the I-th allocation). Prints one
 * "report" line per step (and one before the first); exits non-zero if a call fails. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;
#define NVML_MEMORY_V2 ((unsigned)(sizeof(nvmlMemory_v2_t) | (2u << 24)))

#define CHECK(cond, ...) do { if (!(cond)) { fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); fprintf(stderr, __VA_ARGS__); fprintf(stderr, "\n"); exit(1); } } while (0)
#define OK(call) do { int r_ = (call); CHECK(r_ == 0, "%s returned %d", #call, r_); } while (0)

static void *sym(void *lib, const char *name) {
    void *p = dlsym(lib, name);
    CHECK(p != NULL, "no %s: %s", name, dlerror());
    return p;
}

int main(int argc, char **argv) {
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    void *nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    CHECK(cuda && nvml, "dlopen: %s", dlerror());
    CUresult (*cuInit)(unsigned) = sym(cuda, "cuInit");
    CUresult (*retain)(void **, int) = sym(cuda, "cuDevicePrimaryCtxRetain");
    CUresult (*setCurrent)(void *) = sym(cuda, "cuCtxSetCurrent");
    CUresult (*memAlloc)(CUdeviceptr *, size_t) = sym(cuda, "cuMemAlloc_v2");
    CUresult (*memFree)(CUdeviceptr) = sym(cuda, "cuMemFree_v2");
    CUresult (*memGetInfo)(size_t *, size_t *) = sym(cuda, "cuMemGetInfo_v2");
    CUresult (*totalMem)(size_t *, int) = sym(cuda, "cuDeviceTotalMem_v2");
    int (*nvmlInit)(void) = sym(nvml, "nvmlInit_v2");
    int (*byIndex)(unsigned, void **) = sym(nvml, "nvmlDeviceGetHandleByIndex_v2");
    int (*info1)(void *, nvmlMemory_t *) = sym(nvml, "nvmlDeviceGetMemoryInfo");
    int (*info2)(void *, nvmlMemory_v2_t *) = sym(nvml, "nvmlDeviceGetMemoryInfo_v2");

    void *ctx, *dev;
    OK(cuInit(0));
    OK(retain(&ctx, 0));
    OK(setCurrent(ctx));
    OK(nvmlInit());
    OK(byIndex(0, &dev));

    CUdeviceptr ptrs[64];
    size_t sizes[64];
    int n = 0;
    unsigned long long mine = 0;
    for (int step = 0; step < argc; step++) {
        if (step > 0) {
            const char *op = argv[step];
            if (op[0] == '+') {
                CHECK(n < 64, "too many allocations");
                sizes[n] = (size_t)atol(op + 1) << 20;
                OK(memAlloc(&ptrs[n], sizes[n]));
                mine += sizes[n++];
            } else if (op[0] == '-') {
                int i = atoi(op + 1);
                CHECK(i < n && sizes[i] != 0, "no allocation %d", i);
                OK(memFree(ptrs[i]));
                mine -= sizes[i];
                sizes[i] = 0;
            } else {
                CHECK(0, "bad op %s", op);
            }
        }
        size_t cu_free, cu_total, dev_total;
        OK(memGetInfo(&cu_free, &cu_total));
        OK(totalMem(&dev_total, 0));
        nvmlMemory_t m1;
        OK(info1(dev, &m1));
        nvmlMemory_v2_t m2 = { .version = NVML_MEMORY_V2 };
        OK(info2(dev, &m2));
        printf("report mine %llu cu_free %zu cu_total %zu dev_total %zu nvml_total %llu nvml_free %llu nvml_used %llu "
               "nvml2_total %llu nvml2_free %llu nvml2_used %llu\n",
               mine, cu_free, cu_total, dev_total, m1.total, m1.free, m1.used, m2.total, m2.free, m2.used);
    }
    return 0;
}
