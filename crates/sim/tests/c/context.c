/* The context chapter of the driver API, linked against libcuda (-lcuda): primary contexts
 * (retain, release, state, flags, reset), cuCtxCreate v2/v3/v4, the current-context stack,
 * flags, every CUlimit, the cache preference, the stream priority range, context ids, the CUDA
 * 12.5 whole-context event record and wait, and the CUDA 13.0 _v2 calls that name a context.
 * Codes as CUDA 13.5's cuda.h documents them.
 *
 * Prints one line per failed check and "OK" at the end when none failed; exit status 0 then. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

typedef int CUresult;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUevent;

CUresult cuInit(unsigned);
CUresult cuDeviceGetAttribute(int *, int, int);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, int);
CUresult cuDevicePrimaryCtxRelease_v2(int);
CUresult cuDevicePrimaryCtxGetState(int, unsigned *, int *);
CUresult cuDevicePrimaryCtxSetFlags(int, unsigned);
CUresult cuDevicePrimaryCtxSetFlags_v2(int, unsigned);
CUresult cuDevicePrimaryCtxReset_v2(int);
CUresult cuCtxCreate_v2(CUcontext *, unsigned, int);
CUresult cuCtxCreate_v3(CUcontext *, void *, int, unsigned, int);
CUresult cuCtxCreate_v4(CUcontext *, void *, unsigned, int);
CUresult cuCtxDestroy_v2(CUcontext);
CUresult cuCtxPushCurrent_v2(CUcontext);
CUresult cuCtxPopCurrent_v2(CUcontext *);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuCtxGetCurrent(CUcontext *);
CUresult cuCtxGetDevice(int *);
CUresult cuCtxGetDevice_v2(int *, CUcontext);
CUresult cuCtxGetFlags(unsigned *);
CUresult cuCtxSetFlags(unsigned);
CUresult cuCtxGetId(CUcontext, unsigned long long *);
CUresult cuCtxGetApiVersion(CUcontext, unsigned *);
CUresult cuCtxGetLimit(size_t *, int);
CUresult cuCtxSetLimit(int, size_t);
CUresult cuCtxGetCacheConfig(int *);
CUresult cuCtxSetCacheConfig(int);
CUresult cuCtxGetStreamPriorityRange(int *, int *);
CUresult cuCtxResetPersistingL2Cache(void);
CUresult cuCtxSynchronize(void);
CUresult cuCtxGetExecAffinity(void *, int);
CUresult cuDeviceGetExecAffinitySupport(int *, int, int);
CUresult cuCtxSynchronize_v2(CUcontext);
CUresult cuCtxRecordEvent(CUcontext, CUevent);
CUresult cuCtxWaitEvent(CUcontext, CUevent);
CUresult cuStreamCreate(CUstream *, unsigned);
CUresult cuStreamDestroy_v2(CUstream);
CUresult cuLaunchHostFunc(CUstream, void (*)(void *), void *);
CUresult cuEventCreate(CUevent *, unsigned);
CUresult cuEventRecord(CUevent, CUstream);
CUresult cuEventQuery(CUevent);
CUresult cuEventSynchronize(CUevent);
CUresult cuEventElapsedTime(float *, CUevent, CUevent);
CUresult cuEventDestroy_v2(CUevent);

#define INVALID_VALUE 1
#define NOT_INITIALIZED 3
#define INVALID_DEVICE 101
#define INVALID_CONTEXT 201
#define UNSUPPORTED_LIMIT 215
#define INVALID_HANDLE 400
#define NOT_READY 600
#define PRIMARY_CONTEXT_ACTIVE 708
#define NOT_SUPPORTED 801
#define UNSUPPORTED_EXEC_AFFINITY 224

enum { L_STACK, L_PRINTF, L_HEAP, L_SYNC_DEPTH, L_PENDING, L_L2_FETCH, L_PERSISTING, L_SHMEM, L_CIG,
       L_CIG_FALLBACK, L_PER_BLOCK, L_MAX };
#define ATTR_MAX_PERSISTING_L2 108

#include "expect.h"

static void sleep_ms(void *ms) { usleep((useconds_t)(uintptr_t)ms * 1000); }

static void limits_are_defaults(int line) {
    /* 1 KiB stack, 1 MiB printf FIFO, 8 MiB heap, sync depth 2, 2048 pending launches. */
    static const size_t want[] = {1024, 1 << 20, 8 << 20, 2, 2048};
    for (int l = 0; l < 5; l++) {
        size_t v = 0;
        EXPECT(cuCtxGetLimit(&v, l), 0);
        if (v != want[l]) {
            printf("FAIL line %d: limit %d = %zu, want %zu\n", line, l, v, want[l]);
            failures++;
        }
    }
    size_t v = 1;
    EXPECT(cuCtxGetLimit(&v, L_PERSISTING), 0);
    CHECK(v == 0);
    v = 1;
    EXPECT(cuCtxGetLimit(&v, L_CIG), 0);
    CHECK(v == 0);
}

