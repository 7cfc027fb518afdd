#!/usr/bin/env python3
"""TensorFlow over-allocation test: does a container hold TensorFlow to its GPU-memory quota?

For each fraction 0.3, 0.5, 0.8, 1.0, 1.2 of the GPU memory that is free inside the container,
try to allocate that much as ONE tensor, each in a fresh Python process (so that one failure
cannot poison the next), and print one line:

    GPU 0: total 6144 MiB, free 6142 MiB (cuMemGetInfo inside the container, TensorFlow ...)
    fraction 0.30: allocated 1842 MiB ok
    ...
    fraction 1.20: failed cleanly: ResourceExhaustedError: OOM when allocating tensor ...

Exit status 0 iff every fraction <= 1.0 succeeded and 1.2 failed with a clean
ResourceExhaustedError; 1 if any check failed or a subprocess crashed; 2 if there is no GPU.

What "the quota" is: what the GPU reports inside the container. The number is read with the
CUDA driver's cuMemGetInfo (through ctypes, in each subprocess, after TensorFlow has set up the
GPU), because that is the number TensorFlow itself sizes its allocator from; under cuvisor its
total is the quota and its free is the quota minus what the container already uses.
tf.config.experimental.get_memory_info only reports TensorFlow's own usage, and nvidia-smi is
not always in the image.

TensorFlow is set up so that it neither takes everything up front nor keeps memory back:
  - memory growth on (tf.config.experimental.set_memory_growth), so the allocator asks the driver
    only for what tensors need;
  - TF_DEVICE_MIN_SYS_MEMORY_IN_MB=0, so TensorFlow does not hold back its default reserve for
    "system memory" (up to 1.5 GiB), which would make a fraction of 1.0 fail inside TensorFlow
    no matter what the quota is.
With the default BFC allocator, TensorFlow's own limit (free memory at start-up, as cuvisor
reports it) already refuses the 1.2 request; with --allocator cuda_malloc_async
(TF_GPU_ALLOCATOR=cuda_malloc_async) requests go to the driver's stream-ordered allocator,
where cuvisor's quota applies directly.

Run it in a pod that requests cuvisor.io/gpu-memory (see job.yaml), or by hand:
    cuvisor run --memory 6Gi -- python3 examples/tf_stress/tf_stress.py
"""

import argparse
import ctypes
import json
import os
import subprocess
import sys

FRACTIONS = (0.3, 0.5, 0.8, 1.0, 1.2)
MIB = 1 << 20
RESULT = "TF_STRESS_RESULT "
CHILD_TIMEOUT_S = 600


