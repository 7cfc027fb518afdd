"""The monitoring tools people run, on the simulator, while this process holds GPU memory and
runs a kernel: `gpustat --json`, nvitop's Python API (nvitop_snapshot.py), `nvitop --once`, and
nvidia-ml-py's own example.py. Each runs as its own process, as a user would start it, with
every NVML call traced (trace/sitecustomize.py). Prints one JSON object for
crates/sim/tests/monitoring.rs.

argv[1]: bytes to hold; argv[2]: nanoseconds of kernel to run while the tools look."""
import ctypes
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time

held, kernel_ns = int(sys.argv[1]), int(sys.argv[2])
here = os.path.dirname(os.path.abspath(__file__))
out = {"pid": os.getpid()}

cuda = ctypes.CDLL("libcuda.so.1")


def check(name, r):
    if r != 0:
        raise SystemExit(f"{name} answered {r}")


dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
module, fn = ctypes.c_void_p(), ctypes.c_void_p()
check("cuInit", cuda.cuInit(0))
check("cuDeviceGet", cuda.cuDeviceGet(ctypes.byref(dev), 0))
check("cuDevicePrimaryCtxRetain", cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
check("cuCtxSetCurrent", cuda.cuCtxSetCurrent(ctx))
check("cuMemAlloc", cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(held)))
# The simulator's sim_busy kernel occupies the device for its first argument, in ns.
check("cuModuleLoadData", cuda.cuModuleLoadData(ctypes.byref(module), b"simulated image\0"))
check("cuModuleGetFunction", cuda.cuModuleGetFunction(ctypes.byref(fn), module, b"sim_busy"))
arg = ctypes.c_uint64(kernel_ns)
params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.byref(arg), ctypes.c_void_p))
launched = time.monotonic()
check("cuLaunchKernel", cuda.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, None, params, None))
# NVML's utilization covers the last second: let the kernel fill it before the tools look.
time.sleep(1.1)

trace = tempfile.NamedTemporaryFile(prefix="cuvisor-nvml-trace-", delete=False).name
# No __pycache__ beside the sources.
env = dict(os.environ, PYTHONPATH=os.path.join(here, "trace"), NVML_TRACE=trace, PYTHONDONTWRITEBYTECODE="1")
example = os.path.join(sysconfig.get_paths()["purelib"], "example.py")
tools = {
    "gpustat": [sys.executable, "-m", "gpustat", "--json"],
    "nvitop": [sys.executable, os.path.join(here, "nvitop_snapshot.py")],
    "nvitop_once": [sys.executable, "-m", "nvitop", "--once"],
    "example": [sys.executable, example],
}
calls = {}
try:
    for name, cmd in tools.items():
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        if run.returncode != 0:
            raise SystemExit(f"{cmd} failed ({run.returncode}):\n{run.stdout}\n{run.stderr}")
        text = run.stdout
        out[name] = json.loads(text) if name in ("gpustat", "nvitop") else text
        # Seconds from the launch to the tool's exit: the kernel was running all along if this
        # is below its length.
        out[name + "_done_s"] = time.monotonic() - launched
    with open(trace) as f:
        for line in f:
            name, code, n = line.split()
            calls.setdefault(name, {})
            calls[name][code] = calls[name].get(code, 0) + int(n)
finally:
    os.unlink(trace)

check("cuCtxSynchronize", cuda.cuCtxSynchronize())
check("cuMemFree", cuda.cuMemFree_v2(ptr))
out["calls"] = calls
print(json.dumps(out))
