/* Error log management (cuda.h 13.5, CUDA_LOGS) on the simulated driver, which records no
 * messages: a callback registers and unregisters, the iterator is the empty buffer's end, dumps
 * write nothing, and each call refuses what its documentation lists. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* The declarations this client needs, as cuda.h 13.5 has them. */
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef enum { CU_LOG_LEVEL_ERROR = 0, CU_LOG_LEVEL_WARNING = 1 } CUlogLevel;
typedef struct CUlogsCallbackEntry_st *CUlogsCallbackHandle;
typedef void (*CUlogsCallback)(void *data, CUlogLevel logLevel, char *message, size_t length);
typedef unsigned int CUlogIterator;
#define CUDA_CB
#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_INVALID_CONTEXT 201
CUresult cuInit(unsigned int);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
#define cuMemAlloc cuMemAlloc_v2
CUresult cuLogsRegisterCallback(CUlogsCallback, void *, CUlogsCallbackHandle *);
CUresult cuLogsUnregisterCallback(CUlogsCallbackHandle);
CUresult cuLogsCurrent(CUlogIterator *, unsigned int);
CUresult cuLogsDumpToFile(CUlogIterator *, const char *, unsigned int);
CUresult cuLogsDumpToMemory(CUlogIterator *, char *, size_t *, unsigned int);

#include "expect.h"

static int called;
static void CUDA_CB on_log(void *data, CUlogLevel level, char *msg, size_t len) {
    (void)data; (void)level; (void)msg; (void)len;
    called++;
}

int main(void) {
    EXPECT(cuInit(0), CUDA_SUCCESS);
    CUlogsCallbackHandle h = NULL, h2 = NULL;
    EXPECT(cuLogsRegisterCallback(NULL, NULL, &h), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuLogsRegisterCallback(on_log, NULL, &h), CUDA_SUCCESS);
    CHECK(h != NULL);
    EXPECT(cuLogsRegisterCallback(on_log, NULL, NULL), CUDA_SUCCESS); /* the handle is optional */
    EXPECT(cuLogsRegisterCallback(on_log, NULL, &h2), CUDA_SUCCESS);
    CHECK(h2 != NULL && h2 != h);
    CUdeviceptr p;
    EXPECT(cuMemAlloc(&p, 0), CUDA_ERROR_INVALID_CONTEXT); /* an error, no context current */
    CHECK(called == 0); /* the simulator logs nothing */

    CUlogIterator it = 7;
    EXPECT(cuLogsCurrent(&it, 1), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuLogsCurrent(&it, 0), CUDA_SUCCESS);
    CHECK(it == 0);
    char buf[64];
    buf[0] = 'x';
    size_t size = sizeof buf;
    EXPECT(cuLogsDumpToMemory(&it, buf, &size, 0), CUDA_SUCCESS);
    CHECK(size == 0 && buf[0] == 0);
    size = sizeof buf;
    EXPECT(cuLogsDumpToMemory(NULL, buf, &size, 0), CUDA_SUCCESS); /* NULL: all logs */
    CHECK(size == 0);
    size = 0;
    EXPECT(cuLogsDumpToMemory(&it, buf, &size, 0), CUDA_ERROR_INVALID_VALUE);
    size = sizeof buf;
    EXPECT(cuLogsDumpToMemory(&it, buf, &size, 2), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuLogsDumpToFile(&it, NULL, 0), CUDA_ERROR_INVALID_VALUE);
    EXPECT(cuLogsDumpToFile(&it, "/dev/null", 0), CUDA_SUCCESS);

    EXPECT(cuLogsUnregisterCallback(h), CUDA_SUCCESS);
    EXPECT(cuLogsUnregisterCallback(h), CUDA_ERROR_INVALID_VALUE); /* no longer registered */
    EXPECT(cuLogsUnregisterCallback(h2), CUDA_SUCCESS);
    if (failures) return 1;
    printf("OK\n");
    return 0;
}
