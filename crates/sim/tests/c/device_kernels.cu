// Kernels of different register pressure, shared and local memory for tests/device.rs, which
// builds them with nvcc 13.5 (`--resource-usage`: what ptxas allocated to each) and checks what
// the simulator's cuFuncGetAttribute and occupancy calculator answer for them.
__constant__ float cvals[64];

// Few registers, nothing else.
extern "C" __global__ void light(float *x) { x[threadIdx.x] += 1.0f; }

// 12000 bytes of static shared memory, one barrier, __launch_bounds__(256).
extern "C" __global__ void __launch_bounds__(256) smem(float *x) {
    __shared__ float buf[3000];
    buf[threadIdx.x] = x[threadIdx.x];
    __syncthreads();
    x[threadIdx.x] = buf[(threadIdx.x + 7) % 256] * cvals[threadIdx.x % 64];
}

// A 1 KiB local array indexed at run time: a stack frame.
extern "C" __global__ void local(int *x, int n) {
    int a[256];
    for (int i = 0; i < 256; i++) a[i] = x[i];
    x[0] = a[n];
}

// Forty live values per thread, unrolled: a high register count.
extern "C" __global__ void heavy(float *x, int n) {
    float a[40];
#pragma unroll
    for (int i = 0; i < 40; i++) a[i] = x[i * n + threadIdx.x];
    float s = 0;
#pragma unroll
    for (int i = 0; i < 40; i++) s += a[i] * a[(i * 7) % 40] / (a[(i * 3) % 40] + 1.0f);
#pragma unroll
    for (int i = 0; i < 40; i++) x[i * n + threadIdx.x] = s * a[i];
}
