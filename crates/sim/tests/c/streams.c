/* The stream and event chapters of the driver API, linked against libcuda (-lcuda): stream
 * order with callbacks and host functions, events (flags, timing, records behind host work),
 * IPC events across two processes, memory operations, stream attributes, the profiler.
 *
 *   streams            every check in this process, then the IPC ones with a second process
 *                      (this program again, started through popen)
 *   ipc-wait HANDLE    second process: opens the event and waits for the first one's record
 *   ipc-record HANDLE  second process: records the event behind a 500 ms host function
 *   ipc-stale HANDLE   second process: opening a handle whose event is gone
 *
 * Prints one line per failed check and "OK" at the end when none failed; exit status 0 then. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUevent;
typedef struct { char reserved[64]; } CUipcEventHandle;
typedef union { char pad[64]; struct { void *base; size_t bytes; float ratio; int hit; int miss; } window; int i; unsigned int u; } CUstreamAttrValue;
typedef union {
    unsigned int operation;
    struct { unsigned int operation; CUdeviceptr address; union { unsigned int value; unsigned long long value64; }; unsigned int flags; CUdeviceptr alias; } wait, write;
    unsigned long long pad[6];
} CUstreamBatchMemOpParams;

CUresult cuInit(unsigned int);
CUresult cuDeviceGet(int *, int);
CUresult cuCtxCreate_v2(CUcontext *, unsigned int, int);
CUresult cuCtxDestroy_v2(CUcontext);
CUresult cuCtxPopCurrent_v2(CUcontext *);
CUresult cuCtxPushCurrent_v2(CUcontext);
CUresult cuCtxSynchronize(void);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemAllocManaged(CUdeviceptr *, size_t, unsigned int);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemHostAlloc(void **, size_t, unsigned int);
CUresult cuMemFreeHost(void *);
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr, const void *, size_t, CUstream);
CUresult cuMemcpyDtoHAsync_v2(void *, CUdeviceptr, size_t, CUstream);
CUresult cuMemcpyDtoH_v2(void *, CUdeviceptr, size_t);
CUresult cuStreamCreate(CUstream *, unsigned int);
CUresult cuStreamDestroy_v2(CUstream);
CUresult cuStreamSynchronize(CUstream);
CUresult cuStreamQuery(CUstream);
CUresult cuStreamWaitEvent(CUstream, CUevent, unsigned int);
CUresult cuStreamAddCallback(CUstream, void (*)(CUstream, CUresult, void *), void *, unsigned int);
CUresult cuStreamAddCallback_ptsz(CUstream, void (*)(CUstream, CUresult, void *), void *, unsigned int);
CUresult cuLaunchHostFunc(CUstream, void (*)(void *), void *);
CUresult cuLaunchHostFunc_ptsz(CUstream, void (*)(void *), void *);
CUresult cuStreamSynchronize_ptsz(CUstream);
CUresult cuStreamGetId(CUstream, unsigned long long *);
CUresult cuStreamGetDevice(CUstream, int *);
CUresult cuStreamGetPriority(CUstream, int *);
CUresult cuStreamGetAttribute(CUstream, int, CUstreamAttrValue *);
CUresult cuStreamSetAttribute(CUstream, int, const CUstreamAttrValue *);
CUresult cuStreamCopyAttributes(CUstream, CUstream);
CUresult cuStreamAttachMemAsync(CUstream, CUdeviceptr, size_t, unsigned int);
CUresult cuStreamWaitValue32_v2(CUstream, CUdeviceptr, unsigned int, unsigned int);
CUresult cuStreamWaitValue64_v2(CUstream, CUdeviceptr, unsigned long long, unsigned int);
CUresult cuStreamWriteValue32_v2(CUstream, CUdeviceptr, unsigned int, unsigned int);
CUresult cuStreamWriteValue64_v2(CUstream, CUdeviceptr, unsigned long long, unsigned int);
CUresult cuStreamBatchMemOp_v2(CUstream, unsigned int, CUstreamBatchMemOpParams *, unsigned int);
CUresult cuEventCreate(CUevent *, unsigned int);
CUresult cuEventDestroy_v2(CUevent);
CUresult cuEventRecord(CUevent, CUstream);
CUresult cuEventRecordWithFlags(CUevent, CUstream, unsigned int);
CUresult cuEventQuery(CUevent);
CUresult cuEventSynchronize(CUevent);
CUresult cuEventElapsedTime_v2(float *, CUevent, CUevent);
CUresult cuIpcGetEventHandle(CUipcEventHandle *, CUevent);
CUresult cuIpcOpenEventHandle(CUevent *, CUipcEventHandle);
CUresult cuProfilerStart(void);
CUresult cuProfilerStop(void);

enum { SUCCESS = 0, INVALID_VALUE = 1, INVALID_CONTEXT = 201, INVALID_HANDLE = 400, NOT_READY = 600, NOT_PERMITTED = 800 };
enum { EVENT_BLOCKING_SYNC = 1, EVENT_DISABLE_TIMING = 2, EVENT_INTERPROCESS = 4 };
#define PER_THREAD ((CUstream)0x2)

static int failed;
#define CHECK(cond, ...) do { if (!(cond)) { failed++; printf("FAIL %s:%d: ", __FILE__, __LINE__); printf(__VA_ARGS__); printf("\n"); } } while (0)
#define EXPECT(call, want) do { CUresult r_ = (call); CHECK(r_ == (want), "%s = %d, want %d", #call, r_, (int)(want)); } while (0)

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static void sleep_ms(int ms) {
    struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

/* ---- stream order ------------------------------------------------------------------------- */

