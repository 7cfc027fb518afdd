/* Copies, memsets, arrays, texture and surface objects through the driver API, built against
 * CUDA 13.5's cuda.h and linked with -lcuda (the simulator's). Each section moves bytes and
 * checks every byte against what the copy's parameters say must be where (computed here from
 * the same fill pattern, never written down), then checks the error codes cuda.h documents for
 * misuse. Run on a machine of at least two GPUs (peer copies). Prints "OK <checks>" when every
 * check held; the first failing check prints its line and exits 1. */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int checks;

#define CK(call, want)                                                                   \
    do {                                                                                 \
        CUresult r_ = (call);                                                            \
        checks++;                                                                        \
        if (r_ != (CUresult)(want)) {                                                    \
            printf("FAIL line %d: %s answered %d, want %d\n", __LINE__, #call, (int)r_, \
                   (int)(want));                                                         \
            return 1;                                                                    \
        }                                                                                \
    } while (0)

#define OK(call) CK(call, CUDA_SUCCESS)

#define TRUE(cond)                                                   \
    do {                                                             \
        checks++;                                                    \
        if (!(cond)) {                                               \
            printf("FAIL line %d: %s\n", __LINE__, #cond);           \
            return 1;                                                \
        }                                                            \
    } while (0)

/* CUDA 12.8's batch signature (with failIdx), exported as cuMemcpyBatchAsync_ptsz; cuda.h
 * 13.5 declares it only for the driver's own build. */
CUresult cuMemcpyBatchAsync_ptsz(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
                                 CUmemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs,
                                 size_t *failIdx, CUstream hStream);

static unsigned char pat(size_t i) { return (unsigned char)(i * 131u + 7u); }

static void fill(unsigned char *p, size_t n, size_t seed) {
    for (size_t i = 0; i < n; i++) p[i] = pat(i + seed);
}

static size_t free_now(void) {
    size_t f = 0, t = 0;
    cuMemGetInfo(&f, &t);
    return f;
}

/* A 2D copy host -> pitched device -> host at other pitches and offsets. */
static int two_d(void) {
    const size_t W = 100, H = 10, spitch = 120, hpitch = 200;
    CUdeviceptr d;
    size_t dpitch;
    OK(cuMemAllocPitch(&d, &dpitch, W, H, 4));
    TRUE(dpitch >= W);
    unsigned char *src = malloc(spitch * H), *out = malloc(hpitch * H);
    fill(src, spitch * H, 1);
    memset(out, 0xAB, hpitch * H);
    OK(cuMemsetD8(d, 0, dpitch * H));

    CUDA_MEMCPY2D c;
    memset(&c, 0, sizeof c);
    c.srcMemoryType = CU_MEMORYTYPE_HOST;
    c.srcHost = src;
    c.srcPitch = spitch;
    c.srcXInBytes = 8;
    c.srcY = 1;
    c.dstMemoryType = CU_MEMORYTYPE_DEVICE;
    c.dstDevice = d;
    c.dstPitch = dpitch;
    c.dstXInBytes = 4;
    c.dstY = 2;
    c.WidthInBytes = 90;
    c.Height = 7;
    OK(cuMemcpy2D(&c));

    /* Back to the host at pitch 200, the whole pitched block. */
    CUDA_MEMCPY2D b;
    memset(&b, 0, sizeof b);
    b.srcMemoryType = CU_MEMORYTYPE_UNIFIED;
    b.srcDevice = d;
    b.srcPitch = dpitch;
    b.dstMemoryType = CU_MEMORYTYPE_HOST;
    b.dstHost = out;
    b.dstPitch = hpitch;
    b.WidthInBytes = W;
    b.Height = H;
    OK(cuMemcpy2DUnaligned(&b));
    for (size_t y = 0; y < H; y++)
        for (size_t x = 0; x < W; x++) {
            int in = y >= 2 && y < 9 && x >= 4 && x < 94;
            unsigned char want = in ? src[(y - 2 + 1) * spitch + (x - 4 + 8)] : 0;
            TRUE(out[y * hpitch + x] == want);
        }
    for (size_t y = 0; y < H; y++) TRUE(out[y * hpitch + W] == 0xAB); /* beyond the width */

    /* Asynchronous, on a stream: device -> device inside the allocation. */
    CUstream s;
    OK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CUDA_MEMCPY2D dd;
    memset(&dd, 0, sizeof dd);
    dd.srcMemoryType = CU_MEMORYTYPE_DEVICE;
    dd.srcDevice = d;
    dd.srcPitch = dpitch;
    dd.srcY = 2;
    dd.dstMemoryType = CU_MEMORYTYPE_DEVICE;
    dd.dstDevice = d;
    dd.dstPitch = dpitch;
    dd.WidthInBytes = W;
    dd.Height = 1;
    OK(cuMemcpy2DAsync(&dd, s));
    OK(cuStreamSynchronize(s));
    unsigned char row0[100];
    OK(cuMemcpyDtoH(row0, d, W));
    TRUE(memcmp(row0, out + 2 * hpitch, W) == 0);

    /* Errors (cuMemcpy2D: pitches at least the width plus X; no pitch above
     * CU_DEVICE_ATTRIBUTE_MAX_PITCH; a memory type of the enum; device memory that is). */
    CUDA_MEMCPY2D e = c;
    e.srcPitch = 97; /* < 90 + 8 */
    CK(cuMemcpy2D(&e), CUDA_ERROR_INVALID_VALUE);
    e = c;
    e.dstPitch = 93; /* < 90 + 4 */
    CK(cuMemcpy2D(&e), CUDA_ERROR_INVALID_VALUE);
    int maxpitch = 0;
    OK(cuDeviceGetAttribute(&maxpitch, CU_DEVICE_ATTRIBUTE_MAX_PITCH, 0));
    e = c;
    e.srcPitch = (size_t)2147483647 + 1;
    CK(cuMemcpy2D(&e), CUDA_ERROR_INVALID_VALUE);
    e = c;
    e.srcMemoryType = (CUmemorytype)7;
    CK(cuMemcpy2D(&e), CUDA_ERROR_INVALID_VALUE);
    e = c;
    e.Height = H; /* rows 2 .. 11 of a 10-row allocation */
    e.srcY = 0;
    CK(cuMemcpy2D(&e), CUDA_ERROR_INVALID_VALUE);
    e = c;
    e.srcHost = NULL;
    CK(cuMemcpy2D(&e), CUDA_ERROR_INVALID_VALUE);
    CK(cuMemcpy2D(NULL), CUDA_ERROR_INVALID_VALUE);
    /* A refused copy moved nothing. */
    unsigned char again[100];
    OK(cuMemcpyDtoH(again, d, W));
    TRUE(memcmp(again, row0, W) == 0);

    OK(cuStreamDestroy(s));
    OK(cuMemFree(d));
    free(src);
    free(out);
    return 0;
}

/* 3D sub-boxes between host, pitched device memory and a 3D array. */
static int three_d(void) {
    /* A host volume of 40 bytes x 8 rows x 6 slices. */
    const size_t HP = 40, HH = 8, HD = 6;
    unsigned char *vol = malloc(HP * HH * HD), *back = malloc(HP * HH * HD);
    fill(vol, HP * HH * HD, 3);
    memset(back, 0, HP * HH * HD);
    const size_t DP = 64, DH = 10, DD = 5;
    CUdeviceptr d;
    OK(cuMemAlloc(&d, DP * DH * DD));
    OK(cuMemsetD8(d, 0x11, DP * DH * DD));

    CUDA_MEMCPY3D c;
    memset(&c, 0, sizeof c);
    c.srcMemoryType = CU_MEMORYTYPE_HOST;
    c.srcHost = vol;
    c.srcPitch = HP;
    c.srcHeight = HH;
    c.srcXInBytes = 4;
    c.srcY = 2;
    c.srcZ = 1;
    c.dstMemoryType = CU_MEMORYTYPE_DEVICE;
    c.dstDevice = d;
    c.dstPitch = DP;
    c.dstHeight = DH;
    c.dstXInBytes = 16;
    c.dstY = 5;
    c.dstZ = 2;
    c.WidthInBytes = 24;
    c.Height = 4;
    c.Depth = 3;
    OK(cuMemcpy3D(&c));
    unsigned char *dev = malloc(DP * DH * DD);
    OK(cuMemcpyDtoH(dev, d, DP * DH * DD));
    for (size_t z = 0; z < DD; z++)
        for (size_t y = 0; y < DH; y++)
            for (size_t x = 0; x < DP; x++) {
                int in = z >= 2 && z < 5 && y >= 5 && y < 9 && x >= 16 && x < 40;
                unsigned char want =
                    in ? vol[((z - 2 + 1) * HH + (y - 5 + 2)) * HP + (x - 16 + 4)] : 0x11;
                TRUE(dev[(z * DH + y) * DP + x] == want);
            }

    /* Into a 3D array of float (8 x 6 x 4), at element (1, 2, 1), and the whole array back. */
    CUDA_ARRAY3D_DESCRIPTOR ad = {8, 6, 4, CU_AD_FORMAT_FLOAT, 1, 0};
    CUarray a;
    OK(cuArray3DCreate(&a, &ad));
    CUDA_ARRAY3D_DESCRIPTOR got;
    OK(cuArray3DGetDescriptor(&got, a));
    TRUE(got.Width == 8 && got.Height == 6 && got.Depth == 4 && got.Format == CU_AD_FORMAT_FLOAT &&
         got.NumChannels == 1 && got.Flags == 0);
    unsigned char zero[8 * 4 * 6 * 4];
    memset(zero, 0, sizeof zero);
    CUDA_MEMCPY3D z;
    memset(&z, 0, sizeof z);
    z.srcMemoryType = CU_MEMORYTYPE_HOST;
    z.srcHost = zero;
    z.srcPitch = 32;
    z.srcHeight = 6;
    z.dstMemoryType = CU_MEMORYTYPE_ARRAY;
    z.dstArray = a;
    z.WidthInBytes = 32;
    z.Height = 6;
    z.Depth = 4;
    OK(cuMemcpy3D(&z));
    CUDA_MEMCPY3D h2a = c;
    h2a.dstMemoryType = CU_MEMORYTYPE_ARRAY;
    h2a.dstArray = a;
    h2a.dstDevice = 0;
    h2a.dstXInBytes = 4;
    h2a.dstY = 2;
    h2a.dstZ = 1;
    h2a.WidthInBytes = 20; /* 5 floats */
    h2a.Height = 3;
    h2a.Depth = 2;
    OK(cuMemcpy3D(&h2a));
    unsigned char arr[8 * 4 * 6 * 4];
    CUDA_MEMCPY3D a2h = z;
    a2h.srcMemoryType = CU_MEMORYTYPE_ARRAY;
    a2h.srcArray = a;
    a2h.srcHost = NULL;
    a2h.dstMemoryType = CU_MEMORYTYPE_HOST;
    a2h.dstHost = arr;
    a2h.dstArray = NULL;
    a2h.dstPitch = 32;
    a2h.dstHeight = 6;
    OK(cuMemcpy3D(&a2h));
    for (size_t k = 0; k < 4; k++)
        for (size_t y = 0; y < 6; y++)
            for (size_t x = 0; x < 32; x++) {
                int in = k >= 1 && k < 3 && y >= 2 && y < 5 && x >= 4 && x < 24;
                unsigned char want =
                    in ? vol[((k - 1 + 1) * HH + (y - 2 + 2)) * HP + (x - 4 + 4)] : 0;
                TRUE(arr[(k * 6 + y) * 32 + x] == want);
            }

    /* Array to array (a second one of the same shape), then array to device. */
    CUarray a2;
    OK(cuArray3DCreate(&a2, &ad));
    CUDA_MEMCPY3D aa;
    memset(&aa, 0, sizeof aa);
    aa.srcMemoryType = CU_MEMORYTYPE_ARRAY;
    aa.srcArray = a;
    aa.dstMemoryType = CU_MEMORYTYPE_ARRAY;
    aa.dstArray = a2;
    aa.WidthInBytes = 32;
    aa.Height = 6;
    aa.Depth = 4;
    OK(cuMemcpy3D(&aa));
    CUdeviceptr flat;
    OK(cuMemAlloc(&flat, sizeof arr));
    CUDA_MEMCPY3D a2d = aa;
    a2d.srcArray = a2;
    a2d.dstMemoryType = CU_MEMORYTYPE_DEVICE;
    a2d.dstArray = NULL;
    a2d.dstDevice = flat;
    a2d.dstPitch = 32;
    a2d.dstHeight = 6;
    OK(cuMemcpy3D(&a2d));
    unsigned char arr2[sizeof arr];
    OK(cuMemcpyDtoH(arr2, flat, sizeof arr2));
    TRUE(memcmp(arr, arr2, sizeof arr) == 0);

    /* Errors: LOD must be 0, reserved NULL, slice heights cover Height + Y, array X in whole
     * elements, array boxes inside the array. */
    CUDA_MEMCPY3D e = c;
    e.srcLOD = 1;
    CK(cuMemcpy3D(&e), CUDA_ERROR_INVALID_VALUE);
    e = c;
    e.reserved0 = &e;
    CK(cuMemcpy3D(&e), CUDA_ERROR_INVALID_VALUE);
    e = c;
    e.srcHeight = 5; /* < 4 + 2 */
    CK(cuMemcpy3D(&e), CUDA_ERROR_INVALID_VALUE);
    e = h2a;
    e.dstXInBytes = 2;
    CK(cuMemcpy3D(&e), CUDA_ERROR_INVALID_VALUE);
    e = h2a;
    e.dstZ = 3; /* slices 3 .. 4 of 4 */
    CK(cuMemcpy3D(&e), CUDA_ERROR_INVALID_VALUE);
    e = h2a;
    e.dstArray = (CUarray)(size_t)0x1234;
    CK(cuMemcpy3D(&e), CUDA_ERROR_INVALID_VALUE);

    OK(cuArrayDestroy(a));
    OK(cuArrayDestroy(a2));
    OK(cuMemFree(d));
    OK(cuMemFree(flat));
    free(vol);
    free(back);
    free(dev);
    return 0;
}

/* 1D array round trips: host -> array -> device -> array -> array -> host. */
static int one_d(void) {
    CUDA_ARRAY_DESCRIPTOR ad = {256, 0, CU_AD_FORMAT_UNSIGNED_INT8, 4};
    CUarray a, b;
    OK(cuArrayCreate(&a, &ad));
    OK(cuArrayCreate(&b, &ad));
    CUDA_ARRAY_DESCRIPTOR got;
    OK(cuArrayGetDescriptor(&got, a));
    TRUE(got.Width == 256 && got.Height == 0 && got.Format == CU_AD_FORMAT_UNSIGNED_INT8 &&
         got.NumChannels == 4);
    unsigned char src[1024], out[1024];
    fill(src, sizeof src, 5);
    OK(cuMemcpyHtoA(a, 0, src, 1024));
    CUdeviceptr d;
    OK(cuMemAlloc(&d, 1024));
    OK(cuMemcpyAtoD(d, a, 16, 512));
    OK(cuMemcpyDtoA(b, 64, d, 512));
    OK(cuMemcpyAtoA(a, 0, b, 64, 256)); /* a[0..256) = src[16..272) */
    OK(cuMemcpyAtoH(out, a, 0, 1024));
    for (size_t i = 0; i < 1024; i++) TRUE(out[i] == (i < 256 ? src[i + 16] : src[i]));
    CUstream s;
    OK(cuStreamCreate(&s, 0));
    OK(cuMemcpyHtoAAsync(b, 0, src, 1024, s));
    memset(out, 0, sizeof out);
    OK(cuMemcpyAtoHAsync(out, b, 0, 1024, s));
    OK(cuStreamSynchronize(s));
    TRUE(memcmp(out, src, 1024) == 0);
    /* Beyond the array, and an AtoA count that is no whole number of elements. */
    CK(cuMemcpyHtoA(a, 1000, src, 100), CUDA_ERROR_INVALID_VALUE);
    CK(cuMemcpyAtoH(out, a, 1, 1024), CUDA_ERROR_INVALID_VALUE);
    CK(cuMemcpyAtoA(a, 0, b, 0, 6), CUDA_ERROR_INVALID_VALUE);
    CK(cuMemcpyHtoA((CUarray)(size_t)0x40, 0, src, 4), CUDA_ERROR_INVALID_VALUE);
    /* Sparse properties and memory requirements belong to sparse and deferred arrays. */
    CUDA_ARRAY_SPARSE_PROPERTIES sp;
    CK(cuArrayGetSparseProperties(&sp, a), CUDA_ERROR_INVALID_VALUE);
    CUDA_ARRAY_MEMORY_REQUIREMENTS mr;
    CK(cuArrayGetMemoryRequirements(&mr, a, 0), CUDA_ERROR_INVALID_VALUE);
    OK(cuStreamDestroy(s));
    OK(cuMemFree(d));
    OK(cuArrayDestroy(a));
    OK(cuArrayDestroy(b));
    CK(cuArrayGetDescriptor(&got, a), CUDA_ERROR_INVALID_HANDLE);
    return 0;
}

/* Mipmap levels and planes are arrays of their own extents, copied like any array. */
static int levels_and_planes(void) {
    CUDA_ARRAY3D_DESCRIPTOR md = {64, 32, 0, CU_AD_FORMAT_FLOAT, 1, 0};
    CUmipmappedArray m;
    OK(cuMipmappedArrayCreate(&m, &md, 4));
    CUarray l2, l2again;
    OK(cuMipmappedArrayGetLevel(&l2, m, 2));
    OK(cuMipmappedArrayGetLevel(&l2again, m, 2));
    TRUE(l2 == l2again);
    CUDA_ARRAY3D_DESCRIPTOR got;
    OK(cuArray3DGetDescriptor(&got, l2));
    TRUE(got.Width == 16 && got.Height == 8 && got.Depth == 0 && got.Format == CU_AD_FORMAT_FLOAT);
    CUarray bad;
    CK(cuMipmappedArrayGetLevel(&bad, m, 4), CUDA_ERROR_INVALID_VALUE);
    float img[16 * 8], back[16 * 8];
    for (int i = 0; i < 16 * 8; i++) img[i] = (float)i * 0.5f;
    CUDA_MEMCPY2D c;
    memset(&c, 0, sizeof c);
    c.srcMemoryType = CU_MEMORYTYPE_HOST;
    c.srcHost = img;
    c.srcPitch = 64;
    c.dstMemoryType = CU_MEMORYTYPE_ARRAY;
    c.dstArray = l2;
    c.WidthInBytes = 64;
    c.Height = 8;
    OK(cuMemcpy2D(&c));
    CUDA_MEMCPY2D r;
    memset(&r, 0, sizeof r);
    r.srcMemoryType = CU_MEMORYTYPE_ARRAY;
    r.srcArray = l2;
    r.dstMemoryType = CU_MEMORYTYPE_HOST;
    r.dstHost = back;
    r.dstPitch = 64;
    r.WidthInBytes = 64;
    r.Height = 8;
    OK(cuMemcpy2D(&r));
    TRUE(memcmp(img, back, sizeof img) == 0);
    /* Level 3 does not see level 2's bytes. */
    CUarray l3;
    OK(cuMipmappedArrayGetLevel(&l3, m, 3));
    OK(cuArray3DGetDescriptor(&got, l3));
    TRUE(got.Width == 8 && got.Height == 4);
    c.WidthInBytes = 32;
    c.Height = 5; /* 4 rows only */
    c.dstArray = l3;
    CK(cuMemcpy2D(&c), CUDA_ERROR_INVALID_VALUE);
    OK(cuMipmappedArrayDestroy(m));
    CK(cuArray3DGetDescriptor(&got, l2), CUDA_ERROR_INVALID_HANDLE);

    /* NV12 (cuArrayGetPlane): plane 0 is W x H of one UINT8 channel, plane 1 W/2 x H/2 of two. */
    CUDA_ARRAY3D_DESCRIPTOR nd = {8, 4, 0, CU_AD_FORMAT_NV12, 3, 0};
    CUarray nv, p0, p1;
    OK(cuArray3DCreate(&nv, &nd));
    OK(cuArrayGetPlane(&p0, nv, 0));
    OK(cuArrayGetPlane(&p1, nv, 1));
    CK(cuArrayGetPlane(&bad, nv, 2), CUDA_ERROR_INVALID_VALUE);
    OK(cuArray3DGetDescriptor(&got, p0));
    TRUE(got.Width == 8 && got.Height == 4 && got.Format == CU_AD_FORMAT_UNSIGNED_INT8 &&
         got.NumChannels == 1);
    OK(cuArray3DGetDescriptor(&got, p1));
    TRUE(got.Width == 4 && got.Height == 2 && got.Format == CU_AD_FORMAT_UNSIGNED_INT8 &&
         got.NumChannels == 2);
    unsigned char y[32], uv[16], y2[32], uv2[16];
    fill(y, 32, 9);
    fill(uv, 16, 11);
    OK(cuMemcpyHtoA(p0, 0, y, 32));
    OK(cuMemcpyHtoA(p1, 0, uv, 16));
    OK(cuMemcpyAtoH(y2, p0, 0, 32));
    OK(cuMemcpyAtoH(uv2, p1, 0, 16));
    TRUE(memcmp(y, y2, 32) == 0 && memcmp(uv, uv2, 16) == 0);
    CUDA_ARRAY_DESCRIPTOR plain = {8, 8, CU_AD_FORMAT_UNSIGNED_INT8, 1};
    CUarray pl;
    OK(cuArrayCreate(&pl, &plain));
    CK(cuArrayGetPlane(&bad, pl, 0), CUDA_ERROR_INVALID_VALUE);
    OK(cuArrayDestroy(pl));
    OK(cuArrayDestroy(nv));
    return 0;
}

/* cuMemsetD2D8/16/32 on pitched memory: the rows' first Width elements, nothing of the pitch. */
static int memsets(void) {
    CUdeviceptr d;
    size_t pitch;
    OK(cuMemAllocPitch(&d, &pitch, 64, 6, 4));
    const unsigned widths[3] = {40, 20, 10}; /* elements: 40, 40 and 40 bytes */
    const unsigned sizes[3] = {1, 2, 4};
    unsigned char *row = malloc(pitch * 6);
    CUstream s;
    OK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    for (int k = 0; k < 6; k++) {
        int e = k % 3, async = k >= 3;
        OK(cuMemsetD8(d, 0xEE, pitch * 6));
        CUresult r;
        if (e == 0)
            r = async ? cuMemsetD2D8Async(d + pitch, pitch, 0x5A, widths[e], 4, s)
                      : cuMemsetD2D8(d + pitch, pitch, 0x5A, widths[e], 4);
        else if (e == 1)
            r = async ? cuMemsetD2D16Async(d + pitch, pitch, 0x5A5A, widths[e], 4, s)
                      : cuMemsetD2D16(d + pitch, pitch, 0x5A5A, widths[e], 4);
        else
            r = async ? cuMemsetD2D32Async(d + pitch, pitch, 0x5A5A5A5A, widths[e], 4, s)
                      : cuMemsetD2D32(d + pitch, pitch, 0x5A5A5A5A, widths[e], 4);
        OK(r);
        OK(cuStreamSynchronize(s));
        OK(cuMemcpyDtoH(row, d, pitch * 6));
        for (size_t y = 0; y < 6; y++)
            for (size_t x = 0; x < pitch; x++) {
                int in = y >= 1 && y < 5 && x < widths[e] * sizes[e];
                TRUE(row[y * pitch + x] == (in ? 0x5A : 0xEE));
            }
    }
    /* A pitch below the row, a misaligned pointer, past the allocation. */
    CK(cuMemsetD2D32(d, 16, 1, 10, 2), CUDA_ERROR_INVALID_VALUE);
    CK(cuMemsetD2D16(d + 1, pitch, 1, 4, 2), CUDA_ERROR_INVALID_VALUE);
    CK(cuMemsetD2D8(d, pitch, 1, 4, 7), CUDA_ERROR_INVALID_VALUE);
    OK(cuStreamDestroy(s));
    OK(cuMemFree(d));
    free(row);
    return 0;
}

static int objects(void) {
    CUdeviceptr d;
    OK(cuMemAlloc(&d, 1 << 16));
    CUDA_RESOURCE_DESC rd;
    memset(&rd, 0, sizeof rd);
    rd.resType = CU_RESOURCE_TYPE_LINEAR;
    rd.res.linear.devPtr = d;
    rd.res.linear.format = CU_AD_FORMAT_FLOAT;
    rd.res.linear.numChannels = 4;
    rd.res.linear.sizeInBytes = 4096;
    CUDA_TEXTURE_DESC td;
    memset(&td, 0, sizeof td);
    td.addressMode[0] = CU_TR_ADDRESS_MODE_CLAMP;
    td.filterMode = CU_TR_FILTER_MODE_POINT;
    td.flags = CU_TRSF_READ_AS_INTEGER;
    td.borderColor[2] = 0.25f;
    CUtexObject t;
    OK(cuTexObjectCreate(&t, &rd, &td, NULL));
    TRUE(t != 0);
    CUDA_RESOURCE_DESC rg;
    CUDA_TEXTURE_DESC tg;
    OK(cuTexObjectGetResourceDesc(&rg, t));
    OK(cuTexObjectGetTextureDesc(&tg, t));
    TRUE(memcmp(&rg, &rd, sizeof rd) == 0 && memcmp(&tg, &td, sizeof td) == 0);

    /* Pitch2D: aligned pointer and pitch, rows inside the allocation. */
    CUDA_RESOURCE_DESC pd;
    memset(&pd, 0, sizeof pd);
    pd.resType = CU_RESOURCE_TYPE_PITCH2D;
    pd.res.pitch2D.devPtr = d;
    pd.res.pitch2D.format = CU_AD_FORMAT_UNSIGNED_INT8;
    pd.res.pitch2D.numChannels = 1;
    pd.res.pitch2D.width = 200;
    pd.res.pitch2D.height = 100;
    pd.res.pitch2D.pitchInBytes = 256;
    CUtexObject t2;
    OK(cuTexObjectCreate(&t2, &pd, &td, NULL));
    CUDA_RESOURCE_DESC e = pd;
    e.res.pitch2D.pitchInBytes = 250; /* not a multiple of the texture pitch alignment */
    CK(cuTexObjectCreate(&t2, &e, &td, NULL), CUDA_ERROR_INVALID_VALUE);
    e = pd;
    e.res.pitch2D.height = 1000; /* 256000 bytes of a 64 KiB allocation */
    CK(cuTexObjectCreate(&t2, &e, &td, NULL), CUDA_ERROR_INVALID_VALUE);

    /* An array with a view; a view of linear memory is refused. */
    CUDA_ARRAY3D_DESCRIPTOR ad = {32, 32, 0, CU_AD_FORMAT_UNSIGNED_INT8, 4, 0};
    CUarray a;
    OK(cuArray3DCreate(&a, &ad));
    CUDA_RESOURCE_DESC ar;
    memset(&ar, 0, sizeof ar);
    ar.resType = CU_RESOURCE_TYPE_ARRAY;
    ar.res.array.hArray = a;
    CUDA_RESOURCE_VIEW_DESC vd;
    memset(&vd, 0, sizeof vd);
    vd.format = CU_RES_VIEW_FORMAT_UINT_4X8;
    vd.width = 32;
    vd.height = 32;
    CUtexObject t3;
    OK(cuTexObjectCreate(&t3, &ar, &td, &vd));
    CUDA_RESOURCE_VIEW_DESC vg;
    OK(cuTexObjectGetResourceViewDesc(&vg, t3));
    TRUE(memcmp(&vg, &vd, sizeof vd) == 0);
    CK(cuTexObjectCreate(&t3, &rd, &td, &vd), CUDA_ERROR_INVALID_VALUE);

    /* Misuse: flags, a misaligned pointer, no array, unknown types, double destroy. */
    e = rd;
    e.flags = 1;
    CK(cuTexObjectCreate(&t3, &e, &td, NULL), CUDA_ERROR_INVALID_VALUE);
    e = rd;
    e.res.linear.devPtr = d + 4;
    CK(cuTexObjectCreate(&t3, &e, &td, NULL), CUDA_ERROR_INVALID_VALUE);
    e = rd;
    e.res.linear.sizeInBytes = (1 << 16) + 512;
    CK(cuTexObjectCreate(&t3, &e, &td, NULL), CUDA_ERROR_INVALID_VALUE);
    e = ar;
    e.res.array.hArray = (CUarray)(size_t)0x99;
    CK(cuTexObjectCreate(&t3, &e, &td, NULL), CUDA_ERROR_INVALID_VALUE);
    e = rd;
    e.resType = (CUresourcetype)9;
    CK(cuTexObjectCreate(&t3, &e, &td, NULL), CUDA_ERROR_INVALID_VALUE);
    OK(cuTexObjectDestroy(t));
    CK(cuTexObjectDestroy(t), CUDA_ERROR_INVALID_VALUE);
    CK(cuTexObjectGetResourceDesc(&rg, t), CUDA_ERROR_INVALID_VALUE);

    /* Surfaces: only an array made with CUDA_ARRAY3D_SURFACE_LDST. */
    CUsurfObject sf;
    CK(cuSurfObjectCreate(&sf, &ar), CUDA_ERROR_INVALID_VALUE);
    CK(cuSurfObjectCreate(&sf, &rd), CUDA_ERROR_INVALID_VALUE);
    ad.Flags = CUDA_ARRAY3D_SURFACE_LDST;
    CUarray sa;
    OK(cuArray3DCreate(&sa, &ad));
    CUDA_RESOURCE_DESC sr = ar;
    sr.res.array.hArray = sa;
    OK(cuSurfObjectCreate(&sf, &sr));
    OK(cuSurfObjectGetResourceDesc(&rg, sf));
    TRUE(rg.resType == CU_RESOURCE_TYPE_ARRAY && rg.res.array.hArray == sa);
    OK(cuSurfObjectDestroy(sf));
    CK(cuSurfObjectDestroy(sf), CUDA_ERROR_INVALID_VALUE);
    OK(cuTexObjectDestroy(t2));
    OK(cuTexObjectDestroy(t3));
    OK(cuArrayDestroy(a));
    OK(cuArrayDestroy(sa));
    OK(cuMemFree(d));
    return 0;
}

static int batches(void) {
    CUstream s;
    OK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    unsigned char h[3000], out[1000];
    fill(h, sizeof h, 13);
    CUdeviceptr a, b;
    OK(cuMemAlloc(&a, 4096));
    OK(cuMemAlloc(&b, 4096));
    OK(cuMemsetD8(b, 0, 4096));
    /* Copies within a batch may run in any order: the first batch's two are independent, the
     * next batches read what the earlier ones wrote. */
    CUdeviceptr dsts[2] = {a, b + 2000};
    CUdeviceptr srcs[2] = {(CUdeviceptr)(size_t)h, (CUdeviceptr)(size_t)(h + 2000)};
    size_t sizes[2] = {2000, 1000};
    CUmemcpyAttributes at;
    memset(&at, 0, sizeof at);
    at.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
    size_t idx = 0;
    OK(cuMemcpyBatchAsync(dsts, srcs, sizes, 2, &at, &idx, 1, s));
    CUdeviceptr d2 = b + 100, s2a = a + 500, d3 = (CUdeviceptr)(size_t)out, s3 = b + 100;
    size_t n1000 = 1000;
    OK(cuMemcpyBatchAsync(&d2, &s2a, &n1000, 1, &at, &idx, 1, s));
    OK(cuMemcpyBatchAsync(&d3, &s3, &n1000, 1, &at, &idx, 1, s));
    OK(cuStreamSynchronize(s));
    TRUE(memcmp(out, h + 500, 1000) == 0);
    OK(cuMemcpyDtoH(out, b + 2000, 1000));
    TRUE(memcmp(out, h + 2000, 1000) == 0);
    /* Not on the legacy NULL stream; every copy needs a valid access order. */
    CK(cuMemcpyBatchAsync(dsts, srcs, sizes, 2, &at, &idx, 1, NULL), CUDA_ERROR_INVALID_VALUE);
    CUmemcpyAttributes badat = at;
    badat.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_INVALID;
    CK(cuMemcpyBatchAsync(dsts, srcs, sizes, 2, &badat, &idx, 1, s), CUDA_ERROR_INVALID_VALUE);
    /* The 12.8 form says which copy failed: the second one's source runs past its allocation. */
    size_t big[2] = {16, 4000};
    size_t fail = 77;
    CUdeviceptr s2[2] = {a, a + 500};
    CK(cuMemcpyBatchAsync_ptsz(dsts, s2, big, 2, &at, &idx, 1, &fail, s), CUDA_ERROR_INVALID_VALUE);
    TRUE(fail == 1);
    /* One copy with attributes (CUDA 13.2). */
    OK(cuMemcpyWithAttributesAsync(b, a, 64, &at, s));
    OK(cuStreamSynchronize(s));
    unsigned char o64[64];
    OK(cuMemcpyDtoH(o64, b, 64));
    TRUE(memcmp(o64, h, 64) == 0);

    /* A 3D batch: a host box (rows of 10 elements, layers of 5 rows) into a float array at
     * element (2, 1, 0). */
    CUDA_ARRAY3D_DESCRIPTOR ad = {8, 4, 2, CU_AD_FORMAT_FLOAT, 1, 0};
    CUarray arr;
    OK(cuArray3DCreate(&arr, &ad));
    unsigned char zero[8 * 4 * 4 * 2];
    memset(zero, 0, sizeof zero);
    OK(cuMemcpyHtoA(arr, 0, zero, sizeof zero));
    CUDA_MEMCPY3D_BATCH_OP op;
    memset(&op, 0, sizeof op);
    op.src.type = CU_MEMCPY_OPERAND_TYPE_POINTER;
    op.src.op.ptr.ptr = (CUdeviceptr)(size_t)h;
    op.src.op.ptr.rowLength = 10;
    op.src.op.ptr.layerHeight = 5;
    op.dst.type = CU_MEMCPY_OPERAND_TYPE_ARRAY;
    op.dst.op.array.array = arr;
    op.dst.op.array.offset.x = 2;
    op.dst.op.array.offset.y = 1;
    op.extent.width = 5;
    op.extent.height = 3;
    op.extent.depth = 2;
    op.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
    OK(cuMemcpy3DBatchAsync(1, &op, 0, s));
    OK(cuStreamSynchronize(s));
    unsigned char got[sizeof zero];
    OK(cuMemcpyAtoH(got, arr, 0, sizeof got));
    for (size_t z = 0; z < 2; z++)
        for (size_t y = 0; y < 4; y++)
            for (size_t x = 0; x < 32; x++) {
                int in = y >= 1 && y < 4 && x >= 8 && x < 28;
                unsigned char want = in ? h[((z * 5) + (y - 1)) * 40 + (x - 8)] : 0;
                TRUE(got[(z * 4 + y) * 32 + x] == want);
            }
    CUDA_MEMCPY3D_BATCH_OP e = op;
    e.extent.depth = 0;
    CK(cuMemcpy3DBatchAsync(1, &e, 0, s), CUDA_ERROR_INVALID_VALUE);
    e = op;
    e.src.op.ptr.rowLength = 4; /* below the width */
    CK(cuMemcpy3DBatchAsync(1, &e, 0, s), CUDA_ERROR_INVALID_VALUE);
    CK(cuMemcpy3DBatchAsync(1, &op, 1, s), CUDA_ERROR_INVALID_VALUE);
    OK(cuArrayDestroy(arr));
    OK(cuMemFree(a));
    OK(cuMemFree(b));
    OK(cuStreamDestroy(s));
    return 0;
}

/* Peer copies between device 0's and device 1's primary contexts. */
static int peers(void) {
    int n = 0;
    OK(cuDeviceGetCount(&n));
    TRUE(n >= 2);
    CUdevice d0, d1;
    OK(cuDeviceGet(&d0, 0));
    OK(cuDeviceGet(&d1, 1));
    CUcontext c0, c1;
    OK(cuDevicePrimaryCtxRetain(&c0, d0));
    OK(cuDevicePrimaryCtxRetain(&c1, d1));
    CUdeviceptr p0, p1;
    OK(cuCtxSetCurrent(c1));
    OK(cuMemAlloc(&p1, 8192));
    OK(cuMemsetD8(p1, 0, 8192));
    OK(cuCtxSetCurrent(c0));
    OK(cuMemAlloc(&p0, 8192));
    unsigned char h[8192], out[8192];
    fill(h, sizeof h, 17);
    OK(cuMemcpyHtoD(p0, h, 8192));
    OK(cuMemcpyPeer(p1 + 100, c1, p0 + 200, c0, 4000));
    CUstream s;
    OK(cuStreamCreate(&s, 0));
    OK(cuMemcpyPeerAsync(p1 + 5000, c1, p0, c0, 1000, s));
    OK(cuStreamSynchronize(s));
    OK(cuMemcpyDtoH(out, p1, 8192));
    for (size_t i = 0; i < 8192; i++) {
        unsigned char want = 0;
        if (i >= 100 && i < 4100) want = h[i - 100 + 200];
        if (i >= 5000 && i < 6000) want = h[i - 5000];
        TRUE(out[i] == want);
    }
    /* Each pointer must be its context's device's memory. */
    CK(cuMemcpyPeer(p1, c0, p0, c0, 16), CUDA_ERROR_INVALID_VALUE);
    CK(cuMemcpyPeer(p1, c1, p0, c0, 9000), CUDA_ERROR_INVALID_VALUE);

    /* A 3D peer box: 16 bytes x 4 rows x 2 slices from device 0 (pitch 64, 8 rows a slice)
     * to device 1 (pitch 32, 4 rows a slice), back through device 1's context. */
    CUDA_MEMCPY3D_PEER c;
    memset(&c, 0, sizeof c);
    c.srcMemoryType = CU_MEMORYTYPE_DEVICE;
    c.srcDevice = p0;
    c.srcContext = c0;
    c.srcPitch = 64;
    c.srcHeight = 8;
    c.srcXInBytes = 8;
    c.srcY = 1;
    c.dstMemoryType = CU_MEMORYTYPE_DEVICE;
    c.dstDevice = p1;
    c.dstContext = c1;
    c.dstPitch = 32;
    c.dstHeight = 4;
    c.WidthInBytes = 16;
    c.Height = 4;
    c.Depth = 2;
    OK(cuCtxSetCurrent(c1));
    OK(cuMemsetD8(p1, 0, 256));
    OK(cuMemcpy3DPeer(&c));
    OK(cuMemcpyDtoH(out, p1, 256));
    for (size_t z = 0; z < 2; z++)
        for (size_t y = 0; y < 4; y++)
            for (size_t x = 0; x < 32; x++) {
                unsigned char want = x < 16 ? h[(z * 8 + y + 1) * 64 + x + 8] : 0;
                TRUE(out[(z * 4 + y) * 32 + x] == want);
            }
    CUDA_MEMCPY3D_PEER e = c;
    e.dstContext = c0;
    CK(cuMemcpy3DPeer(&e), CUDA_ERROR_INVALID_VALUE);
    OK(cuMemcpy3DPeerAsync(&c, NULL));
    OK(cuMemFree(p1));
    OK(cuCtxSetCurrent(c0));
    OK(cuMemFree(p0));
    OK(cuStreamDestroy(s));
    OK(cuDevicePrimaryCtxRelease(d1));
    return 0;
}

int main(void) {
    CUdevice dev;
    CUcontext ctx;
    if (cuInit(0) || cuDeviceGet(&dev, 0) || cuDevicePrimaryCtxRetain(&ctx, dev) ||
        cuCtxSetCurrent(ctx)) {
        printf("FAIL: no context\n");
        return 2;
    }
    size_t before = free_now();
    if (two_d() || three_d() || one_d() || levels_and_planes() || memsets() || objects() ||
        batches() || peers())
        return 1;
    /* Every array, level and plane charged once and given back. */
    size_t after = free_now();
    if (after != before) {
        printf("FAIL: free memory %zu at the start, %zu at the end\n", before, after);
        return 1;
    }
    printf("OK %d\n", checks);
    return 0;
}
