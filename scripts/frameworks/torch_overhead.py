"""What interception costs a real framework: a PyTorch loop of small elementwise ops and
allocations, timed per iteration (best of its rounds). scripts/frameworks.sh --bench runs it on
the simulator directly and under `cuvisor run` in turns and compares the two.

Prints one line: "BENCH <ns per iteration> <iterations per round> <rounds>".
"""
import sys
import time

import torch

ITERS = 2000
ROUNDS = 15

x = torch.ones(4096, device="cuda")
# Warm-up: the caching allocator's blocks, the kernels' first launches, the estimates.
for _ in range(ITERS):
    y = (x * 2 + 1).relu_()
    z = torch.empty(64 * 1024, device="cuda")
torch.cuda.synchronize()

best = float("inf")
for _ in range(ROUNDS):
    t = time.perf_counter_ns()
    for _ in range(ITERS):
        y = (x * 2 + 1).relu_()  # three kernel launches
        z = torch.empty(64 * 1024, device="cuda")  # an allocation and a free (cached)
        del z
    torch.cuda.synchronize()
    best = min(best, (time.perf_counter_ns() - t) / ITERS)
print(f"BENCH {best:.0f} {ITERS} {ROUNDS}")
sys.stdout.flush()
