/* Copies that take time over the modelled interconnect (crates/sim/cuda/src/copy_engine.rs),
 * measured as a program measures them: with events around the copy (cuEventElapsedTime), or with
 * the wall clock around a synchronous copy and cuCtxSynchronize. Built against CUDA 13.5's
 * cuda.h, linked with the simulated libcuda. Prints "name value" lines (milliseconds unless
 * the name says otherwise) for tests/timed_copies.rs to judge, FAIL lines for broken checks, and
 * "OK" last when none failed.
 *
 *   timed_copies dgx1            on dgx1-v100: PCIe, NVLink, staged peer copies, sharing, overlap
 *   timed_copies a100            on dgx-a100: a peer copy through NVSwitch
 *   timed_copies bytes           any preset with 2 GPUs: the bytes copies leave, written or not
 *   timed_copies serial          on dgx1-v100: which work synchronous copies are ordered after
 *   timed_copies share T MiB     at CLOCK_MONOTONIC T (ns): a staged copy GPU 0 -> 5 of MiB
 *                                MiB; prints when it started and was done (events), from T
 *   timed_copies nvml            on dgx1-v100: what NVML (the simulated libnvidia-ml, opened
 *                                with dlopen) sees of copies: PCIe throughput, NVLink counters,
 *                                GPU utilization */
#include <cuda.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "expect.h"

#define OK(call) EXPECT(call, CUDA_SUCCESS)
#define MIB (1024ull * 1024ull)

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static CUcontext ctx[8];
static CUfunction busy; /* sim_busy_kernel: runs for its first parameter, in ns */

static CUdeviceptr alloc_on(int d, size_t n) {
    CUdeviceptr p = 0;
    OK(cuCtxSetCurrent(ctx[d]));
    OK(cuMemAlloc(&p, n));
    return p;
}

/* ms between two events recorded around `copy` on stream s. */
static float elapsed(CUevent a, CUevent b) {
    float ms = -1;
    OK(cuEventSynchronize(b));
    OK(cuEventElapsedTime(&ms, a, b));
    return ms;
}

static void contexts(int n) {
    for (int d = 0; d < n; d++) {
        CUdevice dev;
        OK(cuDeviceGet(&dev, d));
        OK(cuDevicePrimaryCtxRetain(&ctx[d], dev));
    }
    OK(cuCtxSetCurrent(ctx[0]));
    CUmodule mod;
    OK(cuModuleLoadData(&mod, "sim"));
    OK(cuModuleGetFunction(&busy, mod, "sim_busy_kernel"));
}

/* Queues a kernel of `ns` on s: what follows on s starts when it ends, whatever the host does
 * meanwhile (an event and a copy queued behind it start at the same instant). */
static void hold(CUstream s, unsigned long long ns) {
    void *args[] = {&ns};
    OK(cuLaunchKernel(busy, 1, 1, 1, 1, 1, 1, 0, s, args, NULL));
}

/* One peer copy 0 -> `to` of n bytes on stream s of context 0, timed by events. */
static float peer_ms(CUstream s, CUdeviceptr dst, int to, CUdeviceptr src, size_t n) {
    CUevent a, b;
    OK(cuCtxSetCurrent(ctx[0]));
    OK(cuEventCreate(&a, 0));
    OK(cuEventCreate(&b, 0));
    hold(s, 50000000ull);
    OK(cuEventRecord(a, s));
    OK(cuMemcpyPeerAsync(dst, ctx[to], src, ctx[0], n, s));
    OK(cuEventRecord(b, s));
    float ms = elapsed(a, b);
    OK(cuEventDestroy(a));
    OK(cuEventDestroy(b));
    return ms;
}

