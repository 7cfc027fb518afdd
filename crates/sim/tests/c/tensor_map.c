/* The tensor-map chapter of the driver API (CUDA 12.0+), linked against libcuda (-lcuda):
 * cuTensorMapEncodeTiled / EncodeIm2col / EncodeIm2colWide accept what CUDA 13.5's cuda.h allows
 * and answer CUDA_ERROR_INVALID_VALUE (1) for each documented constraint broken, one at a time,
 * from a valid call; cuTensorMapReplaceAddress and cuTensorMapSetAllocationClass act on what the
 * encoders wrote and refuse what they did not write.
 *
 * Prints one line per failed check and "OK" at the end when none failed; exit status 0 then. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext;
typedef struct { _Alignas(128) uint64_t opaque[16]; } CUtensorMap;

CUresult cuInit(unsigned);
CUresult cuCtxCreate_v2(CUcontext *, unsigned, int);
CUresult cuCtxDestroy_v2(CUcontext);
CUresult cuCtxPopCurrent_v2(CUcontext *);
CUresult cuCtxPushCurrent_v2(CUcontext);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuTensorMapEncodeTiled(CUtensorMap *, int, unsigned, void *, const uint64_t *, const uint64_t *,
                                const unsigned *, const unsigned *, int, int, int, int);
CUresult cuTensorMapEncodeIm2col(CUtensorMap *, int, unsigned, void *, const uint64_t *, const uint64_t *,
                                 const int *, const int *, unsigned, unsigned, const unsigned *, int, int, int, int);
CUresult cuTensorMapEncodeIm2colWide(CUtensorMap *, int, unsigned, void *, const uint64_t *, const uint64_t *,
                                     int, int, unsigned, unsigned, const unsigned *, int, int, int, int, int);
CUresult cuTensorMapReplaceAddress(CUtensorMap *, void *);
CUresult cuTensorMapSetAllocationClass(CUtensorMap *, int, int *);

enum { U8 = 0, U16, U32, I32, U64, I64, F16, F32, F64, BF16, F32_FTZ, TF32, TF32_FTZ, U4_8B, U4_16B, U6_16B };
enum { IL_NONE = 0, IL_16B, IL_32B };
enum { SW_NONE = 0, SW_32B, SW_64B, SW_128B, SW_128B_A32, SW_128B_A32_F8, SW_128B_A64 };
enum { OOB_NONE = 0, OOB_NAN };
enum { CLASS_AUTO = 0, CLASS_SMALL, CLASS_LARGE };
#define INVALID_VALUE 1
#define INVALID_CONTEXT 201

#include "expect.h"

static CUtensorMap map;
static void *base;

/* A valid 2-D tiled encoding: 64 x 32 fp16 tiles of a 1024 x 512 matrix (rows of 2048 bytes). */
static uint64_t dims[5], strides[4];
static unsigned box[5], es[5];
static int dt, il, sw, l2, oob;
static unsigned rank;
static void tiled_defaults(void) {
    rank = 2; dt = F16; il = IL_NONE; sw = SW_128B; l2 = 2; oob = OOB_NONE;
    for (int i = 0; i < 5; i++) { dims[i] = 64; box[i] = 8; es[i] = 1; }
    for (int i = 0; i < 4; i++) strides[i] = 4096;
    dims[0] = 1024; dims[1] = 512; strides[0] = 2048; box[0] = 64; box[1] = 32;
}
static CUresult tiled(void) {
    return cuTensorMapEncodeTiled(&map, dt, rank, base, dims, strides, box, es, il, sw, l2, oob);
}
#define TILED(stmt, want)              \
    do {                               \
        tiled_defaults();              \
        stmt;                          \
        EXPECT(tiled(), want);         \
    } while (0)

/* A valid im2col encoding: NHWC fp16, 8 x 32 x 32 x 64, corners -1/+1 in H and W. */
static int lo[3], hi[3];
static unsigned cpp, ppc;
static void im2col_defaults(void) {
    rank = 4; dt = F16; il = IL_NONE; sw = SW_128B; l2 = 0; oob = OOB_NONE; cpp = 64; ppc = 256;
    for (int i = 0; i < 5; i++) { es[i] = 1; }
    dims[0] = 64; dims[1] = 32; dims[2] = 32; dims[3] = 8; dims[4] = 4;
    strides[0] = 128; strides[1] = 128 * 32; strides[2] = 128 * 32 * 32; strides[3] = 128 * 32 * 32 * 8;
    lo[0] = -1; lo[1] = -1; lo[2] = 0; hi[0] = 1; hi[1] = 1; hi[2] = 0;
}
static CUresult im2col(void) {
    return cuTensorMapEncodeIm2col(&map, dt, rank, base, dims, strides, lo, hi, cpp, ppc, es, il, sw, l2, oob);
}
#define IM2COL(stmt, want)             \
    do {                               \
        im2col_defaults();             \
        stmt;                          \
        EXPECT(im2col(), want);        \
    } while (0)

