/* The driver-level twin of tf_stress.py: the same over-allocation test with nothing but the CUDA
 * driver API, so that it runs anywhere libcuda.so.1 does — on the simulated GPU in CI, on a real
 * GPU in scripts/gpu-check.sh.
 *
 * It reads free and total memory with cuMemGetInfo, then for each fraction 0.3, 0.5, 0.8, 1.0,
 * 1.2 of that free memory allocates the whole amount as one cuMemAlloc, frees it, and prints one
 * line. It then allocates 1 MiB to show the process carries on after a refusal. It passes (exit
 * 0) iff every fraction <= 1.0 succeeded, 1.2 failed with CUDA_ERROR_OUT_OF_MEMORY, and the
 * 1 MiB allocation succeeded. Exit 1: a check failed; exit 2: no usable driver or device.
 *
 * The entry points are found the way libcudart 12 (and so TensorFlow and PyTorch) finds them:
 * dlopen("libcuda.so.1"), then cuGetProcAddress_v2 with base names and cudaVersion 12000. With
 * --resolve dlsym it uses dlsym on the library handle with the versioned names instead (the way
 * programs written against the driver API directly do). No CUDA headers needed:
 *
 *     cc -O2 -Wall -o twin examples/tf_stress/twin.c -ldl
 *     cuvisor run --memory 6Gi --sim single -- ./twin
 *
 * Usage: twin [--device N] [--resolve procaddress|dlsym]
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;

enum { CUDA_SUCCESS = 0, CUDA_ERROR_OUT_OF_MEMORY = 2 };
#define MIB (1024.0 * 1024.0)

static CUresult (*p_cuInit)(unsigned);
static CUresult (*p_cuDeviceGet)(CUdevice *, int);
static CUresult (*p_cuDeviceGetName)(char *, int, CUdevice);
static CUresult (*p_cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
static CUresult (*p_cuDevicePrimaryCtxRelease)(CUdevice);
static CUresult (*p_cuCtxSetCurrent)(CUcontext);
static CUresult (*p_cuMemGetInfo)(size_t *, size_t *);
static CUresult (*p_cuMemAlloc)(CUdeviceptr *, size_t);
static CUresult (*p_cuMemFree)(CUdeviceptr);
static CUresult (*p_cuGetErrorName)(CUresult, const char **);

static void *lib;

typedef CUresult (*gpa_v2_t)(const char *, void **, int, unsigned long long, int *);

static void setup_failure(const char *what) {
    fprintf(stderr, "twin: %s\n", what);
    exit(2);
}

/* Through cuGetProcAddress_v2, as libcudart 12 does (flags 0 = CU_GET_PROC_ADDRESS_DEFAULT). */
static void *by_procaddress(gpa_v2_t gpa, const char *base) {
    void *p = NULL;
    int status = -1;
    CUresult r = gpa(base, &p, 12000, 0, &status);
    if (r != CUDA_SUCCESS || p == NULL) {
        fprintf(stderr, "twin: cuGetProcAddress_v2(\"%s\", 12000) = %d (symbol status %d)\n", base, r, status);
        exit(2);
    }
    return p;
}

static void *by_dlsym(const char *symbol) {
    void *p = dlsym(lib, symbol);
    if (p == NULL) {
        fprintf(stderr, "twin: libcuda.so.1 has no %s\n", symbol);
        exit(2);
    }
    return p;
}

/* Returns how the entry points were found, for the header line. */
static const char *resolve(int use_dlsym) {
    lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        fprintf(stderr, "twin: cannot load the CUDA driver: %s\n", dlerror());
        exit(2);
    }
    gpa_v2_t gpa = use_dlsym ? NULL : (gpa_v2_t)dlsym(lib, "cuGetProcAddress_v2");
    if (gpa != NULL) {
        *(void **)&p_cuInit = by_procaddress(gpa, "cuInit");
        *(void **)&p_cuDeviceGet = by_procaddress(gpa, "cuDeviceGet");
        *(void **)&p_cuDeviceGetName = by_procaddress(gpa, "cuDeviceGetName");
        *(void **)&p_cuDevicePrimaryCtxRetain = by_procaddress(gpa, "cuDevicePrimaryCtxRetain");
        *(void **)&p_cuDevicePrimaryCtxRelease = by_procaddress(gpa, "cuDevicePrimaryCtxRelease");
        *(void **)&p_cuCtxSetCurrent = by_procaddress(gpa, "cuCtxSetCurrent");
        *(void **)&p_cuMemGetInfo = by_procaddress(gpa, "cuMemGetInfo");
        *(void **)&p_cuMemAlloc = by_procaddress(gpa, "cuMemAlloc");
        *(void **)&p_cuMemFree = by_procaddress(gpa, "cuMemFree");
        *(void **)&p_cuGetErrorName = by_procaddress(gpa, "cuGetErrorName");
        return "cuGetProcAddress_v2, cudaVersion 12000";
    }
    *(void **)&p_cuInit = by_dlsym("cuInit");
    *(void **)&p_cuDeviceGet = by_dlsym("cuDeviceGet");
    *(void **)&p_cuDeviceGetName = by_dlsym("cuDeviceGetName");
    *(void **)&p_cuDevicePrimaryCtxRetain = by_dlsym("cuDevicePrimaryCtxRetain");
    *(void **)&p_cuDevicePrimaryCtxRelease = by_dlsym("cuDevicePrimaryCtxRelease_v2");
    *(void **)&p_cuCtxSetCurrent = by_dlsym("cuCtxSetCurrent");
    *(void **)&p_cuMemGetInfo = by_dlsym("cuMemGetInfo_v2");
    *(void **)&p_cuMemAlloc = by_dlsym("cuMemAlloc_v2");
    *(void **)&p_cuMemFree = by_dlsym("cuMemFree_v2");
    *(void **)&p_cuGetErrorName = by_dlsym("cuGetErrorName");
    return use_dlsym ? "dlsym" : "dlsym (no cuGetProcAddress_v2 in this driver)";
}

