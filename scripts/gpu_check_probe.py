#!/usr/bin/env python3
"""The Python checks of scripts/gpu-check.sh, one per process, each run under LD_PRELOAD=libcuvisor.so
with a quota and a fresh state directory (the shell script sets those up).

    gpu_check_probe.py torch-fill     QUOTA_BYTES   PyTorch allocates until OutOfMemoryError
    gpu_check_probe.py torch-meminfo  QUOTA_BYTES   torch.cuda.mem_get_info() total is the quota
    gpu_check_probe.py torch-props    QUOTA_BYTES   device properties' total_memory is the quota
    gpu_check_probe.py jax-prealloc   QUOTA_BYTES   JAX preallocates 75 % of the quota
    gpu_check_probe.py ledger         STATE_DIR     print the ledger's devices (for tests)

Each check prints, as its last line, one tab-separated row for the table:

    GPUCHECK <expected> <observed> <PASS|FAIL>

and exits 0 whether it passed or not (a crash is the shell's to report). torch-fill takes its
allocator from PYTORCH_CUDA_ALLOC_CONF, as PyTorch does.
"""

import os
import struct
import sys

MIB = 1 << 20
GIB = 1 << 30

# The ledger file, as crates/shm/src/ledger.rs lays it out (version 4; its share table after the processes is not read here), read-only here:
# Header { magic u64, version u32, size u32, max_devices u32, max_procs u32, container_id u64 }
# = 32 bytes, then DeviceEntry[max_devices] { state u32, pad u32, uuid 2*u64, limit, used, peak,
# denied, gpu_ns, throttled_ns, launches: u64 } = 80 bytes each; `used` keeps bytes in its low 48
# bits (the high 16 count changes).
# crates/cli/tests/run.rs checks this reader against the Rust definition.
LEDGER_MAGIC = 0x3147_4445_4C56_5543  # "CUVLEDG1"
LEDGER_VERSION = 4
BYTES_MASK = (1 << 48) - 1
HEADER_SIZE = 32
DEVICE_SIZE = 80
DEV_READY = 2


def ledger_devices(state_dir):
    """[(limit, used, peak, denied)] of the ledger's devices, or a string saying why not."""
    path = os.path.join(state_dir, "ledger")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        return f"no ledger ({e.strerror})"
    if len(data) < HEADER_SIZE:
        return "ledger too short"
    magic, version, _size, max_devices, _max_procs = struct.unpack_from("<QIIII", data, 0)
    if magic != LEDGER_MAGIC or version != LEDGER_VERSION:
        return f"ledger of an unknown layout (magic {magic:#x}, version {version})"
    if len(data) < HEADER_SIZE + max_devices * DEVICE_SIZE:
        return "ledger too short"
    out = []
    for i in range(max_devices):
        off = HEADER_SIZE + i * DEVICE_SIZE
        (state,) = struct.unpack_from("<I", data, off)
        if state == DEV_READY:
            limit, used, peak, denied = struct.unpack_from("<QQQQ", data, off + 24)
            out.append((limit, used & BYTES_MASK, peak, denied))
    return out


def ledger_used(state_dir):
    """Bytes the container's ledger has charged on all its GPUs, or a string saying why not."""
    devices = ledger_devices(state_dir)
    if isinstance(devices, str):
        return devices
    return sum(used for (_limit, used, _peak, _denied) in devices)


def gib(n):
    return f"{n / GIB:.2f} GiB"


def row(expected, observed, ok):
    print(f"GPUCHECK\t{expected}\t{observed}\t{'PASS' if ok else 'FAIL'}", flush=True)


def first_line(e):
    text = str(e).strip()
    line = text.splitlines()[0] if text else type(e).__name__
    return line[:100]


def import_torch():
    import torch  # pylint: disable=import-outside-toplevel

    if not torch.cuda.is_available():
        raise RuntimeError("torch.cuda.is_available() is False")
    return torch


