"""PyTorch 2.15's first allocation, as tests/torch215.rs runs it on the simulator: prints one
JSON object of what it saw (no verdicts: the test checks them)."""

import json

import torch

MIB = 1 << 20
out = {"version": torch.__version__, "cuda": torch.version.cuda}
out["is_available"] = torch.cuda.is_available()
free0, total = torch.cuda.mem_get_info()
out["mem_get_info"] = [free0, total]
# The first allocation: before the simulator resolved every entry point PyTorch 2.15's allocator
# looks up, this raised "CUDA error: named symbol not found".
x = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
out["empty"] = [x.numel(), x.device.type]
out["mem_get_info_after_empty"] = list(torch.cuda.mem_get_info())
out["reserved"] = torch.cuda.memory_reserved()
del x
torch.cuda.empty_cache()
out["mem_get_info_after_free"] = list(torch.cuda.mem_get_info())
y = torch.ones(1 << 20, device="cuda") * 2
torch.cuda.synchronize()
out["elementwise"] = list(y.shape)
print(json.dumps(out))
