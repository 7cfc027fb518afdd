/* Loads modules as NVIDIA's libcudart does: through the driver's private CUDART_INTERFACE table
 * (cuGetExportTable, UUID 6bd5fb6c-5bf4-e74a-8987-d93912fd9df9), slot 1 (a __fatBinC_Wrapper_t),
 * slot 6 (the same, three more arguments) and slot 8 (the fat binary itself). Arguments: a fat
 * binary file with a 2 GiB .global, and one with a 256 MiB one. Run under a 1 GiB quota: the
 * big one is refused seven times each way with CUDA_ERROR_OUT_OF_MEMORY and nothing shown
 * taken; three small ones are charged; malformed wrappers are refused; cuModuleUnload (by dlsym
 * and by cuGetProcAddress, as libcudart reaches it) and the primary context's release give
 * everything back. Prints "cudart_table: ok"; exits non-zero at the first failed check. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
#define OOM 2
#define MIB (1024ULL * 1024)

#define CHECK(cond, ...) do { if (!(cond)) { fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); fprintf(stderr, __VA_ARGS__); fprintf(stderr, "\n"); exit(1); } } while (0)
#define OK(call) do { int r_ = (call); CHECK(r_ == 0, "%s returned %d", #call, r_); } while (0)

struct wrapper { unsigned magic, version; const void *data; const void *filename; };

static void *sym(void *lib, const char *name) {
    void *p = dlsym(lib, name);
    CHECK(p != NULL, "no %s: %s", name, dlerror());
    return p;
}

static void *slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    CHECK(f, "open %s", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    void *b = aligned_alloc(8, (n + 8) & ~7L);
    CHECK(b && fread(b, 1, n, f) == (size_t)n, "read %s", path);
    fclose(f);
    return b;
}

static CUresult (*memGetInfo)(size_t *, size_t *);
static size_t free_mem(void) {
    size_t free, total;
    OK(memGetInfo(&free, &total));
    return free;
}

typedef CUresult (*Slot1)(void **, const void *);
typedef CUresult (*Slot6)(void **, const void *, void *, void *, unsigned);
typedef CUresult (*Slot8)(const void *, void **, void *, void *, unsigned);

int main(int argc, char **argv) {
    CHECK(argc == 3, "usage: cudart_table BIG.fatbin SMALL.fatbin");
    void *big = slurp(argv[1]), *small = slurp(argv[2]);
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    CHECK(cuda, "dlopen: %s", dlerror());
    CUresult (*cuInit)(unsigned) = sym(cuda, "cuInit");
    CUresult (*retain)(void **, int) = sym(cuda, "cuDevicePrimaryCtxRetain");
    CUresult (*release)(int) = sym(cuda, "cuDevicePrimaryCtxRelease_v2");
    CUresult (*setCurrent)(void *) = sym(cuda, "cuCtxSetCurrent");
    CUresult (*memAlloc)(CUdeviceptr *, size_t) = sym(cuda, "cuMemAlloc_v2");
    CUresult (*unload)(void *) = sym(cuda, "cuModuleUnload");
    CUresult (*getExportTable)(const void **, const unsigned char *) = sym(cuda, "cuGetExportTable");
    CUresult (*gpa)(const char *, void **, int, unsigned long long, int *) = sym(cuda, "cuGetProcAddress_v2");
    memGetInfo = sym(cuda, "cuMemGetInfo_v2");

    void *ctx;
    OK(cuInit(0));
    OK(retain(&ctx, 0));
    OK(setCurrent(ctx));

    static const unsigned char cudart[16] = {0x6b, 0xd5, 0xfb, 0x6c, 0x5b, 0xf4, 0xe7, 0x4a,
                                             0x89, 0x87, 0xd9, 0x39, 0x12, 0xfd, 0x9d, 0xf9};
    const void *t = NULL, *again = NULL;
    OK(getExportTable(&t, cudart));
    OK(getExportTable(&again, cudart));
    CHECK(t == again, "one table, every call");
    const void *const *slots = t;
    CHECK((size_t)slots[0] >= 9 * sizeof(void *), "a table of %zu bytes", (size_t)slots[0]);
    Slot1 slot1 = (Slot1)slots[1];
    Slot6 slot6 = (Slot6)slots[6];
    Slot8 slot8 = (Slot8)slots[8];

    struct wrapper wbig = {0x466243b1, 1, big, NULL}, wsmall = {0x466243b1, 1, small, NULL};
    size_t base = free_mem();
    CHECK(base == 1024 * MIB, "free %zu before any load", base);
    void *m = NULL;
    for (int i = 0; i < 7; i++) {
        CUresult r = slot1(&m, &wbig);
        CHECK(r == OOM, "2 GiB through slot 1 (%d): %d", i, r);
        r = slot8(big, &m, NULL, NULL, 0);
        CHECK(r == OOM, "2 GiB through slot 8 (%d): %d", i, r);
        r = slot6(&m, &wbig, NULL, NULL, 0);
        CHECK(r == OOM, "2 GiB through slot 6 (%d): %d", i, r);
    }
    CHECK(free_mem() == base, "nothing taken, nothing shown taken: free %zu", free_mem());

    /* A wrapper that is none, and one without its fat binary: not sized, so not loaded. */
    struct wrapper bad = {0x12345678, 1, small, NULL}, empty = {0x466243b1, 1, NULL, NULL};
    CHECK(slot1(&m, &bad) == OOM, "a wrapper with another magic");
    CHECK(slot1(&m, &empty) == OOM, "a wrapper without its fat binary");
    CHECK(slot8(&wsmall, &m, NULL, NULL, 0) == OOM, "a wrapper where slot 8 takes a fat binary");

    void *m1, *m2, *m3;
    OK(slot1(&m1, &wsmall));
    CHECK(base - free_mem() == 256 * MIB, "slot 1: charged %zu", base - free_mem());
    OK(slot8(small, &m2, NULL, NULL, 0));
    CHECK(base - free_mem() == 512 * MIB, "slot 8: charged %zu", base - free_mem());
    OK(slot6(&m3, &wsmall, NULL, NULL, 0));
    CHECK(base - free_mem() == 768 * MIB, "slot 6: charged %zu", base - free_mem());
    CUdeviceptr p;
    CHECK(memAlloc(&p, 512 * MIB) == OOM, "512 MiB beyond the 256 MiB left");

    OK(unload(m1));
    CHECK(base - free_mem() == 512 * MIB, "cuModuleUnload gives back exactly");
    CUresult (*unload2)(void *) = NULL;
    int status = 0;
    OK(gpa("cuModuleUnload", (void **)&unload2, 12000, 0, &status));
    OK(unload2(m2));
    CHECK(base - free_mem() == 256 * MIB, "cuModuleUnload by cuGetProcAddress gives back");
    /* The primary context's last release: its modules go with it. */
    OK(release(0));
    OK(retain(&ctx, 0));
    OK(setCurrent(ctx));
    CHECK(free_mem() == base, "the context's teardown gives back: free %zu", free_mem());
    (void)m3;
    printf("cudart_table: ok\n");
    return 0;
}
