/* A GPU tenant for the container tests: runs the steps given as arguments, one line of output
 * per step (flushed at once, so a test can follow it), then "done". It reaches the driver the
 * way libcudart does (dlopen + dlsym), with nothing of cuvisor in its environment: the library
 * gets in through /etc/ld.so.preload, as Allocate mounts it.
 *
 *   id           "id pid P ppid Q uid U gid G"
 *   info         "info free F total T"                         (cuMemGetInfo_v2)
 *   alloc MIB    "alloc MIB R"     R the CUresult; kept on success
 *   free         "free R"          every allocation kept so far
 *   procs        "procs N used B"  the driver's NVML process list: N processes, B bytes in all
 *   launch N     "launch N R"      N 1 ms kernels (the simulator's sim_busy), then a synchronize
 *   wait PATH    "waited PATH"     once PATH exists (at most 120 s, then exit 3)
 *   ipcget PATH  "ipcget R"        cuIpcGetMemHandle of the last allocation kept, its 64 bytes
 *                                  written to PATH (through a rename: whole or not at all)
 *   ipcopen PATH "ipcopen R"       cuIpcOpenMemHandle_v2 of the handle in PATH; kept on success
 *   ipcclose     "ipcclose R"      cuIpcCloseMemHandle of the last pointer opened
 *   hold         "holding"         then sleeps until killed
 *
 * Exit status 0 unless the driver cannot be set up (1) or a step is malformed (2). */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef struct { unsigned int pid; unsigned long long used; } nvmlProcessInfo_v1_t;

#define CHECK(cond, ...) do { if (!(cond)) { fprintf(stderr, "tenant: "); fprintf(stderr, __VA_ARGS__); fprintf(stderr, "\n"); exit(1); } } while (0)
#define OK(call) do { int r_ = (call); CHECK(r_ == 0, "%s returned %d", #call, r_); } while (0)