int main(void) {
    CUcontext primary, c1, c2, c3, c4, cur, popped;
    unsigned flags;
    int active, dev;
    unsigned long long id_p, id1, id3;
    size_t v;

    /* Before cuInit. */
    EXPECT(cuCtxGetCurrent(&cur), NOT_INITIALIZED);
    EXPECT(cuInit(0), 0);

    /* No context yet. */
    EXPECT(cuCtxGetCurrent(&cur), 0);
    CHECK(cur == NULL);
    EXPECT(cuCtxGetLimit(&v, L_STACK), INVALID_CONTEXT);
    EXPECT(cuCtxSetCacheConfig(0), INVALID_CONTEXT);
    EXPECT(cuCtxPopCurrent_v2(&popped), INVALID_CONTEXT);
    EXPECT(cuCtxGetDevice(&dev), INVALID_CONTEXT);

    /* ---- primary context ---- */
    EXPECT(cuDevicePrimaryCtxGetState(0, &flags, &active), 0);
    CHECK(flags == 0 && active == 0);
    EXPECT(cuDevicePrimaryCtxGetState(7, &flags, &active), INVALID_DEVICE);
    EXPECT(cuDevicePrimaryCtxSetFlags(0, 4 /* SCHED_BLOCKING_SYNC */), 0);   /* inactive: v1 may */
    EXPECT(cuDevicePrimaryCtxRetain(&primary, 0), 0);
    EXPECT(cuDevicePrimaryCtxRetain(NULL, 0), INVALID_VALUE);
    EXPECT(cuDevicePrimaryCtxGetState(0, &flags, &active), 0);
    CHECK(flags == 4 && active == 1);
    /* v1 refuses an active primary context; v2 (CUDA 11.0) allows it. */
    EXPECT(cuDevicePrimaryCtxSetFlags(0, 2), PRIMARY_CONTEXT_ACTIVE);
    EXPECT(cuDevicePrimaryCtxSetFlags_v2(0, 2 /* SCHED_YIELD */), 0);
    EXPECT(cuDevicePrimaryCtxSetFlags_v2(0, 0x40000000), INVALID_VALUE);
    EXPECT(cuDevicePrimaryCtxGetState(0, &flags, &active), 0);
    CHECK(flags == 2 && active == 1);
    {
        CUcontext again;
        EXPECT(cuDevicePrimaryCtxRetain(&again, 0), 0);
        CHECK(again == primary);
        EXPECT(cuDevicePrimaryCtxRelease_v2(0), 0);
    }
    EXPECT(cuCtxSetCurrent(primary), 0);
    EXPECT(cuCtxGetCurrent(&cur), 0);
    CHECK(cur == primary);
    EXPECT(cuCtxGetDevice(&dev), 0);
    CHECK(dev == 0);
    EXPECT(cuCtxGetFlags(&flags), 0);
    CHECK(flags == 2);
    EXPECT(cuCtxGetId(primary, &id_p), 0);
    CHECK(id_p != 0);
    /* A destroy of the primary context is refused. */
    EXPECT(cuCtxDestroy_v2(primary), INVALID_CONTEXT);

    /* ---- created contexts and the stack ---- */
    EXPECT(cuCtxCreate_v2(NULL, 0, 0), INVALID_VALUE);
    EXPECT(cuCtxCreate_v2(&c1, 0, 9), INVALID_DEVICE);
    EXPECT(cuCtxCreate_v2(&c1, 0x40000000, 0), INVALID_VALUE);
    EXPECT(cuCtxCreate_v2(&c1, 0, 0), 0);
    EXPECT(cuCtxGetCurrent(&cur), 0);
    CHECK(cur == c1);
    EXPECT(cuCtxGetId(c1, &id1), 0);
    CHECK(id1 != 0 && id1 != id_p);
    EXPECT(cuCtxGetId(NULL, &id1), 0);   /* NULL: the current context */
    {
        unsigned long long again;
        EXPECT(cuCtxGetId(c1, &again), 0);
        CHECK(again == id1);
    }
    EXPECT(cuCtxPopCurrent_v2(&popped), 0);
    CHECK(popped == c1);
    EXPECT(cuCtxGetCurrent(&cur), 0);
    CHECK(cur == primary);
    EXPECT(cuCtxPushCurrent_v2(c1), 0);
    EXPECT(cuCtxGetCurrent(&cur), 0);
    CHECK(cur == c1);
    {
        unsigned api;
        EXPECT(cuCtxGetApiVersion(c1, &api), 0);
        CHECK(api == 3020);
    }
    /* v3: execution-affinity parameters; a count without an array is invalid. */
    EXPECT(cuCtxCreate_v3(&c2, NULL, 1, 0, 0), INVALID_VALUE);
    EXPECT(cuCtxCreate_v3(&c2, NULL, 0, 0, 0), 0);
    EXPECT(cuCtxGetCurrent(&cur), 0);
    CHECK(cur == c2);
    /* Execution affinity (SM count) needs MPS, which no simulated context is: the device says
     * so, and asking for it is UNSUPPORTED_EXEC_AFFINITY; an unknown type INVALID_VALUE. */
    {
        struct { int type; unsigned val; } aff = {0 /* SM_COUNT */, 8}, bad = {5, 8};
        struct { void *aff; int naff; void *cig; } p4 = {&aff, 1, NULL};
        int supported = -1;
        CUcontext none = NULL;
        EXPECT(cuDeviceGetExecAffinitySupport(&supported, 0, 0), 0);
        CHECK(supported == 0);
        EXPECT(cuCtxCreate_v3(&none, &aff, 1, 0, 0), UNSUPPORTED_EXEC_AFFINITY);
        EXPECT(cuCtxCreate_v3(&none, &bad, 1, 0, 0), INVALID_VALUE);
        EXPECT(cuCtxCreate_v4(&none, &p4, 0, 0), UNSUPPORTED_EXEC_AFFINITY);
        p4.aff = NULL;   /* a count without an array */
        EXPECT(cuCtxCreate_v4(&none, &p4, 0, 0), INVALID_VALUE);
        p4.naff = 0;
        p4.cig = &bad;   /* CUDA-in-graphics: no simulated GPU supports it */
        EXPECT(cuCtxCreate_v4(&none, &p4, 0, 0), NOT_SUPPORTED);
        CHECK(none == NULL);
        EXPECT(cuCtxGetCurrent(&cur), 0);
        CHECK(cur == c2);   /* nothing was pushed */
        EXPECT(cuCtxGetExecAffinity(&aff, 0), UNSUPPORTED_EXEC_AFFINITY);
        EXPECT(cuCtxGetExecAffinity(&aff, 1), INVALID_VALUE);
        p4.cig = NULL;
        EXPECT(cuCtxCreate_v4(&c3, &p4, 1 /* SCHED_SPIN */, 0), 0);   /* neither: a plain context */
        EXPECT(cuCtxDestroy_v2(c3), 0);
    }
    /* v4: CUctxCreateParams may be NULL. */
    EXPECT(cuCtxCreate_v4(&c3, NULL, 1 /* SCHED_SPIN */, 0), 0);
    EXPECT(cuCtxGetFlags(&flags), 0);
    CHECK(flags == 1);
    EXPECT(cuCtxSetFlags(4), 0);
    EXPECT(cuCtxGetFlags(&flags), 0);
    CHECK(flags == 4);
    EXPECT(cuCtxSetFlags(0x40000000), INVALID_VALUE);
    EXPECT(cuCtxGetId(c3, &id3), 0);
    CHECK(id3 != id1 && id3 != id_p);
    /* SetCurrent replaces the top of the stack (primary, c1, c2, c3 -> primary, c1, c2, c1). */
    EXPECT(cuCtxSetCurrent(c1), 0);
    EXPECT(cuCtxPopCurrent_v2(&popped), 0);
    CHECK(popped == c1);
    EXPECT(cuCtxPopCurrent_v2(&popped), 0);
    CHECK(popped == c2);
    EXPECT(cuCtxGetCurrent(&cur), 0);
    CHECK(cur == c1);
    EXPECT(cuCtxPushCurrent_v2(c3), 0);

    /* ---- limits (c3 current) ---- */
    limits_are_defaults(__LINE__);
    EXPECT(cuCtxGetLimit(&v, L_MAX), INVALID_VALUE);
    EXPECT(cuCtxSetLimit(L_MAX, 1), INVALID_VALUE);
    EXPECT(cuCtxGetLimit(&v, L_SHMEM), UNSUPPORTED_LIMIT);   /* a CIG context's only */
    EXPECT(cuCtxSetLimit(L_SHMEM, 1), UNSUPPORTED_LIMIT);    /* query-only */
    EXPECT(cuCtxSetLimit(L_CIG, 1), UNSUPPORTED_LIMIT);      /* query-only */
    EXPECT(cuCtxGetLimit(NULL, L_STACK), INVALID_VALUE);
    EXPECT(cuCtxSetLimit(L_STACK, 4096), 0);
    EXPECT(cuCtxSetLimit(L_PRINTF, 4 << 20), 0);
    EXPECT(cuCtxSetLimit(L_HEAP, 64 << 20), 0);
    EXPECT(cuCtxSetLimit(L_PENDING, 4096), 0);
    EXPECT(cuCtxSetLimit(L_SYNC_DEPTH, 24), 0);
    EXPECT(cuCtxSetLimit(L_SYNC_DEPTH, 25), INVALID_VALUE);
    EXPECT(cuCtxGetLimit(&v, L_STACK), 0);      CHECK(v == 4096);
    EXPECT(cuCtxGetLimit(&v, L_PRINTF), 0);     CHECK(v == 4 << 20);
    EXPECT(cuCtxGetLimit(&v, L_HEAP), 0);       CHECK(v == 64 << 20);
    EXPECT(cuCtxGetLimit(&v, L_PENDING), 0);    CHECK(v == 4096);
    EXPECT(cuCtxGetLimit(&v, L_SYNC_DEPTH), 0); CHECK(v == 24);
    /* Hints, clamped: L2 fetch granularity to 0..128 bytes, persisting L2 to the device's
     * set-aside maximum. */
    EXPECT(cuCtxSetLimit(L_L2_FETCH, 64), 0);
    EXPECT(cuCtxGetLimit(&v, L_L2_FETCH), 0);   CHECK(v == 64);
    EXPECT(cuCtxSetLimit(L_L2_FETCH, 4096), 0);
    EXPECT(cuCtxGetLimit(&v, L_L2_FETCH), 0);   CHECK(v == 128);
    {
        int max_persisting = -1;
        EXPECT(cuDeviceGetAttribute(&max_persisting, ATTR_MAX_PERSISTING_L2, 0), 0);
        CHECK(max_persisting > 0);   /* the preset's GPU is an sm_80 */
        EXPECT(cuCtxSetLimit(L_PERSISTING, 1 << 20), 0);
        EXPECT(cuCtxGetLimit(&v, L_PERSISTING), 0);
        CHECK(v == (size_t)(1 << 20) || (max_persisting < (1 << 20) && v == (size_t)max_persisting));
        EXPECT(cuCtxSetLimit(L_PERSISTING, (size_t)1 << 40), 0);
        EXPECT(cuCtxGetLimit(&v, L_PERSISTING), 0);
        CHECK(v == (size_t)max_persisting);
    }
    EXPECT(cuCtxSetLimit(L_CIG_FALLBACK, 0), 0);
    EXPECT(cuCtxGetLimit(&v, L_CIG_FALLBACK), 0);  CHECK(v == 0);
    EXPECT(cuCtxSetLimit(L_PER_BLOCK, 1024), 0);
    EXPECT(cuCtxGetLimit(&v, L_PER_BLOCK), 0);  CHECK(v == 1024);
    /* Limits are the context's: another context still has the defaults. */
    EXPECT(cuCtxCreate_v2(&c4, 0, 0), 0);
    limits_are_defaults(__LINE__);
    EXPECT(cuCtxDestroy_v2(c4), 0);
    EXPECT(cuCtxGetCurrent(&cur), 0);
    CHECK(cur == c3);
    EXPECT(cuCtxGetLimit(&v, L_STACK), 0);      CHECK(v == 4096);

    /* ---- cache preference ---- */
    {
        int cfg = -1;
        EXPECT(cuCtxGetCacheConfig(&cfg), 0);
        CHECK(cfg == 0);   /* CU_FUNC_CACHE_PREFER_NONE */
        EXPECT(cuCtxSetCacheConfig(2 /* PREFER_L1 */), 0);
        EXPECT(cuCtxGetCacheConfig(&cfg), 0);
        CHECK(cfg == 2);
        EXPECT(cuCtxSetCacheConfig(4), INVALID_VALUE);
        EXPECT(cuCtxGetCacheConfig(&cfg), 0);
        CHECK(cfg == 2);
        EXPECT(cuCtxGetCacheConfig(NULL), INVALID_VALUE);
    }

    /* ---- stream priorities: 0 the least, a negative number the greatest ---- */
    {
        int least = 99, greatest = 99;
        EXPECT(cuCtxGetStreamPriorityRange(&least, &greatest), 0);
        CHECK(least == 0 && greatest < 0);
        EXPECT(cuCtxGetStreamPriorityRange(NULL, &greatest), 0);
    }
    EXPECT(cuCtxResetPersistingL2Cache(), 0);

    /* ---- CUDA 13.0: a context named, NULL for the current one ---- */
    dev = -1;
    EXPECT(cuCtxGetDevice_v2(&dev, NULL), 0);
    CHECK(dev == 0);
    dev = -1;
    EXPECT(cuCtxGetDevice_v2(&dev, c1), 0);
    CHECK(dev == 0);
    EXPECT(cuCtxSynchronize_v2(NULL), 0);
    EXPECT(cuCtxSynchronize_v2(c1), 0);

    /* ---- cuCtxRecordEvent / cuCtxWaitEvent (12.5) ---- */
    {
        CUstream s1, s2, sb;
        CUevent ev, evb, ev_other;
        float ms = 0;
        /* c3 is current: an event of c3, streams of c3. */
        EXPECT(cuStreamCreate(&s1, 0), 0);
        EXPECT(cuStreamCreate(&s2, 1 /* NON_BLOCKING */), 0);
        EXPECT(cuEventCreate(&ev, 0), 0);
        /* Nothing queued: complete at once. */
        EXPECT(cuCtxRecordEvent(c3, ev), 0);
        EXPECT(cuEventQuery(ev), 0);
        /* An event of another context: INVALID_HANDLE; a NULL or destroyed context: INVALID_CONTEXT. */
        EXPECT(cuCtxPushCurrent_v2(c1), 0);
        EXPECT(cuEventCreate(&ev_other, 0), 0);
        EXPECT(cuStreamCreate(&sb, 0), 0);
        EXPECT(cuEventCreate(&evb, 0), 0);
        EXPECT(cuCtxPopCurrent_v2(&popped), 0);
        EXPECT(cuCtxRecordEvent(c3, ev_other), INVALID_HANDLE);
        EXPECT(cuCtxRecordEvent(NULL, ev), INVALID_CONTEXT);
        EXPECT(cuCtxRecordEvent(c3, NULL), INVALID_HANDLE);
        /* Work in the second stream only: the context's event still captures it. */
        EXPECT(cuLaunchHostFunc(s2, sleep_ms, (void *)(uintptr_t)300), 0);
        EXPECT(cuCtxRecordEvent(c3, ev), 0);
        EXPECT(cuEventQuery(ev), NOT_READY);
        /* c1 waits for it: work queued in c1's stream after the wait ends after it. */
        EXPECT(cuCtxWaitEvent(c1, ev), 0);
        EXPECT(cuCtxPushCurrent_v2(c1), 0);
        EXPECT(cuEventRecord(evb, sb), 0);
        EXPECT(cuEventQuery(evb), NOT_READY);
        EXPECT(cuEventSynchronize(evb), 0);
        EXPECT(cuCtxPopCurrent_v2(&popped), 0);
        EXPECT(cuEventQuery(ev), 0);
        EXPECT(cuEventElapsedTime(&ms, ev, evb), 0);
        CHECK(ms >= 0);
        EXPECT(cuCtxWaitEvent(c1, NULL), INVALID_HANDLE);
        EXPECT(cuEventDestroy_v2(ev), 0);
        EXPECT(cuEventDestroy_v2(evb), 0);
        EXPECT(cuEventDestroy_v2(ev_other), 0);
        EXPECT(cuStreamDestroy_v2(s1), 0);
        EXPECT(cuStreamDestroy_v2(s2), 0);
        EXPECT(cuStreamDestroy_v2(sb), 0);
    }

    /* ---- destruction ---- */
    EXPECT(cuCtxDestroy_v2(c2), 0);
    EXPECT(cuCtxDestroy_v2(c1), 0);
    EXPECT(cuCtxGetId(c1, &id1), INVALID_CONTEXT);
    EXPECT(cuCtxGetDevice_v2(&dev, c1), INVALID_CONTEXT);
    EXPECT(cuCtxPushCurrent_v2(c1), INVALID_CONTEXT);
    EXPECT(cuCtxDestroy_v2(c3), 0);
    EXPECT(cuCtxSynchronize(), 0);   /* the primary context is current again */
    EXPECT(cuDevicePrimaryCtxReset_v2(0), 0);
    EXPECT(cuDevicePrimaryCtxRelease_v2(0), 0);
    EXPECT(cuDevicePrimaryCtxGetState(0, &flags, &active), 0);
    CHECK(active == 0);

    if (failures == 0)
        printf("OK\n");
    return failures != 0;
}