def torch_fill(quota):
    """Allocate in chunks (256 MiB, halving after each out-of-memory down to 2 MiB) until the
    allocator gives up; the total must end within 90-100 % of the quota, the error must be
    torch's OutOfMemoryError, and the process must be able to allocate again afterwards."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    expected = f"OutOfMemoryError at 90-100% of {gib(quota)}, then goes on"
    try:
        torch = import_torch()
    except Exception as e:  # pylint: disable=broad-except
        row(expected, f"no PyTorch on a GPU: {first_line(e)}", False)
        return
    oom_type = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    held, total, chunk = [], 0, 256 * MIB
    ooms, other, over = 0, None, False
    while chunk >= 2 * MIB:
        try:
            held.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
            total += chunk
            if total > quota:
                over = True  # not enforced: stop before taking the whole card
                break
        except oom_type:
            ooms += 1
            chunk //= 2
        except Exception as e:  # pylint: disable=broad-except
            other = e
            break
    reserved = torch.cuda.memory_reserved()
    used = ledger_used(os.environ.get("CUVISOR_STATE_DIR", ""))
    del held
    torch.cuda.empty_cache()
    try:
        after_ok = torch.ones(MIB, device="cuda").sum().item() == MIB
    except Exception:  # pylint: disable=broad-except
        after_ok = False
    share = 100.0 * total / quota
    if other is not None:
        observed = f"{type(other).__name__} after {gib(total)}: {first_line(other)}"
    elif over:
        observed = f"allocated {gib(total)}, past the quota, no error"
    else:
        observed = f"OutOfMemoryError after {gib(total)} ({share:.1f}%)"
    # The allocator's own segments must fit the quota too (the async backend's pool is not
    # counted by memory_reserved the same way, so only the others are held to it).
    reserved_ok = "cudaMallocAsync" in conf or reserved <= quota
    observed += f", reserved {gib(reserved)}"
    if isinstance(used, int):
        observed += f", ledger {gib(used)}"
        used_ok = used <= quota
    else:
        observed += f", {used}"
        used_ok = True
    if not after_ok:
        observed += ", then a 1 MiB tensor FAILED"
    ok = (
        other is None
        and not over
        and ooms > 0
        and 0.9 * quota <= total <= quota
        and reserved_ok
        and used_ok
        and after_ok
    )
    row(expected, observed, ok)


def torch_meminfo(quota):
    expected = f"total {quota} (the quota), 0 < free <= total"
    try:
        torch = import_torch()
        free, total = torch.cuda.mem_get_info()
    except Exception as e:  # pylint: disable=broad-except
        row(expected, f"{type(e).__name__}: {first_line(e)}", False)
        return
    row(expected, f"total {total}, free {free}", total == quota and 0 < free <= total)


def torch_props(quota):
    expected = f"total_memory {quota} (the quota)"
    try:
        torch = import_torch()
        total = torch.cuda.get_device_properties(0).total_memory
    except Exception as e:  # pylint: disable=broad-except
        row(expected, f"{type(e).__name__}: {first_line(e)}", False)
        return
    row(expected, f"total_memory {total}", total == quota)


def jax_prealloc(quota):
    """JAX (XLA_PYTHON_CLIENT_PREALLOCATE unset = true, MEM_FRACTION unset = 0.75) preallocates
    75 % of the GPU's memory, which under cuvisor must mean of the quota: its allocator's
    bytes_limit within 70-75 % of the quota (70: older jaxlib takes 75 % of free, not of total),
    and the ledger holding at least that and at most the quota."""
    expected = f"bytes_limit 70-75% of {gib(quota)}, ledger <= quota"
    try:
        import jax  # pylint: disable=import-outside-toplevel

        devices = jax.devices()
        dev = devices[0]
        if dev.platform != "gpu":
            raise RuntimeError(f"JAX's first device is {dev.platform}, not a GPU")
        # Something on the device, so the client is certainly up.
        jax.numpy.ones(1024).block_until_ready()
        stats = dev.memory_stats() or {}
    except Exception as e:  # pylint: disable=broad-except
        row(expected, f"{type(e).__name__}: {first_line(e)}", False)
        return
    limit = stats.get("bytes_limit")
    used = ledger_used(os.environ.get("CUVISOR_STATE_DIR", ""))
    if limit is None:
        row(expected, f"no bytes_limit in memory_stats(): {sorted(stats)}", False)
        return
    share = 100.0 * limit / quota
    observed = f"bytes_limit {gib(limit)} ({share:.1f}% of quota)"
    ok = 0.70 * quota <= limit <= 0.75 * quota + MIB
    if isinstance(used, int):
        observed += f", ledger {gib(used)}"
        ok = ok and limit <= used <= quota
    else:
        observed += f", {used}"
    row(expected, observed, ok)


def main(argv):
    checks = {
        "torch-fill": torch_fill,
        "torch-meminfo": torch_meminfo,
        "torch-props": torch_props,
        "jax-prealloc": jax_prealloc,
    }
    if len(argv) == 3 and argv[1] == "ledger":
        devices = ledger_devices(argv[2])
        if isinstance(devices, str):
            print(devices, file=sys.stderr)
            return 1
        for limit, used, peak, denied in devices:
            print(f"limit {limit} used {used} peak {peak} denied {denied}")
        return 0
    if len(argv) != 3 or argv[1] not in checks or not argv[2].isdigit():
        print(__doc__, file=sys.stderr)
        return 2
    checks[argv[1]](int(argv[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