struct order {
    pthread_t main_thread;
    int *seen_by_cb;     /* host buffer the earlier memcpy filled */
    int seen;            /* what the callback saw there */
    int *later_src;      /* the source of a later memcpy, which the callback writes */
    CUstream stream_arg; /* the stream the callback was given */
    CUresult status_arg;
    int on_driver_thread;
    double returned_ms;
    int calls;
    CUresult api_in_cb;  /* what a driver call made inside the callback answered */
};

static void order_callback(CUstream s, CUresult status, void *p) {
    struct order *o = p;
    o->stream_arg = s;
    o->status_arg = status;
    o->on_driver_thread = !pthread_equal(pthread_self(), o->main_thread);
    o->seen = o->seen_by_cb[0];
    o->api_in_cb = cuStreamQuery(s);
    sleep_ms(200);
    o->later_src[0] = 7777;
    o->calls++;
    o->returned_ms = now_ms();
}

static void stream_order(void) {
    struct order o = {0};
    o.main_thread = pthread_self();
    int *h_in, *h_seen, *h_later, *h_out;
    cuMemHostAlloc((void **)&h_in, 64, 0);
    cuMemHostAlloc((void **)&h_seen, 64, 0);
    cuMemHostAlloc((void **)&h_later, 64, 0);
    cuMemHostAlloc((void **)&h_out, 64, 0);
    h_in[0] = 4242; h_seen[0] = 0; h_later[0] = 1; h_out[0] = 0;
    o.seen_by_cb = h_seen;
    o.later_src = h_later;
    CUdeviceptr d;
    cuMemAlloc_v2(&d, 64);
    CUstream s;
    EXPECT(cuStreamCreate(&s, 0), SUCCESS);
    CUevent after;
    cuEventCreate(&after, 0);

    /* earlier memcpys, the callback, later memcpys, an event: issue order is stream order */
    EXPECT(cuMemcpyHtoDAsync_v2(d, h_in, 4, s), SUCCESS);
    EXPECT(cuMemcpyDtoHAsync_v2(h_seen, d, 4, s), SUCCESS);
    double t0 = now_ms();
    EXPECT(cuStreamAddCallback(s, order_callback, &o, 0), SUCCESS);
    EXPECT(cuMemcpyHtoDAsync_v2(d, h_later, 4, s), SUCCESS);
    EXPECT(cuMemcpyDtoHAsync_v2(h_out, d, 4, s), SUCCESS);
    EXPECT(cuEventRecord(after, s), SUCCESS);
    CHECK(now_ms() - t0 < 100, "enqueueing behind a callback blocked the caller %.0f ms", now_ms() - t0);
    EXPECT(cuStreamQuery(s), NOT_READY);
    EXPECT(cuEventQuery(after), NOT_READY);
    CHECK(h_out[0] == 0, "the later copy ran before the callback returned (%d)", h_out[0]);
    EXPECT(cuStreamSynchronize(s), SUCCESS);
    CHECK(o.calls == 1, "callback ran %d times", o.calls);
    CHECK(o.returned_ms > 0 && now_ms() >= o.returned_ms, "synchronize returned before the callback did");
    CHECK(o.seen == 4242, "the callback saw %d, not what the earlier memcpy wrote", o.seen);
    CHECK(h_out[0] == 7777, "the later memcpy copied %d: it ran before the callback returned", h_out[0]);
    CHECK(o.stream_arg == s && o.status_arg == SUCCESS, "callback got (%p, %d)", o.stream_arg, o.status_arg);
    CHECK(o.on_driver_thread, "the callback ran on the calling thread");
    /* cuda.h: "Attempting to use a CUDA API will result in CUDA_ERROR_NOT_PERMITTED" */
    CHECK(o.api_in_cb == NOT_PERMITTED, "cuStreamQuery inside a callback answered %d", o.api_in_cb);
    EXPECT(cuStreamQuery(s), SUCCESS);
    EXPECT(cuEventQuery(after), SUCCESS);

    /* an event recorded behind a callback completes when the callback returns */
    o.calls = 0;
    EXPECT(cuStreamAddCallback(s, order_callback, &o, 0), SUCCESS);
    EXPECT(cuEventRecord(after, s), SUCCESS);
    EXPECT(cuEventSynchronize(after), SUCCESS);
    CHECK(o.calls == 1, "event synchronize returned before the callback ran (%d)", o.calls);

    /* a stream waiting on that event waits for the callback too */
    CUstream s2;
    cuStreamCreate(&s2, 0);
    o.calls = 0;
    h_out[0] = 0;
    EXPECT(cuStreamAddCallback(s, order_callback, &o, 0), SUCCESS);
    EXPECT(cuEventRecord(after, s), SUCCESS);
    EXPECT(cuStreamWaitEvent(s2, after, 0), SUCCESS);
    h_later[0] = 1;
    EXPECT(cuMemcpyHtoDAsync_v2(d, h_later, 4, s2), SUCCESS); /* after the callback's write */
    EXPECT(cuMemcpyDtoHAsync_v2(h_out, d, 4, s2), SUCCESS);
    EXPECT(cuStreamSynchronize(s2), SUCCESS);
    CHECK(o.calls == 1 && h_out[0] == 7777, "stream 2 ran ahead of the event it waits for (%d, %d)", o.calls, h_out[0]);
    cuStreamSynchronize(s);

    /* error codes (cuda.h: flags "must be 0"; a NULL function) */
    EXPECT(cuStreamAddCallback(s, order_callback, &o, 1), INVALID_VALUE);
    EXPECT(cuStreamAddCallback(s, NULL, &o, 0), INVALID_VALUE);
    EXPECT(cuLaunchHostFunc(s, NULL, NULL), INVALID_VALUE);

    cuStreamDestroy_v2(s2);
    cuStreamDestroy_v2(s);
    EXPECT(cuStreamAddCallback(s, order_callback, &o, 0), INVALID_HANDLE);
    cuEventDestroy_v2(after);
    cuMemFree_v2(d);
    cuMemFreeHost(h_in); cuMemFreeHost(h_seen); cuMemFreeHost(h_later); cuMemFreeHost(h_out);
}

