// CUDA graphs through the runtime (nvcc 13.5, static libcudart) on the simulated driver:
// 1. a graph built by hand with a memory-allocation node, a memset into that memory, a kernel,
//    a copy back to the host, a host node that reads what was copied, and the free node;
// 2. the same work captured from a stream (cudaMallocAsync, a kernel, cudaMemsetAsync,
//    cudaMemcpyAsync, cudaLaunchHostFunc, cudaFreeAsync), launched twice.
// The simulator runs no device code: kernels take time; copies and memsets move the bytes.
// Prints "OK" and exits 0 when every check holds.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda_runtime.h>

#define CK(x)                                                                              \
    do {                                                                                   \
        cudaError_t e_ = (x);                                                              \
        if (e_ != cudaSuccess) {                                                           \
            fprintf(stderr, "graph.cu:%d: %s -> %s\n", __LINE__, #x, cudaGetErrorName(e_)); \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

__global__ void touch(unsigned *p) { p[threadIdx.x] += 1; }

static const size_t N = 1 << 16; // bytes
static unsigned char host[N];
static int host_ran;
static int host_saw_bytes;

static void CUDART_CB check_host(void *want) {
    host_ran++;
    host_saw_bytes = 1;
    for (size_t i = 0; i < N; i++)
        if (host[i] != (unsigned char)(size_t)want) host_saw_bytes = 0;
}

int main() {
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

    // ---- 1. by hand ----
    cudaGraph_t g;
    CK(cudaGraphCreate(&g, 0));
    cudaMemAllocNodeParams ap;
    memset(&ap, 0, sizeof ap);
    ap.poolProps.allocType = cudaMemAllocationTypePinned;
    ap.poolProps.location.type = cudaMemLocationTypeDevice;
    ap.poolProps.location.id = 0;
    ap.bytesize = N;
    cudaGraphNode_t n_alloc, n_set, n_kern, n_copy, n_host, n_free;
    CK(cudaGraphAddMemAllocNode(&n_alloc, g, nullptr, 0, &ap));
    if (ap.dptr == nullptr) {
        fprintf(stderr, "no address from the allocation node\n");
        return 1;
    }
    cudaMemsetParams ms;
    memset(&ms, 0, sizeof ms);
    ms.dst = ap.dptr;
    ms.value = 0x3c;
    ms.elementSize = 1;
    ms.width = N;
    ms.height = 1;
    CK(cudaGraphAddMemsetNode(&n_set, g, &n_alloc, 1, &ms));
    cudaKernelNodeParams kp;
    memset(&kp, 0, sizeof kp);
    void *arg = ap.dptr;
    void *args[] = {&arg};
    kp.func = (void *)touch;
    kp.gridDim = dim3(1);
    kp.blockDim = dim3(32);
    kp.kernelParams = args;
    CK(cudaGraphAddKernelNode(&n_kern, g, &n_set, 1, &kp));
    CK(cudaGraphAddMemcpyNode1D(&n_copy, g, &n_set, 1, host, ap.dptr, N, cudaMemcpyDeviceToHost));
    cudaHostNodeParams hp = {check_host, (void *)0x3c};
    cudaGraphNode_t before_host[] = {n_kern, n_copy};
    CK(cudaGraphAddHostNode(&n_host, g, before_host, 2, &hp));
    CK(cudaGraphAddMemFreeNode(&n_free, g, &n_host, 1, ap.dptr));
    size_t count = 0;
    CK(cudaGraphGetNodes(g, nullptr, &count));
    cudaGraphExec_t x;
    CK(cudaGraphInstantiate(&x, g, 0));
    memset(host, 0, N);
    CK(cudaGraphLaunch(x, s));
    CK(cudaStreamSynchronize(s));
    if (count != 6 || host_ran != 1 || !host_saw_bytes) {
        fprintf(stderr, "by hand: %zu nodes, host node ran %d times, saw the bytes: %d\n", count, host_ran,
                host_saw_bytes);
        return 1;
    }
    CK(cudaGraphExecDestroy(x));
    CK(cudaGraphDestroy(g));

    // ---- 2. captured ----
    host_ran = 0;
    cudaGraph_t cg;
    unsigned char *p = nullptr;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    CK(cudaMallocAsync((void **)&p, N, s));
    touch<<<1, 32, 0, s>>>((unsigned *)p);
    CK(cudaGetLastError());
    CK(cudaMemsetAsync(p, 0x5e, N, s));
    CK(cudaMemcpyAsync(host, p, N, cudaMemcpyDeviceToHost, s));
    CK(cudaLaunchHostFunc(s, check_host, (void *)0x5e));
    CK(cudaFreeAsync(p, s));
    CK(cudaStreamEndCapture(s, &cg));
    cudaGraphNode_t nodes[8];
    cudaGraphNodeType want[] = {cudaGraphNodeTypeMemAlloc, cudaGraphNodeTypeKernel, cudaGraphNodeTypeMemset,
                                cudaGraphNodeTypeMemcpy,   cudaGraphNodeTypeHost,   cudaGraphNodeTypeMemFree};
    count = 8;
    CK(cudaGraphGetNodes(cg, nodes, &count));
    if (count != 6) {
        fprintf(stderr, "captured %zu nodes, want 6\n", count);
        return 1;
    }
    for (size_t i = 0; i < count; i++) {
        cudaGraphNodeType t;
        CK(cudaGraphNodeGetType(nodes[i], &t));
        if (t != want[i]) {
            fprintf(stderr, "captured node %zu has type %d, want %d\n", i, (int)t, (int)want[i]);
            return 1;
        }
    }
    CK(cudaGraphInstantiate(&x, cg, 0));
    for (int i = 0; i < 2; i++) {
        memset(host, 0, N);
        CK(cudaGraphLaunch(x, s));
        CK(cudaStreamSynchronize(s));
        if (!host_saw_bytes) {
            fprintf(stderr, "captured launch %d: the host function did not see the copied bytes\n", i);
            return 1;
        }
    }
    if (host_ran != 2) {
        fprintf(stderr, "captured host function ran %d times, want 2\n", host_ran);
        return 1;
    }
    CK(cudaGraphExecDestroy(x));
    CK(cudaGraphDestroy(cg));
    CK(cudaStreamDestroy(s));
    printf("OK\n");
    return 0;
}