static void dgx1(void) {
    contexts(8);
    CUstream s, s2, k;
    OK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    OK(cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING));
    OK(cuStreamCreate(&k, CU_STREAM_NON_BLOCKING));
    CUevent a, b, c;
    OK(cuEventCreate(&a, 0));
    OK(cuEventCreate(&b, 0));
    OK(cuEventCreate(&c, 0));

    /* Host memory copies move real bytes, which takes this machine's memcpy time inside the
     * call; a real program hides that behind device work, and so does this one: each copy is
     * queued behind a kernel on its stream (the bytes move while the kernel runs: 1 s covers
     * 256 MiB into untouched pages on a busy 2-core machine) and timed from an event recorded
     * between the two, so the events see the modelled copy. */

    /* Pinned host to device, 256 MiB, over GPU 0's PCIe Gen3 x16 link. */
    size_t big = 256 * MIB;
    void *pinned = NULL;
    OK(cuMemAllocHost(&pinned, big));
    memset(pinned, 0x5a, big);
    CUdeviceptr d0 = alloc_on(0, big);
    OK(cuCtxSetCurrent(ctx[0]));
    hold(s, 1000000000ull);
    OK(cuEventRecord(a, s));
    uint64_t issued = now_ns();
    OK(cuMemcpyHtoDAsync(d0, pinned, big, s));
    printf("h2d_pinned_call %.4f\n", (now_ns() - issued) / 1e6);
    OK(cuEventRecord(b, s));
    printf("h2d_pinned_256mib %.4f\n", elapsed(a, b));

    /* Pageable, 64 MiB (staged by the driver: slower per byte), against pinned. */
    size_t mid = 64 * MIB;
    void *pageable = malloc(mid);
    CHECK(pageable != NULL);
    memset(pageable, 0x5a, mid);
    hold(s, 300000000ull);
    OK(cuEventRecord(a, s));
    uint64_t called = now_ns();
    OK(cuMemcpyHtoDAsync(d0, pageable, mid, s));
    uint64_t returned = now_ns();
    OK(cuEventRecord(b, s));
    printf("h2d_pageable_64mib %.4f\n", elapsed(a, b));
    /* Blocking: the call returns once the copy is done, behind the 300 ms kernel. */
    printf("h2d_pageable_call %.4f\n", (returned - called) / 1e6);
    hold(s, 300000000ull);
    OK(cuEventRecord(a, s));
    OK(cuMemcpyHtoDAsync(d0, pinned, mid, s));
    OK(cuEventRecord(b, s));
    printf("h2d_pinned_64mib %.4f\n", elapsed(a, b));
    free(pageable);
    OK(cuMemFreeHost(pinned));
    OK(cuMemFree(d0));

    /* Peer copies of 256 MiB from GPU 0 (never written: no bytes move, time still taken). */
    CUdeviceptr src = alloc_on(0, big), d1 = alloc_on(1, big), d3 = alloc_on(3, big),
                d4 = alloc_on(4, big), d5 = alloc_on(5, big);
    OK(cuCtxSetCurrent(ctx[0]));
    printf("peer_0_3_no_access %.4f\n", peer_ms(s, d3, 3, src, big));
    OK(cuCtxEnablePeerAccess(ctx[3], 0));
    OK(cuCtxEnablePeerAccess(ctx[4], 0));
    OK(cuCtxEnablePeerAccess(ctx[1], 0));
    EXPECT(cuCtxEnablePeerAccess(ctx[5], 0), CUDA_ERROR_PEER_ACCESS_UNSUPPORTED);
    printf("peer_0_3 %.4f\n", peer_ms(s, d3, 3, src, big));
    printf("peer_0_5 %.4f\n", peer_ms(s, d5, 5, src, big));
    /* The same with cuMemcpyDtoDAsync across devices (unified addressing). */
    hold(s, 50000000ull);
    OK(cuEventRecord(a, s));
    OK(cuMemcpyDtoDAsync(d3, src, big, s));
    OK(cuEventRecord(b, s));
    printf("dtod_0_3 %.4f\n", elapsed(a, b));

    /* A memset takes the device's memory: 16 MiB written at V100's 898 GB/s. */
    hold(s, 300000000ull);
    OK(cuEventRecord(a, s));
    OK(cuMemsetD32Async(d3, 0x01020304u, 4 * MIB, s));
    OK(cuEventRecord(b, s));
    printf("memset_16mib_us %.4f\n", elapsed(a, b) * 1000.0);

    /* A captured copy becomes a graph memcpy node, timed as the stream's copies are. */
    CUgraph g;
    CUgraphExec gx;
    OK(cuStreamBeginCapture(s2, CU_STREAM_CAPTURE_MODE_RELAXED));
    OK(cuMemcpyDtoDAsync(d3, src, big, s2));
    OK(cuStreamEndCapture(s2, &g));
    OK(cuGraphInstantiate(&gx, g, 0));
    hold(s, 50000000ull);
    OK(cuEventRecord(a, s));
    OK(cuGraphLaunch(gx, s));
    OK(cuEventRecord(b, s));
    printf("graph_dtod_0_3 %.4f\n", elapsed(a, b));
    OK(cuGraphExecDestroy(gx));
    OK(cuGraphDestroy(g));

    /* Two copies at once on two streams: over one link (0->3 twice), over two (0->3, 0->4). */
    OK(cuStreamSynchronize(s));
    hold(s, 50000000ull);
    OK(cuEventRecord(a, s));
    OK(cuStreamWaitEvent(s2, a, 0));
    OK(cuMemcpyPeerAsync(d3, ctx[3], src, ctx[0], big, s));
    OK(cuMemcpyPeerAsync(d3, ctx[3], src, ctx[0], big, s2));
    OK(cuEventRecord(b, s));
    OK(cuEventRecord(c, s2));
    float x = elapsed(a, b), y = elapsed(a, c);
    printf("two_on_one_link %.4f\n", x > y ? x : y);
    OK(cuStreamSynchronize(s2));
    hold(s, 50000000ull);
    OK(cuEventRecord(a, s));
    OK(cuStreamWaitEvent(s2, a, 0));
    OK(cuMemcpyPeerAsync(d3, ctx[3], src, ctx[0], big, s));
    OK(cuMemcpyPeerAsync(d4, ctx[4], src, ctx[0], big, s2));
    OK(cuEventRecord(b, s));
    OK(cuEventRecord(c, s2));
    x = elapsed(a, b), y = elapsed(a, c);
    printf("two_on_two_links %.4f\n", x > y ? x : y);
    OK(cuStreamSynchronize(s2));

    /* A 20 ms kernel on one stream, a 256 MiB NVLink copy (about 5.4 ms) on another: they
     * overlap (copy engines beside the SMs), so both are done about 20 ms after the start. */
    hold(k, 50000000ull);
    OK(cuEventRecord(a, k));
    OK(cuStreamWaitEvent(s, a, 0));
    hold(k, 20000000ull);
    OK(cuMemcpyPeerAsync(d3, ctx[3], src, ctx[0], big, s));
    OK(cuEventRecord(b, k));
    OK(cuEventRecord(c, s));
    x = elapsed(a, b), y = elapsed(a, c);
    printf("kernel_alone %.4f\n", x);
    printf("kernel_and_copy %.4f\n", x > y ? x : y);

    /* A synchronous device-to-device copy does not block the host; cuCtxSynchronize waits. */
    uint64_t t0 = now_ns();
    OK(cuMemcpyDtoD(d3, src, big));
    uint64_t t1 = now_ns();
    OK(cuCtxSynchronize());
    uint64_t t2 = now_ns();
    printf("sync_dtod_returned %.4f\n", (t1 - t0) / 1e6);
    printf("sync_dtod_done %.4f\n", (t2 - t0) / 1e6);
    (void)d1;
}

