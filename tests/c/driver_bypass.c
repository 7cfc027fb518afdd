/* Ways a program can reach libcuda's own cuMemAlloc_v2 past libcuvisor's wrappers, one per mode.
 * Each resolves cuMemAlloc_v2 through the named path, prints "which FILE" (the object the
 * pointer lies in), then fills the quota with 256 MiB chunks and prints "total BYTES".
 *
 *   dlvsym-2.34 / dlvsym-2.2.5: glibc's dlsym taken with dlvsym(RTLD_DEFAULT, "dlsym", VERSION)
 *   dlvsym-driver:              dlvsym(libcuda's handle, "cuMemAlloc_v2", "any")
 *   libc-dlsym:                 dlsym taken from libc.so.6's own handle
 *   libc-dlvsym:                dlvsym taken from libc.so.6's own handle, then as dlvsym-2.34
 *   full-path:                  dlopen(FULL PATH of the loaded libcuda) then dlsym
 *   copy:                       dlopen(a copy of libcuda.so.1 at $COPY) then dlsym
 *   deepbind:                   dlopen($DEEP, RTLD_DEEPBIND): a library linked with -lcuda whose
 *                               deep_alloc() calls cuMemAlloc_v2
 *   dlmopen:                    dlmopen(LM_ID_NEWLM, "libcuda.so.1") then dlsym
 *   deepbind-plain:             dlopen($DEEP_PLAIN, RTLD_DEEPBIND), a library that does not bring
 *                               the driver in: prints "deep-bound yes" if its own deep_tag()
 *                               was preferred to the program's (the flag kept), then exits
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef CUresult (*Alloc)(CUdeviceptr *, size_t);
typedef void *(*Dlsym)(void *, const char *);
typedef void *(*Dlvsym)(void *, const char *, const char *);

#define CHECK(cond, ...) do { if (!(cond)) { fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); fprintf(stderr, __VA_ARGS__); fprintf(stderr, "\n"); exit(1); } } while (0)
#define OK(call) do { CUresult r_ = (call); CHECK(r_ == 0, "%s returned %d", #call, r_); } while (0)

/* Makes a context current through the entry points of instance `h` (a second instance of the
 * driver has a state of its own, which an attacker initializes first). */
static void init_via(void *h) {
    CUresult (*init)(unsigned) = dlsym(h, "cuInit");
    CUresult (*retain)(void **, int) = dlsym(h, "cuDevicePrimaryCtxRetain");
    CUresult (*set)(void *) = dlsym(h, "cuCtxSetCurrent");
    CHECK(init && retain && set, "instance symbols");
    void *ctx;
    OK(init(0));
    OK(retain(&ctx, 0));
    OK(set(ctx));
}

/* Also defined by the deepbind-plain library: which one its call reaches tells deep binding. */
int deep_tag(void) { return 0; }

static const char *file_of(void *p) {
    Dl_info info;
    if (!p || !dladdr(p, &info) || !info.dli_fname) return "none";
    const char *base = strrchr(info.dli_fname, '/');
    return base ? base + 1 : info.dli_fname;
}

