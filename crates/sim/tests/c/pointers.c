/* Pointers and page-locked host memory, linked against libcuda (-lcuda): every
 * CUpointer_attribute on device, managed, pool, page-locked (allocated and registered) host
 * memory and on memory the driver does not know; cuPointerGetAttributes' defaults;
 * cuPointerSetAttribute SYNC_MEMOPS; cuMemGetAddressRange; cuMemHostGetFlags;
 * cuMemHostRegister's flags and errors; cuMemHostGetDevicePointer. Codes as CUDA 13.5's cuda.h
 * documents them.
 *
 * Prints one line per failed check and "OK" at the end when none failed; exit status 0 then. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUmemoryPool;
typedef struct { unsigned long long p2pToken; unsigned int vaSpaceToken; } P2PTokens;

CUresult cuInit(unsigned);
CUresult cuCtxCreate_v2(CUcontext *, unsigned, int);
CUresult cuCtxDestroy_v2(CUcontext);
CUresult cuCtxPopCurrent_v2(CUcontext *);
CUresult cuCtxPushCurrent_v2(CUcontext);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemAllocManaged(CUdeviceptr *, size_t, unsigned);
CUresult cuMemAllocAsync(CUdeviceptr *, size_t, CUstream);
CUresult cuMemFreeAsync(CUdeviceptr, CUstream);
CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *, int);
CUresult cuStreamSynchronize(CUstream);
CUresult cuMemAllocHost_v2(void **, size_t);
CUresult cuMemHostAlloc(void **, size_t, unsigned);
CUresult cuMemFreeHost(void *);
CUresult cuMemHostRegister_v2(void *, size_t, unsigned);
CUresult cuMemHostUnregister(void *);
CUresult cuMemHostGetFlags(unsigned *, void *);
CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *, void *, unsigned);
CUresult cuMemGetAddressRange_v2(CUdeviceptr *, size_t *, CUdeviceptr);
CUresult cuPointerGetAttribute(void *, int, CUdeviceptr);
CUresult cuPointerGetAttributes(unsigned, int *, void **, CUdeviceptr);
CUresult cuPointerSetAttribute(const void *, int, CUdeviceptr);

#define INVALID_VALUE 1
#define INVALID_CONTEXT 201
#define NOT_FOUND 500
#define HOST_MEMORY_ALREADY_REGISTERED 712
#define HOST_MEMORY_NOT_REGISTERED 713

enum { A_CONTEXT = 1, A_MEMORY_TYPE, A_DEVICE_POINTER, A_HOST_POINTER, A_P2P_TOKENS, A_SYNC_MEMOPS,
       A_BUFFER_ID, A_IS_MANAGED, A_DEVICE_ORDINAL, A_IS_LEGACY_IPC, A_RANGE_START, A_RANGE_SIZE,
       A_MAPPED, A_ALLOWED_HANDLE_TYPES, A_RDMA, A_ACCESS_FLAGS, A_MEMPOOL, A_MAPPING_SIZE,
       A_MAPPING_BASE, A_BLOCK_ID, A_HW_DECOMPRESS, A_LOCALITY };
#define MEMORYTYPE_HOST 1
#define MEMORYTYPE_DEVICE 2

#include "expect.h"

static CUcontext ctx;

/* What each kind of memory answers; `want_host` says whether HOST_POINTER exists. */
struct expect {
    const char *what;
    CUdeviceptr base;
    size_t size;
    unsigned type;
    int managed, legacy_ipc, rdma, has_host;
    CUmemoryPool pool;
};

