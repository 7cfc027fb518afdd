/* A library that defines a cu* name of its own (as cuDNN- or cuBLAS-like libraries may):
 * its cuMemAlloc_v2 has nothing to do with the driver. */
#include <stddef.h>

int cuMemAlloc_v2(unsigned long long *p, size_t n) {
    (void)p;
    (void)n;
    return 12345;
}

int cudnnCreate(void **handle) {
    *handle = (void *)0x1;
    return 0;
}
