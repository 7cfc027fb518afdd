/* Contexts take device memory (linked against libcuda and libnvidia-ml, like a toolkit program
 * and a monitoring tool): argv[1] is the bytes one context takes on this GPU (the machine
 * model's context_memory). Checks, printing "OK" at the end, each failure a line on stderr and
 * exit 1:
 *   - cuCtxCreate takes it: cuMemGetInfo's free drops by it, NVML's used memory and this
 *     process's usedGpuMemory (nvmlDeviceGetComputeRunningProcesses_v3) count it;
 *   - a second context takes it again, and cuCtxDestroy gives it back;
 *   - the primary context takes it from its first retain to its last release;
 *   - a context that does not fit beside what is allocated is CUDA_ERROR_OUT_OF_MEMORY (2), and
 *     fits again once memory is freed. */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
CUresult cuInit(unsigned int);
CUresult cuDeviceGet(int *, int);
CUresult cuCtxCreate_v2(void **, unsigned int, int);
CUresult cuCtxDestroy_v2(void *);
CUresult cuCtxSetCurrent(void *);
CUresult cuDevicePrimaryCtxRetain(void **, int);
CUresult cuDevicePrimaryCtxRelease_v2(int);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemGetInfo_v2(size_t *, size_t *);

typedef int nvmlReturn_t;
typedef void *nvmlDevice_t;
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t;
nvmlReturn_t nvmlInit_v2(void);
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int, nvmlDevice_t *);
nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t, nvmlMemory_t *);
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t, unsigned int *, nvmlProcessInfo_t *);

static int failed;
#define CHECK(cond, ...)                                                 \
    do {                                                                 \
        if (!(cond)) {                                                   \
            fprintf(stderr, "line %d: ", __LINE__);                      \
            fprintf(stderr, __VA_ARGS__);                                \
            fputc('\n', stderr);                                         \
            failed = 1;                                                  \
        }                                                                \
    } while (0)
#define OK(call) CHECK((call) == 0, "%s failed", #call)

static nvmlDevice_t gpu;

static size_t free_mem(void) {
    size_t free, total;
    OK(cuMemGetInfo_v2(&free, &total));
    return free;
}

/* NVML's used memory of the device, and what it lists for this process (0 if absent). */
static void nvml_used(unsigned long long *device, unsigned long long *mine) {
    nvmlMemory_t m;
    OK(nvmlDeviceGetMemoryInfo(gpu, &m));
    *device = m.used;
    nvmlProcessInfo_t p[16];
    unsigned int n = 16;
    OK(nvmlDeviceGetComputeRunningProcesses_v3(gpu, &n, p));
    *mine = 0;
    for (unsigned int i = 0; i < n; i++)
        if (p[i].pid == (unsigned int)getpid()) *mine = p[i].usedGpuMemory;
}

int main(int argc, char **argv) {
    if (argc != 2) return 2;
    const unsigned long long ctx_mem = strtoull(argv[1], NULL, 10);
    int dev;
    void *a, *b, *primary;
    unsigned long long used, mine;
    size_t total;
    OK(cuInit(0));
    OK(cuDeviceGet(&dev, 0));
    OK(nvmlInit_v2());
    OK(nvmlDeviceGetHandleByIndex_v2(0, &gpu));
    nvml_used(&used, &mine);
    CHECK(used == 0 && mine == 0, "before any context: used %llu, mine %llu", used, mine);

    OK(cuCtxCreate_v2(&a, 0, dev));
    size_t free1;
    OK(cuMemGetInfo_v2(&free1, &total));
    CHECK(total - free1 == ctx_mem, "one context: %zu of %zu free", free1, total);
    nvml_used(&used, &mine);
    CHECK(used == ctx_mem && mine == ctx_mem, "NVML, one context: used %llu, mine %llu", used, mine);

    OK(cuCtxCreate_v2(&b, 0, dev));
    CHECK(free1 - free_mem() == ctx_mem, "a second context takes its own");
    nvml_used(&used, &mine);
    CHECK(used == 2 * ctx_mem && mine == 2 * ctx_mem, "NVML, two: used %llu, mine %llu", used, mine);
    OK(cuCtxDestroy_v2(b));
    OK(cuCtxSetCurrent(a));
    CHECK(free_mem() == free1, "cuCtxDestroy gives it back");

    OK(cuDevicePrimaryCtxRetain(&primary, dev));
    CHECK(free1 - free_mem() == ctx_mem, "the primary context takes its own once retained");
    void *again;
    OK(cuDevicePrimaryCtxRetain(&again, dev));
    CHECK(free1 - free_mem() == ctx_mem, "once, however often retained");
    OK(cuDevicePrimaryCtxRelease_v2(dev));
    OK(cuDevicePrimaryCtxRelease_v2(dev));
    CHECK(free_mem() == free1, "its last release gives it back");

    /* Fill the device in 256 MiB steps, then 1 MiB ones, until less than a context is free. */
    CUdeviceptr p[1024];
    int n = 0;
    for (size_t step = 256 << 20; step >= 1 << 20 && n < 1024; step >>= 8)
        while (n < 1024 && free_mem() >= step + ctx_mem && cuMemAlloc_v2(&p[n], step) == 0) n++;
    while (n < 1024 && free_mem() >= ctx_mem && cuMemAlloc_v2(&p[n], 1 << 20) == 0) n++;
    CHECK(free_mem() < ctx_mem, "filled to less than a context: %zu free", free_mem());
    CHECK(cuCtxCreate_v2(&b, 0, dev) == 2, "a context that does not fit: CUDA_ERROR_OUT_OF_MEMORY");
    OK(cuCtxSetCurrent(a));
    for (int i = 0; i < n; i++) OK(cuMemFree_v2(p[i]));
    OK(cuCtxCreate_v2(&b, 0, dev));
    OK(cuCtxDestroy_v2(b));
    OK(cuCtxDestroy_v2(a));
    nvml_used(&used, &mine);
    CHECK(used == 0 && mine == 0, "every context gone: used %llu, mine %llu", used, mine);
    if (!failed) puts("OK");
    return failed;
}