static void a100(void) {
    contexts(2);
    CUstream s;
    OK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    size_t big = 256 * MIB;
    CUdeviceptr src = alloc_on(0, big), d1 = alloc_on(1, big);
    OK(cuCtxSetCurrent(ctx[0]));
    OK(cuCtxEnablePeerAccess(ctx[1], 0));
    printf("nvswitch_0_1 %.4f\n", peer_ms(s, d1, 1, src, big));
}

/* Bytes: a written source is copied exactly; a never-written one gives zeros, also over a
 * destination that held something, at offsets that cut pages. */
static void bytes(void) {
    contexts(2);
    size_t n = 3 * MIB;
    unsigned char *h = malloc(n), *back = malloc(n);
    for (size_t i = 0; i < n; i++) h[i] = (unsigned char)(i * 7 + 3);
    CUdeviceptr a = alloc_on(0, n), b = alloc_on(1, n), clean = alloc_on(0, n);
    OK(cuCtxSetCurrent(ctx[0]));
    OK(cuMemcpyHtoD(a, h, n));
    OK(cuMemcpyPeer(b, ctx[1], a, ctx[0], n));
    OK(cuMemcpyDtoH(back, b, n));
    CHECK(memcmp(h, back, n) == 0);
    /* b holds the pattern; copy never-written memory over part of it. */
    size_t off = 1000, len = 2 * MIB + 5000;
    OK(cuMemcpyDtoD(b + off, clean + 77, len));
    OK(cuCtxSynchronize());
    OK(cuMemcpyDtoH(back, b, n));
    int zeros = 1, kept = 1;
    for (size_t i = 0; i < n; i++) {
        if (i >= off && i < off + len)
            zeros &= back[i] == 0;
        else
            kept &= back[i] == h[i];
    }
    CHECK(zeros);
    CHECK(kept);
    /* And into host memory, and within one device. */
    memset(back, 0xee, n);
    OK(cuMemcpyDtoH(back, clean, n));
    int host_zeros = 1;
    for (size_t i = 0; i < n; i++) host_zeros &= back[i] == 0;
    CHECK(host_zeros);
    OK(cuMemcpyDtoD(clean, a, n)); /* now written */
    OK(cuMemcpyDtoH(back, clean, n));
    CHECK(memcmp(h, back, n) == 0);
    printf("bytes_checked %zu\n", n);
    free(h);
    free(back);
}