/* host functions on the legacy and per-thread streams, in order */
struct seq { int log[8]; int n; };
static void step(void *p) { struct seq *q = p; sleep_ms(30); q->log[q->n] = q->n + 1; q->n++; }
static void legacy_cb(CUstream s, CUresult st, void *p) { (void)s; (void)st; step(p); }
static void set_later(void *p) { struct { int *at; int value; int ms; } *x = p; sleep_ms(x->ms); *x->at = x->value; }
static void look_at(void *p) { struct { int *at; int saw; } *x = p; x->saw = *x->at; }

static void default_streams(void) {
    struct seq q = {{0}, 0};
    EXPECT(cuLaunchHostFunc(NULL, step, &q), SUCCESS);
    EXPECT(cuStreamAddCallback(NULL, legacy_cb, &q, 0), SUCCESS);
    EXPECT(cuLaunchHostFunc(NULL, step, &q), SUCCESS);
    EXPECT(cuStreamQuery(NULL), NOT_READY);
    EXPECT(cuCtxSynchronize(), SUCCESS);
    CHECK(q.n == 3 && q.log[0] == 1 && q.log[1] == 2 && q.log[2] == 3, "legacy stream: %d host functions, log %d %d %d", q.n, q.log[0], q.log[1], q.log[2]);

    struct seq p = {{0}, 0};
    EXPECT(cuLaunchHostFunc_ptsz(NULL, step, &p), SUCCESS);
    EXPECT(cuStreamAddCallback_ptsz(PER_THREAD, legacy_cb, &p, 0), SUCCESS);
    EXPECT(cuStreamSynchronize_ptsz(NULL), SUCCESS);
    CHECK(p.n == 2, "per-thread stream: %d host functions ran before its synchronize returned", p.n);

    /* implicit synchronization: the legacy stream waits for blocking streams' earlier work,
       and blocking streams for the legacy stream's; a non-blocking stream for neither */
    CUstream blocking, nonblocking;
    cuStreamCreate(&blocking, 0);
    cuStreamCreate(&nonblocking, 1 /* CU_STREAM_NON_BLOCKING */);
    int *h;
    cuMemHostAlloc((void **)&h, 64, 0);
    memset(h, 0, 64);
    CUdeviceptr dd;
    cuMemAlloc_v2(&dd, 64);
    struct setter { int *at; int value; int ms; } one = {&h[0], 99, 100}, two = {&h[2], 5, 300};
    EXPECT(cuLaunchHostFunc(blocking, set_later, &one), SUCCESS);
    EXPECT(cuLaunchHostFunc(nonblocking, set_later, &two), SUCCESS);
    EXPECT(cuMemcpyHtoDAsync_v2(dd, h, 16, NULL), SUCCESS);
    EXPECT(cuMemcpyDtoHAsync_v2(&h[4], dd, 16, NULL), SUCCESS);
    EXPECT(cuStreamSynchronize(NULL), SUCCESS);
    CHECK(h[4] == 99, "the legacy stream's copy ran before the blocking stream's host function (%d)", h[4]);
    CHECK(h[6] == 0, "the legacy stream waited for a non-blocking stream (%d)", h[6]);
    struct setter three = {&h[8], 7, 100};
    struct seen { int *at; int saw; } look = {&h[8], -1};
    EXPECT(cuLaunchHostFunc(NULL, set_later, &three), SUCCESS);
    EXPECT(cuLaunchHostFunc(blocking, look_at, &look), SUCCESS);
    EXPECT(cuStreamSynchronize(blocking), SUCCESS);
    CHECK(look.saw == 7, "a blocking stream's host function ran before the legacy stream's (%d)", look.saw);
    EXPECT(cuStreamSynchronize(nonblocking), SUCCESS);
    CHECK(h[2] == 5, "the non-blocking stream's host function did not run");
    cuStreamDestroy_v2(blocking);
    cuStreamDestroy_v2(nonblocking);
    cuMemFree_v2(dd);
    cuMemFreeHost(h);

    /* a synchronous copy waits for the host functions before it */
    struct seq r = {{0}, 0};
    CUdeviceptr d;
    cuMemAlloc_v2(&d, 4);
    int v = 0;
    EXPECT(cuLaunchHostFunc(NULL, step, &r), SUCCESS);
    EXPECT(cuMemcpyDtoH_v2(&v, d, 4), SUCCESS);
    CHECK(r.n == 1, "a synchronous copy ran before the host function queued before it");
    cuMemFree_v2(d);
}

