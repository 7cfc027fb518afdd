"""nvitop's Python API, as dashboards use it: every device's snapshot and its GPU processes, as
JSON (values nvitop could not get are its "N/A")."""
import json

import nvitop

KEYS = [
    "index", "name", "uuid", "bus_id", "memory_total", "memory_used", "memory_free",
    "gpu_utilization", "memory_utilization", "encoder_utilization", "decoder_utilization",
    "sm_clock", "memory_clock", "fan_speed", "temperature", "power_usage", "power_limit",
    "display_active", "display_mode", "persistence_mode", "performance_state",
    "total_volatile_uncorrected_ecc_errors", "compute_mode", "mig_mode",
]
out = []
for device in nvitop.Device.all():
    snap = device.as_snapshot()
    entry = {k: (v if isinstance(v, (int, float, str)) else str(v)) for k in KEYS for v in [getattr(snap, k)]}
    entry["nvlink_link_count"] = device.nvlink_link_count()
    entry["processes"] = sorted([pid, p.gpu_memory()] for pid, p in device.processes().items())
    out.append(entry)
print(json.dumps(out))
