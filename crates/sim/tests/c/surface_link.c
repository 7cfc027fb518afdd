/* A program linked with -lcuda against CUDA 13.5's cuda.h that calls entry points the simulated
 * libcuda.so.1 did not export before issue 17 (so it did not link): each answers, with NULL
 * where it writes, either the code its stub table (cuvisorSimUnsupported) gives it, or, where
 * the simulator models it, an error (a NULL out-pointer is refused). Prints "surface_link: ok". */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The simulator's stub table: "name code" lines. */
extern const char *cuvisorSimUnsupported(void);

static int failures = 0;

static void check(const char *name, CUresult got) {
    const char *table = cuvisorSimUnsupported();
    size_t n = strlen(name);
    const char *p = table;
    while ((p = strstr(p, name)) != NULL) {
        if ((p == table || p[-1] == '\n') && p[n] == ' ') {
            int want = atoi(p + n + 1);
            if ((int)got != want) {
                printf("%s: stub answered %d, its table says %d\n", name, (int)got, want);
                failures++;
            } else {
                printf("%s: stub, %d\n", name, (int)got);
            }
            return;
        }
        p += n;
    }
    if (got == CUDA_SUCCESS) {
        printf("%s: modelled, but accepted a NULL out-pointer\n", name);
        failures++;
    } else {
        printf("%s: modelled, refused NULL with %d\n", name, (int)got);
    }
}

int main(void) {
    if (cuInit(0) != CUDA_SUCCESS) {
        printf("cuInit failed\n");
        return 1;
    }
    CUdevice dev;
    CUcontext ctx;
    if (cuDeviceGet(&dev, 0) != CUDA_SUCCESS || cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS ||
        cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
        printf("no context\n");
        return 1;
    }
    check("cuOccupancyMaxPotentialBlockSize",
          cuOccupancyMaxPotentialBlockSize(NULL, NULL, NULL, NULL, 0, 0));
    check("cuMemGetAllocationPropertiesFromHandle", cuMemGetAllocationPropertiesFromHandle(NULL, 0));
    check("cuDeviceGetP2PAttribute",
          cuDeviceGetP2PAttribute(NULL, CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED, dev, dev));
    check("cuIpcGetEventHandle", cuIpcGetEventHandle(NULL, NULL));
    check("cuTexObjectCreate", cuTexObjectCreate(NULL, NULL, NULL, NULL));
    check("cuSurfObjectCreate", cuSurfObjectCreate(NULL, NULL));
    check("cuMemPoolExportToShareableHandle",
          cuMemPoolExportToShareableHandle(NULL, NULL, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    check("cuGraphAddMemcpyNode", cuGraphAddMemcpyNode(NULL, NULL, NULL, 0, NULL, ctx));
    check("cuLogicalEndpointCreate", cuLogicalEndpointCreate(0, NULL));
    cuDevicePrimaryCtxRelease(dev);
    if (failures) {
        printf("surface_link: %d failures\n", failures);
        return 1;
    }
    printf("surface_link: ok\n");
    return 0;
}