/* ---- events --------------------------------------------------------------------------------- */

static void sleep100(void *p) { (void)p; sleep_ms(100); }

static void events(void) {
    CUevent e, t0, t1, nt, ipc;
    EXPECT(cuEventCreate(&e, 0x8), INVALID_VALUE);
    EXPECT(cuEventCreate(&e, EVENT_INTERPROCESS), INVALID_VALUE); /* needs DISABLE_TIMING */
    EXPECT(cuEventCreate(&t0, EVENT_BLOCKING_SYNC), SUCCESS);
    EXPECT(cuEventCreate(&t1, 0), SUCCESS);
    EXPECT(cuEventCreate(&nt, EVENT_DISABLE_TIMING), SUCCESS);
    EXPECT(cuEventCreate(&ipc, EVENT_INTERPROCESS | EVENT_DISABLE_TIMING), SUCCESS);
    float ms = -1;
    EXPECT(cuEventQuery(t0), SUCCESS); /* never recorded: an empty set of work */
    EXPECT(cuEventElapsedTime_v2(&ms, t0, t1), INVALID_HANDLE); /* never recorded */
    CUstream s;
    cuStreamCreate(&s, 0);
    EXPECT(cuEventRecord(t0, s), SUCCESS);
    EXPECT(cuLaunchHostFunc(s, sleep100, NULL), SUCCESS);
    EXPECT(cuEventRecordWithFlags(t1, s, 0), SUCCESS);
    EXPECT(cuEventRecord(nt, s), SUCCESS);
    EXPECT(cuEventElapsedTime_v2(&ms, t0, t1), NOT_READY);
    EXPECT(cuEventSynchronize(t1), SUCCESS);
    EXPECT(cuEventElapsedTime_v2(&ms, t0, t1), SUCCESS);
    CHECK(ms >= 99.0 && ms < 1000.0, "a 100 ms host function between two events took %.3f ms", ms);
    EXPECT(cuEventElapsedTime_v2(&ms, t0, nt), INVALID_HANDLE); /* DISABLE_TIMING */
    EXPECT(cuEventRecordWithFlags(t1, s, 1), INVALID_VALUE); /* EXTERNAL outside capture */
    EXPECT(cuEventRecordWithFlags(t1, s, 2), INVALID_VALUE);
    EXPECT(cuStreamWaitEvent(s, t1, 2), INVALID_VALUE);
    EXPECT(cuStreamWaitEvent(s, t1, 1), INVALID_VALUE); /* WAIT_EXTERNAL outside capture */
    CUipcEventHandle h;
    EXPECT(cuIpcGetEventHandle(&h, t1), INVALID_HANDLE); /* not CU_EVENT_INTERPROCESS */
    EXPECT(cuIpcGetEventHandle(&h, ipc), SUCCESS);
    CUevent mine;
    EXPECT(cuIpcOpenEventHandle(&mine, h), INVALID_CONTEXT); /* its own process */
    cuEventDestroy_v2(t0); cuEventDestroy_v2(t1); cuEventDestroy_v2(nt); cuEventDestroy_v2(ipc);
    EXPECT(cuEventQuery(t0), INVALID_HANDLE);
    cuStreamDestroy_v2(s);
}

