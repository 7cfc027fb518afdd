/* Peer context memory access, linked against libcuda (-lcuda): cuDeviceCanAccessPeer and
 * cuCtxEnablePeerAccess / cuCtxDisablePeerAccess with the codes CUDA 13.5's cuda.h documents
 * (already enabled, not enabled, the current context itself, no access path, flags, invalid
 * contexts). Run on "dgx-a100" and "h200" (8 GPUs behind NVSwitch: every pair has a path) and on "pcie-8"
 * (pairs of A10s under PCIe switches, two host bridges: GPU 0 reaches 1..3, not 4..7); the
 * program reads which from CUVISOR_SIM.
 *
 * Prints one line per failed check and "OK" at the end when none failed; exit status 0 then. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef void *CUcontext;

CUresult cuInit(unsigned);
CUresult cuDeviceGetCount(int *);
CUresult cuDeviceCanAccessPeer(int *, int, int);
CUresult cuCtxCreate_v2(CUcontext *, unsigned, int);
CUresult cuCtxDestroy_v2(CUcontext);
CUresult cuCtxPushCurrent_v2(CUcontext);
CUresult cuCtxPopCurrent_v2(CUcontext *);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuCtxEnablePeerAccess(CUcontext, unsigned);
CUresult cuCtxDisablePeerAccess(CUcontext);

#define INVALID_VALUE 1
#define INVALID_DEVICE 101
#define INVALID_CONTEXT 201
#define PEER_ACCESS_UNSUPPORTED 217
#define PEER_ACCESS_ALREADY_ENABLED 704
#define PEER_ACCESS_NOT_ENABLED 705

#include "expect.h"

int main(void) {
    const char *preset = getenv("CUVISOR_SIM");
    int pcie = preset && strcmp(preset, "pcie-8") == 0;
    int n = 0, can = -1;
    CUcontext c[8], c0b, popped;

    EXPECT(cuInit(0), 0);
    EXPECT(cuDeviceGetCount(&n), 0);
    CHECK(n == 8);
    if (n != 8)
        return 1;

    /* ---- cuDeviceCanAccessPeer ---- */
    for (int a = 0; a < 8; a++)
        for (int b = 0; b < 8; b++) {
            /* NVSwitch: every distinct pair. PCIe: the same host bridge (GPUs 0-3, 4-7). */
            int want = a != b && (!pcie || a / 4 == b / 4);
            can = -1;
            EXPECT(cuDeviceCanAccessPeer(&can, a, b), 0);
            if (can != want) {
                printf("FAIL: cuDeviceCanAccessPeer(%d, %d) = %d, want %d\n", a, b, can, want);
                failures++;
            }
        }
    EXPECT(cuDeviceCanAccessPeer(&can, 0, 8), INVALID_DEVICE);
    EXPECT(cuDeviceCanAccessPeer(NULL, 0, 1), INVALID_VALUE);

    /* One context per device; c[0] current at the end. */
    for (int i = 7; i >= 0; i--) {
        EXPECT(cuCtxCreate_v2(&c[i], 0, i), 0);
        EXPECT(cuCtxPopCurrent_v2(&popped), 0);
    }
    /* No current context. */
    EXPECT(cuCtxEnablePeerAccess(c[1], 0), INVALID_CONTEXT);
    EXPECT(cuCtxDisablePeerAccess(c[1]), INVALID_CONTEXT);
    EXPECT(cuCtxSetCurrent(c[0]), 0);

    /* ---- enable / disable, from c[0] to c[1] ---- */
    EXPECT(cuCtxEnablePeerAccess(c[0], 0), INVALID_CONTEXT);      /* the current context itself */
    EXPECT(cuCtxEnablePeerAccess(NULL, 0), INVALID_CONTEXT);
    EXPECT(cuCtxEnablePeerAccess((CUcontext)0x1234, 0), INVALID_CONTEXT);
    EXPECT(cuCtxEnablePeerAccess(c[1], 1), INVALID_VALUE);        /* flags must be 0 */
    EXPECT(cuCtxDisablePeerAccess(c[1]), PEER_ACCESS_NOT_ENABLED);
    EXPECT(cuCtxEnablePeerAccess(c[1], 0), 0);
    EXPECT(cuCtxEnablePeerAccess(c[1], 0), PEER_ACCESS_ALREADY_ENABLED);
    /* Unidirectional: c[1] has not mapped c[0]. */
    EXPECT(cuCtxPushCurrent_v2(c[1]), 0);
    EXPECT(cuCtxDisablePeerAccess(c[0]), PEER_ACCESS_NOT_ENABLED);
    EXPECT(cuCtxEnablePeerAccess(c[0], 0), 0);
    EXPECT(cuCtxDisablePeerAccess(c[0]), 0);
    EXPECT(cuCtxPopCurrent_v2(&popped), 0);
    EXPECT(cuCtxDisablePeerAccess(c[1]), 0);
    EXPECT(cuCtxDisablePeerAccess(c[1]), PEER_ACCESS_NOT_ENABLED);
    EXPECT(cuCtxDisablePeerAccess(NULL), INVALID_CONTEXT);

    /* ---- every other device, as cuDeviceCanAccessPeer says ---- */
    for (int b = 1; b < 8; b++) {
        int want = (!pcie || b < 4) ? 0 : PEER_ACCESS_UNSUPPORTED;
        CUresult r = cuCtxEnablePeerAccess(c[b], 0);
        if (r != want) {
            printf("FAIL: cuCtxEnablePeerAccess(ctx of GPU %d) = %d, want %d\n", b, r, want);
            failures++;
        }
        EXPECT(cuCtxDisablePeerAccess(c[b]), want == 0 ? 0 : PEER_ACCESS_NOT_ENABLED);
    }
    /* Two contexts of one device: cuDeviceCanAccessPeer answers 0 for a device and itself. */
    EXPECT(cuCtxCreate_v2(&c0b, 0, 0), 0);
    EXPECT(cuCtxPopCurrent_v2(&popped), 0);
    EXPECT(cuCtxEnablePeerAccess(c0b, 0), PEER_ACCESS_UNSUPPORTED);
    EXPECT(cuCtxDestroy_v2(c0b), 0);

    /* ---- a destroyed peer, and a new context where it was ---- */
    EXPECT(cuCtxEnablePeerAccess(c[2], 0), 0);
    EXPECT(cuCtxDestroy_v2(c[2]), 0);
    EXPECT(cuCtxEnablePeerAccess(c[2], 0), INVALID_CONTEXT);
    EXPECT(cuCtxDisablePeerAccess(c[2]), INVALID_CONTEXT);
    EXPECT(cuCtxCreate_v2(&c[2], 0, 2), 0);
    EXPECT(cuCtxPopCurrent_v2(&popped), 0);
    EXPECT(cuCtxDisablePeerAccess(c[2]), PEER_ACCESS_NOT_ENABLED);  /* nothing inherited */

    for (int i = 0; i < 8; i++)
        EXPECT(cuCtxDestroy_v2(c[i]), 0);
    if (failures == 0)
        printf("OK\n");
    return failures != 0;
}
