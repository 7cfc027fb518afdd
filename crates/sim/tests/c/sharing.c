/* Memory shared between processes, and managed memory, on the simulated driver, built against
 * CUDA 13.5's cuda.h and linked with -lcuda. The process forks before cuInit (a CUDA process
 * must not fork after it); the parent exports, the child imports, and they pass descriptors
 * over a Unix socket with SCM_RIGHTS, as NCCL and PyTorch's CUDA IPC do:
 *  - an IPC-capable pool: access, attributes, export of the pool (a POSIX file descriptor) and
 *    of one allocation (cuMemPoolExportPointer); the child reads the parent's bytes through
 *    the imported pointer and writes its own, which the parent then reads;
 *  - a VMM allocation exported as a file descriptor, mapped in both processes: same bytes;
 *  - an IPC memory handle: the same bytes, counted once;
 *  - managed memory: an allocation twice the device's memory, prefetch, advice, the range
 *    attributes, and what is resident (prefetched) charged to the device.
 * Every call's result is checked, error codes included. Prints "OK" and exits 0 when all hold. */
#include <cuda.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

static const char *who = "parent";

#define CHECK(call) expect((call), CUDA_SUCCESS, #call, __LINE__)
#define EXPECT(call, code) expect((call), (code), #call, __LINE__)
static void expect(CUresult got, CUresult want, const char *what, int line) {
    if (got != want) {
        printf("%s: line %d: %s answered %d, expected %d\n", who, line, what, (int)got, (int)want);
        exit(1);
    }
}
#define ASSERT(cond) do { if (!(cond)) { printf("%s: line %d: %s\n", who, __LINE__, #cond); exit(1); } } while (0)

/* ---- the socket between the two processes ---- */
static void send_msg(int s, const void *buf, size_t n, int fd) {
    struct iovec iov = {(void *)buf, n};
    char ctl[CMSG_SPACE(sizeof(int))];
    struct msghdr m = {0};
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    if (fd >= 0) {
        memset(ctl, 0, sizeof ctl);
        m.msg_control = ctl;
        m.msg_controllen = sizeof ctl;
        struct cmsghdr *c = CMSG_FIRSTHDR(&m);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &fd, sizeof(int));
    }
    ASSERT(sendmsg(s, &m, 0) == (ssize_t)n);
}
static int recv_msg(int s, void *buf, size_t n) {
    struct iovec iov = {buf, n};
    char ctl[CMSG_SPACE(sizeof(int))];
    struct msghdr m = {0};
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    m.msg_control = ctl;
    m.msg_controllen = sizeof ctl;
    ASSERT(recvmsg(s, &m, MSG_WAITALL) == (ssize_t)n);
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    int fd = -1;
    if (c && c->cmsg_type == SCM_RIGHTS) memcpy(&fd, CMSG_DATA(c), sizeof(int));
    return fd;
}

static void fill(CUdeviceptr p, size_t n, unsigned char seed) {
    unsigned char *h = malloc(n);
    for (size_t i = 0; i < n; i++) h[i] = (unsigned char)(seed + i * 7);
    CHECK(cuMemcpyHtoD(p, h, n));
    free(h);
}
static int holds(CUdeviceptr p, size_t n, unsigned char seed) {
    unsigned char *h = malloc(n);
    CHECK(cuMemcpyDtoH(h, p, n));
    int ok = 1;
    for (size_t i = 0; i < n && ok; i++) ok = h[i] == (unsigned char)(seed + i * 7);
    free(h);
    return ok;
}
static size_t free_mem(void) {
    size_t f, t;
    CHECK(cuMemGetInfo(&f, &t));
    return f;
}

#define MiB ((size_t)1 << 20)
#define POOL_BYTES MiB
#define VMM_BYTES (2 * MiB)
#define IPC_BYTES (4 * MiB)

struct ipc_msg {
    CUmemPoolPtrExportData ptr;
    CUipcMemHandle ipc;
};

static void start(CUcontext *ctx) {
    CUdevice dev;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDevicePrimaryCtxRetain(ctx, dev));
    CHECK(cuCtxSetCurrent(*ctx));
}