/* ---- IPC events across two processes -------------------------------------------------------- */

static void hex(const CUipcEventHandle *h, char *out) {
    for (int i = 0; i < 64; i++) sprintf(out + 2 * i, "%02x", (unsigned char)h->reserved[i]);
}
static void unhex(const char *s, CUipcEventHandle *h) {
    for (int i = 0; i < 64; i++) { unsigned v; sscanf(s + 2 * i, "%2x", &v); h->reserved[i] = (char)v; }
}

static FILE *second(const char *self, const char *mode, const CUipcEventHandle *h) {
    char cmd[4096], hx[129];
    hex(h, hx);
    snprintf(cmd, sizeof cmd, "'%s' %s %s", self, mode, hx);
    return popen(cmd, "r");
}

static double returned_ms;
static void sleep1500(void *p) { (void)p; sleep_ms(1500); returned_ms = now_ms(); }

static void ipc(const char *self) {
    CUevent e;
    CUstream s;
    cuStreamCreate(&s, 0);
    EXPECT(cuEventCreate(&e, EVENT_INTERPROCESS | EVENT_DISABLE_TIMING), SUCCESS);
    CUipcEventHandle h;
    EXPECT(cuIpcGetEventHandle(&h, e), SUCCESS);

    /* 1. this process records behind a 1.5 s host function (the other process starts meanwhile); the other one waits for it */
    returned_ms = 0;
    EXPECT(cuLaunchHostFunc(s, sleep1500, NULL), SUCCESS);
    EXPECT(cuEventRecord(e, s), SUCCESS);
    FILE *p = second(self, "ipc-wait", &h);
    char line[256];
    double synced = 0;
    int query = -1, waited = -1, child_ok = 0;
    while (fgets(line, sizeof line, p)) {
        sscanf(line, "query %d", &query);
        sscanf(line, "synchronized %lf", &synced);
        sscanf(line, "stream-waited %d", &waited);
        if (strncmp(line, "CHILD OK", 8) == 0) child_ok = 1;
        if (strncmp(line, "FAIL", 4) == 0) { failed++; printf("second process: %s", line); }
    }
    int st = pclose(p);
    CHECK(st == 0 && child_ok, "second process (ipc-wait) exited with %d", st);
    CHECK(query == NOT_READY, "the second process's query of a pending record answered %d", query);
    EXPECT(cuStreamSynchronize(s), SUCCESS);
    CHECK(returned_ms > 0 && synced >= returned_ms, "the second process's synchronize returned at %.1f, the record completes at %.1f", synced, returned_ms);
    CHECK(waited == 1, "the second process's stream did not wait for the event (%d)", waited);

    /* 2. the other process records behind its own 500 ms host function; this one waits */
    p = second(self, "ipc-record", &h);
    int saw_pending = -1;
    double recorded = 0, synced_here = 0, child_returned = 0;
    while (fgets(line, sizeof line, p)) {
        if (sscanf(line, "recorded %lf", &recorded) == 1) {
            saw_pending = cuEventQuery(e);
            EXPECT(cuEventSynchronize(e), SUCCESS);
            synced_here = now_ms();
        }
        sscanf(line, "returned %lf", &child_returned);
        if (strncmp(line, "FAIL", 4) == 0) { failed++; printf("second process: %s", line); }
    }
    st = pclose(p);
    CHECK(st == 0, "second process (ipc-record) exited with %d", st);
    CHECK(saw_pending == NOT_READY, "a query of the other process's pending record answered %d", saw_pending);
    CHECK(recorded > 0 && child_returned > 0, "the second process did not record");
    CHECK(synced_here >= child_returned, "this process's synchronize returned at %.1f, before the other's host function returned at %.1f", synced_here, child_returned);

    /* 3. once the exporter destroyed its event, its handle opens nothing */
    EXPECT(cuEventDestroy_v2(e), SUCCESS);
    p = second(self, "ipc-stale", &h);
    int stale = -1;
    while (fgets(line, sizeof line, p)) sscanf(line, "open %d", &stale);
    pclose(p);
    CHECK(stale == INVALID_VALUE, "opening the handle of a destroyed event answered %d", stale);
    cuStreamDestroy_v2(s);
}

