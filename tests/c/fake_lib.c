/* dlopens the fake cuDNN (path in $FAKE) and the driver; lookups on the fake's handle must give
 * the fake's own functions, lookups on the driver's handle cuvisor's wrappers. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(cond, ...) do { if (!(cond)) { fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); fprintf(stderr, __VA_ARGS__); fprintf(stderr, "\n"); exit(1); } } while (0)

static const char *file_of(void *p) {
    Dl_info info;
    return dladdr(p, &info) && info.dli_fname ? info.dli_fname : "?";
}

int main(void) {
    const char *path = getenv("FAKE");
    CHECK(path != NULL, "FAKE not set");
    void *fake = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    CHECK(fake != NULL, "dlopen %s: %s", path, dlerror());
    int (*alloc)(unsigned long long *, size_t) = dlsym(fake, "cuMemAlloc_v2");
    int (*create)(void **) = dlsym(fake, "cudnnCreate");
    CHECK(alloc && create, "fake symbols");
    CHECK(strcmp(file_of((void *)alloc), path) == 0, "cuMemAlloc_v2 on the fake's handle is in %s", file_of((void *)alloc));
    unsigned long long p = 0;
    printf("fake cuMemAlloc_v2 returned %d\n", alloc(&p, 1 << 20));
    void *h = NULL;
    printf("cudnnCreate returned %d\n", create(&h));

    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    CHECK(cuda != NULL, "dlopen libcuda: %s", dlerror());
    void *real = dlsym(cuda, "cuMemAlloc_v2");
    CHECK(real != NULL && real != (void *)alloc, "libcuda's cuMemAlloc_v2");
    if (strstr(file_of(real), "libcuvisor")) printf("libcuda cuMemAlloc_v2 is libcuvisor's\n");
    return 0;
}
