// A kernel and two variables of known sizes: what tests/fatbin_compression.rs builds into fat
// binaries with each of nvcc's compression modes and loads on the simulator.
__device__ float table_a[1000];   // 4000 bytes
__constant__ int table_c[300];    // 1200 bytes

extern "C" __global__ void scale(float *x, float f, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] * f + table_a[i % 1000] + table_c[i % 300];
}