static CUmemLocation device_loc(int id) {
    CUmemLocation l;
    memset(&l, 0, sizeof l);
    l.type = CU_MEM_LOCATION_TYPE_DEVICE;
    l.id = id;
    return l;
}

/* ---- the importing process ---- */
static int child(int s) {
    who = "child";
    CUcontext ctx;
    start(&ctx);
    CUstream st;
    CHECK(cuStreamCreate(&st, CU_STREAM_NON_BLOCKING));

    struct ipc_msg msg;
    int pool_fd = recv_msg(s, &msg, sizeof msg);
    ASSERT(pool_fd >= 0);
    char b;
    int vmm_fd = recv_msg(s, &b, 1);
    ASSERT(vmm_fd >= 0);

    /* The pool. */
    CUmemoryPool pool;
    EXPECT(cuMemPoolImportFromShareableHandle(&pool, (void *)(uintptr_t)pool_fd, CU_MEM_HANDLE_TYPE_FABRIC, 0),
           CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemPoolImportFromShareableHandle(&pool, (void *)(uintptr_t)pool_fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 1),
           CUDA_ERROR_INVALID_VALUE);
    CHECK(cuMemPoolImportFromShareableHandle(&pool, (void *)(uintptr_t)pool_fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    CUmemAllocationHandleType types = 99;
    CHECK(cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_EXPORT_HANDLE_TYPES, &types));
    ASSERT(types == CU_MEM_HANDLE_TYPE_NONE); /* "an imported pool cannot be re-exported" */
    int again;
    EXPECT(cuMemPoolExportToShareableHandle(&again, pool, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
           CUDA_ERROR_INVALID_VALUE);
    CUdeviceptr mine;
    EXPECT(cuMemAllocFromPoolAsync(&mine, MiB, pool, st), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuDeviceSetMemPool(0, pool), CUDA_ERROR_INVALID_VALUE);
    CUmemPoolPtrExportData forged = msg.ptr;
    forged.reserved[0] ^= 0xff;
    CUdeviceptr p;
    EXPECT(cuMemPoolImportPointer(&p, pool, &forged), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuMemPoolImportPointer(&p, pool, &msg.ptr));
    ASSERT(holds(p, POOL_BYTES, 0x11)); /* the exporter's bytes */
    fill(p, POOL_BYTES, 0x33);
    CUmemoryPool owner = 0;
    CHECK(cuPointerGetAttribute(&owner, CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, p));
    ASSERT(owner == pool);

    /* The VMM allocation. */
    CUmemGenericAllocationHandle h;
    CHECK(cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)vmm_fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    CUmemAllocationProp prop;
    CHECK(cuMemGetAllocationPropertiesFromHandle(&prop, h));
    ASSERT(prop.type == CU_MEM_ALLOCATION_TYPE_PINNED && prop.location.type == CU_MEM_LOCATION_TYPE_DEVICE &&
           prop.location.id == 0 && prop.requestedHandleTypes == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    CUdeviceptr va;
    CHECK(cuMemAddressReserve(&va, VMM_BYTES, 0, 0, 0));
    CHECK(cuMemMap(va, VMM_BYTES, 0, h, 0));
    CUmemAccessDesc rw = {device_loc(0), CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    CHECK(cuMemSetAccess(va, VMM_BYTES, &rw, 1));
    ASSERT(holds(va, VMM_BYTES, 0x22));
    fill(va, VMM_BYTES, 0x44);

    /* The IPC handle. */
    CUdeviceptr ip, ip2;
    EXPECT(cuIpcOpenMemHandle(&ip, msg.ipc, 2), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuIpcOpenMemHandle(&ip, msg.ipc, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
    CHECK(cuIpcOpenMemHandle(&ip2, msg.ipc, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
    ASSERT(ip == ip2); /* opened twice in one context: one mapping, counted twice */
    ASSERT(holds(ip, IPC_BYTES, 0x55)); /* the exporter's bytes */
    fill(ip, IPC_BYTES, 0x66);
    size_t seen = free_mem();
    send_msg(s, &seen, sizeof seen, -1);

    /* Let go of everything, then tell the parent. */
    CHECK(cuIpcCloseMemHandle(ip));
    CHECK(cuIpcCloseMemHandle(ip2));
    EXPECT(cuIpcCloseMemHandle(ip), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuMemUnmap(va, VMM_BYTES));
    CHECK(cuMemAddressFree(va, VMM_BYTES));
    CHECK(cuMemRelease(h));
    CHECK(cuMemFree(p)); /* "The pointer may be freed with cuMemFree or cuMemFreeAsync" */
    CHECK(cuMemPoolDestroy(pool));
    close(pool_fd);
    close(vmm_fd);
    send_msg(s, "d", 1, -1);
    CHECK(cuDevicePrimaryCtxRelease(0));
    return 0;
}

/* ---- the exporting process: pools ---- */
static void pool_attributes_and_access(CUmemoryPool pool) {
    int v = -7;
    cuuint64_t v64 = 7;
    CHECK(cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES, &v));
    ASSERT(v == 1); /* "(default enabled)" */
    CHECK(cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_ALLOCATION_TYPE, &v));
    ASSERT(v == CU_MEM_ALLOCATION_TYPE_PINNED);
    CHECK(cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_EXPORT_HANDLE_TYPES, &v));
    ASSERT(v == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    CHECK(cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_LOCATION_TYPE, &v));
    ASSERT(v == CU_MEM_LOCATION_TYPE_DEVICE);
    CHECK(cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_LOCATION_ID, &v));
    ASSERT(v == 0);
    CHECK(cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_MAX_POOL_SIZE, &v64));
    ASSERT(v64 == 0);
    CHECK(cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_HW_DECOMPRESS_ENABLED, &v));
    ASSERT(v == 0);
    CHECK(cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_LOCALITY_DOMAIN_ID, &v));
    ASSERT(v == -1);
    EXPECT(cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_MAX_POOL_SIZE, &v64), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemPoolGetAttribute(pool, (CUmemPool_attribute)99, &v), CUDA_ERROR_INVALID_VALUE);

    /* Access: the owner always reads and writes; others as set. */
    CUmemAccess_flags f = 99;
    CUmemLocation d0 = device_loc(0), d1 = device_loc(1), d2 = device_loc(2);
    CHECK(cuMemPoolGetAccess(&f, pool, &d0));
    ASSERT(f == CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    CHECK(cuMemPoolGetAccess(&f, pool, &d1));
    ASSERT(f == CU_MEM_ACCESS_FLAGS_PROT_NONE);
    CUmemAccessDesc desc[2] = {{d1, CU_MEM_ACCESS_FLAGS_PROT_READWRITE}, {d2, CU_MEM_ACCESS_FLAGS_PROT_READ}};
    CHECK(cuMemPoolSetAccess(pool, desc, 2));
    CHECK(cuMemPoolGetAccess(&f, pool, &d1));
    ASSERT(f == CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    CHECK(cuMemPoolGetAccess(&f, pool, &d2));
    ASSERT(f == CU_MEM_ACCESS_FLAGS_PROT_READ);
    CUmemAccessDesc owner_none = {d0, CU_MEM_ACCESS_FLAGS_PROT_NONE};
    EXPECT(cuMemPoolSetAccess(pool, &owner_none, 1), CUDA_ERROR_INVALID_VALUE);
    CUmemAccessDesc bad_flags = {d1, (CUmemAccess_flags)2};
    EXPECT(cuMemPoolSetAccess(pool, &bad_flags, 1), CUDA_ERROR_INVALID_VALUE);
    CUmemAccessDesc no_device = {device_loc(99), CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    EXPECT(cuMemPoolSetAccess(pool, &no_device, 1), CUDA_ERROR_INVALID_DEVICE);
    CUmemAccessDesc none = {d1, CU_MEM_ACCESS_FLAGS_PROT_NONE};
    CHECK(cuMemPoolSetAccess(pool, &none, 1));
    CHECK(cuMemPoolGetAccess(&f, pool, &d1));
    ASSERT(f == CU_MEM_ACCESS_FLAGS_PROT_NONE);
}

/* What NVML reports this process holds on device 0 (the simulated libnvidia-ml.so.1, opened
 * as monitoring tools open it; nvml.h's v3 process record). */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvml_process;
static unsigned long long nvml_used_by_me(void) {
    static void *nvml;
    if (!nvml) nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    ASSERT(nvml);
    int (*init)(void) = (int (*)(void))dlsym(nvml, "nvmlInit_v2");
    int (*handle)(unsigned int, void **) = (int (*)(unsigned int, void **))dlsym(nvml, "nvmlDeviceGetHandleByIndex_v2");
    int (*procs)(void *, unsigned int *, nvml_process *) =
        (int (*)(void *, unsigned int *, nvml_process *))dlsym(nvml, "nvmlDeviceGetComputeRunningProcesses_v3");
    ASSERT(init && handle && procs);
    void *dev;
    ASSERT(init() == 0 && handle(0, &dev) == 0);
    nvml_process list[64];
    unsigned int n = 64;
    ASSERT(procs(dev, &n, list) == 0);
    for (unsigned int i = 0; i < n; i++)
        if (list[i].pid == (unsigned int)getpid()) return list[i].usedGpuMemory;
    return 0;
}

/* ---- the exporting process: managed memory ---- */
static void managed(size_t total, CUstream st) {
    CUdeviceptr m, plain;
    size_t before = free_mem();
    /* Twice the device's memory: oversubscription, no device memory taken yet. */
    CHECK(cuMemAllocManaged(&m, 2 * total, CU_MEM_ATTACH_GLOBAL));
    ASSERT(free_mem() == before);
    CUmemLocation d0 = device_loc(0), host = device_loc(0), d99 = device_loc(99);
    host.type = CU_MEM_LOCATION_TYPE_HOST;
    /* NVML's per-process memory also holds the context's own (the model's context_memory). */
    unsigned long long used0 = nvml_used_by_me();
    CHECK(cuMemPrefetchAsync(m, 64 * MiB, d0, 0, st));
    ASSERT(before - free_mem() == 64 * MiB);
    ASSERT(nvml_used_by_me() - used0 == 64 * MiB); /* NVML shows what is resident */
    int v;
    CHECK(cuMemRangeGetAttribute(&v, 4, CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION, m, 64 * MiB));
    ASSERT(v == 0);
    CHECK(cuMemRangeGetAttribute(&v, 4, CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION, m, 128 * MiB));
    ASSERT(v == CU_DEVICE_INVALID); /* half of it was never prefetched */
    CUmemLocationType lt;
    CHECK(cuMemRangeGetAttribute(&lt, sizeof lt, CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION_TYPE, m, 64 * MiB));
    ASSERT(lt == CU_MEM_LOCATION_TYPE_DEVICE);
    /* The whole of it: as much as the device holds, the rest stays in host memory. */
    CHECK(cuMemPrefetchAsync(m, 2 * total, d0, 0, st));
    ASSERT(free_mem() == 0);
    CHECK(cuMemPrefetchAsync(m, 2 * total, host, 0, st));
    ASSERT(free_mem() == before);
    ASSERT(nvml_used_by_me() == used0);
    CHECK(cuMemRangeGetAttribute(&v, 4, CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION, m, 2 * total));
    ASSERT(v == CU_DEVICE_CPU);
    EXPECT(cuMemPrefetchAsync(m, MiB, d0, 1, st), CUDA_ERROR_INVALID_VALUE);      /* flags "must be zero" */
    EXPECT(cuMemPrefetchAsync(m, MiB, d99, 0, st), CUDA_ERROR_INVALID_DEVICE);
    EXPECT(cuMemPrefetchAsync(m, 0, d0, 0, st), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemPrefetchAsync(m + 2 * total - MiB, 2 * MiB, d0, 0, st), CUDA_ERROR_INVALID_VALUE);

    /* The CUDA 8.0 forms libcuda still exports: a CUdevice, CU_DEVICE_CPU for the host. */
    CUresult (*prefetch_v1)(CUdeviceptr, size_t, CUdevice, CUstream) =
        (CUresult(*)(CUdeviceptr, size_t, CUdevice, CUstream))dlsym(RTLD_DEFAULT, "cuMemPrefetchAsync");
    CUresult (*advise_v1)(CUdeviceptr, size_t, CUmem_advise, CUdevice) =
        (CUresult(*)(CUdeviceptr, size_t, CUmem_advise, CUdevice))dlsym(RTLD_DEFAULT, "cuMemAdvise");
    ASSERT(prefetch_v1 && advise_v1);
    CHECK(prefetch_v1(m, 8 * MiB, 0, st));
    ASSERT(before - free_mem() == 8 * MiB);
    CHECK(prefetch_v1(m, 8 * MiB, CU_DEVICE_CPU, st));
    ASSERT(free_mem() == before);

    /* Advice and the range attributes. */
    CHECK(cuMemAdvise(m, 4 * MiB, CU_MEM_ADVISE_SET_READ_MOSTLY, d0));
    CHECK(cuMemRangeGetAttribute(&v, 4, CU_MEM_RANGE_ATTRIBUTE_READ_MOSTLY, m, 4 * MiB));
    ASSERT(v == 1);
    CHECK(cuMemRangeGetAttribute(&v, 4, CU_MEM_RANGE_ATTRIBUTE_READ_MOSTLY, m, 8 * MiB));
    ASSERT(v == 0); /* not all of its pages */
    CHECK(cuMemRangeGetAttribute(&v, 4, CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION, m, 4 * MiB));
    ASSERT(v == CU_DEVICE_INVALID);
    CHECK(cuMemAdvise(m, 4 * MiB, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, d0));
    CHECK(cuMemRangeGetAttribute(&v, 4, CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION, m, 4 * MiB));
    ASSERT(v == 0);
    CHECK(cuMemRangeGetAttribute(&lt, sizeof lt, CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_TYPE, m, 4 * MiB));
    ASSERT(lt == CU_MEM_LOCATION_TYPE_DEVICE);
    CHECK(cuMemRangeGetAttribute(&v, 4, CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_ID, m, 4 * MiB));
    ASSERT(v == 0);
    CHECK(advise_v1(m, 4 * MiB, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, CU_DEVICE_CPU));
    CHECK(cuMemRangeGetAttribute(&v, 4, CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION, m, 4 * MiB));
    ASSERT(v == CU_DEVICE_CPU);
    CHECK(cuMemAdvise(m, 4 * MiB, CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION, d0));
    CHECK(cuMemAdvise(m, 4 * MiB, CU_MEM_ADVISE_SET_ACCESSED_BY, d0));
    int ids[3] = {7, 7, 7};
    CHECK(cuMemRangeGetAttribute(ids, sizeof ids, CU_MEM_RANGE_ATTRIBUTE_ACCESSED_BY, m, 4 * MiB));
    ASSERT(ids[0] == 0 && ids[1] == CU_DEVICE_INVALID && ids[2] == CU_DEVICE_INVALID);
    CHECK(cuMemAdvise(m, 4 * MiB, CU_MEM_ADVISE_UNSET_ACCESSED_BY, d0));
    CHECK(cuMemRangeGetAttribute(ids, sizeof ids, CU_MEM_RANGE_ATTRIBUTE_ACCESSED_BY, m, 4 * MiB));
    ASSERT(ids[0] == CU_DEVICE_INVALID);
    EXPECT(cuMemRangeGetAttribute(&v, 8, CU_MEM_RANGE_ATTRIBUTE_READ_MOSTLY, m, MiB), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemRangeGetAttribute(ids, 6, CU_MEM_RANGE_ATTRIBUTE_ACCESSED_BY, m, MiB), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemAdvise(m, MiB, (CUmem_advise)9, d0), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemAdvise(m, MiB, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, d99), CUDA_ERROR_INVALID_DEVICE);
    /* Several at once. */
    int rm = -1, pl = -1;
    void *data[2] = {&rm, &pl};
    size_t sizes[2] = {4, 4};
    CUmem_range_attribute attrs[2] = {CU_MEM_RANGE_ATTRIBUTE_READ_MOSTLY, CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION};
    CHECK(cuMemRangeGetAttributes(data, sizes, attrs, 2, m, 4 * MiB));
    ASSERT(rm == 1 && pl == CU_DEVICE_CPU);

    /* Stream association: the whole allocation (0 or its size), one of the flags. */
    CUdeviceptr odd;
    CHECK(cuMemAllocManaged(&odd, 1000, CU_MEM_ATTACH_GLOBAL));
    CHECK(cuStreamAttachMemAsync(st, odd, 0, CU_MEM_ATTACH_SINGLE));
    CHECK(cuStreamAttachMemAsync(st, odd, 1000, CU_MEM_ATTACH_HOST));
    EXPECT(cuStreamAttachMemAsync(st, odd, 500, CU_MEM_ATTACH_GLOBAL), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuStreamAttachMemAsync(st, odd, 0, 3), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuStreamAttachMemAsync(0, odd, 0, CU_MEM_ATTACH_SINGLE), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuMemFree(odd));

    /* Not managed memory: INVALID_VALUE. */
    CHECK(cuMemAlloc(&plain, MiB));
    EXPECT(cuMemPrefetchAsync(plain, MiB, d0, 0, st), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemAdvise(plain, MiB, CU_MEM_ADVISE_SET_READ_MOSTLY, d0), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemRangeGetAttribute(&v, 4, CU_MEM_RANGE_ATTRIBUTE_READ_MOSTLY, plain, MiB), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuMemFree(plain));

    /* Batches (CUDA 13): not on the legacy stream; a discard gives the device memory back. */
    CUdeviceptr ptrs[2] = {m, m + 16 * MiB};
    size_t lens[2] = {4 * MiB, 4 * MiB};
    size_t idx[1] = {0};
    EXPECT(cuMemPrefetchBatchAsync(ptrs, lens, 2, &d0, idx, 1, 0, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuMemPrefetchBatchAsync(ptrs, lens, 2, &d0, idx, 1, 0, st));
    ASSERT(before - free_mem() == 8 * MiB);
    CHECK(cuMemDiscardBatchAsync(ptrs, lens, 2, 0, st));
    ASSERT(free_mem() == before);

    /* Freeing gives back what is resident. */
    CHECK(cuMemPrefetchAsync(m + 32 * MiB, 16 * MiB, d0, 0, st));
    ASSERT(before - free_mem() == 16 * MiB);
    CHECK(cuMemFree(m));
    ASSERT(free_mem() == before);
}

int main(void) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv)) return 2;
    pid_t pid = fork();
    if (pid == 0) {
        close(sv[0]);
        return child(sv[1]);
    }
    close(sv[1]);
    int s = sv[0];

    CUcontext ctx;
    start(&ctx);
    CUstream st;
    CHECK(cuStreamCreate(&st, CU_STREAM_NON_BLOCKING));
    size_t total, f0;
    CHECK(cuMemGetInfo(&f0, &total));
    /* What this process holds before it allocates: its context's own memory. (f0 may or may not
     * include the child's context yet: the two start concurrently.) */
    unsigned long long own0 = nvml_used_by_me();

    /* A pool without a handle type cannot be exported, nor its pointers. */
    CUmemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    props.location = device_loc(0);
    CUmemoryPool plain_pool, pool;
    CHECK(cuMemPoolCreate(&plain_pool, &props));
    int fd = -1;
    EXPECT(cuMemPoolExportToShareableHandle(&fd, plain_pool, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
           CUDA_ERROR_INVALID_VALUE);
    CUdeviceptr q;
    CHECK(cuMemAllocFromPoolAsync(&q, MiB, plain_pool, st));
    CUmemPoolPtrExportData data;
    EXPECT(cuMemPoolExportPointer(&data, q), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuMemFreeAsync(q, st));
    CHECK(cuStreamSynchronize(st));
    CHECK(cuMemPoolDestroy(plain_pool));
    props.handleTypes = CU_MEM_HANDLE_TYPE_FABRIC; /* needs an IMEX channel: none here */
    EXPECT(cuMemPoolCreate(&pool, &props), CUDA_ERROR_NOT_SUPPORTED);

    /* CUDA 13.0's location forms name the same pools as the device forms. */
    CUmemoryPool dflt, by_loc, cur;
    CUmemLocation loc0 = device_loc(0), loc_host = device_loc(0), loc_bad = device_loc(0);
    loc_host.type = CU_MEM_LOCATION_TYPE_HOST;
    loc_bad.type = CU_MEM_LOCATION_TYPE_INVISIBLE;
    CHECK(cuDeviceGetDefaultMemPool(&dflt, 0));
    CHECK(cuMemGetDefaultMemPool(&by_loc, &loc0, CU_MEM_ALLOCATION_TYPE_PINNED));
    ASSERT(by_loc == dflt);
    CHECK(cuMemGetMemPool(&cur, &loc0, CU_MEM_ALLOCATION_TYPE_PINNED));
    ASSERT(cur == dflt);
    EXPECT(cuMemGetDefaultMemPool(&by_loc, &loc_host, CU_MEM_ALLOCATION_TYPE_PINNED), CUDA_ERROR_NOT_SUPPORTED);
    EXPECT(cuMemGetDefaultMemPool(&by_loc, &loc_bad, CU_MEM_ALLOCATION_TYPE_PINNED), CUDA_ERROR_INVALID_VALUE);
    CUmemLocation loc1 = device_loc(1);
    EXPECT(cuMemSetMemPool(&loc1, CU_MEM_ALLOCATION_TYPE_PINNED, dflt), CUDA_ERROR_INVALID_VALUE); /* not its pool */

    /* The IPC-capable pool. */
    props.handleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    CHECK(cuMemPoolCreate(&pool, &props));
    pool_attributes_and_access(pool);
    CHECK(cuMemSetMemPool(&loc0, CU_MEM_ALLOCATION_TYPE_PINNED, pool));
    CHECK(cuDeviceGetMemPool(&cur, 0));
    ASSERT(cur == pool);
    CHECK(cuMemSetMemPool(&loc0, CU_MEM_ALLOCATION_TYPE_PINNED, dflt));
    CUdeviceptr p;
    CHECK(cuMemAllocFromPoolAsync(&p, POOL_BYTES, pool, st));
    CHECK(cuStreamSynchronize(st));
    fill(p, POOL_BYTES, 0x11);
    EXPECT(cuMemPoolExportToShareableHandle(&fd, pool, CU_MEM_HANDLE_TYPE_FABRIC, 0), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuMemPoolExportToShareableHandle(&fd, pool, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 1), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuMemPoolExportToShareableHandle(&fd, pool, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    ASSERT(fd >= 0);
    struct ipc_msg msg;
    EXPECT(cuMemPoolExportPointer(&msg.ptr, p + 512), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuMemPoolExportPointer(&msg.ptr, p));

    /* VMM, exported as a file descriptor. */
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location = device_loc(0);
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    size_t gmin = 0, grec = 0;
    CHECK(cuMemGetAllocationGranularity(&gmin, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    CHECK(cuMemGetAllocationGranularity(&grec, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    ASSERT(gmin == 2 * MiB && grec == 2 * MiB);
    EXPECT(cuMemGetAllocationGranularity(&gmin, &prop, (CUmemAllocationGranularity_flags)5), CUDA_ERROR_INVALID_VALUE);
    CUmemGenericAllocationHandle h;
    CHECK(cuMemCreate(&h, VMM_BYTES, &prop, 0));
    CUmemAllocationProp back;
    CHECK(cuMemGetAllocationPropertiesFromHandle(&back, h));
    ASSERT(back.type == CU_MEM_ALLOCATION_TYPE_PINNED && back.location.type == CU_MEM_LOCATION_TYPE_DEVICE &&
           back.location.id == 0 && back.requestedHandleTypes == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    CUdeviceptr va;
    CHECK(cuMemAddressReserve(&va, VMM_BYTES, 0, 0, 0));
    CHECK(cuMemMap(va, VMM_BYTES, 0, h, 0));
    unsigned long long acc = 99;
    CUmemLocation d0 = device_loc(0);
    CHECK(cuMemGetAccess(&acc, &d0, va));
    ASSERT(acc == CU_MEM_ACCESS_FLAGS_PROT_NONE);
    CUmemAccessDesc rw = {d0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    CHECK(cuMemSetAccess(va, VMM_BYTES, &rw, 1));
    CHECK(cuMemGetAccess(&acc, &d0, va + MiB));
    ASSERT(acc == CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    EXPECT(cuMemGetAccess(&acc, &d0, p), CUDA_ERROR_INVALID_VALUE); /* not a mapping */
    fill(va, VMM_BYTES, 0x22); /* written before the export: the export carries it */
    int vfd = -1;
    EXPECT(cuMemExportToShareableHandle(&vfd, h, CU_MEM_HANDLE_TYPE_FABRIC, 0), CUDA_ERROR_NOT_SUPPORTED);
    CHECK(cuMemExportToShareableHandle(&vfd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    ASSERT(vfd >= 0);
    ASSERT(holds(va, VMM_BYTES, 0x22));
    int dmabuf;
    EXPECT(cuMemGetHandleForAddressRange(&dmabuf, va, VMM_BYTES, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0),
           CUDA_ERROR_NOT_SUPPORTED);

    /* IPC: a process cannot open its own handle. */
    CUdeviceptr ipc_mem, self;
    CHECK(cuMemAlloc(&ipc_mem, IPC_BYTES));
    fill(ipc_mem, IPC_BYTES, 0x55); /* written before the export: the importer reads it */
    CHECK(cuIpcGetMemHandle(&msg.ipc, ipc_mem));
    ASSERT(holds(ipc_mem, IPC_BYTES, 0x55));
    EXPECT(cuIpcOpenMemHandle(&self, msg.ipc, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), CUDA_ERROR_INVALID_CONTEXT);
    CUipcMemHandle interior;
    EXPECT(cuIpcGetMemHandle(&interior, ipc_mem + 512), CUDA_ERROR_INVALID_VALUE); /* not its base */

    size_t held = free_mem();
    send_msg(s, &msg, sizeof msg, fd);
    send_msg(s, "v", 1, vfd);
    close(fd);
    close(vfd);

    /* While the child holds it all, the device holds it once. */
    size_t seen;
    recv_msg(s, &seen, sizeof seen);
    ASSERT(seen == held);
    char done;
    recv_msg(s, &done, 1);
    ASSERT(done == 'd');
    ASSERT(holds(p, POOL_BYTES, 0x33)); /* the child's bytes, through the pool */
    ASSERT(holds(va, VMM_BYTES, 0x44)); /* and through the VMM mapping */
    ASSERT(holds(ipc_mem, IPC_BYTES, 0x66)); /* and through the IPC handle */
    int status = 0;
    ASSERT(waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0);

    CHECK(cuMemFree(ipc_mem));
    CHECK(cuMemUnmap(va, VMM_BYTES));
    CHECK(cuMemAddressFree(va, VMM_BYTES));
    CHECK(cuMemRelease(h));
    CHECK(cuMemFreeAsync(p, st));
    CHECK(cuStreamSynchronize(st));
    CHECK(cuMemPoolDestroy(pool));
    /* Everything is given back: this process holds what it held at the start, and with the
     * child gone (its context and what it imported) nothing else is on the device. */
    ASSERT(nvml_used_by_me() == own0);
    ASSERT(free_mem() == total - own0);

    managed(total, st);

    CHECK(cuStreamDestroy(st));
    CHECK(cuDevicePrimaryCtxRelease(0));
    printf("OK\n");
    return 0;
}
