// Stream callbacks and host functions through the CUDA runtime (cudaStreamAddCallback,
// cudaLaunchHostFunc), built by nvcc 13.5: the runtime resolves the driver's entry points
// through cuGetProcAddress and calls them as any CUDA program does. Checks stream order: a
// callback sees what an earlier copy wrote, a later copy waits until the callback returned, a
// host function after the callback runs after it, an event after a 50 ms host function is 50 ms
// later, and a kernel launched behind a callback runs after it. Prints one FAIL line per failed
// check and OK at the end.
#include <cstdio>
#include <ctime>
#include <cuda_runtime.h>

static int failed;
#define CHECK(c, ...) do { if (!(c)) { failed++; printf("FAIL line %d: ", __LINE__); printf(__VA_ARGS__); printf("\n"); } } while (0)

static void sleep_ms(int ms) {
    timespec t = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&t, nullptr);
}

struct State {
    int *seen_src;  // filled by a copy before the callback
    int *later_src; // copied after the callback; the callback writes it
    int seen;
    cudaError_t status;
    int order[4];
    int n;
};

static void CUDART_CB callback(cudaStream_t, cudaError_t status, void *p) {
    State *s = (State *)p;
    s->status = status;
    s->seen = s->seen_src[0];
    sleep_ms(100);
    s->later_src[0] = 456;
    s->order[s->n++] = 1;
}

static void CUDART_CB host_fn(void *p) {
    State *s = (State *)p;
    s->order[s->n++] = 2;
}

static void CUDART_CB sleep50(void *) { sleep_ms(50); }

__global__ void noop() {}

int main() {
    cudaStream_t st;
    CHECK(cudaStreamCreate(&st) == cudaSuccess, "cudaStreamCreate");
    int *h_in, *h_seen, *h_later, *h_out, *d;
    cudaMallocHost(&h_in, 64);
    cudaMallocHost(&h_seen, 64);
    cudaMallocHost(&h_later, 64);
    cudaMallocHost(&h_out, 64);
    cudaMalloc(&d, 64);
    h_in[0] = 123; h_seen[0] = 0; h_later[0] = 0; h_out[0] = 0;
    State s = {h_seen, h_later, 0, cudaErrorUnknown, {0}, 0};

    noop<<<1, 1, 0, st>>>();
    cudaMemcpyAsync(d, h_in, 4, cudaMemcpyHostToDevice, st);
    cudaMemcpyAsync(h_seen, d, 4, cudaMemcpyDeviceToHost, st);
    CHECK(cudaStreamAddCallback(st, callback, &s, 0) == cudaSuccess, "cudaStreamAddCallback");
    cudaMemcpyAsync(d, h_later, 4, cudaMemcpyHostToDevice, st);
    cudaMemcpyAsync(h_out, d, 4, cudaMemcpyDeviceToHost, st);
    noop<<<1, 1, 0, st>>>();
    CHECK(cudaLaunchHostFunc(st, host_fn, &s) == cudaSuccess, "cudaLaunchHostFunc");
    CHECK(cudaStreamQuery(st) == cudaErrorNotReady, "the stream is busy while its callback sleeps");
    CHECK(cudaStreamSynchronize(st) == cudaSuccess, "cudaStreamSynchronize");
    CHECK(s.status == cudaSuccess, "callback status %d", (int)s.status);
    CHECK(s.seen == 123, "the callback saw %d, not the earlier copy's 123", s.seen);
    CHECK(h_out[0] == 456, "the later copy copied %d: it ran before the callback returned", h_out[0]);
    CHECK(s.n == 2 && s.order[0] == 1 && s.order[1] == 2, "order %d: %d %d", s.n, s.order[0], s.order[1]);
    CHECK(cudaStreamAddCallback(st, callback, &s, 1) == cudaErrorInvalidValue, "flags must be 0");

    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    cudaEventRecord(a, st);
    cudaLaunchHostFunc(st, sleep50, nullptr);
    cudaEventRecord(b, st);
    CHECK(cudaEventSynchronize(b) == cudaSuccess, "cudaEventSynchronize");
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b) == cudaSuccess && ms >= 49.0f && ms < 1000.0f, "a 50 ms host function between events: %.3f ms", ms);

    // the legacy default stream
    s.n = 0;
    CHECK(cudaLaunchHostFunc(0, host_fn, &s) == cudaSuccess, "cudaLaunchHostFunc on the NULL stream");
    CHECK(cudaDeviceSynchronize() == cudaSuccess && s.n == 1, "cudaDeviceSynchronize waits for a host function (%d)", s.n);

    cudaEventDestroy(a);
    cudaEventDestroy(b);
    cudaStreamDestroy(st);
    cudaFree(d);
    cudaFreeHost(h_in); cudaFreeHost(h_seen); cudaFreeHost(h_later); cudaFreeHost(h_out);
    if (!failed) printf("OK\n");
    return failed != 0;
}