static void done_flag(void *p) { *(volatile int *)p = 1; }
static double second_returned_ms;
static void sleep500(void *p) { (void)p; sleep_ms(500); second_returned_ms = now_ms(); }

static int ipc_second(const char *mode, const char *hx) {
    CUipcEventHandle h;
    unhex(hx, &h);
    CUevent e;
    if (strcmp(mode, "ipc-stale") == 0) {
        printf("open %d\n", cuIpcOpenEventHandle(&e, h));
        return 0;
    }
    EXPECT(cuIpcOpenEventHandle(&e, h), SUCCESS);
    CUstream s;
    cuStreamCreate(&s, 0);
    if (strcmp(mode, "ipc-wait") == 0) {
        printf("query %d\n", cuEventQuery(e));
        /* a stream of this process waits for the other's record, then runs a host function */
        volatile int flag = 0;
        EXPECT(cuStreamWaitEvent(s, e, 0), SUCCESS);
        EXPECT(cuLaunchHostFunc(s, done_flag, (void *)&flag), SUCCESS);
        EXPECT(cuEventSynchronize(e), SUCCESS);
        printf("synchronized %.3f\n", now_ms());
        EXPECT(cuStreamSynchronize(s), SUCCESS);
        printf("stream-waited %d\n", flag);
        float ms;
        EXPECT(cuEventElapsedTime_v2(&ms, e, e), INVALID_HANDLE); /* opened: DISABLE_TIMING */
    } else {
        EXPECT(cuLaunchHostFunc(s, sleep500, NULL), SUCCESS);
        EXPECT(cuEventRecord(e, s), SUCCESS);
        printf("recorded %.3f\n", now_ms());
        fflush(stdout);
        EXPECT(cuStreamSynchronize(s), SUCCESS);
        printf("returned %.3f\n", second_returned_ms);
    }
    EXPECT(cuEventDestroy_v2(e), SUCCESS);
    cuStreamDestroy_v2(s);
    if (!failed) printf("CHILD OK\n");
    return failed != 0;
}

/* ---- memory operations ---------------------------------------------------------------------- */

