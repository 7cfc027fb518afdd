/* Modules, libraries, kernels and functions, linked against libcuda (-lcuda): counting and
 * enumerating an image's functions / kernels, their names, a kernel's library, a function's
 * loading state (as CUDA_MODULE_LOADING sets the mode), a kernel's cache preference, and the library symbols the image
 * does not have, with the codes CUDA 13.5's cuda.h documents. The image is PTX (the driver
 * loads PTX text as it loads a cubin).
 *
 * CUDA_MODULE_LOADING=EAGER in the environment: the program expects eager loading.
 *
 *   modules TYPE PATH NAME...   an image nvcc built (TYPE: the CUjitInputType, 0 cubin, 1 PTX,
 *                               2 fat binary): loaded from the file as a module and as a library,
 *                               and linked, it must count and name exactly the kernels NAME...
 * Prints one line per failed check and "OK" at the end when none failed; exit status 0 then. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext;
typedef void *CUmodule;
typedef void *CUfunction;
typedef void *CUlibrary;
typedef void *CUkernel;

CUresult cuInit(unsigned);
CUresult cuCtxCreate_v2(CUcontext *, unsigned, int);
CUresult cuCtxDestroy_v2(CUcontext);
CUresult cuModuleLoadData(CUmodule *, const void *);
CUresult cuModuleLoad(CUmodule *, const char *);
CUresult cuLibraryLoadFromFile(CUlibrary *, const char *, void *, void *, unsigned, void *, void *, unsigned);
CUresult cuModuleUnload(CUmodule);
CUresult cuModuleGetFunction(CUfunction *, CUmodule, const char *);
CUresult cuModuleGetGlobal_v2(CUdeviceptr *, size_t *, CUmodule, const char *);
CUresult cuModuleGetFunctionCount(unsigned *, CUmodule);
CUresult cuModuleEnumerateFunctions(CUfunction *, unsigned, CUmodule);
CUresult cuFuncGetName(const char **, CUfunction);
CUresult cuFuncGetModule(CUmodule *, CUfunction);
CUresult cuFuncIsLoaded(unsigned *, CUfunction);
CUresult cuFuncLoad(CUfunction);
CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                        void *, void **, void **);
CUresult cuCtxSynchronize(void);
CUresult cuLibraryLoadData(CUlibrary *, const void *, void *, void *, unsigned, void *, void *, unsigned);
CUresult cuLibraryUnload(CUlibrary);
CUresult cuLibraryGetKernel(CUkernel *, CUlibrary, const char *);
CUresult cuLibraryGetKernelCount(unsigned *, CUlibrary);
CUresult cuLibraryEnumerateKernels(CUkernel *, unsigned, CUlibrary);
CUresult cuLibraryGetUnifiedFunction(void **, CUlibrary, const char *);
CUresult cuLibraryGetManaged(CUdeviceptr *, size_t *, CUlibrary, const char *);
CUresult cuKernelGetName(const char **, CUkernel);
CUresult cuKernelGetLibrary(CUlibrary *, CUkernel);
CUresult cuKernelGetFunction(CUfunction *, CUkernel);
CUresult cuKernelSetCacheConfig(CUkernel, int, int);
typedef void *CUlinkState;
CUresult cuLinkCreate_v2(unsigned, int *, void **, CUlinkState *);
CUresult cuLinkAddData_v2(CUlinkState, int, void *, size_t, const char *, unsigned, int *, void **);
CUresult cuLinkAddFile_v2(CUlinkState, int, const char *, unsigned, int *, void **);
CUresult cuLinkComplete(CUlinkState, void **, size_t *);
CUresult cuLinkDestroy(CUlinkState);

#define INVALID_VALUE 1
#define INVALID_DEVICE 101
#define INVALID_HANDLE 400
#define NOT_FOUND 500
#define INVALID_IMAGE 200
#define INVALID_PTX 218
#define FILE_NOT_FOUND 301
enum { JIT_WALL_TIME = 2, JIT_INFO_LOG_BUFFER = 3, JIT_INFO_LOG_BUFFER_SIZE_BYTES = 4 };
enum { IN_CUBIN = 0, IN_PTX = 1, IN_FATBINARY = 2, IN_OBJECT = 3 };

#include "expect.h"

static const char ptx[] =
    ".version 8.8\n.target sm_80\n.address_size 64\n"
    ".global .align 4 .b8 table[256];\n"
    ".visible .entry sim_busy_ns(.param .u64 ns)\n{\n\tret;\n}\n"
    ".visible .entry scale(.param .u64 p, .param .f32 k)\n{\n\tret;\n}\n"
    ".weak .entry _Z3sumPfi(.param .u64 a, .param .u32 n)\n{\n\tret;\n}\n";
static const char *names[3] = {"_Z3sumPfi", "scale", "sim_busy_ns"};

/* Whether `name` is one of the image's kernels, each seen once. */
static int seen[3];
static void saw(const char *name) {
    for (int i = 0; i < 3; i++)
        if (name && strcmp(name, names[i]) == 0) {
            CHECK(!seen[i]);
            seen[i] = 1;
            return;
        }
    printf("FAIL: unexpected name %s\n", name ? name : "(null)");
    failures++;
}

