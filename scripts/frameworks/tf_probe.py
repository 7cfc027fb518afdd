#!/usr/bin/env python3
"""TensorFlow (`tensorflow[and-cuda]`), unmodified, under libcuvisor on the simulated GPU: run by
scripts/frameworks.sh as `cuvisor run --memory 6Gi --sim single -- python tf_probe.py`. It runs
the project's TensorFlow over-allocation test, examples/tf_stress/tf_stress.py, as it is, once
with each of TensorFlow's GPU allocators (BFC with memory growth, and cuda_malloc_async), and
turns each of its lines into one tab-separated row for the table:

    FWCHECK <client> <check> <PASS|FAIL|NOTE> <what was measured>

The quota is CUVISOR_MEMORY_LIMIT (bytes), as `cuvisor run` sets it.
"""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TF_STRESS = os.path.join(HERE, "..", "..", "examples", "tf_stress", "tf_stress.py")
MIB = 1 << 20
quota = int(os.environ["CUVISOR_MEMORY_LIMIT"])


def row(client, check, verdict, measured):
    measured = " ".join(str(measured).split())
    print(f"FWCHECK\t{client}\t{check}\t{verdict}\t{measured}", flush=True)


for allocator in ("bfc", "cuda_malloc_async"):
    client = f"tensorflow-{allocator}"
    ran = subprocess.run(
        [sys.executable, TF_STRESS, "--allocator", allocator],
        capture_output=True,
        text=True,
        check=False,
    )
    lines = ran.stdout.splitlines()
    for line in lines:
        if line.startswith("GPU 0: total "):
            total = int(line.split()[3]) * MIB
            verdict = "PASS" if total == quota else "FAIL"
            row(client, "total = quota", verdict, line[len("GPU 0: "):])
        elif line.startswith("fraction "):
            label, _, what = line.partition(": ")
            verdict = "FAIL" if what.startswith(("FAIL", "CRASHED")) else "PASS"
            row(client, label, verdict, what[:200])
    verdict = "PASS" if ran.returncode == 0 else "FAIL"
    last = lines[-1] if lines else (ran.stderr.strip().splitlines() or ["no output"])[-1]
    row(client, "tf_stress exit status", verdict, f"{ran.returncode}: {last[:200]}")
