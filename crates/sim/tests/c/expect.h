/* The checks the chapter clients (context.c, modules.c, peer.c, pointers.c, tensor_map.c) share:
 * EXPECT(call, want) compares a CUresult with the code the documentation gives, CHECK(cond) a
 * condition; each failure prints one FAIL line with its source line and counts in `failures`,
 * so a client reports every deviation, then exits non-zero. */
#ifndef CUVISOR_SIM_TEST_EXPECT_H
#define CUVISOR_SIM_TEST_EXPECT_H
#include <stdio.h>

static int failures;
#define EXPECT(call, want)                                                                  \
    do {                                                                                    \
        CUresult r_ = (call);                                                               \
        if (r_ != (want)) {                                                                 \
            printf("FAIL line %d: %s = %d, want %d\n", __LINE__, #call, r_, (int)(want));   \
            failures++;                                                                     \
        }                                                                                   \
    } while (0)
#define CHECK(cond)                                                                         \
    do {                                                                                    \
        if (!(cond)) {                                                                      \
            printf("FAIL line %d: %s\n", __LINE__, #cond);                                  \
            failures++;                                                                     \
        }                                                                                   \
    } while (0)

#endif