/* Loads the image at `path` as a module, a library and a link input; each must define exactly
 * the kernels `want`. */
static int image_mode(int type, const char *path, int n, char **want) {
    CUcontext ctx;
    CUmodule mod;
    CUlibrary lib;
    CUlinkState st;
    CUfunction fs[16];
    CUkernel ks[16];
    unsigned count = 0;
    const char *name;
    void *cubin;
    size_t size;
    EXPECT(cuInit(0), 0);
    EXPECT(cuCtxCreate_v2(&ctx, 0, 0), 0);
    EXPECT(cuModuleLoad(&mod, path), 0);
    EXPECT(cuModuleGetFunctionCount(&count, mod), 0);
    if (count != (unsigned)n)
        printf("FAIL: %s: %u functions, want %d\n", path, count, n), failures++;
    EXPECT(cuModuleEnumerateFunctions(fs, 16, mod), 0);
    for (unsigned i = 0; i < count && i < 16; i++) {
        int found = 0;
        EXPECT(cuFuncGetName(&name, fs[i]), 0);
        for (int j = 0; j < n; j++)
            found |= strcmp(name, want[j]) == 0;
        if (!found)
            printf("FAIL: %s: function %s not expected\n", path, name), failures++;
    }
    for (int j = 0; j < n; j++) {
        CUfunction f;
        EXPECT(cuModuleGetFunction(&f, mod, want[j]), 0);
    }
    EXPECT(cuModuleUnload(mod), 0);
    EXPECT(cuLibraryLoadFromFile(&lib, path, NULL, NULL, 0, NULL, NULL, 0), 0);
    EXPECT(cuLibraryGetKernelCount(&count, lib), 0);
    if (count != (unsigned)n)
        printf("FAIL: %s: %u kernels, want %d\n", path, count, n), failures++;
    EXPECT(cuLibraryEnumerateKernels(ks, 16, lib), 0);
    for (unsigned i = 0; i < count && i < 16; i++) {
        CUlibrary back;
        EXPECT(cuKernelGetName(&name, ks[i]), 0);
        EXPECT(cuKernelGetLibrary(&back, ks[i]), 0);
        CHECK(back == lib);
    }
    EXPECT(cuLibraryUnload(lib), 0);
    /* Linked alone, the image gives a cubin with the same kernels. */
    EXPECT(cuLinkCreate_v2(0, NULL, NULL, &st), 0);
    EXPECT(cuLinkAddFile_v2(st, type, path, 0, NULL, NULL), 0);
    EXPECT(cuLinkComplete(st, &cubin, &size), 0);
    EXPECT(cuModuleLoadData(&mod, cubin), 0);
    EXPECT(cuModuleGetFunctionCount(&count, mod), 0);
    if (count != (unsigned)n)
        printf("FAIL: %s linked: %u functions, want %d\n", path, count, n), failures++;
    EXPECT(cuModuleUnload(mod), 0);
    EXPECT(cuLinkDestroy(st), 0);
    EXPECT(cuCtxDestroy_v2(ctx), 0);
    if (failures == 0)
        printf("OK\n");
    return failures != 0;
}