int main(int argc, char **argv) {
    CHECK(argc == 2, "usage: driver_bypass MODE");
    const char *mode = argv[1];
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    CHECK(cuda != NULL, "dlopen: %s", dlerror());
    CUresult (*cuInit)(unsigned) = dlsym(cuda, "cuInit");
    CUresult (*retain)(void **, int) = dlsym(cuda, "cuDevicePrimaryCtxRetain");
    CUresult (*setCurrent)(void *) = dlsym(cuda, "cuCtxSetCurrent");
    CUresult (*memFree)(CUdeviceptr) = dlsym(cuda, "cuMemFree_v2");
    CHECK(cuInit && retain && setCurrent && memFree, "driver symbols");
    void *ctx;
    OK(cuInit(0));
    OK(retain(&ctx, 0));
    OK(setCurrent(ctx));

    Alloc alloc = NULL;
    CUresult (*deep_alloc)(CUdeviceptr *, size_t) = NULL;
    if (strncmp(mode, "dlvsym-", 7) == 0 && strcmp(mode, "dlvsym-driver") != 0) {
        const char *version = strcmp(mode, "dlvsym-2.34") == 0 ? "GLIBC_2.34" : "GLIBC_2.2.5";
        Dlsym real = (Dlsym)dlvsym(RTLD_DEFAULT, "dlsym", version);
        CHECK(real != NULL, "dlvsym(dlsym): %s", dlerror());
        printf("dlsym-from %s\n", file_of((void *)real));
        alloc = (Alloc)real(cuda, "cuMemAlloc_v2");
    } else if (strcmp(mode, "dlvsym-driver") == 0) {
        alloc = (Alloc)dlvsym(cuda, "cuMemAlloc_v2", "GLIBC_2.2.5");
    } else if (strcmp(mode, "libc-dlsym") == 0) {
        void *libc = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
        CHECK(libc != NULL, "libc: %s", dlerror());
        Dlsym real = (Dlsym)dlsym(libc, "dlsym");
        printf("dlsym-from %s\n", file_of((void *)real));
        alloc = (Alloc)real(cuda, "cuMemAlloc_v2");
    } else if (strcmp(mode, "libc-dlvsym") == 0) {
        void *libc = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
        CHECK(libc != NULL, "libc: %s", dlerror());
        Dlvsym v = (Dlvsym)dlsym(libc, "dlvsym");
        printf("dlvsym-from %s\n", file_of((void *)v));
        Dlsym real = (Dlsym)v(libc, "dlsym", "GLIBC_2.34");
        printf("dlsym-from %s\n", file_of((void *)real));
        alloc = (Alloc)real(cuda, "cuMemAlloc_v2");
    } else if (strcmp(mode, "full-path") == 0) {
        struct link_map *map = NULL;
        CHECK(dlinfo(cuda, RTLD_DI_LINKMAP, &map) == 0, "dlinfo");
        void *again = dlopen(map->l_name, RTLD_NOW);
        CHECK(again != NULL, "dlopen %s: %s", map->l_name, dlerror());
        printf("same-handle %s\n", again == cuda ? "yes" : "no");
        alloc = (Alloc)dlsym(again, "cuMemAlloc_v2");
    } else if (strcmp(mode, "copy") == 0) {
        void *copy = dlopen(getenv("COPY"), RTLD_NOW | RTLD_LOCAL);
        CHECK(copy != NULL, "dlopen copy: %s", dlerror());
        printf("same-handle %s\n", copy == cuda ? "yes" : "no");
        alloc = (Alloc)dlsym(copy, "cuMemAlloc_v2");
        Alloc v = (Alloc)dlvsym(copy, "cuMemAlloc_v2", "GLIBC_2.2.5");
        printf("copy-dlvsym %s\n", file_of((void *)v));
        /* The copy's own non-wrapped entry points are the primary's: one driver, one state. */
        printf("copy-cuInit %s\n", dlsym(copy, "cuInit") == (void *)cuInit ? "primary" : "own");
        init_via(copy);
        memFree = dlsym(copy, "cuMemFree_v2");
    } else if (strcmp(mode, "deepbind") == 0) {
        void *deep = dlopen(getenv("DEEP"), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
        CHECK(deep != NULL, "dlopen deep: %s", dlerror());
        Alloc (*which)(void) = dlsym(deep, "deep_which");
        deep_alloc = dlsym(deep, "deep_alloc");
        CHECK(which && deep_alloc, "deep symbols");
        alloc = which();
    } else if (strcmp(mode, "deepbind-plain") == 0) {
        void *deep = dlopen(getenv("DEEP_PLAIN"), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
        CHECK(deep != NULL, "dlopen deep plain: %s", dlerror());
        int (*probe)(void) = dlsym(deep, "deep_probe");
        CHECK(probe != NULL, "deep_probe");
        printf("deep-bound %s\n", probe() == 1 ? "yes" : "no");
        return 0;
    } else if (strcmp(mode, "dlmopen") == 0) {
        void *ns = dlmopen(LM_ID_NEWLM, "libcuda.so.1", RTLD_NOW);
        if (ns == NULL) {
            printf("dlmopen refused\n");
            return 0;
        }
        init_via(ns);
        alloc = (Alloc)dlsym(ns, "cuMemAlloc_v2");
        memFree = dlsym(ns, "cuMemFree_v2");
    } else {
        CHECK(0, "unknown mode %s", mode);
    }
    printf("which %s\n", file_of((void *)alloc));
    if (alloc == NULL) return 0;
    if (deep_alloc) alloc = deep_alloc;

    CUdeviceptr p[256];
    int n = 0;
    CUresult r;
    while (n < 256 && (r = alloc(&p[n], 256 << 20)) == 0) n++;
    CHECK(r == 2, "stopped with %d", r);
    printf("total %llu\n", (unsigned long long)n << 28);
    while (n > 0) OK(memFree(p[--n]));
    return 0;
}
