/* The CUDA 2.x ABI of the copies (32-bit device pointers, offsets and sizes; cuMemcpy2D and
 * cuMemcpy3D taking CUDA_MEMCPY2D_v1 / CUDA_MEMCPY3D_v1), which libcuda still exports and
 * cuGetProcAddress hands out below version 3020. Built with -D__CUDA_API_VERSION_INTERNAL, under
 * which CUDA 13.5's cuda.h names these functions and declares the v1 structs, so their layout is
 * the header's. Every byte copied is checked against its pattern; prints "OK <checks>". */
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

static unsigned char pat(size_t i) { return (unsigned char)(i * 37u + 11u); }

int main(void) {
    CUdevice dev;
    CUcontext ctx;
    if (cuInit(0) || cuDeviceGet(&dev, 0) || cuDevicePrimaryCtxRetain(&ctx, dev) ||
        cuCtxSetCurrent(ctx)) {
        printf("FAIL: no context\n");
        return 2;
    }
    /* 2D: host (pitch 50) -> pitched 32-bit device memory -> host (pitch 64). */
    CUdeviceptr_v1 d;
    unsigned int pitch;
    OK(cuMemAllocPitch(&d, &pitch, 40, 6, 4));
    OK(cuMemsetD8(d, 0x33, pitch * 6));
    unsigned char src[50 * 6], out[64 * 6];
    for (size_t i = 0; i < sizeof src; i++) src[i] = pat(i);
    memset(out, 0, sizeof out);
    CUDA_MEMCPY2D_v1 c;
    memset(&c, 0, sizeof c);
    c.srcMemoryType = CU_MEMORYTYPE_HOST;
    c.srcHost = src;
    c.srcPitch = 50;
    c.srcXInBytes = 3;
    c.srcY = 1;
    c.dstMemoryType = CU_MEMORYTYPE_DEVICE;
    c.dstDevice = d;
    c.dstPitch = pitch;
    c.dstXInBytes = 2;
    c.dstY = 1;
    c.WidthInBytes = 30;
    c.Height = 4;
    OK(cuMemcpy2D(&c));
    CUDA_MEMCPY2D_v1 b;
    memset(&b, 0, sizeof b);
    b.srcMemoryType = CU_MEMORYTYPE_DEVICE;
    b.srcDevice = d;
    b.srcPitch = pitch;
    b.dstMemoryType = CU_MEMORYTYPE_HOST;
    b.dstHost = out;
    b.dstPitch = 64;
    b.WidthInBytes = 40;
    b.Height = 6;
    OK(cuMemcpy2DUnaligned(&b));
    for (size_t y = 0; y < 6; y++)
        for (size_t x = 0; x < 40; x++) {
            int in = y >= 1 && y < 5 && x >= 2 && x < 32;
            TRUE(out[y * 64 + x] == (in ? src[y * 50 + x + 1] : 0x33));
        }
    CUDA_MEMCPY2D_v1 e = c;
    e.srcPitch = 32; /* < 30 + 3 */
    CK(cuMemcpy2D(&e), CUDA_ERROR_INVALID_VALUE);

    /* 3D: a 2 x 2 x 2 box of 4-byte elements out of a 4 x 3 x 2 host volume into a 1D-laid
     * float array of 8 x 2 x 2 (through the v1 3D struct), and back. */
    CUDA_ARRAY3D_DESCRIPTOR_v1 ad = {8, 2, 2, CU_AD_FORMAT_FLOAT, 1, 0};
    CUarray a;
    OK(cuArray3DCreate(&a, &ad));
    unsigned char vol[16 * 3 * 2], zero[32 * 2 * 2], arr[32 * 2 * 2];
    for (size_t i = 0; i < sizeof vol; i++) vol[i] = pat(i + 5);
    memset(zero, 0, sizeof zero);
    OK(cuMemcpyHtoA(a, 0, zero, sizeof zero));
    CUDA_MEMCPY3D_v1 t;
    memset(&t, 0, sizeof t);
    t.srcMemoryType = CU_MEMORYTYPE_HOST;
    t.srcHost = vol;
    t.srcPitch = 16;
    t.srcHeight = 3;
    t.srcXInBytes = 4;
    t.srcY = 1;
    t.dstMemoryType = CU_MEMORYTYPE_ARRAY;
    t.dstArray = a;
    t.dstXInBytes = 8;
    t.WidthInBytes = 8;
    t.Height = 2;
    t.Depth = 2;
    OK(cuMemcpy3D(&t));
    OK(cuMemcpyAtoH(arr, a, 0, sizeof arr));
    for (size_t z = 0; z < 2; z++)
        for (size_t y = 0; y < 2; y++)
            for (size_t x = 0; x < 32; x++) {
                int in = x >= 8 && x < 16;
                unsigned char want = in ? vol[(z * 3 + y + 1) * 16 + x - 8 + 4] : 0;
                TRUE(arr[(z * 2 + y) * 32 + x] == want);
            }
    CUDA_MEMCPY3D_v1 l = t;
    l.dstLOD = 1;
    CK(cuMemcpy3D(&l), CUDA_ERROR_INVALID_VALUE);

    /* 1D arrays, 32-bit pointers and offsets; asynchronous forms on a stream. */
    CUDA_ARRAY_DESCRIPTOR_v1 od = {64, 0, CU_AD_FORMAT_UNSIGNED_INT8, 1};
    CUarray o, o2;
    OK(cuArrayCreate(&o, &od));
    OK(cuArrayCreate(&o2, &od));
    CUDA_ARRAY_DESCRIPTOR_v1 og;
    OK(cuArrayGetDescriptor(&og, o));
    TRUE(og.Width == 64 && og.Height == 0 && og.NumChannels == 1);
    CUdeviceptr_v1 lin;
    OK(cuMemAlloc(&lin, 64));
    unsigned char h64[64], r64[64];
    for (size_t i = 0; i < 64; i++) h64[i] = pat(i + 9);
    CUstream s;
    OK(cuStreamCreate(&s, 0));
    OK(cuMemcpyHtoAAsync(o, 0, h64, 64, s));
    OK(cuStreamSynchronize(s));
    OK(cuMemcpyAtoD(lin, o, 8, 32));
    OK(cuMemcpyDtoA(o2, 0, lin, 32));
    OK(cuMemcpyAtoA(o2, 32, o, 0, 8));
    memset(r64, 0, sizeof r64);
    OK(cuMemcpyAtoHAsync(r64, o2, 0, 40, s));
    OK(cuStreamSynchronize(s));
    for (size_t i = 0; i < 40; i++) TRUE(r64[i] == (i < 32 ? h64[i + 8] : h64[i - 32]));
    OK(cuMemcpyDtoD(lin + 32, lin, 16));
    OK(cuMemcpyDtoHAsync(r64, lin + 32, 16, s));
    OK(cuStreamSynchronize(s));
    TRUE(memcmp(r64, h64 + 8, 16) == 0);
    CK(cuMemcpyHtoA(o, 60, h64, 8), CUDA_ERROR_INVALID_VALUE);

    /* Memsets, 1D and 2D. */
    OK(cuMemsetD32(d, 0x01020304, pitch * 6 / 4));
    OK(cuMemsetD2D16(d, pitch, 0xBEEF, 4, 2));
    unsigned char m[8];
    OK(cuMemcpyDtoH(m, d + pitch, 8));
    TRUE(m[0] == 0xEF && m[1] == 0xBE && m[6] == 0xEF && m[7] == 0xBE);
    OK(cuMemcpyDtoH(m, d + pitch + 8, 4));
    TRUE(m[0] == 0x04 && m[3] == 0x01);
    CK(cuMemsetD2D32(d, 8, 0, 4, 2), CUDA_ERROR_INVALID_VALUE);

    OK(cuStreamDestroy_v2(s));
    OK(cuArrayDestroy(a));
    OK(cuArrayDestroy(o));
    OK(cuArrayDestroy(o2));
    OK(cuMemFree(d));
    OK(cuMemFree(lin));
    printf("OK %d\n", checks);
    return 0;
}
