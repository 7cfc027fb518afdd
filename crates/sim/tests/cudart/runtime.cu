// An ordinary CUDA program, built by nvcc from NVIDIA's CUDA 13 wheels (nvidia-cuda-nvcc,
// nvidia-nvvm, nvidia-cuda-crt; linked with the static libcudart, nvcc's default) and run on the
// simulator by crates/sim/tests/cudart.rs, plain and under `cuvisor run`. The kernel is compiled
// for real (PTX and a cubin in a fat binary the runtime registers); the simulator runs no code
// and takes a `sim_busy` kernel's first parameter as its run time in ns.
//
//   runtime memory         one JSON object: memory info, totalGlobalMem, each allocator (taken,
//                          counted, freed; beyond the GPU's free memory refused, and the program
//                          goes on), a kernel timed by events
//   runtime busy S US      prints "pid N", then launches US-microsecond kernels on one stream for
//                          S seconds, synchronizing every 20 launches (a training loop's steps)
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

__global__ void sim_busy(unsigned long long ns) {
    // The simulator reads `ns`; on a real GPU this spins about as long.
    unsigned long long start = clock64();
    while (clock64() - start < ns) {
    }
}

static double now_s() {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int first = 1;
static void key(const char *k) {
    printf("%s\"%s\": ", first ? "{" : ", ", k);
    first = 0;
}

// "<k>": [rc, free, total]
static void mem_info(const char *k) {
    size_t free = 0, total = 0;
    cudaError_t r = cudaMemGetInfo(&free, &total);
    key(k);
    printf("[%d, %zu, %zu]", (int)r, free, total);
}

static void result(const char *k, cudaError_t r) {
    key(k);
    printf("[%d]", (int)r);
}

// One allocator: `take` 64 MiB (or what it takes), memory info, free it, memory info; then
// `too_large` (more than is free), the error it returned, cudaGetLastError (which reports it once
// and clears it), and a small allocation by the same allocator afterwards, freed.
#define ALLOCATOR(name, take, release, too_large)                                                \
    do {                                                                                         \
        result(name, take);                                                                      \
        mem_info(name "_taken");                                                                 \
        result(name "_freed", release);                                                          \
        mem_info(name "_after_free");                                                            \
        result(name "_too_large", too_large);                                                    \
        result(name "_last_error", cudaGetLastError());                                          \
        cudaError_t again = take, again_freed = release;                                         \
        key(name "_after_refusal");                                                              \
        printf("[%d, %d]", (int)again, (int)again_freed);                                        \
    } while (0)

static int memory() {
    size_t free = 0, total = 0;
    cudaMemGetInfo(&free, &total);
    mem_info("cudaMemGetInfo");
    cudaDeviceProp p;
    memset(&p, 0, sizeof p);
    cudaError_t r = cudaGetDeviceProperties(&p, 0);
    key("cudaGetDeviceProperties");
    printf("[%d, %zu]", (int)r, p.totalGlobalMem);

    const size_t MiB = 1 << 20, big = 2 * total + (1ull << 30);
    void *d = 0;
    ALLOCATOR("cudaMalloc", cudaMalloc(&d, 64 * MiB), cudaFree(d), cudaMalloc(&d, big));

    cudaStream_t s;
    cudaStreamCreate(&s);
    // Stream-ordered: taken at the launch of the allocation, given back by the default pool
    // (release threshold 0) at the synchronization after the free.
    ALLOCATOR("cudaMallocAsync", (cudaMallocAsync(&d, 64 * MiB, s), cudaStreamSynchronize(s)),
              (cudaFreeAsync(d, s), cudaStreamSynchronize(s)),
              (cudaMallocAsync(&d, big, s)));

    ALLOCATOR("cudaMallocManaged", cudaMallocManaged(&d, 64 * MiB, cudaMemAttachGlobal),
              cudaFree(d), cudaMallocManaged(&d, big, cudaMemAttachGlobal));

    // 4 KiB rows (a pitch of at least that), 16384 of them: 64 MiB.
    size_t pitch = 0;
    ALLOCATOR("cudaMallocPitch", cudaMallocPitch(&d, &pitch, 4096, 16384), cudaFree(d),
              cudaMallocPitch(&d, &pitch, 1 << 20, big >> 20));
    key("pitch");
    printf("%zu", pitch);

    // float4 (16 bytes) elements, 1024 x 1024 x 4: 64 MiB. Too large: 1024 x 1024 x depth with
    // depth within the device's 3D limit.
    cudaArray_t a = 0;
    cudaChannelFormatDesc f = cudaCreateChannelDesc<float4>();
    size_t depth = big / (16 * MiB) + 1;
    ALLOCATOR("cudaMalloc3DArray", cudaMalloc3DArray(&a, &f, make_cudaExtent(1024, 1024, 4), 0),
              cudaFreeArray(a),
              cudaMalloc3DArray(&a, &f, make_cudaExtent(1024, 1024, depth), 0));

    // A kernel launched by the runtime (<<<>>>: cudaLaunchKernel), 50 ms by its parameter, timed
    // by events around it.
    cudaEvent_t e1, e2;
    cudaEventCreate(&e1);
    cudaEventCreate(&e2);
    cudaEventRecord(e1, s);
    sim_busy<<<1, 1, 0, s>>>(50ull * 1000 * 1000);
    result("launch", cudaGetLastError());
    cudaEventRecord(e2, s);
    result("cudaEventSynchronize", cudaEventSynchronize(e2));
    float ms = -1;
    r = cudaEventElapsedTime(&ms, e1, e2);
    key("cudaEventElapsedTime");
    printf("[%d, %f]", (int)r, ms);
    cudaEventDestroy(e1);
    cudaEventDestroy(e2);
    cudaStreamDestroy(s);
    mem_info("cudaMemGetInfo_at_end");
    printf("}\n");
    return 0;
}

static int busy(double seconds, long us) {
    printf("pid %d\n", (int)getpid());
    fflush(stdout);
    cudaStream_t s;
    if (cudaStreamCreate(&s) != cudaSuccess) {
        fprintf(stderr, "cudaStreamCreate failed\n");
        return 1;
    }
    double end = now_s() + seconds;
    long launches = 0;
    while (now_s() < end) {
        sim_busy<<<1, 32, 0, s>>>((unsigned long long)us * 1000);
        cudaError_t r = cudaGetLastError();
        if (r != cudaSuccess) {
            fprintf(stderr, "launch %ld: %s\n", launches, cudaGetErrorString(r));
            return 1;
        }
        if (++launches % 20 == 0 && cudaStreamSynchronize(s) != cudaSuccess) {
            fprintf(stderr, "cudaStreamSynchronize failed\n");
            return 1;
        }
    }
    cudaStreamSynchronize(s);
    printf("launched %ld\n", launches);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 2 && !strcmp(argv[1], "memory"))
        return memory();
    if (argc == 4 && !strcmp(argv[1], "busy"))
        return busy(atof(argv[2]), atol(argv[3]));
    fprintf(stderr, "usage: runtime memory | runtime busy SECONDS KERNEL_US\n");
    return 2;
}