def cu_mem_get_info(ordinal):
    """(free, total) bytes of CUDA device `ordinal` from the driver, in its primary context (the
    one TensorFlow uses, so this adds no context of its own)."""
    cuda = ctypes.CDLL("libcuda.so.1")

    def check(result, call):
        if result != 0:
            raise RuntimeError(f"{call} failed with CUresult {result}")

    dev = ctypes.c_int()
    ctx = ctypes.c_void_p()
    free = ctypes.c_size_t()
    total = ctypes.c_size_t()
    check(cuda.cuInit(0), "cuInit")
    check(cuda.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
    check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    try:
        check(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        # cuMemGetInfo without _v2 is the 32-bit CUDA 3.1 ABI.
        check(cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo_v2")
    finally:
        cuda.cuDevicePrimaryCtxRelease_v2(dev)
    return free.value, total.value


def child(fraction):
    """One attempt, in its own process: prints one RESULT line (JSON) on stdout."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        print(RESULT + json.dumps({"no_gpu": True}), flush=True)
        return
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    # Creates the GPU devices: the CUDA context, and TensorFlow's allocator sized from
    # cuMemGetInfo.
    tf.config.list_logical_devices("GPU")
    # Measured once before TensorFlow's first tensor (what is reported if even that fails), and
    # again after it, inside the attempt: that first tensor makes TensorFlow's allocator take its
    # first region of device memory (2 MiB under BFC with memory growth), where the small tensors
    # every op needs live (Fill's scalar value, say). "Free" after it is what a tensor can get;
    # before it, a fraction of 1.0 would ask for those 2 MiB twice, and TensorFlow refuses that by
    # itself (seen with TensorFlow 2.20 on the simulator, a 6 GiB request under a 6 GiB quota:
    # "Total bytes in pool: 2097152 memory_limit_: 6442450944" in the BFC dump). A real GPU is
    # no different.
    free, total = cu_mem_get_info(0)
    out = {"fraction": fraction, "free": free, "total": total, "bytes": whole_mib(fraction, free)}
    try:
        with tf.device("/GPU:0"):
            warm = tf.zeros([1], dtype=tf.float32)
            _ = warm.numpy()
        free, total = cu_mem_get_info(0)
        out.update(free=free, total=total, bytes=whole_mib(fraction, free))
        with tf.device("/GPU:0"):
            tensor = tf.zeros([out["bytes"] // 4], dtype=tf.float32)
        # Eager ops run (and allocate) when called; this just confirms where it landed.
        out["device"] = tensor.device
        out["ok"] = "GPU:0" in tensor.device
        if not out["ok"]:
            out["error"] = f"the tensor landed on {tensor.device}, not the GPU"
        del tensor
    except tf.errors.ResourceExhaustedError as e:
        out["ok"] = False
        out["clean"] = True
        out["error"] = f"ResourceExhaustedError: {first_line(e.message)}"
    except Exception as e:  # pylint: disable=broad-except
        out["ok"] = False
        out["clean"] = False
        out["error"] = f"{type(e).__name__}: {first_line(str(e))}"
    print(RESULT + json.dumps(out), flush=True)


def whole_mib(fraction, free):
    """Whole MiB, never more than the fraction of free: TensorFlow's allocator rounds requests up
    (to 256 bytes) and limits itself to whole 256-byte units, so an exact 1.0 * free that is not
    so aligned could be refused by TensorFlow for a few bytes."""
    return int(fraction * free) // MIB * MIB


def first_line(text, limit=160):
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def attempt(fraction, env):
    """Runs one child; returns (result dict or None, description of a crash)."""
    try:
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--child", str(fraction)],
            env=env,
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None, f"timed out after {CHILD_TIMEOUT_S} s"
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):]), ""
    tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
    how = f"exit {proc.returncode}" if proc.returncode >= 0 else f"signal {-proc.returncode}"
    return None, f"{how}: {tail}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--child", type=float, help=argparse.SUPPRESS)
    parser.add_argument(
        "--allocator",
        choices=("bfc", "cuda_malloc_async"),
        default="bfc",
        help="TensorFlow's GPU allocator (TF_GPU_ALLOCATOR); default: its BFC allocator",
    )
    args = parser.parse_args()
    if args.child is not None:
        child(args.child)
        return 0

    env = dict(os.environ)
    env.setdefault("TF_DEVICE_MIN_SYS_MEMORY_IN_MB", "0")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.allocator == "cuda_malloc_async":
        env["TF_GPU_ALLOCATOR"] = "cuda_malloc_async"
    else:
        env.pop("TF_GPU_ALLOCATOR", None)

    failures = 0
    header_done = False
    for fraction in FRACTIONS:
        result, crash = attempt(fraction, env)
        label = f"fraction {fraction:.2f}:"
        if result is None:
            print(f"{label} CRASHED: {crash}", flush=True)
            failures += 1
            continue
        if result.get("no_gpu"):
            print("tf_stress: TensorFlow sees no GPU; nothing was tested", file=sys.stderr)
            return 2
        if not header_done:
            print(
                f"GPU 0: total {result['total'] // MIB} MiB, free {result['free'] // MIB} MiB "
                f"(cuMemGetInfo inside the container, TensorFlow {args.allocator} allocator, "
                "memory growth on)",
                flush=True,
            )
            header_done = True
        size = f"{result['bytes'] // MIB} MiB"
        if fraction <= 1.0:
            if result["ok"]:
                print(f"{label} allocated {size} ok", flush=True)
            else:
                print(f"{label} FAIL: {size} refused: {result['error']}", flush=True)
                failures += 1
        elif result["ok"]:
            print(f"{label} FAIL: allocated {size}, more than is free", flush=True)
            failures += 1
        elif result.get("clean"):
            print(f"{label} failed cleanly: {result['error']}", flush=True)
        else:
            print(f"{label} FAIL: refused, but not cleanly: {result['error']}", flush=True)
            failures += 1
    print("tf_stress: PASS" if failures == 0 else f"tf_stress: FAIL ({failures} of 5)")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