static int wlo, whi, mode;
static CUresult wide(void) {
    return cuTensorMapEncodeIm2colWide(&map, dt, rank, base, dims, strides, wlo, whi, cpp, ppc, es, il, mode, sw, l2, oob);
}
#define WIDE(stmt, want)                           \
    do {                                           \
        im2col_defaults();                         \
        wlo = -1; whi = 1; mode = 0; sw = SW_128B; \
        stmt;                                      \
        EXPECT(wide(), want);                      \
    } while (0)

int main(void) {
    CUcontext ctx, popped;
    CUdeviceptr d;
    EXPECT(cuInit(0), 0);
    EXPECT(cuCtxCreate_v2(&ctx, 0, 0), 0);
    EXPECT(cuMemAlloc_v2(&d, 64 << 20), 0);
    base = (void *)(uintptr_t)d;

    /* ---- tiled ---- */
    TILED((void)0, 0);
    /* The map is the simulator's own encoding; it is written, and re-encoding the same
     * parameters writes the same bytes. */
    {
        CUtensorMap first;
        tiled_defaults();
        memset(&map, 0, sizeof map);
        EXPECT(tiled(), 0);
        first = map;
        CHECK(memcmp(&first, &(CUtensorMap){{0}}, sizeof first) != 0);
        EXPECT(tiled(), 0);
        CHECK(memcmp(&first, &map, sizeof map) == 0);
        /* A different box encodes differently. */
        box[1] = 16;
        EXPECT(tiled(), 0);
        CHECK(memcmp(&first, &map, sizeof map) != 0);
    }
    /* The map itself must be 64-byte aligned. */
    tiled_defaults();
    EXPECT(cuTensorMapEncodeTiled((CUtensorMap *)((char *)&map + 32), dt, rank, base, dims, strides, box, es, il, sw, l2, oob), INVALID_VALUE);
    EXPECT(cuTensorMapEncodeTiled(NULL, dt, rank, base, dims, strides, box, es, il, sw, l2, oob), INVALID_VALUE);
    /* Enums out of range. */
    TILED(dt = 16, INVALID_VALUE);
    TILED(il = 3, INVALID_VALUE);
    TILED(sw = 7, INVALID_VALUE);
    TILED(l2 = 4, INVALID_VALUE);
    TILED(oob = 2, INVALID_VALUE);
    /* Rank: 1..5, and >= 3 with an interleave. */
    TILED(rank = 0, INVALID_VALUE);
    TILED(rank = 6, INVALID_VALUE);
    TILED((rank = 1, box[0] = 64), 0);
    TILED((rank = 5), 0);
    TILED((il = IL_16B, sw = SW_NONE), INVALID_VALUE);
    TILED((rank = 3, il = IL_16B, sw = SW_NONE), 0);
    /* globalAddress: 16-byte aligned; 32 with INTERLEAVE_32B. */
    TILED(base = (char *)base + 16, 0);
    base = (void *)(uintptr_t)d;
    TILED(base = (char *)base + 8, INVALID_VALUE);
    base = (void *)(uintptr_t)d;
    TILED((rank = 3, il = IL_32B, sw = SW_32B, box[0] = 16, strides[0] = 2048, strides[1] = 4096, base = (char *)base + 16), INVALID_VALUE);
    base = (void *)(uintptr_t)d;
    TILED((rank = 3, il = IL_32B, sw = SW_32B, box[0] = 16), 0);
    /* globalDim: 1..2^31. */
    TILED(dims[1] = 0, INVALID_VALUE);
    TILED(dims[1] = (1ull << 31), 0);
    TILED(dims[1] = (1ull << 31) + 1, INVALID_VALUE);
    /* globalStrides: multiples of 16 below 2^40; multiples of 32 with INTERLEAVE_32B. */
    TILED(strides[0] = 2056, INVALID_VALUE);
    TILED(strides[0] = 1ull << 40, INVALID_VALUE);
    TILED(strides[0] = (1ull << 40) - 16, 0);
    TILED((rank = 3, il = IL_32B, sw = SW_32B, box[0] = 16, strides[0] = 2064), INVALID_VALUE);
    /* boxDim: 1..256, and the inner box a multiple of 16 bytes without interleave. */
    TILED(box[1] = 0, INVALID_VALUE);
    TILED(box[1] = 257, INVALID_VALUE);
    TILED((sw = SW_NONE, box[1] = 256), 0);
    TILED((sw = SW_NONE, box[0] = 4), INVALID_VALUE);   /* 8 bytes */
    TILED((sw = SW_NONE, box[0] = 8), 0);               /* 16 bytes */
    TILED((sw = SW_NONE, box[0] = 256), 0);             /* 512 bytes, no swizzle span */
    /* elementStrides: 1..8. */
    TILED(es[1] = 0, INVALID_VALUE);
    TILED(es[1] = 9, INVALID_VALUE);
    TILED(es[1] = 8, 0);
    /* Swizzle spans bound the inner box: 32B <= 32, 64B <= 64, 128B* <= 128 bytes. */
    TILED((sw = SW_32B, box[0] = 16), 0);
    TILED((sw = SW_32B, box[0] = 24), INVALID_VALUE);
    TILED((sw = SW_64B, box[0] = 32), 0);
    TILED((sw = SW_64B, box[0] = 40), INVALID_VALUE);
    TILED((sw = SW_128B, box[0] = 72), INVALID_VALUE);
    TILED((sw = SW_128B_A64, box[0] = 64), 0);
    TILED((sw = SW_128B_A32_F8, box[0] = 72), INVALID_VALUE);
    /* INTERLEAVE_32B needs SWIZZLE_32B. */
    TILED((rank = 3, il = IL_32B, sw = SW_64B, box[0] = 16), INVALID_VALUE);
    /* With an interleave the inner box need not be a multiple of 16 bytes nor fit the span. */
    TILED((rank = 3, il = IL_16B, sw = SW_32B, box[0] = 4), 0);
    /* The float-only OOB fill. */
    TILED(oob = OOB_NAN, 0);
    TILED((oob = OOB_NAN, dt = I32, box[0] = 32), INVALID_VALUE);
    TILED((oob = OOB_NAN, dt = BF16), 0);
    /* Packed types. 16U4_ALIGN8B: globalDim[0] even. */
    TILED((dt = U4_8B, sw = SW_NONE, box[0] = 32), 0);
    TILED((dt = U4_8B, sw = SW_NONE, box[0] = 32, dims[0] = 1023), INVALID_VALUE);
    TILED((dt = U4_8B, sw = SW_NONE, box[0] = 32, oob = OOB_NAN), INVALID_VALUE);
    /* 16-byte packed types: address and strides 32-aligned, globalDim[0] % 128, boxDim[0] 128,
     * their own swizzles, 16U6 without interleave. */
    TILED((dt = U4_16B, box[0] = 128), 0);
    TILED((dt = U4_16B, box[0] = 64), INVALID_VALUE);
    TILED((dt = U4_16B, box[0] = 128, dims[0] = 1000), INVALID_VALUE);
    TILED((dt = U4_16B, box[0] = 128, strides[0] = 2064), INVALID_VALUE);
    TILED((dt = U4_16B, box[0] = 128, base = (char *)base + 16), INVALID_VALUE);
    base = (void *)(uintptr_t)d;
    TILED((dt = U4_16B, box[0] = 128, sw = SW_128B_A64), INVALID_VALUE);
    TILED((dt = U6_16B, box[0] = 128, sw = SW_128B_A64), 0);
    TILED((dt = U6_16B, box[0] = 128, sw = SW_64B), INVALID_VALUE);
    TILED((dt = U6_16B, box[0] = 128, sw = SW_NONE, rank = 3, il = IL_16B), INVALID_VALUE);
    TILED((dt = U4_16B, box[0] = 128, sw = SW_NONE, rank = 3, il = IL_16B), 0);

    /* ---- im2col ---- */
    IM2COL((void)0, 0);
    IM2COL(rank = 2, INVALID_VALUE);
    IM2COL(rank = 6, INVALID_VALUE);
    IM2COL((rank = 3, lo[0] = -32768, hi[0] = 32767), 0);
    IM2COL((rank = 3, lo[0] = -32769), INVALID_VALUE);
    IM2COL((lo[0] = -128, hi[1] = 127), 0);
    IM2COL(lo[0] = -129, INVALID_VALUE);
    IM2COL(hi[1] = 128, INVALID_VALUE);
    IM2COL((rank = 5, lo[0] = -16, lo[2] = 15, hi[1] = 15), 0);
    IM2COL((rank = 5, lo[2] = 16), INVALID_VALUE);
    /* Zero area: W (globalDim[1] = 32) shrunk by 32. */
    IM2COL((lo[1] = 0, hi[1] = -32), INVALID_VALUE);
    IM2COL((lo[1] = 0, hi[1] = -31), 0);
    IM2COL(cpp = 0, INVALID_VALUE);
    IM2COL((sw = SW_NONE, cpp = 256), 0);
    IM2COL((sw = SW_NONE, cpp = 257), INVALID_VALUE);
    IM2COL(ppc = 1024, 0);
    IM2COL(ppc = 1025, INVALID_VALUE);
    IM2COL((sw = SW_64B, cpp = 32), 0);
    IM2COL((sw = SW_64B, cpp = 33), INVALID_VALUE);
    IM2COL(strides[1] = 100, INVALID_VALUE);
    IM2COL(es[2] = 9, INVALID_VALUE);
    IM2COL((dt = U6_16B, cpp = 64, dims[0] = 128, strides[0] = 256), INVALID_VALUE);  /* cpp must be 128 */
    IM2COL((dt = U6_16B, cpp = 128, dims[0] = 128, strides[0] = 256, strides[1] = 256 * 32, strides[2] = 256 * 32 * 32), 0);

    /* ---- im2col wide ---- */
    WIDE((void)0, 0);
    WIDE(sw = SW_NONE, INVALID_VALUE);
    WIDE(sw = SW_32B, INVALID_VALUE);
    WIDE(sw = SW_128B_A64, INVALID_VALUE);
    WIDE((sw = SW_64B, cpp = 32), 0);
    WIDE(sw = SW_128B_A32, 0);
    WIDE(mode = 2, INVALID_VALUE);
    WIDE(ppc = 1025, INVALID_VALUE);
    WIDE((mode = 1, ppc = 5000), 0);   /* pixelsPerColumn is ignored in W128 mode */
    WIDE(wlo = -32769, INVALID_VALUE);
    WIDE((wlo = 0, whi = -32), INVALID_VALUE);
    WIDE(rank = 2, INVALID_VALUE);
    WIDE((dt = U4_16B, cpp = 128, dims[0] = 128, strides[0] = 256, strides[1] = 256 * 32, strides[2] = 256 * 32 * 32, sw = SW_64B), INVALID_VALUE);
    WIDE((dt = U4_16B, cpp = 128, dims[0] = 128, strides[0] = 256, strides[1] = 256 * 32, strides[2] = 256 * 32 * 32, sw = SW_128B), 0);

    /* ---- replace address ---- */
    tiled_defaults();
    EXPECT(tiled(), 0);
    {
        CUtensorMap before = map;
        EXPECT(cuTensorMapReplaceAddress(&map, (char *)base + 4096), 0);
        CHECK(memcmp(&before, &map, sizeof map) != 0);
        EXPECT(cuTensorMapReplaceAddress(&map, base), 0);
        CHECK(memcmp(&before, &map, sizeof map) == 0);
        /* 16-byte alignment stays required; a failed replace leaves the map alone. */
        EXPECT(cuTensorMapReplaceAddress(&map, (char *)base + 8), INVALID_VALUE);
        CHECK(memcmp(&before, &map, sizeof map) == 0);
    }
    /* A map encoded with a 32-byte rule keeps it. */
    TILED((rank = 3, il = IL_32B, sw = SW_32B, box[0] = 16), 0);
    EXPECT(cuTensorMapReplaceAddress(&map, (char *)base + 16), INVALID_VALUE);
    EXPECT(cuTensorMapReplaceAddress(&map, (char *)base + 64), 0);
    /* What no encoder wrote is refused. */
    {
        static CUtensorMap junk;
        memset(&junk, 0x5a, sizeof junk);
        EXPECT(cuTensorMapReplaceAddress(&junk, base), INVALID_VALUE);
        EXPECT(cuTensorMapReplaceAddress(NULL, base), INVALID_VALUE);
    }

    /* ---- allocation class: out is SMALL before validation and stays SMALL; the simulated GPUs
     * are ones where the class has no effect. ---- */
    {
        int out = -1;
        tiled_defaults();
        EXPECT(tiled(), 0);
        CUtensorMap before = map;
        EXPECT(cuTensorMapSetAllocationClass(&map, CLASS_LARGE, &out), 0);
        CHECK(out == CLASS_SMALL);
        CHECK(memcmp(&before, &map, sizeof map) == 0);
        out = -1;
        EXPECT(cuTensorMapSetAllocationClass(&map, CLASS_AUTO, &out), 0);
        CHECK(out == CLASS_SMALL);
        EXPECT(cuTensorMapSetAllocationClass(&map, CLASS_SMALL, NULL), 0);
        out = -1;
        EXPECT(cuTensorMapSetAllocationClass(&map, 3, &out), INVALID_VALUE);
        CHECK(out == CLASS_SMALL);
        static CUtensorMap junk;
        out = -1;
        EXPECT(cuTensorMapSetAllocationClass(&junk, CLASS_SMALL, &out), INVALID_VALUE);
        CHECK(out == CLASS_SMALL);
    }

    /* ---- no current context: CUDA_ERROR_INVALID_CONTEXT ---- */
    EXPECT(cuCtxPopCurrent_v2(&popped), 0);
    tiled_defaults();
    EXPECT(tiled(), INVALID_CONTEXT);
    EXPECT(cuCtxPushCurrent_v2(popped), 0);
    EXPECT(tiled(), 0);

    EXPECT(cuCtxDestroy_v2(ctx), 0);
    if (failures == 0)
        printf("OK\n");
    return failures != 0;
}