static void share(uint64_t at, size_t mib) {
    contexts(8);
    size_t n = mib * MIB;
    CUdeviceptr src = alloc_on(0, n), dst = alloc_on(5, n);
    OK(cuCtxSetCurrent(ctx[0]));
    while (now_ns() < at) {
        struct timespec t = {0, 100000};
        nanosleep(&t, NULL);
    }
    /* Timed by events on the legacy stream: from the copy's issue to its modelled end. */
    CUevent a, b;
    OK(cuEventCreate(&a, 0));
    OK(cuEventCreate(&b, 0));
    uint64_t t0 = now_ns();
    OK(cuEventRecord(a, NULL));
    OK(cuMemcpyDtoD(dst, src, n));
    OK(cuEventRecord(b, NULL));
    float ms = elapsed(a, b);
    printf("share_started %.4f\n", (t0 - at) / 1e6);
    printf("share_done %.4f\n", (t0 - at) / 1e6 + ms);
}

/* nvml.h's nvmlFieldValue_t (40 bytes). */
typedef struct {
    unsigned int fieldId, scopeId;
    long long timestamp, latencyUsec;
    int valueType, nvmlReturn;
    unsigned long long value;
} FieldValue;

static void nvml(void) {
    void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    CHECK(lib != NULL);
    if (!lib) return;
    int (*init)(void) = (int (*)(void))dlsym(lib, "nvmlInit_v2");
    int (*handle)(unsigned, void **) = (int (*)(unsigned, void **))dlsym(lib, "nvmlDeviceGetHandleByIndex_v2");
    int (*pcie)(void *, unsigned, unsigned *) = (int (*)(void *, unsigned, unsigned *))dlsym(lib, "nvmlDeviceGetPcieThroughput");
    int (*util)(void *, unsigned *) = (int (*)(void *, unsigned *))dlsym(lib, "nvmlDeviceGetUtilizationRates");
    int (*fields)(void *, int, FieldValue *) = (int (*)(void *, int, FieldValue *))dlsym(lib, "nvmlDeviceGetFieldValues");
    CHECK(init && handle && pcie && util && fields);
    if (!(init && handle && pcie && util && fields)) return;
    CHECK(init() == 0);
    void *g0 = NULL, *g5 = NULL;
    CHECK(handle(0, &g0) == 0 && handle(5, &g5) == 0);

    contexts(8);
    CUstream s;
    OK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    size_t n = 512 * MIB;
    CUdeviceptr src = alloc_on(0, n), dst = alloc_on(5, n), d3 = alloc_on(3, 256 * MIB);
    OK(cuCtxSetCurrent(ctx[0]));
    /* 256 MiB over the two NVLinks 0 -> 3. */
    OK(cuCtxEnablePeerAccess(ctx[3], 0));
    OK(cuMemcpyPeerAsync(d3, ctx[3], src, ctx[0], 256 * MIB, s));
    OK(cuStreamSynchronize(s));
    unsigned long long tx = 0;
    for (unsigned l = 0; l < 6; l++) {
        FieldValue f = {.fieldId = 138, .scopeId = l};
        CHECK(fields(g0, 1, &f) == 0 && f.nvmlReturn == 0);
        tx += f.value;
    }
    printf("nvlink_tx_kib %llu\n", tx);
    /* Four staged copies 0 -> 5 of 512 MiB queued back to back: GPU 0's PCIe link sends for
     * about 136 ms. Read NVML 60 ms in. */
    uint64_t t0 = now_ns();
    for (int i = 0; i < 4; i++) OK(cuMemcpyDtoDAsync(dst, src, n, s));
    while (now_ns() < t0 + 60000000ull) {
        struct timespec t = {0, 1000000};
        nanosleep(&t, NULL);
    }
    unsigned sent = 0, got = 0, u[2] = {99, 99};
    CHECK(pcie(g0, 0, &sent) == 0);
    CHECK(pcie(g5, 1, &got) == 0);
    CHECK(util(g0, u) == 0);
    printf("pcie_tx_gpu0_kbs %u\n", sent);
    printf("pcie_rx_gpu5_kbs %u\n", got);
    printf("gpu_util_gpu0 %u\n", u[0]);
    printf("mem_util_gpu0 %u\n", u[1]);
    OK(cuStreamSynchronize(s));
}

