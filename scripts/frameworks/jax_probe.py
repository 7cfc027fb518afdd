#!/usr/bin/env python3
"""JAX (`jax[cuda12]`), unmodified, under libcuvisor on the simulated GPU: run by
scripts/frameworks.sh as `cuvisor run --memory 6Gi --sim single -- python jax_probe.py`, with
JAX's defaults (XLA_PYTHON_CLIENT_PREALLOCATE unset = true, XLA_PYTHON_CLIENT_MEM_FRACTION unset =
0.75), so XLA's BFC allocator preallocates 75 % of the total the driver reports: under cuvisor,
of the quota, not of the simulated 16 GiB GPU.

Each check prints one tab-separated line for the table:

    FWCHECK <client> <check> <PASS|FAIL|NOTE> <what was measured>

The quota is CUVISOR_MEMORY_LIMIT (bytes), as `cuvisor run` sets it. The simulator runs no kernel
code: computations are checked to run and synchronize, never their results.
"""

import ctypes
import os
import sys
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from gpu_check_probe import ledger_used  # noqa: E402  (the ledger reader gpu-check.sh uses)

MIB = 1 << 20
GIB = 1 << 30
CLIENT = "jax"
quota = int(os.environ["CUVISOR_MEMORY_LIMIT"])
FRACTION = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))


def row(check, verdict, measured):
    measured = " ".join(str(measured).split())
    print(f"FWCHECK\t{CLIENT}\t{check}\t{verdict}\t{measured}", flush=True)


def first_line(e):
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200] if text else ''}"


def gib(n):
    return f"{n / GIB:.3f} GiB"


def ledger():
    used = ledger_used(os.environ.get("CUVISOR_STATE_DIR", ""))
    return used if isinstance(used, str) else gib(used)


def check(name):
    def run(fn):
        try:
            fn()
        except Exception as e:  # pylint: disable=broad-except
            tb = traceback.extract_tb(e.__traceback__)[-1]
            row(name, "FAIL", f"{first_line(e)} (at {os.path.basename(tb.filename)}:{tb.lineno})")
        return fn

    return run


def driver_mem_info():
    """cuMemGetInfo on the primary context, through the same libcuda.so.1 (and so the same
    libcuvisor wrappers) JAX uses: (free, total)."""
    cu = ctypes.CDLL("libcuda.so.1")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    for what, rc in (
        ("cuInit", cu.cuInit(0)),
        ("cuDeviceGet", cu.cuDeviceGet(ctypes.byref(dev), 0)),
        ("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)),
        ("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx)),
        ("cuMemGetInfo_v2", cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))),
    ):
        if rc != 0:
            raise RuntimeError(f"{what} returned {rc}")
    return free.value, total.value


import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax._src import hardware_utils  # noqa: E402

# The one change to JAX: before it tries its CUDA plugin at all, jax._src.xla_bridge.backends()
# asks hardware_utils.has_visible_nvidia_gpu(), which only looks for the device files
# /dev/nvidia0 or /dev/nvidiactl. The simulator has no device files (it is a libcuda.so.1, not a
# kernel driver), so without this JAX silently falls back to the CPU. Everything after that check
# (the PJRT plugin, its CUDA version checks, cuInit, the BFC allocator) runs unmodified.
if not hardware_utils.has_visible_nvidia_gpu():
    hardware_utils.has_visible_nvidia_gpu = lambda: True
    row("device-file check bypassed", "NOTE",
        "no /dev/nvidia0 or /dev/nvidiactl here: jax._src.hardware_utils.has_visible_nvidia_gpu() patched to True")

state = {}


@check("GPU backend starts")
def _():
    devs = jax.devices()
    ok = devs[0].platform == "gpu"
    state["dev"] = devs[0]
    import jaxlib  # pylint: disable=import-outside-toplevel

    row("GPU backend starts", "PASS" if ok else "FAIL",
        f"{devs} ({devs[0].device_kind}), jax {jax.__version__} jaxlib {jaxlib.__version__}")
    if not ok:
        sys.exit(0)  # the rest would measure the CPU


@check(f"preallocates {FRACTION:.2f} x quota")
def _():
    dev = state["dev"]
    jnp.ones(1024).block_until_ready()  # the client is certainly up
    stats = dev.memory_stats() or {}
    limit = stats.get("bytes_limit")
    free, total = driver_mem_info()
    held = total - free
    want = FRACTION * quota
    ok = limit is not None and abs(limit - want) <= 64 * MIB and total == quota and want - 64 * MIB <= held <= quota
    row(f"preallocates {FRACTION:.2f} x quota", "PASS" if ok else "FAIL",
        f"bytes_limit {limit} ({gib(limit or 0)}, {100.0 * (limit or 0) / quota:.1f}% of the quota); "
        f"cuMemGetInfo total {gib(total)}, held {gib(held)}; ledger {ledger()}")


@check("jit elementwise runs")
def _():
    x = jnp.arange(1 << 20, dtype=jnp.float32)
    y = jax.jit(lambda a: jnp.sin(a) * 2 + 1)(x)
    y.block_until_ready()
    row("jit elementwise runs", "PASS", f"jit(sin(x) * 2 + 1) on {y.shape} compiled, loaded and ran (results not computed)")


@check("matmul (cuBLAS)")
def _():
    m = jnp.ones((256, 256)) @ jnp.ones((256, 256))
    m.block_until_ready()
    row("matmul (cuBLAS)", "PASS", f"{m.shape} matmul ran (results not computed)")


@check("beyond the preallocation fails cleanly")
def _():
    n = int(quota)  # more than the allocator's 0.75 x quota
    try:
        z = jnp.zeros((n // 4,), dtype=jnp.float32)
        z.block_until_ready()
        row("beyond the preallocation fails cleanly", "FAIL", f"a {gib(n)} array was allocated")
        del z
        return
    except Exception as e:  # pylint: disable=broad-except
        err = e
    text = str(err)
    ok = "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text
    # and it goes on
    again = jnp.ones(1 << 20).block_until_ready()
    row("beyond the preallocation fails cleanly", "PASS" if ok else "FAIL",
        f"{gib(n)} array: {first_line(err)}; then a {gib(again.nbytes)} array allocated; ledger {ledger()}")
