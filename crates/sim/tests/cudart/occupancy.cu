// The runtime's occupancy calls on kernels libcudart registered (a <<<>>> program's own), for
// tests/device.rs: for each kernel of ../c/device_kernels.cu, what cudaFuncGetAttributes,
// cudaOccupancyMaxActiveBlocksPerMultiprocessor and cudaOccupancyMaxPotentialBlockSize answer.
// One "key values..." line each; exit status 1 at the first error.
#include "../c/device_kernels.cu"
#include <cstdio>
#include <cstdlib>

#define CHECK(call)                                                                       \
    do {                                                                                  \
        cudaError_t e_ = (call);                                                          \
        if (e_ != cudaSuccess) {                                                          \
            printf("FAIL %s: %d %s\n", #call, (int)e_, cudaGetErrorString(e_));           \
            exit(1);                                                                      \
        }                                                                                 \
    } while (0)

template <typename K> static void report(const char *name, K kernel) {
    cudaFuncAttributes a;
    CHECK(cudaFuncGetAttributes(&a, kernel));
    printf("func %s max_threads %d shared %zu local %zu regs %d binary %d\n", name,
           a.maxThreadsPerBlock, a.sharedSizeBytes, a.localSizeBytes, a.numRegs, a.binaryVersion);
    const int blocks[] = {32, 64, 96, 128, 256, 512, 640, 1024};
    for (int b : blocks) {
        int n0, n1;
        CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n0, kernel, b, 0));
        CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n1, kernel, b, 20000));
        printf("occ %s %d %d %d\n", name, b, n0, n1);
    }
    int grid, block;
    CHECK(cudaOccupancyMaxPotentialBlockSize(&grid, &block, kernel, 0, 0));
    printf("potential %s 0 %d %d\n", name, grid, block);
}

int main() {
    report("light", light);
    report("smem", smem);
    report("local", local);
    report("heavy", heavy);
    // The kernel runs too: registering it did not stop at the simulator.
    float *x;
    CHECK(cudaMalloc(&x, 1024 * sizeof(float)));
    light<<<1, 256>>>(x);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaFree(x));
    printf("OK\n");
    return 0;
}
