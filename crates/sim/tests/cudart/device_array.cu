// A program whose only device memory is a `__device__` array of BIG bytes (a macro, default
// 64 MiB): the runtime loads it through the driver's private table, not cuModuleLoadData.
// Prints one line per step, "STEP ERROR_NUMBER ERROR_NAME", and the free memory before and after.
#include <cstdio>
#include <cuda_runtime.h>

#ifndef BIG
#define BIG (64ull << 20)
#endif

__device__ char big[BIG];

__global__ void touch(char v) { big[threadIdx.x] = v; }

static void step(const char *what, cudaError_t e) {
    std::printf("%s %d %s\n", what, (int)e, cudaGetErrorName(e));
}

int main() {
    size_t free0 = 0, total = 0;
    step("cudaMemGetInfo", cudaMemGetInfo(&free0, &total));
    std::printf("free %zu total %zu\n", free0, total);
    void *p = nullptr;
    step("cudaGetSymbolAddress", cudaGetSymbolAddress(&p, big));
    touch<<<1, 32>>>(1);
    step("launch", cudaGetLastError());
    step("cudaDeviceSynchronize", cudaDeviceSynchronize());
    size_t free1 = 0;
    step("cudaMemGetInfo_after", cudaMemGetInfo(&free1, &total));
    std::printf("free_after %zu\n", free1);
    return 0;
}