static const char *error_name(CUresult r) {
    const char *name = NULL;
    if (p_cuGetErrorName != NULL && p_cuGetErrorName(r, &name) == CUDA_SUCCESS && name != NULL)
        return name;
    static char buf[32];
    snprintf(buf, sizeof buf, "CUresult %d", r);
    return buf;
}

static void must(CUresult r, const char *call) {
    if (r != CUDA_SUCCESS) {
        fprintf(stderr, "twin: %s failed: %s\n", call, error_name(r));
        exit(2);
    }
}

int main(int argc, char **argv) {
    int ordinal = 0, use_dlsym = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--device") == 0 && i + 1 < argc) {
            char *end = NULL;
            long v = strtol(argv[++i], &end, 10);
            if (end == argv[i] || *end != '\0' || v < 0 || v > 1024)
                setup_failure("--device takes a CUDA device ordinal");
            ordinal = (int)v;
        } else if (strcmp(argv[i], "--resolve") == 0 && i + 1 < argc) {
            i++;
            if (strcmp(argv[i], "dlsym") == 0)
                use_dlsym = 1;
            else if (strcmp(argv[i], "procaddress") != 0)
                setup_failure("--resolve takes procaddress or dlsym");
        } else {
            fprintf(stderr, "usage: %s [--device N] [--resolve procaddress|dlsym]\n", argv[0]);
            return 2;
        }
    }
    /* Line by line even into a pipe, so that the table interleaves with cuvisor's stderr lines. */
    setvbuf(stdout, NULL, _IOLBF, 0);

    const char *how = resolve(use_dlsym);
    CUdevice dev;
    CUcontext ctx;
    char name[256] = "";
    must(p_cuInit(0), "cuInit");
    must(p_cuDeviceGet(&dev, ordinal), "cuDeviceGet");
    must(p_cuDeviceGetName(name, (int)sizeof name, dev), "cuDeviceGetName");
    /* The primary context, as the CUDA runtime (and so every framework) uses. */
    must(p_cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
    must(p_cuCtxSetCurrent(ctx), "cuCtxSetCurrent");

    size_t free0 = 0, total = 0;
    must(p_cuMemGetInfo(&free0, &total), "cuMemGetInfo");
    printf("GPU %d (%s): total %.0f MiB, free %.0f MiB (cuMemGetInfo; entry points through %s)\n",
           ordinal, name, total / MIB, free0 / MIB, how);

    static const double fractions[] = {0.3, 0.5, 0.8, 1.0, 1.2};
    int failures = 0;
    for (size_t i = 0; i < sizeof fractions / sizeof fractions[0]; i++) {
        double f = fractions[i];
        size_t bytes = (size_t)(f * (double)free0);
        CUdeviceptr ptr = 0;
        CUresult r = p_cuMemAlloc(&ptr, bytes);
        int expect_ok = f <= 1.0;
        if (r == CUDA_SUCCESS) {
            CUresult fr = p_cuMemFree(ptr);
            if (fr != CUDA_SUCCESS) {
                printf("fraction %.2f: allocated %.0f MiB, but cuMemFree failed: %s\n", f, bytes / MIB, error_name(fr));
                failures++;
            } else if (expect_ok) {
                printf("fraction %.2f: allocated %.0f MiB ok\n", f, bytes / MIB);
            } else {
                printf("fraction %.2f: allocated %.0f MiB: FAIL, more than is free must be refused\n", f, bytes / MIB);
                failures++;
            }
        } else if (!expect_ok && r == CUDA_ERROR_OUT_OF_MEMORY) {
            printf("fraction %.2f: failed cleanly: %s (%.0f MiB)\n", f, error_name(r), bytes / MIB);
        } else {
            printf("fraction %.2f: FAIL: %.0f MiB refused with %s (expected %s)\n", f, bytes / MIB, error_name(r),
                   expect_ok ? "success" : "CUDA_ERROR_OUT_OF_MEMORY");
            failures++;
        }
    }

    /* The refusal must leave the process able to go on. */
    CUdeviceptr small = 0;
    size_t free1 = 0, total1 = 0;
    CUresult r = p_cuMemAlloc(&small, 1 << 20);
    if (r == CUDA_SUCCESS)
        r = p_cuMemFree(small);
    if (r == CUDA_SUCCESS)
        r = p_cuMemGetInfo(&free1, &total1);
    if (r == CUDA_SUCCESS) {
        printf("afterwards: 1 MiB allocation ok, free %.0f MiB of %.0f MiB\n", free1 / MIB, total1 / MIB);
    } else {
        printf("afterwards: FAIL: a 1 MiB allocation and free failed: %s\n", error_name(r));
        failures++;
    }
    p_cuDevicePrimaryCtxRelease(dev);

    if (failures == 0)
        printf("twin: PASS\n");
    else
        printf("twin: FAIL (%d of 6 checks)\n", failures);
    return failures == 0 ? 0 : 1;
}
