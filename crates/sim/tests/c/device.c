/* The device chapter on the simulator, through CUDA 13.5's own cuda.h: every device attribute
 * the header defines on every device, the peer queries on every pair, the other device queries,
 * and, for the kernels of a module image (argv[1], a cubin or fat binary; optional), their
 * attributes and the occupancy calculator. Prints one "key value..." line per fact for
 * tests/c_clients.rs to check; exits non-zero at the first call that answers other than the
 * header documents. */
/* cuDeviceGetProperties is deprecated, and called here on purpose: programs still do. */
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#include <cuda.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

#define CHECK(call, want)                                                        \
    do {                                                                         \
        CUresult r_ = (call);                                                    \
        if (r_ != (want)) {                                                      \
            printf("FAIL %s:%d %s = %d, want %d\n", __FILE__, __LINE__, #call,   \
                   (int)r_, (int)(want));                                        \
            exit(1);                                                             \
        }                                                                        \
    } while (0)

/* NVML's view of the same figures (nvml.h: nvmlInit_v2, nvmlDeviceGetHandleByIndex_v2,
 * nvmlDeviceGetMaxClockInfo with NVML_CLOCK_SM = 1 and NVML_CLOCK_MEM = 2,
 * nvmlDeviceGetMemoryBusWidth), through dlopen so that this client needs no nvml.h. */
static void nvml_figures(int n) {
    void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!h) {
        printf("FAIL dlopen libnvidia-ml.so.1: %s\n", dlerror());
        exit(1);
    }
    int (*init)(void) = (int (*)(void))dlsym(h, "nvmlInit_v2");
    int (*get)(unsigned, void **) = (int (*)(unsigned, void **))dlsym(h, "nvmlDeviceGetHandleByIndex_v2");
    int (*clock)(void *, int, unsigned *) = (int (*)(void *, int, unsigned *))dlsym(h, "nvmlDeviceGetMaxClockInfo");
    int (*width)(void *, unsigned *) = (int (*)(void *, unsigned *))dlsym(h, "nvmlDeviceGetMemoryBusWidth");
    if (!init || !get || !clock || !width || init() != 0) {
        printf("FAIL NVML entry points\n");
        exit(1);
    }
    for (int d = 0; d < n; d++) {
        void *dev;
        unsigned sm = 0, mem = 0, w = 0;
        if (get(d, &dev) || clock(dev, 1, &sm) || clock(dev, 2, &mem) || width(dev, &w)) {
            printf("FAIL NVML figures of %d\n", d);
            exit(1);
        }
        printf("nvml %d %u %u %u\n", d, sm, mem, w);
    }
}

static size_t smem_for_block(int block) { return (size_t)block * 16; }

static const char *KERNELS[] = {"light", "smem", "local", "heavy"};
static const int BLOCKS[] = {32, 64, 96, 128, 256, 512, 640, 1024};