/* Review findings (issue 18): which work a synchronous copy is ordered after.
 * - cuMemcpyPeer is serialized after the pending work of its source (and destination) context:
 *   "serialized with respect all pending and future asynchronous work in to the current device,
 *   srcDevice, and dstDevice" (cuda_runtime_api.h 13.5, cudaMemcpyPeer; cudaMemcpy3DPeer says
 *   the same). A 100 ms kernel pending in the source context: the copy ends after it.
 * - A synchronous copy runs on the legacy stream, which does not synchronize with a
 *   CU_STREAM_NON_BLOCKING stream ("should perform no implicit synchronization with stream 0",
 *   cuda.h 13.5, cuStreamCreate): a 100 ms kernel there must not hold a 1 MiB pinned copy. */
static void serial(void) {
    contexts(2);
    size_t n = MIB;
    CUdeviceptr src = alloc_on(1, n), dst = alloc_on(0, n);
    OK(cuCtxSetCurrent(ctx[1]));
    hold(0, 100000000ull);
    OK(cuCtxSetCurrent(ctx[0]));
    uint64_t t0 = now_ns();
    OK(cuMemcpyPeer(dst, ctx[0], src, ctx[1], n));
    OK(cuCtxSynchronize());
    printf("peer_sync_after_source_work %.3f\n", (now_ns() - t0) / 1e6);
    OK(cuCtxSetCurrent(ctx[1]));
    OK(cuCtxSynchronize());
    OK(cuCtxSetCurrent(ctx[0]));
    CUstream nb;
    void *h = NULL;
    OK(cuStreamCreate(&nb, CU_STREAM_NON_BLOCKING));
    OK(cuMemAllocHost(&h, n));
    hold(nb, 100000000ull);
    t0 = now_ns();
    OK(cuMemcpyHtoD(dst, h, n));
    printf("sync_copy_beside_non_blocking_work %.3f\n", (now_ns() - t0) / 1e6);
    OK(cuStreamSynchronize(nb));
    /* - An asynchronous copy on the legacy stream follows the work already issued to the
     *   context's blocking streams ("The legacy default stream ... synchronizes with all other
     *   streams in the same CUcontext except for non-blocking streams", CUDA driver API,
     *   "Stream synchronization behavior"): it ends after a 100 ms kernel of a blocking stream.
     *   Printed: its end minus the kernel's, by events (>= the copy's 0.07 ms). */
    CUstream blocking;
    CUevent a, b;
    OK(cuStreamCreate(&blocking, CU_STREAM_DEFAULT));
    OK(cuEventCreate(&a, 0));
    OK(cuEventCreate(&b, 0));
    hold(blocking, 100000000ull);
    OK(cuEventRecord(a, blocking));
    OK(cuMemcpyHtoDAsync(dst, h, n, 0));
    OK(cuEventRecord(b, 0));
    OK(cuEventSynchronize(a));
    printf("legacy_copy_after_blocking_kernel %.3f\n", elapsed(a, b));
    OK(cuStreamSynchronize(blocking));
    OK(cuEventDestroy(a));
    OK(cuEventDestroy(b));
    OK(cuStreamDestroy(blocking));
    OK(cuMemFreeHost(h));
    OK(cuStreamDestroy(nb));
}

int main(int argc, char **argv) {
    OK(cuInit(0));
    const char *mode = argc > 1 ? argv[1] : "";
    if (!strcmp(mode, "dgx1"))
        dgx1();
    else if (!strcmp(mode, "a100"))
        a100();
    else if (!strcmp(mode, "nvml"))
        nvml();
    else if (!strcmp(mode, "bytes"))
        bytes();
    else if (!strcmp(mode, "serial"))
        serial();
    else if (!strcmp(mode, "share") && argc > 3)
        share(strtoull(argv[2], NULL, 10), strtoull(argv[3], NULL, 10));
    else {
        printf("FAIL unknown mode %s\n", mode);
        return 2;
    }
    if (failures) return 1;
    printf("OK\n");
    return 0;
}
