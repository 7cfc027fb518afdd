#!/usr/bin/env python3
"""PyTorch (the PyPI CUDA build), unmodified, under libcuvisor on the simulated GPU: run by
scripts/frameworks.sh as `cuvisor run --memory 6Gi --sim single -- python torch_probe.py`, once
per allocator (PYTORCH_CUDA_ALLOC_CONF unset, expandable_segments:True, backend:cudaMallocAsync;
the shell sets it, since PyTorch reads it once).

Each check prints one tab-separated line for the table:

    FWCHECK <client> <check> <PASS|FAIL|NOTE> <what was measured>

and a check that raises is a FAIL saying where it stopped; the probe goes on with the next one.
The quota is CUVISOR_MEMORY_LIMIT (bytes), as `cuvisor run` sets it; without it (the probe run
on the simulator directly, frameworks.sh --set newest) the GPU's whole memory. The simulator runs no
kernel code: kernels and cuBLAS calls are checked to launch and synchronize, never their results.
"""

import os
import sys
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from gpu_check_probe import ledger_used  # noqa: E402  (the ledger reader gpu-check.sh uses)

MIB = 1 << 20
GIB = 1 << 30
CONF = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
CLIENT = "torch " + (CONF or "native")


def row(check, verdict, measured):
    measured = " ".join(str(measured).split())
    print(f"FWCHECK\t{CLIENT}\t{check}\t{verdict}\t{measured}", flush=True)


def first_line(e):
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:160] if text else ''}"


def gib(n):
    return f"{n / GIB:.3f} GiB"


def check(name):
    """Runs the decorated function at once as one check: a raise is a FAIL with where it stopped."""

    def run(fn):
        try:
            fn()
        except Exception as e:  # pylint: disable=broad-except
            tb = traceback.extract_tb(e.__traceback__)[-1]
            row(name, "FAIL", f"{first_line(e)} (at {os.path.basename(tb.filename)}:{tb.lineno})")
        return fn

    return run


import torch  # noqa: E402

HOOKED = "CUVISOR_MEMORY_LIMIT" in os.environ
quota = int(os.environ["CUVISOR_MEMORY_LIMIT"]) if HOOKED else torch.cuda.get_device_properties(0).total_memory

OOM = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


@check("is_available")
def _():
    ok = torch.cuda.is_available()
    row("is_available", "PASS" if ok else "FAIL",
        f"{ok}, {torch.cuda.device_count()} device(s), torch {torch.__version__} CUDA {torch.version.cuda}")
    if not ok:
        sys.exit(0)


@check("mem_get_info total == quota")
def _():
    free, total = torch.cuda.mem_get_info()
    props = torch.cuda.get_device_properties(0).total_memory
    row("mem_get_info total == quota", "PASS" if total == quota and props == quota and 0 < free <= total else "FAIL",
        f"total {total} ({gib(total)}), free {free}, properties.total_memory {props}")


def alloc(frac):
    n = int(frac * quota)
    name = f"alloc {frac:.1f} x quota"
    free_before = torch.cuda.mem_get_info()[0]
    try:
        t = torch.empty(n, dtype=torch.uint8, device="cuda")
    except OOM as e:
        msg = str(e).splitlines()[0][:110]
        used = ledger_used(os.environ.get("CUVISOR_STATE_DIR", ""))
        torch.cuda.empty_cache()
        return name, False, n, f"OutOfMemoryError ({gib(n)} asked, {gib(free_before)} free before; ledger {used if isinstance(used, str) else gib(used)}): {msg}"
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    used = ledger_used(os.environ.get("CUVISOR_STATE_DIR", ""))
    free_after = torch.cuda.mem_get_info()[0]
    del t
    torch.cuda.empty_cache()
    return name, True, n, (f"allocated {gib(n)}: reserved {gib(reserved)}, free {gib(free_before)} -> {gib(free_after)}, "
                           f"ledger {used if isinstance(used, str) else gib(used)}")


for frac in (0.3, 0.5, 0.8):
    @check(f"alloc {frac:.1f} x quota")
    def _():
        name, ok, _n, text = alloc(frac)
        row(name, "PASS" if ok else "FAIL", text)


@check("alloc 1.0 x quota")
def _():
    # Whether exactly the quota fits depends on the allocator's rounding (and, on a real GPU,
    # on what the context itself takes: the simulated context takes no device memory). The
    # native allocator and cudaMallocAsync ask for the size itself (6 GiB is a multiple of their
    # 2 MiB rounding); expandable segments map 20 MiB pages, so they need ceil(n / 20 MiB) of
    # them. Either a clean OutOfMemoryError or a success is right; the row says which, and why.
    name, ok, n, text = alloc(1.0)
    if "expandable_segments:True" in CONF.replace(" ", ""):
        page = 20 * MIB
        pages = -(-n // page)
        why = f"expandable segments: {pages} pages of 20 MiB = {gib(pages * page)} needed"
    else:
        why = ("a 2 MiB multiple" if n % (2 * MIB) == 0 else "rounded up to 2 MiB") + \
            "; what the process already holds counts against it: its modules' memory, and on the " \
            "simulator directly its context's"
    row(name, "NOTE", f"[{why}] {text}")


@check("alloc 1.2 x quota -> OutOfMemoryError")
def _():
    name, ok, _n, text = alloc(1.2)
    row("alloc 1.2 x quota -> OutOfMemoryError", "FAIL" if ok else ("PASS" if text.startswith("OutOfMemoryError") else "FAIL"), text)


@check("allocates again after OOM")
def _():
    t = torch.ones(16 * MIB // 4, device="cuda")
    torch.cuda.synchronize()
    row("allocates again after OOM", "PASS", f"{gib(t.numel() * 4)} tensor, reserved {gib(torch.cuda.memory_reserved())}")
    del t
    torch.cuda.empty_cache()


@check("elementwise ops")
def _():
    x = torch.ones(1 << 20, device="cuda")
    y = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    z = (x * 2 + y).relu_().sin()
    w = torch.where(z > 0, z, -z)
    torch.cuda.synchronize()
    row("elementwise ops", "PASS", f"ones, arange, mul, add, relu_, sin, where: {tuple(w.shape)} {w.dtype}, synchronized")


@check("matmul (cuBLAS)")
def _():
    a = torch.randn(512, 512, device="cuda")
    b = torch.randn(512, 512, device="cuda")
    c = a @ b
    torch.cuda.synchronize()
    h = torch.randn(64, 512, device="cuda", dtype=torch.float16) @ torch.randn(512, 256, device="cuda", dtype=torch.float16)
    torch.cuda.synchronize()
    row("matmul (cuBLAS)", "PASS", f"fp32 {tuple(c.shape)} and fp16 {tuple(h.shape)} matmuls ran (results not computed by the simulator)")


@check("memory at the end")
def _():
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    used = ledger_used(os.environ.get("CUVISOR_STATE_DIR", ""))
    row("memory at the end", "NOTE", f"free {gib(free)} of {gib(total)}, reserved {gib(torch.cuda.memory_reserved())}, "
        f"ledger {used if isinstance(used, str) else gib(used)}")