static void check_all(const struct expect *e) {
    CUdeviceptr inner = e->base + e->size / 2;
    CUcontext c = (void *)1;
    unsigned u = 99;
    int i = 99;
    CUdeviceptr p = 1;
    void *hp = (void *)1;
    size_t sz = 1;
    unsigned long long id = 0, id2 = 0, block = 0, handle_types = 99;
    CUmemoryPool pool = (void *)1;
#define ATTR(v, a) cuPointerGetAttribute(&(v), (a), inner)
    EXPECT(ATTR(c, A_CONTEXT), 0);                 if (c != ctx) printf("FAIL %s: context\n", e->what), failures++;
    EXPECT(ATTR(u, A_MEMORY_TYPE), 0);             if (u != e->type) printf("FAIL %s: memory type %u\n", e->what, u), failures++;
    EXPECT(ATTR(p, A_DEVICE_POINTER), 0);          if (p != inner) printf("FAIL %s: device pointer\n", e->what), failures++;
    if (e->has_host) {
        EXPECT(ATTR(hp, A_HOST_POINTER), 0);
        if (hp != (void *)(uintptr_t)inner) printf("FAIL %s: host pointer\n", e->what), failures++;
    } else {
        EXPECT(ATTR(hp, A_HOST_POINTER), INVALID_VALUE);
    }
    EXPECT(ATTR(id, A_BUFFER_ID), 0);              if (id == 0) printf("FAIL %s: buffer id 0\n", e->what), failures++;
    EXPECT(cuPointerGetAttribute(&id2, A_BUFFER_ID, e->base), 0);
    if (id != id2) printf("FAIL %s: buffer id differs inside one allocation\n", e->what), failures++;
    EXPECT(ATTR(i, A_IS_MANAGED), 0);              if (i != e->managed) printf("FAIL %s: is managed %d\n", e->what, i), failures++;
    EXPECT(ATTR(i, A_DEVICE_ORDINAL), 0);          if (i != 0) printf("FAIL %s: ordinal %d\n", e->what, i), failures++;
    EXPECT(ATTR(i, A_IS_LEGACY_IPC), 0);           if (i != e->legacy_ipc) printf("FAIL %s: legacy ipc %d\n", e->what, i), failures++;
    EXPECT(ATTR(p, A_RANGE_START), 0);             if (p != e->base) printf("FAIL %s: range start\n", e->what), failures++;
    EXPECT(ATTR(sz, A_RANGE_SIZE), 0);             if (sz < e->size) printf("FAIL %s: range size %zu\n", e->what, sz), failures++;
    EXPECT(ATTR(i, A_MAPPED), 0);                  if (i != 1) printf("FAIL %s: mapped %d\n", e->what, i), failures++;
    EXPECT(ATTR(handle_types, A_ALLOWED_HANDLE_TYPES), 0); if (handle_types != 0) printf("FAIL %s: handle types\n", e->what), failures++;
    EXPECT(ATTR(i, A_RDMA), 0);                    if (i != e->rdma) printf("FAIL %s: rdma %d\n", e->what, i), failures++;
    EXPECT(ATTR(u, A_ACCESS_FLAGS), 0);            if (u != 3) printf("FAIL %s: access flags %u\n", e->what, u), failures++;
    EXPECT(ATTR(pool, A_MEMPOOL), 0);              if (pool != e->pool) printf("FAIL %s: pool\n", e->what), failures++;
    EXPECT(ATTR(sz, A_MAPPING_SIZE), 0);           if (sz < e->size) printf("FAIL %s: mapping size\n", e->what), failures++;
    EXPECT(ATTR(p, A_MAPPING_BASE), 0);            if (p != e->base) printf("FAIL %s: mapping base\n", e->what), failures++;
    EXPECT(ATTR(block, A_BLOCK_ID), 0);            if (block == 0) printf("FAIL %s: block id\n", e->what), failures++;
    EXPECT(ATTR(i, A_HW_DECOMPRESS), 0);           if (i != 0) printf("FAIL %s: hw decompress\n", e->what), failures++;
    EXPECT(ATTR(i, A_LOCALITY), 0);                if (i != -1) printf("FAIL %s: locality %d\n", e->what, i), failures++;
    EXPECT(ATTR(i, 0), INVALID_VALUE);
    EXPECT(ATTR(i, 23), INVALID_VALUE);
    EXPECT(cuPointerGetAttribute(NULL, A_MEMORY_TYPE, inner), INVALID_VALUE);
    /* The plural call answers the same; a pointer one past the end belongs to nothing here. */
    {
        int attrs[3] = {A_MEMORY_TYPE, A_RANGE_START, A_BUFFER_ID};
        unsigned t = 0;
        CUdeviceptr start = 0;
        unsigned long long bid = 0;
        void *data[3] = {&t, &start, &bid};
        EXPECT(cuPointerGetAttributes(3, attrs, data, inner), 0);
        if (t != e->type || start != e->base || bid != id) printf("FAIL %s: GetAttributes differs\n", e->what), failures++;
    }
#undef ATTR
}

