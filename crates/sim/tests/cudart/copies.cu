// Copies through the CUDA runtime on the simulator: cudaMemcpy2D between host and pitched device
// memory, cudaMallocArray + cudaMemcpy2DToArray / cudaMemcpy2DFromArray, cudaMemset2D, and
// texture and surface objects over arrays. Every byte that comes back is checked against the
// pattern it was made from. Prints "STEP ERROR_NUMBER ERROR_NAME" per runtime call, "MISMATCH
// ..." for a wrong byte, and "DONE <bytes checked>" at the end; exit status 0 only when every
// call answered what it should and every byte matched.
#include <cstdio>
#include <cstring>
#include <vector>
#include <cuda_runtime.h>

static int bad = 0;

static void step(const char *what, cudaError_t e, cudaError_t want = cudaSuccess) {
    std::printf("%s %d %s\n", what, (int)e, cudaGetErrorName(e));
    if (e != want) bad = 1;
}

static unsigned char pat(size_t i) { return (unsigned char)(i * 29u + 3u); }

int main() {
    size_t checked = 0;
    const size_t W = 300, H = 20;  // bytes x rows
    std::vector<unsigned char> src(W * H), back(512 * H, 0);
    for (size_t i = 0; i < src.size(); i++) src[i] = pat(i);

    void *d = nullptr;
    size_t pitch = 0;
    step("cudaMallocPitch", cudaMallocPitch(&d, &pitch, W, H));
    step("cudaMemset2D", cudaMemset2D(d, pitch, 0x7f, W, H));
    // Rows 2..17 of the source, 200 bytes from byte 50, to (10, 1) on the device.
    step("cudaMemcpy2D_HtoD", cudaMemcpy2D((char *)d + pitch + 10, pitch, src.data() + 2 * W + 50,
                                           W, 200, 16, cudaMemcpyHostToDevice));
    step("cudaMemcpy2D_DtoH",
         cudaMemcpy2D(back.data(), 512, d, pitch, W, H, cudaMemcpyDeviceToHost));
    for (size_t y = 0; y < H; y++)
        for (size_t x = 0; x < W; x++) {
            bool in = y >= 1 && y < 17 && x >= 10 && x < 210;
            unsigned char want = in ? src[(y - 1 + 2) * W + (x - 10 + 50)] : 0x7f;
            checked++;
            if (back[y * 512 + x] != want) {
                std::printf("MISMATCH pitched %zu %zu\n", x, y);
                bad = 1;
            }
        }
    step("cudaMemcpy2D_pitch_below_width",
         cudaMemcpy2D(back.data(), 100, d, pitch, W, H, cudaMemcpyDeviceToHost),
         cudaErrorInvalidPitchValue);

    // A 2D array of uchar4, 64 x 16: in from the host, out again.
    cudaChannelFormatDesc f = cudaCreateChannelDesc<uchar4>();
    cudaArray_t a = nullptr;
    step("cudaMallocArray", cudaMallocArray(&a, &f, 64, 16));
    std::vector<unsigned char> img(256 * 16), got(256 * 16, 0);
    for (size_t i = 0; i < img.size(); i++) img[i] = pat(i + 7);
    step("cudaMemcpy2DToArray",
         cudaMemcpy2DToArray(a, 0, 0, img.data(), 256, 256, 16, cudaMemcpyHostToDevice));
    step("cudaMemcpy2DFromArray",
         cudaMemcpy2DFromArray(got.data(), 256, a, 0, 0, 256, 16, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < img.size(); i++) {
        checked++;
        if (img[i] != got[i]) {
            std::printf("MISMATCH array %zu\n", i);
            bad = 1;
            break;
        }
    }
    // Device to array and back through device memory, at an offset of 8 elements, 2 rows.
    step("cudaMemcpy2DToArray_DtoA",
         cudaMemcpy2DToArray(a, 32, 2, d, pitch, 128, 4, cudaMemcpyDeviceToDevice));
    step("cudaMemcpy2DFromArray_AtoH",
         cudaMemcpy2DFromArray(got.data(), 128, a, 32, 2, 128, 4, cudaMemcpyDeviceToHost));
    for (size_t y = 0; y < 4; y++)
        for (size_t x = 0; x < 128; x++) {
            checked++;
            if (got[y * 128 + x] != back[y * 512 + x]) {
                std::printf("MISMATCH array_from_device %zu %zu\n", x, y);
                bad = 1;
            }
        }

    // Texture object over the array; a surface object needs cudaArraySurfaceLoadStore.
    cudaResourceDesc rd;
    std::memset(&rd, 0, sizeof rd);
    rd.resType = cudaResourceTypeArray;
    rd.res.array.array = a;
    cudaTextureDesc td;
    std::memset(&td, 0, sizeof td);
    td.addressMode[0] = cudaAddressModeClamp;
    td.readMode = cudaReadModeElementType;
    cudaTextureObject_t tex = 0;
    step("cudaCreateTextureObject", cudaCreateTextureObject(&tex, &rd, &td, nullptr));
    cudaSurfaceObject_t surf = 0;
    step("cudaCreateSurfaceObject_plain_array", cudaCreateSurfaceObject(&surf, &rd),
         cudaErrorInvalidValue);
    cudaArray_t s = nullptr;
    step("cudaMallocArray_surface",
         cudaMallocArray(&s, &f, 64, 16, cudaArraySurfaceLoadStore));
    rd.res.array.array = s;
    step("cudaCreateSurfaceObject", cudaCreateSurfaceObject(&surf, &rd));
    cudaResourceDesc back_rd;
    step("cudaGetSurfaceObjectResourceDesc", cudaGetSurfaceObjectResourceDesc(&back_rd, surf));
    if (back_rd.resType != cudaResourceTypeArray || back_rd.res.array.array != s) {
        std::printf("MISMATCH surface resource\n");
        bad = 1;
    }
    step("cudaDestroySurfaceObject", cudaDestroySurfaceObject(surf));
    step("cudaDestroyTextureObject", cudaDestroyTextureObject(tex));
    step("cudaFreeArray_surface", cudaFreeArray(s));
    step("cudaFreeArray", cudaFreeArray(a));
    step("cudaFree", cudaFree(d));
    std::printf("DONE %zu\n", checked);
    return bad;
}
