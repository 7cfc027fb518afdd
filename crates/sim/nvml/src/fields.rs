//! `nvmlDeviceGetFieldValues`: many facts in one call, each with its own return code. The fields
//! modelled are the ones monitoring tools ask for (nvitop: NVLink link count and per-link data
//! counters; DCGM-style exporters: ECC mode and counts, energy, power, memory temperature),
//! answered from the same model as the single-purpose queries; every other field id below
//! NVML_FI_MAX gets NVML_ERROR_NOT_SUPPORTED in its entry, and an id at or past NVML_FI_MAX
//! NVML_ERROR_INVALID_ARGUMENT in its entry, while the call itself succeeds, as documented
//! ("NVML_SUCCESS if any values in values were populated. Note that you must check the
//! nvmlReturn field of each value").

use crate::device::model_dev;
use crate::sensors::{energy_mj, power_at, temperature_at, utilization};
use crate::{export, read, write};
use cuvisor_cuda_abi::nvml::*;
use cuvisor_sim::model::Device;
use cuvisor_sim::state::now_ns;
use cuvisor_sim::Sim;
use std::ffi::{c_int, c_longlong, c_uint};

/// `nvmlFieldValue_t` (nvml.h): field id, scope id (the link for NVLink fields), CPU timestamp
/// in µs, latency in µs, `nvmlValueType_t`, the entry's return code, and an 8-byte value union.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
#[allow(non_snake_case)]
pub struct nvmlFieldValue_t {
    pub fieldId: c_uint,
    pub scopeId: c_uint,
    pub timestamp: c_longlong,
    pub latencyUsec: c_longlong,
    pub valueType: c_uint,
    pub nvmlReturn: nvmlReturn_t,
    pub value: u64,
}
const _: () = assert!(std::mem::size_of::<nvmlFieldValue_t>() == 40);

// Field ids (nvml.h `NVML_FI_*`; 3 to 6 are the SBE/DBE volatile/aggregate totals).
pub const FI_DEV_ECC_CURRENT: c_uint = 1;
pub const FI_DEV_ECC_PENDING: c_uint = 2;
pub const FI_DEV_ECC_SBE_VOL_TOTAL: c_uint = 3;
pub const FI_DEV_ECC_DBE_AGG_TOTAL: c_uint = 6;
pub const FI_DEV_RETIRED_SBE: c_uint = 29;
pub const FI_DEV_RETIRED_DBE: c_uint = 30;
pub const FI_DEV_MEMORY_TEMP: c_uint = 82;
pub const FI_DEV_TOTAL_ENERGY_CONSUMPTION: c_uint = 83;
pub const FI_DEV_NVLINK_LINK_COUNT: c_uint = 91;
pub const FI_DEV_NVLINK_THROUGHPUT_DATA_TX: c_uint = 138;
pub const FI_DEV_NVLINK_THROUGHPUT_RAW_RX: c_uint = 141;
pub const FI_DEV_POWER_AVERAGE: c_uint = 185;
pub const FI_DEV_POWER_INSTANT: c_uint = 186;
pub const FI_MAX: c_uint = 308;

// `nvmlValueType_t`.
const VALUE_UNSIGNED_INT: c_uint = 1;
const VALUE_UNSIGNED_LONG_LONG: c_uint = 3;

/// HBM sits this much warmer than the GPU core (UNVERIFIED rule of thumb: an idle H100's
/// nvidia-smi -q reads GPU 34 C, memory 40 C).
const MEMORY_TEMPERATURE_OFFSET_C: u32 = 6;

/// HBM boards report a memory temperature; GDDR boards (the A10) do not.
fn has_hbm(d: &Device) -> bool {
    matches!(d.cc, (7, 0) | (8, 0) | (9, 0)) || d.cc.0 >= 10
}

