"""Runs CuPy the way a program would and prints what it saw as one JSON object
(crates/sim/tests/cupy.rs checks it). The simulator runs no kernel code: launches are checked
to succeed and synchronize, never their results."""
import json
import time

import cupy

out = {}
MIB = 1 << 20
rt = cupy.cuda.runtime
dev = cupy.cuda.Device()

out["getDeviceCount"] = rt.getDeviceCount()
out["mem_info"] = list(dev.mem_info)
free0, total = out["mem_info"]

# The memory pool: 256 MiB through it, then back to the driver with free_all_blocks.
pool = cupy.get_default_memory_pool()
a = cupy.empty(256 * MIB, dtype=cupy.uint8)
out["pool_after_alloc"] = [pool.used_bytes(), pool.total_bytes(), dev.mem_info[0]]
del a
out["pool_after_del"] = [pool.used_bytes(), pool.total_bytes()]
pool.free_all_blocks()
out["pool_after_free_all_blocks"] = [pool.used_bytes(), pool.total_bytes(), dev.mem_info[0]]

# Beyond the total: OutOfMemoryError, and the program goes on.
try:
    cupy.empty(2 * total + (1 << 30), dtype=cupy.uint8)
    out["too_large"] = "allocated"
except cupy.cuda.memory.OutOfMemoryError as e:
    out["too_large"] = "OutOfMemoryError: " + str(e)
b = cupy.empty(16 * MIB, dtype=cupy.uint8)
out["after_oom"] = [pool.used_bytes(), b.nbytes]
del b
pool.free_all_blocks()

# Kernels compiled by NVRTC: CuPy's own elementwise `x + y`, an ElementwiseKernel, a RawKernel.
x = cupy.zeros(1024, dtype=cupy.float32)
y = cupy.ones(1024, dtype=cupy.float32)
z = x + y
dev.synchronize()
out["x_plus_y"] = [z.shape[0], str(z.dtype)]
ek = cupy.ElementwiseKernel("float32 a, float32 b", "float32 c", "c = a * b + 1", "cuvisor_fma")
w = ek(x, y)
dev.synchronize()
out["elementwise_kernel"] = [w.shape[0]]

# A RawKernel the simulator times: sim_busy's first parameter is its run time in ns.
busy = cupy.RawKernel(
    r'extern "C" __global__ void sim_busy(unsigned long long ns, float* a) { a[0] = 1; }',
    "sim_busy",
)
t = time.monotonic()
busy((1,), (32,), (cupy.uint64(100_000_000), x))
dev.synchronize()
out["raw_kernel_s"] = time.monotonic() - t

# A C++ kernel by name expression (mangled by NVRTC), and a module variable.
mod = cupy.RawModule(
    code=r"""
__device__ float table[64];
template <typename T> __global__ void sim_busy_t(unsigned long long ns, T* a) { a[0] = table[0]; }
""",
    name_expressions=["sim_busy_t<float>"],
)
k = mod.get_function("sim_busy_t<float>")
t = time.monotonic()
k((1,), (32,), (cupy.uint64(50_000_000), x))
dev.synchronize()
out["raw_module_s"] = time.monotonic() - t
g = mod.get_global("table")
t = cupy.ndarray((64,), cupy.float32, g)
t[:] = 2
dev.synchronize()
out["get_global"] = bool(g.ptr)

del x, y, z, w, t
pool.free_all_blocks()
out["mem_info_at_end"] = list(dev.mem_info)
print(json.dumps(out))