int main(int argc, char **argv) {
    if (argc > 2)
        return image_mode(atoi(argv[1]), argv[2], argc - 3, argv + 3);
    int eager = getenv("CUDA_MODULE_LOADING") && strcmp(getenv("CUDA_MODULE_LOADING"), "EAGER") == 0;
    CUcontext ctx;
    CUmodule mod, back;
    CUfunction fs[4], f;
    unsigned count = 0, state = 9;
    const char *name;

    EXPECT(cuInit(0), 0);
    EXPECT(cuCtxCreate_v2(&ctx, 0, 0), 0);

    /* ---- a module ---- */
    EXPECT(cuModuleLoadData(&mod, ptx), 0);
    EXPECT(cuModuleGetFunctionCount(&count, mod), 0);
    CHECK(count == 3);
    EXPECT(cuModuleGetFunctionCount(NULL, mod), INVALID_VALUE);
    EXPECT(cuModuleGetFunctionCount(&count, (CUmodule)0x1234), INVALID_HANDLE);
    memset(fs, 0, sizeof fs);
    EXPECT(cuModuleEnumerateFunctions(fs, 4, mod), 0);
    CHECK(fs[3] == NULL);   /* only `count` of them */
    for (int i = 0; i < 3; i++) {
        name = NULL;
        EXPECT(cuFuncGetName(&name, fs[i]), 0);
        saw(name);
        EXPECT(cuModuleGetFunction(&f, mod, name), 0);
        CHECK(f == fs[i]);   /* the same handle cuModuleGetFunction gives */
        EXPECT(cuFuncGetModule(&back, fs[i]), 0);
        CHECK(back == mod);
    }
    memset(fs, 0, sizeof fs);
    EXPECT(cuModuleEnumerateFunctions(fs, 2, mod), 0);   /* at most numFunctions */
    CHECK(fs[0] && fs[1] && !fs[2]);
    EXPECT(cuModuleEnumerateFunctions(NULL, 2, mod), INVALID_VALUE);
    EXPECT(cuModuleEnumerateFunctions(fs, 2, (CUmodule)0x1234), INVALID_HANDLE);
    EXPECT(cuModuleGetFunction(&f, mod, "missing"), NOT_FOUND);
    {
        CUdeviceptr g;
        size_t bytes;
        EXPECT(cuModuleGetGlobal_v2(&g, &bytes, mod, "table"), 0);
        CHECK(bytes == 256);
        EXPECT(cuModuleGetGlobal_v2(&g, &bytes, mod, "missing"), NOT_FOUND);
    }
    /* Names: C linkage as is, C++ mangled; NULL arguments are INVALID_VALUE. */
    EXPECT(cuModuleGetFunction(&f, mod, "_Z3sumPfi"), 0);
    EXPECT(cuFuncGetName(&name, f), 0);
    CHECK(strcmp(name, "_Z3sumPfi") == 0);
    EXPECT(cuFuncGetName(NULL, f), INVALID_VALUE);
    EXPECT(cuFuncGetName(&name, NULL), INVALID_VALUE);
    /* Loading state: lazy until cuFuncLoad; eager at once. */
    EXPECT(cuFuncIsLoaded(&state, f), 0);
    CHECK(state == (eager ? 1u : 0u));
    EXPECT(cuFuncLoad(f), 0);
    EXPECT(cuFuncIsLoaded(&state, f), 0);
    CHECK(state == 1);
    EXPECT(cuFuncIsLoaded(NULL, f), INVALID_VALUE);
    /* A launch loads a function too. */
    {
        CUfunction busy;
        unsigned long long ns = 1000;
        void *args[1] = {&ns};
        EXPECT(cuModuleGetFunction(&busy, mod, "sim_busy_ns"), 0);
        EXPECT(cuFuncIsLoaded(&state, busy), 0);
        CHECK(state == (eager ? 1u : 0u));
        EXPECT(cuLaunchKernel(busy, 1, 1, 1, 32, 1, 1, 0, NULL, args, NULL), 0);
        EXPECT(cuCtxSynchronize(), 0);
        EXPECT(cuFuncIsLoaded(&state, busy), 0);
        CHECK(state == 1);
    }
    EXPECT(cuFuncLoad((CUfunction)0x1234), INVALID_HANDLE);
    EXPECT(cuModuleUnload(mod), 0);
    EXPECT(cuModuleGetFunctionCount(&count, mod), INVALID_HANDLE);

    /* ---- a library ---- */
    {
        CUlibrary lib, klib;
        CUkernel ks[4], k;
        void *fp;
        CUdeviceptr dp;
        size_t bytes;
        EXPECT(cuLibraryLoadData(&lib, ptx, NULL, NULL, 0, NULL, NULL, 0), 0);
        EXPECT(cuLibraryGetKernelCount(&count, lib), 0);
        CHECK(count == 3);
        EXPECT(cuLibraryGetKernelCount(NULL, lib), INVALID_VALUE);
        EXPECT(cuLibraryGetKernelCount(&count, (CUlibrary)0x1234), INVALID_HANDLE);
        memset(ks, 0, sizeof ks);
        memset(seen, 0, sizeof seen);
        EXPECT(cuLibraryEnumerateKernels(ks, 4, lib), 0);
        CHECK(ks[3] == NULL);
        for (int i = 0; i < 3; i++) {
            name = NULL;
            EXPECT(cuKernelGetName(&name, ks[i]), 0);
            saw(name);
            EXPECT(cuLibraryGetKernel(&k, lib, name), 0);
            CHECK(k == ks[i]);
            EXPECT(cuKernelGetLibrary(&klib, ks[i]), 0);
            CHECK(klib == lib);
            EXPECT(cuKernelGetFunction(&f, ks[i]), 0);
            EXPECT(cuFuncGetName(&name, f), 0);
        }
        EXPECT(cuKernelGetName(NULL, ks[0]), INVALID_VALUE);
        EXPECT(cuKernelGetName(&name, NULL), INVALID_VALUE);
        EXPECT(cuKernelGetLibrary(NULL, ks[0]), INVALID_VALUE);
        EXPECT(cuKernelGetLibrary(&klib, (CUkernel)0x1234), INVALID_HANDLE);
        EXPECT(cuLibraryEnumerateKernels(NULL, 1, lib), INVALID_VALUE);
        /* No unified functions or managed variables in this image. */
        EXPECT(cuLibraryGetUnifiedFunction(&fp, lib, "scale"), NOT_FOUND);
        EXPECT(cuLibraryGetUnifiedFunction(NULL, lib, "scale"), INVALID_VALUE);
        EXPECT(cuLibraryGetUnifiedFunction(&fp, (CUlibrary)0x1234, "scale"), INVALID_HANDLE);
        EXPECT(cuLibraryGetManaged(&dp, &bytes, lib, "table"), NOT_FOUND);
        EXPECT(cuLibraryGetManaged(NULL, NULL, lib, "table"), INVALID_VALUE);
        /* Cache preference: CUfunc_cache values, a valid device. */
        EXPECT(cuKernelSetCacheConfig(ks[0], 1 /* PREFER_SHARED */, 0), 0);
        EXPECT(cuKernelSetCacheConfig(ks[0], 4, 0), INVALID_VALUE);
        EXPECT(cuKernelSetCacheConfig(ks[0], 1, 7), INVALID_DEVICE);
        EXPECT(cuKernelSetCacheConfig((CUkernel)0x1234, 1, 0), INVALID_HANDLE);
        EXPECT(cuLibraryUnload(lib), 0);
        EXPECT(cuKernelGetLibrary(&klib, ks[0]), INVALID_HANDLE);
        EXPECT(cuLibraryGetKernelCount(&count, lib), INVALID_HANDLE);
    }

    /* ---- JIT linking: two PTX inputs in memory and one from a file make one image ---- */
    {
        static char ptx_a[] = ".version 8.8\n.target sm_80\n.address_size 64\n"
                              ".global .align 4 .b8 counts[64];\n"
                              ".visible .entry first(.param .u64 p)\n{\n\tret;\n}\n";
        static char ptx_b[] = ".version 8.8\n.target sm_80\n.address_size 64\n"
                              ".visible .entry second(.param .u64 p)\n{\n\tret;\n}\n";
        static const char ptx_c[] = ".version 8.8\n.target sm_80\n.address_size 64\n"
                                    ".visible .entry third()\n{\n\tret;\n}\n";
        char path[64], log[64];
        CUlinkState st;
        void *cubin = NULL;
        size_t size = 0;
        float wall = -1.0f;
        int keys[3] = {JIT_WALL_TIME, JIT_INFO_LOG_BUFFER, JIT_INFO_LOG_BUFFER_SIZE_BYTES};
        void *vals[3] = {NULL, log, (void *)(uintptr_t)sizeof log};
        int bad_key[1] = {JIT_WALL_TIME};
        void *bad_val[1] = {NULL};
        snprintf(path, sizeof path, "/tmp/cuvisor-link-%d.ptx", (int)getpid());
        FILE *fp = fopen(path, "w");
        CHECK(fp != NULL);
        if (fp) {
            fputs(ptx_c, fp);
            fclose(fp);
        }
        memset(log, 'x', sizeof log);
        memcpy(&vals[0], &wall, sizeof wall);   /* -1.0f until the link writes it */
        EXPECT(cuLinkCreate_v2(1, NULL, NULL, &st), INVALID_VALUE);
        EXPECT(cuLinkCreate_v2(0, NULL, NULL, NULL), INVALID_VALUE);
        EXPECT(cuLinkCreate_v2(3, keys, vals, &st), 0);
        EXPECT(cuLinkAddData_v2(st, IN_PTX, ptx_a, sizeof ptx_a, "a", 0, NULL, NULL), 0);
        EXPECT(cuLinkAddData_v2(st, IN_PTX, ptx_b, sizeof ptx_b, "b", 0, NULL, NULL), 0);
        EXPECT(cuLinkAddFile_v2(st, IN_PTX, path, 0, NULL, NULL), 0);
        EXPECT(cuLinkAddFile_v2(st, IN_PTX, "/nonexistent/x.ptx", 0, NULL, NULL), FILE_NOT_FOUND);
        /* Inputs that are not what their type says; types and options it refuses. */
        EXPECT(cuLinkAddData_v2(st, IN_CUBIN, ptx_a, sizeof ptx_a, "a", 0, NULL, NULL), INVALID_IMAGE);
        EXPECT(cuLinkAddData_v2(st, IN_FATBINARY, ptx_a, sizeof ptx_a, "a", 0, NULL, NULL), INVALID_IMAGE);
        EXPECT(cuLinkAddData_v2(st, IN_PTX, "hello", 6, "h", 0, NULL, NULL), INVALID_PTX);
        EXPECT(cuLinkAddData_v2(st, 6, ptx_a, sizeof ptx_a, "a", 0, NULL, NULL), INVALID_VALUE);
        EXPECT(cuLinkAddData_v2(st, IN_PTX, NULL, 10, "a", 0, NULL, NULL), INVALID_VALUE);
        EXPECT(cuLinkAddData_v2(st, IN_PTX, ptx_b, sizeof ptx_b, "b", 1, bad_key, bad_val), INVALID_VALUE);
        EXPECT(cuLinkAddData_v2((CUlinkState)0x1234, IN_PTX, ptx_b, sizeof ptx_b, "b", 0, NULL, NULL), INVALID_HANDLE);
        EXPECT(cuLinkComplete(st, NULL, &size), INVALID_VALUE);
        EXPECT(cuLinkComplete(st, &cubin, &size), 0);
        CHECK(cubin != NULL && size > 0);
        CHECK(memcmp(cubin, "\x7f" "ELF", 4) == 0);
        memcpy(&wall, &vals[0], sizeof wall);
        CHECK(wall >= 0.0f);   /* overwritten with the time spent, a float in the slot */
        CHECK(log[0] == 0);   /* an empty log */
        /* The linked image loads, with every input's kernels and variables. */
        EXPECT(cuModuleLoadData(&mod, cubin), 0);
        EXPECT(cuModuleGetFunctionCount(&count, mod), 0);
        CHECK(count == 3);
        EXPECT(cuModuleGetFunction(&f, mod, "first"), 0);
        EXPECT(cuModuleGetFunction(&f, mod, "second"), 0);
        EXPECT(cuModuleGetFunction(&f, mod, "third"), 0);
        EXPECT(cuModuleGetFunction(&f, mod, "missing"), NOT_FOUND);
        {
            CUdeviceptr g;
            size_t bytes;
            EXPECT(cuModuleGetGlobal_v2(&g, &bytes, mod, "counts"), 0);
            CHECK(bytes == 64);
        }
        EXPECT(cuModuleUnload(mod), 0);
        EXPECT(cuLinkDestroy(st), 0);
        EXPECT(cuLinkDestroy(st), INVALID_HANDLE);
        EXPECT(cuLinkComplete(st, &cubin, &size), INVALID_HANDLE);
        remove(path);
    }
    EXPECT(cuCtxDestroy_v2(ctx), 0);
    if (failures == 0)
        printf("OK\n");
    return failures != 0;
}