static void *sym(void *lib, const char *name) {
    void *p = dlsym(lib, name);
    CHECK(p != NULL, "no %s: %s", name, dlerror());
    return p;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    /* TENANT_LIBCUDA: the driver by path, for a set-user-ID tenant (whose loader ignores
     * LD_LIBRARY_PATH). */
    const char *driver = getenv("TENANT_LIBCUDA") ? getenv("TENANT_LIBCUDA") : "libcuda.so.1";
    void *cuda = dlopen(driver, RTLD_NOW | RTLD_LOCAL);
    CHECK(cuda != NULL, "dlopen %s: %s", driver, dlerror());
    CUresult (*cuInit)(unsigned) = sym(cuda, "cuInit");
    CUresult (*retain)(void **, int) = sym(cuda, "cuDevicePrimaryCtxRetain");
    CUresult (*setCurrent)(void *) = sym(cuda, "cuCtxSetCurrent");
    CUresult (*memAlloc)(CUdeviceptr *, size_t) = sym(cuda, "cuMemAlloc_v2");
    CUresult (*memFree)(CUdeviceptr) = sym(cuda, "cuMemFree_v2");
    CUresult (*memGetInfo)(size_t *, size_t *) = sym(cuda, "cuMemGetInfo_v2");
    CUresult (*modLoad)(void **, const void *) = sym(cuda, "cuModuleLoadData");
    CUresult (*getFunction)(void **, void *, const char *) = sym(cuda, "cuModuleGetFunction");
    CUresult (*launchKernel)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                             void **, void **) = sym(cuda, "cuLaunchKernel");
    CUresult (*synchronize)(void) = sym(cuda, "cuCtxSynchronize");
    typedef struct { char reserved[64]; } CUipcMemHandle;
    CUresult (*ipcGet)(CUipcMemHandle *, CUdeviceptr) = sym(cuda, "cuIpcGetMemHandle");
    CUresult (*ipcOpen)(CUdeviceptr *, CUipcMemHandle, unsigned) = sym(cuda, "cuIpcOpenMemHandle_v2");
    CUresult (*ipcClose)(CUdeviceptr) = sym(cuda, "cuIpcCloseMemHandle");
    static CUdeviceptr opened[64];
    int n_opened = 0;
    void *ctx;
    OK(cuInit(0));
    OK(retain(&ctx, 0));
    OK(setCurrent(ctx));

    static CUdeviceptr kept[1024];
    int n = 0;
    for (int i = 1; i < argc; i++) {
        const char *op = argv[i];
        if (strcmp(op, "id") == 0) {
            printf("id pid %d ppid %d uid %d gid %d\n", (int)getpid(), (int)getppid(), (int)getuid(), (int)getgid());
        } else if (strcmp(op, "info") == 0) {
            size_t free_b = 0, total_b = 0;
            OK(memGetInfo(&free_b, &total_b));
            printf("info free %zu total %zu\n", free_b, total_b);
        } else if (strcmp(op, "alloc") == 0 && i + 1 < argc) {
            const char *mib = argv[++i];
            CHECK(n < 1024, "too many allocations");
            CUdeviceptr p = 0;
            CUresult r = memAlloc(&p, (size_t)atoll(mib) << 20);
            if (r == 0) kept[n++] = p;
            printf("alloc %s %d\n", mib, r);
        } else if (strcmp(op, "free") == 0) {
            CUresult r = 0;
            while (n > 0 && r == 0) r = memFree(kept[--n]);
            printf("free %d\n", r);
        } else if (strcmp(op, "procs") == 0) {
            void *nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
            CHECK(nvml != NULL, "dlopen libnvidia-ml.so.1: %s", dlerror());
            int (*nvmlInit)(void) = sym(nvml, "nvmlInit_v2");
            int (*byIndex)(unsigned, void **) = sym(nvml, "nvmlDeviceGetHandleByIndex_v2");
            int (*list)(void *, unsigned *, nvmlProcessInfo_v1_t *) = sym(nvml, "nvmlDeviceGetComputeRunningProcesses");
            void *dev;
            OK(nvmlInit());
            OK(byIndex(0, &dev));
            nvmlProcessInfo_v1_t infos[64];
            unsigned count = 64;
            OK(list(dev, &count, infos));
            unsigned long long used = 0;
            for (unsigned k = 0; k < count; k++) used += infos[k].used;
            printf("procs %u used %llu\n", count, used);
        } else if (strcmp(op, "launch") == 0 && i + 1 < argc) {
            const char *count = argv[++i];
            void *module, *fn;
            OK(modLoad(&module, "tenant"));
            OK(getFunction(&fn, module, "sim_busy"));
            unsigned long long ns = 1000 * 1000;
            void *params[] = { &ns };
            CUresult r = 0;
            for (int k = 0; k < atoi(count) && r == 0; k++) r = launchKernel(fn, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL);
            if (r == 0) r = synchronize();
            printf("launch %s %d\n", count, r);
        } else if (strcmp(op, "wait") == 0 && i + 1 < argc) {
            const char *path = argv[++i];
            struct timespec tick = { 0, 10 * 1000 * 1000 };
            for (int k = 0; access(path, F_OK) != 0; k++) {
                if (k == 12000) { fprintf(stderr, "tenant: %s never came\n", path); return 3; }
                nanosleep(&tick, NULL);
            }
            printf("waited %s\n", path);
        } else if (strcmp(op, "ipcget") == 0 && i + 1 < argc) {
            const char *path = argv[++i];
            CHECK(n > 0, "ipcget: nothing allocated");
            CUipcMemHandle h;
            CUresult r = ipcGet(&h, kept[n - 1]);
            if (r == 0) {
                char tmp[4096];
                snprintf(tmp, sizeof tmp, "%s.tmp", path);
                FILE *f = fopen(tmp, "wb");
                CHECK(f != NULL && fwrite(&h, sizeof h, 1, f) == 1 && fclose(f) == 0, "writing %s", tmp);
                CHECK(rename(tmp, path) == 0, "renaming %s", tmp);
            }
            printf("ipcget %d\n", r);
        } else if (strcmp(op, "ipcopen") == 0 && i + 1 < argc) {
            const char *path = argv[++i];
            CUipcMemHandle h;
            FILE *f = fopen(path, "rb");
            CHECK(f != NULL && fread(&h, sizeof h, 1, f) == 1, "reading %s", path);
            fclose(f);
            CHECK(n_opened < 64, "too many opens");
            CUdeviceptr p = 0;
            CUresult r = ipcOpen(&p, h, 1);
            if (r == 0) opened[n_opened++] = p;
            printf("ipcopen %d\n", r);
        } else if (strcmp(op, "ipcclose") == 0) {
            CHECK(n_opened > 0, "ipcclose: nothing opened");
            printf("ipcclose %d\n", ipcClose(opened[--n_opened]));
        } else if (strcmp(op, "hold") == 0) {
            printf("holding\n");
            for (;;) pause();
        } else {
            fprintf(stderr, "tenant: bad step %s\n", op);
            return 2;
        }
    }
    printf("done\n");
    return 0;
}
