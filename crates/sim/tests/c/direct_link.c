/* Linked against libcuda (-lcuda), like a program built with the CUDA toolkit: fills the
 * device with 1 GiB allocations until the driver says CUDA_ERROR_OUT_OF_MEMORY. Prints how
 * many fitted. Exit status 0 when the numbers are self-consistent. */
#include <stdio.h>
#include <stddef.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
CUresult cuInit(unsigned int);
CUresult cuDeviceGet(int *, int);
CUresult cuCtxCreate_v2(void **, unsigned int, int);
CUresult cuCtxDestroy_v2(void *);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemGetInfo_v2(size_t *, size_t *);

int main(void) {
    int dev;
    void *ctx;
    if (cuInit(0) || cuDeviceGet(&dev, 0) || cuCtxCreate_v2(&ctx, 0, dev)) return 2;
    size_t free0, total;
    cuMemGetInfo_v2(&free0, &total);
    CUdeviceptr p[64];
    int n = 0;
    CUresult r = 0;
    while (n < 64 && (r = cuMemAlloc_v2(&p[n], (size_t)1 << 30)) == 0) n++;
    size_t free1;
    cuMemGetInfo_v2(&free1, &total);
    printf("allocated %d GiB, stopped with %d, free %zu of %zu\n", n, r, free1, total);
    for (int i = 0; i < n; i++) cuMemFree_v2(p[i]);
    size_t free2;
    cuMemGetInfo_v2(&free2, &total);
    cuCtxDestroy_v2(ctx);
    return (r == 2 && free2 == free0) ? 0 : 1;
}