int main(void) {
    CUcontext popped;
    CUdeviceptr d, m, a;
    void *h, *h2, *reg;
    CUmemoryPool defpool;
    unsigned flags;

    EXPECT(cuInit(0), 0);
    EXPECT(cuCtxCreate_v2(&ctx, 0, 0), 0);

    /* ---- host allocation and registration ---- */
    EXPECT(cuMemAllocHost_v2(&h, 1 << 20), 0);
    EXPECT(cuMemHostAlloc(&h2, 4096, 0x8), INVALID_VALUE);   /* not a CU_MEMHOSTALLOC_* flag */
    EXPECT(cuMemHostAlloc(&h2, 4096, 0x1 | 0x2 /* PORTABLE | DEVICEMAP */), 0);
    EXPECT(cuMemHostGetFlags(&flags, h2), 0);
    CHECK(flags == 0x3);
    EXPECT(cuMemHostGetFlags(&flags, h), 0);
    CHECK(flags == 0);
    reg = malloc(1 << 16);
    EXPECT(cuMemHostRegister_v2(NULL, 4096, 0), INVALID_VALUE);
    EXPECT(cuMemHostRegister_v2(reg, 0, 0), INVALID_VALUE);
    EXPECT(cuMemHostRegister_v2(reg, 1 << 16, 0x10), INVALID_VALUE);   /* unknown flag */
    EXPECT(cuMemHostRegister_v2(reg, 1 << 16, 0x2 | 0x8 /* DEVICEMAP | READ_ONLY */), 0);
    EXPECT(cuMemHostRegister_v2((char *)reg + 4096, 4096, 0), HOST_MEMORY_ALREADY_REGISTERED);
    EXPECT(cuMemHostRegister_v2(h, 4096, 0), HOST_MEMORY_ALREADY_REGISTERED);   /* already page-locked */
    EXPECT(cuMemHostGetFlags(&flags, reg), INVALID_VALUE);   /* not from cuMemHostAlloc */
    {
        CUdeviceptr dp = 0;
        EXPECT(cuMemHostGetDevicePointer_v2(&dp, h2, 0), 0);
        CHECK(dp == (CUdeviceptr)(uintptr_t)h2);   /* unified addressing, host pointer usable */
        EXPECT(cuMemHostGetDevicePointer_v2(&dp, (char *)reg + 100, 0), 0);
        CHECK(dp == (CUdeviceptr)(uintptr_t)reg + 100);
        EXPECT(cuMemHostGetDevicePointer_v2(&dp, h2, 1), INVALID_VALUE);   /* flags must be 0 */
        int on_stack;
        EXPECT(cuMemHostGetDevicePointer_v2(&dp, &on_stack, 0), INVALID_VALUE);   /* not page-locked */
    }

    /* ---- device, managed and pool memory ---- */
    EXPECT(cuMemAlloc_v2(&d, 1 << 20), 0);
    EXPECT(cuMemAllocManaged(&m, 1 << 20, 1 /* ATTACH_GLOBAL */), 0);
    EXPECT(cuMemAllocAsync(&a, 1 << 20, NULL), 0);
    EXPECT(cuStreamSynchronize(NULL), 0);
    EXPECT(cuDeviceGetDefaultMemPool(&defpool, 0), 0);

    {
        struct expect dev = {"device", d, 1 << 20, MEMORYTYPE_DEVICE, 0, 1, 1, 0, NULL};
        struct expect man = {"managed", m, 1 << 20, MEMORYTYPE_DEVICE, 1, 0, 0, 1, NULL};
        struct expect poo = {"pool", a, 1 << 20, MEMORYTYPE_DEVICE, 0, 0, 1, 0, defpool};
        struct expect hst = {"host", (CUdeviceptr)(uintptr_t)h, 1 << 20, MEMORYTYPE_HOST, 0, 0, 0, 1, NULL};
        struct expect rgd = {"registered", (CUdeviceptr)(uintptr_t)reg, 1 << 16, MEMORYTYPE_HOST, 0, 0, 0, 1, NULL};
        check_all(&dev);
        check_all(&man);
        check_all(&poo);
        check_all(&hst);
        check_all(&rgd);
    }
    /* Buffer ids: distinct per allocation, never reused after a free. */
    {
        unsigned long long i1 = 0, i2 = 0, i3 = 0;
        CUdeviceptr d2;
        EXPECT(cuPointerGetAttribute(&i1, A_BUFFER_ID, d), 0);
        EXPECT(cuPointerGetAttribute(&i2, A_BUFFER_ID, m), 0);
        CHECK(i1 != i2);
        EXPECT(cuMemAlloc_v2(&d2, 4096), 0);
        EXPECT(cuPointerGetAttribute(&i2, A_BUFFER_ID, d2), 0);
        EXPECT(cuMemFree_v2(d2), 0);
        EXPECT(cuMemAlloc_v2(&d2, 4096), 0);
        EXPECT(cuPointerGetAttribute(&i3, A_BUFFER_ID, d2), 0);
        CHECK(i3 != i2);
        EXPECT(cuMemFree_v2(d2), 0);
    }

    /* ---- DEVICE_POINTER and ACCESS_FLAGS need a current context ---- */
    EXPECT(cuCtxPopCurrent_v2(&popped), 0);
    {
        CUdeviceptr p;
        unsigned u, t;
        EXPECT(cuPointerGetAttribute(&p, A_DEVICE_POINTER, d), INVALID_CONTEXT);
        EXPECT(cuPointerGetAttribute(&u, A_ACCESS_FLAGS, d), INVALID_CONTEXT);
        EXPECT(cuPointerGetAttribute(&t, A_MEMORY_TYPE, d), 0);
    }
    EXPECT(cuCtxPushCurrent_v2(ctx), 0);

    /* ---- P2P tokens: cuMemAlloc memory only; the query sets SYNC_MEMOPS ---- */
    {
        P2PTokens tok = {0, 0};
        int sync = 99;
        unsigned one = 1, zero = 0;
        EXPECT(cuPointerGetAttribute(&sync, A_SYNC_MEMOPS, d), 0);
        CHECK(sync == 0);
        EXPECT(cuPointerGetAttribute(&tok, A_P2P_TOKENS, d), 0);
        CHECK(tok.p2pToken != 0);
        EXPECT(cuPointerGetAttribute(&sync, A_SYNC_MEMOPS, d), 0);
        CHECK(sync == 1);
        EXPECT(cuPointerGetAttribute(&tok, A_P2P_TOKENS, m), INVALID_VALUE);
        EXPECT(cuPointerGetAttribute(&tok, A_P2P_TOKENS, (CUdeviceptr)(uintptr_t)h), INVALID_VALUE);
        /* cuPointerSetAttribute: SYNC_MEMOPS only. */
        EXPECT(cuPointerSetAttribute(&zero, A_SYNC_MEMOPS, d), 0);
        EXPECT(cuPointerGetAttribute(&sync, A_SYNC_MEMOPS, d), 0);
        CHECK(sync == 0);
        EXPECT(cuPointerSetAttribute(&one, A_SYNC_MEMOPS, a), 0);
        EXPECT(cuPointerGetAttribute(&sync, A_SYNC_MEMOPS, a + 64), 0);
        CHECK(sync == 1);
        EXPECT(cuPointerSetAttribute(&one, A_BUFFER_ID, d), INVALID_VALUE);
        EXPECT(cuPointerSetAttribute(&one, A_SYNC_MEMOPS, 0x10), INVALID_VALUE);
    }

    /* ---- memory the driver does not know ---- */
    {
        char local[64];
        CUdeviceptr unknown = (CUdeviceptr)(uintptr_t)local;
        unsigned t = 77;
        int ord = 77;
        void *hp = (void *)1;
        CUcontext c = (void *)1;
        EXPECT(cuPointerGetAttribute(&t, A_MEMORY_TYPE, unknown), INVALID_VALUE);
        EXPECT(cuPointerGetAttribute(&ord, A_IS_MANAGED, unknown), INVALID_VALUE);
        /* GetAttributes: success, default NULL values. */
        int attrs[4] = {A_MEMORY_TYPE, A_DEVICE_ORDINAL, A_HOST_POINTER, A_CONTEXT};
        void *data[4] = {&t, &ord, &hp, &c};
        EXPECT(cuPointerGetAttributes(4, attrs, data, unknown), 0);
        CHECK(t == 0 && ord == 0 && hp == NULL && c == NULL);
        /* Device memory has no host pointer: its default comes back, and the call succeeds. */
        hp = (void *)1;
        t = 0;
        EXPECT(cuPointerGetAttributes(4, attrs, data, d), 0);
        CHECK(hp == NULL && t == MEMORYTYPE_DEVICE && c == ctx);
        EXPECT(cuPointerGetAttributes(1, NULL, data, d), INVALID_VALUE);
        attrs[0] = 99;
        EXPECT(cuPointerGetAttributes(1, attrs, data, d), INVALID_VALUE);
    }

    /* ---- cuMemGetAddressRange ---- */
    {
        CUdeviceptr base = 0;
        size_t size = 0;
        EXPECT(cuMemGetAddressRange_v2(&base, &size, d + 1000), 0);
        CHECK(base == d && size >= (1 << 20));
        EXPECT(cuMemGetAddressRange_v2(NULL, &size, d + 1000), 0);
        EXPECT(cuMemGetAddressRange_v2(&base, NULL, m), 0);
        CHECK(base == m);
        EXPECT(cuMemGetAddressRange_v2(&base, &size, 0), NOT_FOUND);
    }

    /* ---- teardown ---- */
    EXPECT(cuMemHostUnregister((char *)reg + 4096), HOST_MEMORY_NOT_REGISTERED);
    EXPECT(cuMemHostUnregister(h), HOST_MEMORY_NOT_REGISTERED);   /* allocated, not registered */
    EXPECT(cuMemHostUnregister(reg), 0);
    EXPECT(cuMemHostUnregister(reg), HOST_MEMORY_NOT_REGISTERED);
    EXPECT(cuMemFreeHost(reg), INVALID_VALUE);
    {
        unsigned t;
        EXPECT(cuPointerGetAttribute(&t, A_MEMORY_TYPE, (CUdeviceptr)(uintptr_t)reg), INVALID_VALUE);
    }
    free(reg);
    EXPECT(cuMemFreeHost(h), 0);
    EXPECT(cuMemFreeHost(h), INVALID_VALUE);
    EXPECT(cuMemFreeHost(h2), 0);
    EXPECT(cuMemFree_v2(d), 0);
    EXPECT(cuMemFree_v2(m), 0);
    EXPECT(cuMemFreeAsync(a, NULL), 0);
    EXPECT(cuCtxDestroy_v2(ctx), 0);
    if (failures == 0)
        printf("OK\n");
    return failures != 0;
}