static void memops(void) {
    CUstream s;
    cuStreamCreate(&s, 0);
    volatile unsigned int *flag;
    cuMemHostAlloc((void **)&flag, 64, 0);
    flag[0] = 0;
    CUdeviceptr hflag = (CUdeviceptr)(uintptr_t)flag;
    CUdeviceptr d, m;
    cuMemAlloc_v2(&d, 64);
    cuMemAllocManaged(&m, 4096, 1);
    int *out;
    cuMemHostAlloc((void **)&out, 64, 0);
    out[0] = 0;

    /* a wait blocks the stream until the host writes the value */
    EXPECT(cuStreamWaitValue32_v2(s, hflag, 1, 1 /* EQ */), SUCCESS);
    EXPECT(cuStreamWriteValue32_v2(s, d, 5, 0), SUCCESS);
    EXPECT(cuMemcpyDtoHAsync_v2(out, d, 4, s), SUCCESS);
    sleep_ms(50);
    EXPECT(cuStreamQuery(s), NOT_READY);
    CHECK(out[0] == 0, "work behind an unsatisfied wait ran (%d)", out[0]);
    flag[0] = 1;
    EXPECT(cuStreamSynchronize(s), SUCCESS);
    CHECK(out[0] == 5, "the write behind the wait wrote %d", out[0]);

    /* GEQ is a cyclic comparison; 64-bit forms; a satisfied wait does not block */
    flag[0] = 3;
    EXPECT(cuStreamWaitValue32_v2(s, hflag, 2, 0 /* GEQ */), SUCCESS);
    EXPECT(cuStreamQuery(s), SUCCESS);
    EXPECT(cuStreamWriteValue64_v2(s, d + 8, 0x1122334455667788ULL, 0), SUCCESS);
    unsigned long long w = 0;
    EXPECT(cuMemcpyDtoHAsync_v2(&w, d + 8, 8, s), SUCCESS);
    EXPECT(cuStreamSynchronize(s), SUCCESS);
    CHECK(w == 0x1122334455667788ULL, "64-bit write wrote %llx", w);
    EXPECT(cuStreamWaitValue64_v2(s, d + 8, 0x8, 2 /* AND */), SUCCESS);
    EXPECT(cuStreamSynchronize(s), SUCCESS);

    /* a batch: a wait, then a write, in order */
    CUstreamBatchMemOpParams ops[2];
    memset(ops, 0, sizeof ops);
    flag[0] = 0;
    ops[0].wait.operation = 1; /* WAIT_VALUE_32 */
    ops[0].wait.address = hflag;
    ops[0].wait.value = 9;
    ops[0].wait.flags = 1;
    ops[1].write.operation = 2; /* WRITE_VALUE_32 */
    ops[1].write.address = d;
    ops[1].write.value = 11;
    EXPECT(cuStreamBatchMemOp_v2(s, 2, ops, 0), SUCCESS);
    EXPECT(cuMemcpyDtoHAsync_v2(out, d, 4, s), SUCCESS);
    sleep_ms(20);
    CHECK(out[0] == 5, "the batch's write ran before its wait was satisfied (%d)", out[0]);
    flag[0] = 9;
    EXPECT(cuStreamSynchronize(s), SUCCESS);
    CHECK(out[0] == 11, "the batch wrote %d", out[0]);

    /* errors */
    EXPECT(cuStreamWriteValue32_v2(s, d + 2, 1, 0), INVALID_VALUE);        /* misaligned */
    EXPECT(cuStreamWriteValue32_v2(s, d, 1, 2), INVALID_VALUE);            /* flags */
    EXPECT(cuStreamWaitValue32_v2(s, hflag, 1, 7), INVALID_VALUE);         /* flags */
    EXPECT(cuStreamWriteValue32_v2(s, m, 1, 0), INVALID_VALUE);            /* managed memory */
    CUdeviceptr gone;
    cuMemAlloc_v2(&gone, 64);
    cuMemFree_v2(gone);
    EXPECT(cuStreamWriteValue32_v2(s, gone, 1, 0), INVALID_VALUE);         /* freed memory */
    EXPECT(cuStreamBatchMemOp_v2(s, 2, ops, 1), INVALID_VALUE);            /* flags */
    EXPECT(cuStreamBatchMemOp_v2(s, 256, ops, 0), INVALID_VALUE);          /* count */
    ops[0].operation = 99;
    EXPECT(cuStreamBatchMemOp_v2(s, 2, ops, 0), INVALID_VALUE);
    EXPECT(cuStreamSynchronize(s), SUCCESS);

    /* attaching managed memory */
    EXPECT(cuStreamAttachMemAsync(s, m, 0, 4 /* SINGLE */), SUCCESS);
    EXPECT(cuStreamAttachMemAsync(s, m, 4096, 1), SUCCESS);
    EXPECT(cuStreamAttachMemAsync(s, m, 2048, 1), INVALID_VALUE); /* part of it */
    EXPECT(cuStreamAttachMemAsync(s, m, 0, 3), INVALID_VALUE);   /* not one flag */
    EXPECT(cuStreamAttachMemAsync(NULL, m, 0, 4), INVALID_VALUE); /* SINGLE to the NULL stream */
    EXPECT(cuStreamAttachMemAsync(s, d, 0, 1), INVALID_VALUE);   /* not managed */
    cuMemFree_v2(d);
    cuMemFree_v2(m);
    cuMemFreeHost((void *)flag);
    cuMemFreeHost(out);
    cuStreamDestroy_v2(s);
}