int main(int argc, char **argv) {
    CHECK(cuInit(0), CUDA_SUCCESS);
    int n;
    CHECK(cuDeviceGetCount(&n), CUDA_SUCCESS);
    printf("devices %d\n", n);
    for (int d = 0; d < n; d++) {
        for (int a = 1; a < CU_DEVICE_ATTRIBUTE_MAX; a++) {
            int v = -12345;
            CHECK(cuDeviceGetAttribute(&v, (CUdevice_attribute)a, d), CUDA_SUCCESS);
            printf("attr %d %d %d\n", d, a, v);
        }
        int v;
        CHECK(cuDeviceGetAttribute(&v, (CUdevice_attribute)0, d), CUDA_ERROR_INVALID_VALUE);
        CHECK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_MAX, d), CUDA_ERROR_INVALID_VALUE);
        CHECK(cuDeviceGetAttribute(&v, (CUdevice_attribute)-1, d), CUDA_ERROR_INVALID_VALUE);
        CHECK(cuDeviceGetAttribute(NULL, CU_DEVICE_ATTRIBUTE_WARP_SIZE, d), CUDA_ERROR_INVALID_VALUE);

        CUdevprop prop;
        CHECK(cuDeviceGetProperties(&prop, d), CUDA_SUCCESS);
        int clock, smem;
        CHECK(cuDeviceGetAttribute(&clock, CU_DEVICE_ATTRIBUTE_CLOCK_RATE, d), CUDA_SUCCESS);
        CHECK(cuDeviceGetAttribute(&smem, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK, d), CUDA_SUCCESS);
        if (prop.clockRate != clock || prop.sharedMemPerBlock != smem || prop.SIMDWidth != 32 ||
            prop.maxThreadsDim[2] != 64 || prop.maxGridSize[0] != 2147483647) {
            printf("FAIL cuDeviceGetProperties disagrees with the attributes\n");
            return 1;
        }
        char luid[8];
        unsigned mask;
        CHECK(cuDeviceGetLuid(luid, &mask, d), CUDA_ERROR_NOT_SUPPORTED);
        CHECK(cuDeviceGetExecAffinitySupport(&v, CU_EXEC_AFFINITY_TYPE_SM_COUNT, d), CUDA_SUCCESS);
        printf("exec_affinity %d %d\n", d, v);
        CHECK(cuDeviceGetExecAffinitySupport(&v, CU_EXEC_AFFINITY_TYPE_MAX, d), CUDA_ERROR_INVALID_VALUE);
        size_t w;
        CHECK(cuDeviceGetTexture1DLinearMaxWidth(&w, CU_AD_FORMAT_FLOAT, 4, d), CUDA_SUCCESS);
        printf("tex1d_linear %d %zu\n", d, w);
        CHECK(cuDeviceGetTexture1DLinearMaxWidth(&w, CU_AD_FORMAT_FLOAT, 3, d), CUDA_ERROR_INVALID_VALUE);
        CUatomicOperation ops[2] = {CU_ATOMIC_OPERATION_INTEGER_ADD, CU_ATOMIC_OPERATION_CAS};
        unsigned caps[2] = {99, 99};
        CHECK(cuDeviceGetHostAtomicCapabilities(caps, ops, 2, d), CUDA_SUCCESS);
        printf("host_atomic %d %u %u\n", d, caps[0], caps[1]);
        CHECK(cuDeviceGetHostAtomicCapabilities(caps, ops, 0, d), CUDA_ERROR_INVALID_VALUE);
        for (int p = 0; p < n; p++) {
            int can = -1;
            CHECK(cuDeviceCanAccessPeer(&can, d, p), CUDA_SUCCESS);
            if (p == d) {
                CHECK(cuDeviceGetP2PAttribute(&v, CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED, d, p),
                      CUDA_ERROR_INVALID_DEVICE);
                CHECK(cuDeviceGetP2PAtomicCapabilities(caps, ops, 2, d, p), CUDA_ERROR_INVALID_DEVICE);
                /* The devices are checked before the attribute. */
                CHECK(cuDeviceGetP2PAttribute(&v, (CUdevice_P2PAttribute)9999, d, p), CUDA_ERROR_INVALID_DEVICE);
                continue;
            }
            int attrs[5];
            for (int a = 1; a <= 5; a++)
                CHECK(cuDeviceGetP2PAttribute(&attrs[a - 1], (CUdevice_P2PAttribute)a, d, p), CUDA_SUCCESS);
            CHECK(cuDeviceGetP2PAttribute(&v, (CUdevice_P2PAttribute)6, d, p), CUDA_ERROR_INVALID_VALUE);
            CHECK(cuDeviceGetP2PAtomicCapabilities(caps, ops, 2, d, p), CUDA_SUCCESS);
            printf("p2p %d %d can %d rank %d access %d atomic %d array %d partial %d caps %u %u\n", d, p,
                   can, attrs[0], attrs[1], attrs[2], attrs[3], attrs[4], caps[0], caps[1]);
        }
    }
    int v;
    CHECK(cuDeviceGetP2PAttribute(&v, CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED, 0, n), CUDA_ERROR_INVALID_DEVICE);
    nvml_figures(n);
    if (argc < 2) return 0;

    /* Occupancy: the image's kernels in a context on device 0. */
    CUcontext ctx;
    CUmodule mod;
    CHECK(cuCtxCreate(&ctx, NULL, 0, 0), CUDA_SUCCESS);
    CHECK(cuModuleLoad(&mod, argv[1]), CUDA_SUCCESS);
    for (unsigned k = 0; k < sizeof KERNELS / sizeof *KERNELS; k++) {
        CUfunction f;
        CHECK(cuModuleGetFunction(&f, mod, KERNELS[k]), CUDA_SUCCESS);
        int fa[7];
        for (int a = 0; a < 7; a++)
            CHECK(cuFuncGetAttribute(&fa[a], (CUfunction_attribute)a, f), CUDA_SUCCESS);
        int maxdyn;
        CHECK(cuFuncGetAttribute(&maxdyn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, f), CUDA_SUCCESS);
        CHECK(cuFuncGetAttribute(&v, CU_FUNC_ATTRIBUTE_MAX, f), CUDA_ERROR_INVALID_VALUE);
        CHECK(cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_NUM_REGS, 8), CUDA_ERROR_INVALID_VALUE);
        printf("func %s max_threads %d shared %d const %d local %d regs %d ptx %d binary %d max_dynamic %d\n",
               KERNELS[k], fa[0], fa[1], fa[2], fa[3], fa[4], fa[5], fa[6], maxdyn);
        for (unsigned b = 0; b < sizeof BLOCKS / sizeof *BLOCKS; b++) {
            int o0, o1;
            CHECK(cuOccupancyMaxActiveBlocksPerMultiprocessor(&o0, f, BLOCKS[b], 0), CUDA_SUCCESS);
            CHECK(cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(&o1, f, BLOCKS[b], 20000, 0), CUDA_SUCCESS);
            printf("occ %s %d %d %d\n", KERNELS[k], BLOCKS[b], o0, o1);
        }
        int grid, block;
        CHECK(cuOccupancyMaxPotentialBlockSize(&grid, &block, f, NULL, 0, 0), CUDA_SUCCESS);
        printf("potential %s 0 %d %d\n", KERNELS[k], grid, block);
        CHECK(cuOccupancyMaxPotentialBlockSize(&grid, &block, f, smem_for_block, 0, 0), CUDA_SUCCESS);
        printf("potential %s cb %d %d\n", KERNELS[k], grid, block);
        CHECK(cuOccupancyMaxPotentialBlockSizeWithFlags(&grid, &block, f, NULL, 0, 128, 0), CUDA_SUCCESS);
        printf("potential %s limit128 %d %d\n", KERNELS[k], grid, block);
        size_t avail;
        CHECK(cuOccupancyAvailableDynamicSMemPerBlock(&avail, f, 1, 128), CUDA_SUCCESS);
        printf("avail %s 1 %zu\n", KERNELS[k], avail);
        CHECK(cuOccupancyAvailableDynamicSMemPerBlock(&avail, f, 2, 128), CUDA_SUCCESS);
        printf("avail %s 2 %zu\n", KERNELS[k], avail);
        CHECK(cuOccupancyAvailableDynamicSMemPerBlock(&avail, f, 1000, 128), CUDA_ERROR_INVALID_VALUE);
        CUlaunchConfig cfg = {0};
        cfg.blockDimX = 128;
        cfg.blockDimY = cfg.blockDimZ = 1;
        cfg.gridDimX = cfg.gridDimY = cfg.gridDimZ = 1;
        int cl;
        CUresult rc = cuOccupancyMaxPotentialClusterSize(&cl, f, &cfg);
        printf("cluster %s %d %d\n", KERNELS[k], (int)rc, rc == CUDA_SUCCESS ? cl : -1);
    }
    /* Opting in to more dynamic shared memory than 48 KiB: the attribute, then the occupancy. */
    CUfunction f;
    CHECK(cuModuleGetFunction(&f, mod, "smem"), CUDA_SUCCESS);
    int optin;
    CHECK(cuDeviceGetAttribute(&optin, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, 0), CUDA_SUCCESS);
    int shared;
    CHECK(cuFuncGetAttribute(&shared, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, f), CUDA_SUCCESS);
    CHECK(cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, optin - shared + 1),
          CUDA_ERROR_INVALID_VALUE);
    int o;
    CHECK(cuOccupancyMaxActiveBlocksPerMultiprocessor(&o, f, 128, 60000), CUDA_SUCCESS);
    printf("optin before %d\n", o);
    CHECK(cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 60000), CUDA_SUCCESS);
    CHECK(cuFuncGetAttribute(&v, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, f), CUDA_SUCCESS);
    CHECK(cuOccupancyMaxActiveBlocksPerMultiprocessor(&o, f, 128, 60000), CUDA_SUCCESS);
    printf("optin after %d %d\n", v, o);
    CHECK(cuOccupancyMaxActiveBlocksPerMultiprocessor(&o, f, 128, 60001), CUDA_SUCCESS);
    printf("optin beyond %d\n", o);
    CHECK(cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 101), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 0), CUDA_SUCCESS);
    CHECK(cuOccupancyMaxActiveBlocksPerMultiprocessor(&o, f, 64, 0), CUDA_SUCCESS);
    printf("carveout0 %d\n", o);
    CHECK(cuOccupancyMaxActiveBlocksPerMultiprocessor(&o, f, 0, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(&o, f, 64, 0, 2), CUDA_ERROR_INVALID_VALUE);
    /* Without a current context the occupancy calls have nothing to compute for. */
    CUcontext popped;
    CHECK(cuCtxPopCurrent(&popped), CUDA_SUCCESS);
    CHECK(cuOccupancyMaxActiveBlocksPerMultiprocessor(&o, f, 64, 0), CUDA_ERROR_INVALID_CONTEXT);
    CHECK(cuCtxPushCurrent(popped), CUDA_SUCCESS);
    CHECK(cuModuleUnload(mod), CUDA_SUCCESS);
    CHECK(cuCtxDestroy(ctx), CUDA_SUCCESS);
    printf("OK\n");
    return 0;
}