/// One field's (value type, value), or the code its entry gets.
fn field(
    sim: &Sim,
    index: usize,
    d: &Device,
    id: c_uint,
    scope: c_uint,
) -> Result<(c_uint, u64), nvmlReturn_t> {
    let uint = |v: u32| Ok((VALUE_UNSIGNED_INT, v as u64));
    let ull = |v: u64| Ok((VALUE_UNSIGNED_LONG_LONG, v));
    let links = d.links.len() as c_uint;
    match id {
        // ECC is on (nvmlDeviceGetEccMode) and no memory error is modelled.
        FI_DEV_ECC_CURRENT | FI_DEV_ECC_PENDING => uint(1),
        FI_DEV_ECC_SBE_VOL_TOTAL..=FI_DEV_ECC_DBE_AGG_TOTAL => ull(0),
        // Page retirement is Volta's; Ampere and later remap rows instead ("Retired Pages ... :
        // N/A" in an H100's nvidia-smi -q).
        FI_DEV_RETIRED_SBE | FI_DEV_RETIRED_DBE if d.cc.0 < 8 => ull(0),
        FI_DEV_MEMORY_TEMP if has_hbm(d) => {
            uint(temperature_at(utilization(sim, index)) + MEMORY_TEMPERATURE_OFFSET_C)
        }
        FI_DEV_TOTAL_ENERGY_CONSUMPTION if d.cc.0 >= 7 => {
            let busy = sim
                .shared
                .device(index)
                .busy_total
                .load(std::sync::atomic::Ordering::Acquire);
            ull(energy_mj(d, now_ns(), busy))
        }
        // Documented: "supported on Ampere (except GA100) or newer architectures".
        FI_DEV_POWER_AVERAGE if d.cc.0 >= 8 && d.cc != (8, 0) => {
            uint(power_at(d, utilization(sim, index)))
        }
        FI_DEV_POWER_INSTANT => uint(power_at(d, utilization(sim, index))),
        FI_DEV_NVLINK_LINK_COUNT if d.nvlink_version > 0 => uint(links),
        // Per-link data counters in KiB (DATA_TX 138, DATA_RX 139, RAW_TX 140, RAW_RX 141):
        // the bytes the simulated driver timed over the link (`sensors::nvlink_kib`; raw
        // counts no protocol overhead, so it equals data); a link the device lacks is an
        // invalid scope.
        FI_DEV_NVLINK_THROUGHPUT_DATA_TX..=FI_DEV_NVLINK_THROUGHPUT_RAW_RX
            if d.nvlink_version > 0 =>
        {
            let tx = (id - FI_DEV_NVLINK_THROUGHPUT_DATA_TX).is_multiple_of(2);
            match crate::sensors::nvlink_kib(sim, index, scope as usize, tx) {
                Some(kib) if scope < links => ull(kib),
                _ => Err(ret::ERROR_INVALID_ARGUMENT),
            }
        }
        id if id >= FI_MAX => Err(ret::ERROR_INVALID_ARGUMENT),
        _ => Err(ret::ERROR_NOT_SUPPORTED),
    }
}

fn realtime_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

export! {
    /// Documented: NVML_ERROR_INVALID_ARGUMENT if the device is invalid or `values` is NULL.
    /// A count of 0 or less fills nothing.
    fn nvmlDeviceGetFieldValues(device: nvmlDevice_t, count: c_int, values: *mut nvmlFieldValue_t) {
        let (sim, index, d) = model_dev(device)?;
        if values.is_null() {
            return Err(ret::ERROR_INVALID_ARGUMENT);
        }
        let now = realtime_us();
        for i in 0..count.max(0) as usize {
            let p = values.wrapping_add(i);
            let mut v = read(p)?;
            v.timestamp = now;
            v.latencyUsec = 0;
            match field(sim, index, d, v.fieldId, v.scopeId) {
                Ok((kind, value)) => {
                    v.valueType = kind;
                    v.value = value;
                    v.nvmlReturn = ret::SUCCESS;
                }
                Err(code) => v.nvmlReturn = code,
            }
            write(p, v)?;
        }
        Ok(())
    }
}
