// Device code only: nvcc 13.5 builds it into a cubin, a fat binary and PTX for
// tests/chapters.rs, which loads, counts, enumerates and links them from tests/c/modules.c.
__device__ float scale_factor[32];

extern "C" __global__ void k_alpha(float *x) { x[threadIdx.x] *= scale_factor[threadIdx.x % 32]; }

__global__ void k_beta(int *x, int n) {
    if (threadIdx.x < n) x[threadIdx.x] += 1;
}

template <typename T> __global__ void k_gamma(T *x) { x[threadIdx.x] = T(0); }
template __global__ void k_gamma<double>(double *);
