"""Drives NVIDIA's Python bindings the way a Python program would: `cuda-bindings` (the driver
API) allocates memory and runs a kernel, then `pynvml` (nvidia-ml-py) looks at the GPU. Prints
what every call answered as one JSON object (crates/sim/tests/python_nvml.rs checks it).

argv[1]: bytes of an allocation that must fail (beyond the GPU, or beyond the quota under
libcuvisor)."""
import ctypes
import json
import os
import sys

try:
    from cuda.bindings import driver
except ImportError:  # cuda-python before 12.6 named the module cuda.cuda
    from cuda import cuda as driver
import pynvml

beyond = int(sys.argv[1])
out = {"pid": os.getpid()}
MIB = 1 << 20


def cu(tag, ret):
    """Records a cuda-bindings answer (a tuple: the CUresult, then the values) as [code, ...]."""
    ret = ret if isinstance(ret, tuple) else (ret,)
    values = []
    for v in ret[1:]:
        if isinstance(v, bytes):
            v = v.split(b"\0")[0].decode()
        elif not isinstance(v, (int, float, str, type(None))):
            v = int(v) if hasattr(v, "__int__") else str(v)
        values.append(v)
    out[tag] = [int(ret[0])] + values
    return ret[1] if len(ret) == 2 else ret[1:]


# ---- the driver API through cuda-bindings --------------------------------------------------
cu("cuInit", driver.cuInit(0))
cu("cuDriverGetVersion", driver.cuDriverGetVersion())
cu("cuDeviceGetCount", driver.cuDeviceGetCount())
dev = cu("cuDeviceGet", driver.cuDeviceGet(0))
cu("cuDeviceGetName", driver.cuDeviceGetName(256, dev))
cu("cuDeviceTotalMem", driver.cuDeviceTotalMem(dev))

# The primary context (what the runtime and most frameworks use), then one of our own.
primary = cu("cuDevicePrimaryCtxRetain", driver.cuDevicePrimaryCtxRetain(dev))
cu("cuCtxSetCurrent_primary", driver.cuCtxSetCurrent(primary))
cu("cuMemGetInfo_primary", driver.cuMemGetInfo())
try:  # 13.x: cuCtxCreate(ctxCreateParams, flags, dev)
    created = driver.cuCtxCreate(None, 0, dev)
except TypeError:  # 12.x: cuCtxCreate(flags, dev)
    created = driver.cuCtxCreate(0, dev)
ctx = cu("cuCtxCreate", created)
cu("cuMemGetInfo", driver.cuMemGetInfo())

held = cu("cuMemAlloc", driver.cuMemAlloc(64 * MIB))
cu("cuMemGetInfo_after_alloc", driver.cuMemGetInfo())
cu("cuMemAlloc_beyond", driver.cuMemAlloc(beyond))
# The program goes on after an out-of-memory answer: the next allocation works.
more = cu("cuMemAlloc_after_oom", driver.cuMemAlloc(16 * MIB))
cu("cuMemFree_after_oom", driver.cuMemFree(more))
cu("cuMemGetInfo_after_oom", driver.cuMemGetInfo())

# 300 ms of kernel time (the simulator's sim_busy kernels run for their first argument, in ns),
# for NVML's utilization to see.
module = cu("cuModuleLoadData", driver.cuModuleLoadData(b"simulated image\0"))
fn = cu("cuModuleGetFunction", driver.cuModuleGetFunction(module, b"sim_busy"))
cu(
    "cuLaunchKernel",
    driver.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, 0, ((300_000_000,), (ctypes.c_uint64,)), 0),
)
cu("cuCtxSynchronize", driver.cuCtxSynchronize())


# ---- NVML through pynvml, with the 64 MiB still held ---------------------------------------
def nv(tag, call, *args):
    """Records [0, value] or [NVML error code]."""
    try:
        out[tag] = [0, call(*args)]
    except pynvml.NVMLError as e:
        out[tag] = [e.value]


pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(0)
nv("nvmlSystemGetDriverVersion", pynvml.nvmlSystemGetDriverVersion)
nv("nvmlDeviceGetCount", pynvml.nvmlDeviceGetCount)
nv("nvmlDeviceGetName", pynvml.nvmlDeviceGetName, h)
nv("nvmlDeviceGetUUID", pynvml.nvmlDeviceGetUUID, h)
m = pynvml.nvmlDeviceGetMemoryInfo(h)
out["nvmlDeviceGetMemoryInfo"] = [0, m.total, m.used, m.free]
m = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
out["nvmlDeviceGetMemoryInfo_v2"] = [0, m.total, m.used, m.free, m.reserved]
procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
out["nvmlDeviceGetComputeRunningProcesses"] = [0, [[p.pid, p.usedGpuMemory] for p in procs]]
u = pynvml.nvmlDeviceGetUtilizationRates(h)
out["nvmlDeviceGetUtilizationRates"] = [0, u.gpu, u.memory]
nv("nvmlDeviceGetTemperature", pynvml.nvmlDeviceGetTemperature, h, pynvml.NVML_TEMPERATURE_GPU)
nv("nvmlDeviceGetTemperatureV", pynvml.nvmlDeviceGetTemperatureV, h, pynvml.NVML_TEMPERATURE_GPU)
nv("nvmlDeviceGetPowerUsage", pynvml.nvmlDeviceGetPowerUsage, h)
nv("nvmlDeviceGetPowerManagementLimit", pynvml.nvmlDeviceGetPowerManagementLimit, h)
nv("nvmlDeviceGetEnforcedPowerLimit", pynvml.nvmlDeviceGetEnforcedPowerLimit, h)
nv("nvmlDeviceGetTotalEnergyConsumption", pynvml.nvmlDeviceGetTotalEnergyConsumption, h)
nv("nvmlDeviceGetComputeMode", pynvml.nvmlDeviceGetComputeMode, h)
nv("nvmlDeviceGetMigMode", pynvml.nvmlDeviceGetMigMode, h)
# One GPU: the only pair is the device with itself, which is no peer pair.
nv("nvmlDeviceGetP2PStatus_self", pynvml.nvmlDeviceGetP2PStatus, h, h, 0)
try:
    samples = pynvml.nvmlDeviceGetProcessesUtilizationInfo(h, 0)
    out["nvmlDeviceGetProcessesUtilizationInfo"] = [
        0,
        [[s.pid, s.smUtil, s.memUtil, s.jpgUtil, s.ofaUtil] for s in samples],
    ]
except pynvml.NVMLError as e:
    out["nvmlDeviceGetProcessesUtilizationInfo"] = [e.value]
try:
    samples = pynvml.nvmlDeviceGetProcessUtilization(h, 0)
    out["nvmlDeviceGetProcessUtilization"] = [0, [[s.pid, s.smUtil] for s in samples]]
except pynvml.NVMLError as e:
    out["nvmlDeviceGetProcessUtilization"] = [e.value]
pynvml.nvmlShutdown()

cu("cuMemFree", driver.cuMemFree(held))
cu("cuMemGetInfo_after_free", driver.cuMemGetInfo())
cu("cuCtxDestroy", driver.cuCtxDestroy(ctx))
cu("cuDevicePrimaryCtxRelease", driver.cuDevicePrimaryCtxRelease(dev))
print(json.dumps(out))
