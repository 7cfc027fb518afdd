"""Drives NVIDIA's CUDA runtime (libcudart, argv[1]) through ctypes the way a Python program
would, and prints what it answered as one JSON object (crates/sim/tests/cudart.rs checks it)."""
import ctypes
import json
import sys
import time

rt = ctypes.CDLL(sys.argv[1])
out = {}
c_int, c_size_t, c_void_p, byref = ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p, ctypes.byref


def mem_info(tag):
    free, total = c_size_t(), c_size_t()
    out[tag] = [rt.cudaMemGetInfo(byref(free), byref(total)), free.value, total.value]


n = c_int(-1)
out["cudaGetDeviceCount"] = [rt.cudaGetDeviceCount(byref(n)), n.value]
v = c_int()
out["cudaRuntimeGetVersion"] = [rt.cudaRuntimeGetVersion(byref(v)), v.value]
out["cudaDriverGetVersion"] = [rt.cudaDriverGetVersion(byref(v)), v.value]

# cudaDeviceProp (12.x layout): name[256], uuid[16], luid[8], luidDeviceNodeMask, (pad),
# totalGlobalMem at 288, ..., major at 360, minor at 364. 4 KiB is more than the struct.
props = ctypes.create_string_buffer(4096)
get_props = getattr(rt, "cudaGetDeviceProperties_v2", None) or rt.cudaGetDeviceProperties
r = get_props(props, 0)
raw = props.raw
out["cudaGetDeviceProperties"] = [
    r,
    raw[:256].split(b"\0")[0].decode(),
    raw[256:272].hex(),
    int.from_bytes(raw[288:296], "little"),
    int.from_bytes(raw[360:364], "little"),
    int.from_bytes(raw[364:368], "little"),
]

mem_info("cudaMemGetInfo")
total = out["cudaMemGetInfo"][2]
p = c_void_p()
out["cudaMalloc"] = [rt.cudaMalloc(byref(p), c_size_t(64 << 20)), bool(p.value)]
mem_info("cudaMemGetInfo_after_malloc")
out["cudaFree"] = [rt.cudaFree(p)]
mem_info("cudaMemGetInfo_after_free")
q = c_void_p()
out["cudaMalloc_too_large"] = [rt.cudaMalloc(byref(q), c_size_t(2 * total + (1 << 30)))]
out["cudaGetLastError"] = [rt.cudaGetLastError()]



class ChannelDesc(ctypes.Structure):
    _fields_ = [("x", c_int), ("y", c_int), ("z", c_int), ("w", c_int), ("f", c_int)]


class Extent(ctypes.Structure):
    _fields_ = [("width", c_size_t), ("height", c_size_t), ("depth", c_size_t)]


# Managed, pitched and 3D-array memory: 64 MiB each, counted while held; more than is free
# refused with cudaErrorMemoryAllocation, and the same allocator works again afterwards.
big = 2 * total + (1 << 30)
d, pitch, arr = c_void_p(), c_size_t(), c_void_p()
float4 = ChannelDesc(32, 32, 32, 32, 2)  # cudaChannelFormatKindFloat
allocators = {
    "cudaMallocManaged": (
        lambda n: rt.cudaMallocManaged(byref(d), c_size_t(n), 1),  # cudaMemAttachGlobal
        lambda: rt.cudaFree(d),
    ),
    # 4 KiB rows (a pitch of at least that): n / 4096 of them.
    "cudaMallocPitch": (
        lambda n: rt.cudaMallocPitch(byref(d), byref(pitch), c_size_t(4096), c_size_t(n >> 12)),
        lambda: rt.cudaFree(d),
    ),
    # float4 (16 bytes) elements, 1024 x 1024 x n / 16 MiB.
    "cudaMalloc3DArray": (
        lambda n: rt.cudaMalloc3DArray(
            byref(arr), byref(float4), Extent(1024, 1024, max(1, n >> 24)), 0
        ),
        lambda: rt.cudaFreeArray(arr),
    ),
}
for name, (take, release) in allocators.items():
    out[name] = [take(64 << 20)]
    mem_info(name + "_taken")
    out[name + "_freed"] = [release()]
    mem_info(name + "_after_free")
    out[name + "_too_large"] = [take(big)]
    out[name + "_last_error"] = [rt.cudaGetLastError()]
    out[name + "_after_refusal"] = [take(1 << 20), release()]

s = c_void_p()
out["cudaStreamCreate"] = [rt.cudaStreamCreate(byref(s))]
a = c_void_p()
out["cudaMallocAsync"] = [rt.cudaMallocAsync(byref(a), c_size_t(16 << 20), s), bool(a.value)]
mem_info("cudaMemGetInfo_after_malloc_async")
out["cudaFreeAsync"] = [rt.cudaFreeAsync(a, s)]
out["cudaStreamSynchronize"] = [rt.cudaStreamSynchronize(s)]
mem_info("cudaMemGetInfo_after_free_async")

e1, e2 = c_void_p(), c_void_p()
out["cudaEventCreate"] = [rt.cudaEventCreate(byref(e1)), rt.cudaEventCreate(byref(e2))]
t0 = time.monotonic()
r1 = rt.cudaEventRecord(e1, s)
t1 = time.monotonic()
time.sleep(0.05)
t2 = time.monotonic()
r2 = rt.cudaEventRecord(e2, s)
t3 = time.monotonic()
out["cudaEventRecord"] = [r1, r2]
out["cudaEventSynchronize"] = [rt.cudaEventSynchronize(e2)]
out["cudaEventQuery"] = [rt.cudaEventQuery(e2)]
ms = ctypes.c_float()
out["cudaEventElapsedTime"] = [
    rt.cudaEventElapsedTime(byref(ms), e1, e2),
    ms.value,
    (t2 - t1) * 1e3,
    (t3 - t0) * 1e3,
]
out["cudaEventDestroy"] = [rt.cudaEventDestroy(e1), rt.cudaEventDestroy(e2)]
out["cudaStreamDestroy"] = [rt.cudaStreamDestroy(s)]
out["cudaDeviceSynchronize"] = [rt.cudaDeviceSynchronize()]
out["cudaDeviceReset"] = [rt.cudaDeviceReset()]
print(json.dumps(out))