/* ---- stream attributes ---------------------------------------------------------------------- */

static void attributes(void) {
    CUstream a, b;
    cuStreamCreate(&a, 0);
    cuStreamCreate(&b, 0);
    unsigned long long ia = 0, ib = 0, il = 0;
    EXPECT(cuStreamGetId(a, &ia), SUCCESS);
    EXPECT(cuStreamGetId(b, &ib), SUCCESS);
    EXPECT(cuStreamGetId(NULL, &il), SUCCESS);
    CHECK(ia != ib && ia != il && ib != il, "stream ids %llu %llu %llu", ia, ib, il);
    int dev = -1;
    EXPECT(cuStreamGetDevice(a, &dev), SUCCESS);
    CHECK(dev == 0, "stream device %d", dev);

    CUstreamAttrValue v, got;
    memset(&got, 0, sizeof got);
    EXPECT(cuStreamGetAttribute(a, 3 /* SYNCHRONIZATION_POLICY */, &got), SUCCESS);
    CHECK(got.u == 1, "default synchronization policy %u (AUTO is 1)", got.u);
    memset(&v, 0, sizeof v);
    v.u = 4; /* BLOCKING_SYNC */
    EXPECT(cuStreamSetAttribute(a, 3, &v), SUCCESS);
    v.u = 9;
    EXPECT(cuStreamSetAttribute(a, 3, &v), INVALID_VALUE);
    memset(&v, 0, sizeof v);
    v.window.base = (void *)0x1000; v.window.bytes = 1 << 20; v.window.ratio = 0.5f; v.window.hit = 2; v.window.miss = 1;
    EXPECT(cuStreamSetAttribute(a, 1 /* ACCESS_POLICY_WINDOW */, &v), SUCCESS);
    v.window.ratio = 1.5f;
    EXPECT(cuStreamSetAttribute(a, 1, &v), INVALID_VALUE);
    memset(&v, 0, sizeof v);
    v.i = -1;
    EXPECT(cuStreamSetAttribute(a, 8 /* PRIORITY */, &v), SUCCESS);
    int prio = 0;
    EXPECT(cuStreamGetPriority(a, &prio), SUCCESS);
    CHECK(prio == -1, "priority set as an attribute reads %d", prio);
    EXPECT(cuStreamGetAttribute(a, 2 /* COOPERATIVE: not a stream attribute */, &got), INVALID_VALUE);

    EXPECT(cuStreamCopyAttributes(b, a), SUCCESS);
    memset(&got, 0, sizeof got);
    EXPECT(cuStreamGetAttribute(b, 3, &got), SUCCESS);
    CHECK(got.u == 4, "copied synchronization policy %u", got.u);
    memset(&got, 0, sizeof got);
    EXPECT(cuStreamGetAttribute(b, 1, &got), SUCCESS);
    CHECK(got.window.base == (void *)0x1000 && got.window.bytes == (1 << 20) && got.window.ratio == 0.5f && got.window.hit == 2,
          "copied access policy window %p %zu %f %d", got.window.base, got.window.bytes, got.window.ratio, got.window.hit);
    memset(&got, 0, sizeof got);
    EXPECT(cuStreamGetAttribute(b, 8, &got), SUCCESS);
    CHECK(got.i == -1, "copied priority %d", got.i);
    cuStreamDestroy_v2(a);
    cuStreamDestroy_v2(b);
}

int main(int argc, char **argv) {
    int dev;
    CUcontext ctx;
    if (cuInit(0) || cuDeviceGet(&dev, 0) || cuCtxCreate_v2(&ctx, 0, dev)) return 2;
    if (argc == 3) return ipc_second(argv[1], argv[2]);

    stream_order();
    default_streams();
    events();
    memops();
    attributes();
    ipc(argv[0]);

    EXPECT(cuProfilerStart(), SUCCESS);
    EXPECT(cuProfilerStart(), SUCCESS); /* already enabled: no effect */
    EXPECT(cuProfilerStop(), SUCCESS);
    CUcontext popped;
    cuCtxPopCurrent_v2(&popped);
    EXPECT(cuProfilerStart(), INVALID_CONTEXT);
    cuCtxPushCurrent_v2(popped);

    cuCtxDestroy_v2(ctx);
    if (!failed) printf("OK\n");
    return failed != 0;
}
