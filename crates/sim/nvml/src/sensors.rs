//! Board sensors and modes: temperature, power and energy, and the compute mode.
//!
//! The simulator has no thermal or electrical model, so these follow from what it does model, the
//! kernel timeline, by one simple deterministic rule each (documented at the constants): a GPU
//! idles cool and at a fraction of its board power and rises linearly with the utilization NVML
//! reports for the last second. Monitoring tools (nvidia-smi-like dashboards, DCGM-style
//! exporters, the NVIDIA device plugin's health checks) read these on every poll; a real
//! datacenter GPU answers them all, so NOT_SUPPORTED here would send them down paths no real
//! machine takes.

use crate::device::model_dev;
use crate::{export, read, write, Res};
use cuvisor_cuda_abi::nvml::*;
use cuvisor_sim::model::Device;
use cuvisor_sim::state::now_ns;
use cuvisor_sim::Sim;
use std::ffi::{c_int, c_uint, c_ulonglong};

/// `nvmlTemperatureSensors_t`: the only sensor nvml.h defines.
pub const NVML_TEMPERATURE_GPU: c_uint = 0;

/// `nvmlComputeMode_t`: NVML_COMPUTEMODE_DEFAULT, several contexts per device from any process
/// (what a GPU shared by containers must be in; cuvisor never changes it).
pub const NVML_COMPUTEMODE_DEFAULT: c_uint = 0;

/// `nvmlTemperature_v1_t` (nvml.h since R565, `nvmlDeviceGetTemperatureV`): the caller sets
/// `version` and `sensorType`, NVML fills `temperature` (°C).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
#[allow(non_snake_case)]
pub struct nvmlTemperature_v1_t {
    pub version: c_uint,
    pub sensorType: c_uint,
    pub temperature: c_int,
}

/// `nvmlTemperature_v1` = `NVML_STRUCT_VERSION(Temperature, 1)`: 0x0100000C, the value pynvml
/// (nvidia-ml-py 13.615) hard-codes.
pub const NVML_TEMPERATURE_V1: c_uint =
    nvml_struct_version(std::mem::size_of::<nvmlTemperature_v1_t>(), 1);
const _: () = assert!(NVML_TEMPERATURE_V1 == 0x0100_000C);

/// Core temperature of an idle GPU, °C (datacenter boards idle in the low 30s in a cooled rack).
pub const IDLE_TEMPERATURE_C: u32 = 33;
/// What a fully busy GPU adds to [`IDLE_TEMPERATURE_C`], °C: 100 % utilization reads 63 °C, well
/// below any slowdown threshold, so no client sees a thermal event the simulator does not raise.
pub const LOAD_TEMPERATURE_RISE_C: u32 = 30;
/// An idle GPU draws this fraction of its board power (`idle = TDP * 3 / 20`, 15 %).
const IDLE_POWER_NUM: u32 = 3;
const IDLE_POWER_DEN: u32 = 20;

/// Board power (TDP) in milliwatts for the GPUs the presets model, from NVIDIA's product
/// datasheets: A100 PCIe 250 W, A100 SXM4 400 W, V100 SXM2 300 W, A10 150 W, H200 SXM 700 W (an
/// H200's nvidia-smi -q: "Default Power Limit: 700.00 W"). The model has no
/// power field, so the board is recognised by its PCI device id (high 16 bits of
/// `pciDeviceId`); a model file's device keeps the A100 PCIe id unless it is one of these, and so
/// gets 250 W.
pub fn board_power_mw(d: &Device) -> u32 {
    match d.pci_device_id >> 16 {
        0x20b2 => 400_000, // A100-SXM4-80GB
        0x1db1 => 300_000, // V100-SXM2-16GB
        0x2236 => 150_000, // A10
        0x2335 => 700_000, // H200 SXM
        _ => 250_000,      // A100 PCIe (0x20f1) and anything else
    }
}

pub fn idle_power_mw(d: &Device) -> u32 {
    board_power_mw(d) / IDLE_POWER_DEN * IDLE_POWER_NUM
}

/// What nvmlDeviceGetUtilizationRates reports as `gpu`, percent of the last second.
pub(crate) fn utilization(sim: &Sim, d: usize) -> u32 {
    sim.shared
        .device_utilization(d, crate::device::UTIL_WINDOW_NS)
        .min(100)
}

/// °C at `util` percent: linear from idle to idle + rise.
/// The window nvmlDeviceGetPcieThroughput reports over: "This function is querying a byte
/// counter over a 20ms interval and thus is the PCIe throughput over that interval" (nvml.h).
/// The simulator reads the 20 ms just past instead of waiting for the next.
pub const PCIE_WINDOW_NS: u64 = 20_000_000;

/// KB/s (KiB, as NVML counts) device `d`'s PCIe link carried over the last 20 ms: received by
/// the device (host to device, `rx`) or sent (device to host). The copies the simulated driver
/// timed over the link (`cuvisor_sim::state::Shared::reserve`) fill these counters.
pub(crate) fn pcie_throughput(sim: &Sim, d: usize, rx: bool) -> u32 {
    sim.shared
        .pcie_kib_per_s(d, rx, PCIE_WINDOW_NS)
        .min(u32::MAX as u64) as u32
}

/// KiB that NVLink `link` of device `d` ever carried, sent (`tx`) or received: the bytes the
/// simulated driver timed over the resource the link is part of (the bonded links to one peer
/// GPU, or the links into the NVSwitches), shared evenly by its links. None: no such link.
pub(crate) fn nvlink_kib(sim: &Sim, d: usize, link: usize, tx: bool) -> Option<u64> {
    use cuvisor_fabric::Resource;
    use cuvisor_sim::model::LinkPeer;
    let dev = sim.model.devices.get(d)?;
    let f = &sim.fabric;
    let peer = dev.links.get(link)?;
    let (r, n) = match *peer {
        LinkPeer::Gpu(b) => {
            let r = if tx {
                Resource::NvLink(d, b)
            } else {
                Resource::NvLink(b, d)
            };
            (r, f.direct_links(d, b))
        }
        LinkPeer::Switch(_) => {
            let r = if tx {
                Resource::SwitchPortOut(d)
            } else {
                Resource::SwitchPortIn(d)
            };
            (r, f.gpus().get(d)?.switch_links)
        }
    };
    let bytes = f.index(r).map_or(0, |i| sim.shared.link_bytes(i));
    Some(bytes / n.max(1) as u64 / 1024)
}

pub fn temperature_at(util: u32) -> u32 {
    IDLE_TEMPERATURE_C + LOAD_TEMPERATURE_RISE_C * util.min(100) / 100
}

/// mW at `util` percent: linear from the idle draw to the board power.
pub fn power_at(d: &Device, util: u32) -> u32 {
    let idle = idle_power_mw(d);
    idle + (board_power_mw(d) - idle) / 100 * util.min(100)
}

/// mJ since the driver loaded (CLOCK_MONOTONIC zero, the boot): the idle draw all along plus the
/// extra of a busy GPU for all kernel time ever queued on the device (counted when queued, so
/// that the counter only grows, which is what clients differencing two readings rely on).
pub fn energy_mj(d: &Device, now_ns: u64, busy_ns: u64) -> u64 {
    let idle = idle_power_mw(d) as u128;
    let extra = (board_power_mw(d) - idle_power_mw(d)) as u128;
    ((idle * now_ns as u128 + extra * busy_ns as u128) / 1_000_000_000) as u64
}

fn check_sensor(sensor: c_uint) -> Res {
    if sensor == NVML_TEMPERATURE_GPU {
        Ok(())
    } else {
        Err(ret::ERROR_INVALID_ARGUMENT)
    }
}

export! {
    /// Documented: NVML_ERROR_INVALID_ARGUMENT for a bad sensor or a NULL `temp`.
    fn nvmlDeviceGetTemperature(device: nvmlDevice_t, sensor: c_uint, temp: *mut c_uint) {
        let (sim, d, _) = model_dev(device)?;
        check_sensor(sensor)?;
        write(temp, temperature_at(utilization(sim, d)))
    }

    /// The versioned form (the unversioned one is deprecated as of CUDA 13): `version` must be
    /// nvmlTemperature_v1, else NVML_ERROR_ARGUMENT_VERSION_MISMATCH, as every versioned NVML
    /// struct is checked.
    fn nvmlDeviceGetTemperatureV(device: nvmlDevice_t, temperature: *mut nvmlTemperature_v1_t) {
        let (sim, d, _) = model_dev(device)?;
        let mut t = read(temperature)?;
        if t.version != NVML_TEMPERATURE_V1 {
            return Err(ret::ERROR_ARGUMENT_VERSION_MISMATCH);
        }
        check_sensor(t.sensorType)?;
        t.temperature = temperature_at(utilization(sim, d)) as c_int;
        write(temperature, t)
    }

    /// Milliwatts, from the utilization of the last second (see [`power_at`]).
    fn nvmlDeviceGetPowerUsage(device: nvmlDevice_t, power: *mut c_uint) {
        let (sim, d, m) = model_dev(device)?;
        write(power, power_at(m, utilization(sim, d)))
    }

    /// The board power: no one has set a lower limit (that needs root and nvidia-smi -pl).
    fn nvmlDeviceGetPowerManagementLimit(device: nvmlDevice_t, limit: *mut c_uint) {
        write(limit, board_power_mw(model_dev(device)?.2))
    }

    fn nvmlDeviceGetPowerManagementDefaultLimit(device: nvmlDevice_t, limit: *mut c_uint) {
        write(limit, board_power_mw(model_dev(device)?.2))
    }

    /// The smaller of the management limit and any other (none here): the board power.
    fn nvmlDeviceGetEnforcedPowerLimit(device: nvmlDevice_t, limit: *mut c_uint) {
        write(limit, board_power_mw(model_dev(device)?.2))
    }

    /// Millijoules since the driver loaded (see [`energy_mj`]). Documented "for Volta or newer":
    /// older devices a model file describes answer NVML_ERROR_NOT_SUPPORTED.
    fn nvmlDeviceGetTotalEnergyConsumption(device: nvmlDevice_t, energy: *mut c_ulonglong) {
        let (sim, d, m) = model_dev(device)?;
        if m.cc.0 < 7 {
            return Err(ret::ERROR_NOT_SUPPORTED);
        }
        let busy = sim.shared.device(d).busy_total.load(std::sync::atomic::Ordering::Acquire);
        write(energy, energy_mj(m, now_ns(), busy))
    }

    fn nvmlDeviceGetComputeMode(device: nvmlDevice_t, mode: *mut c_uint) {
        model_dev(device)?;
        write(mode, NVML_COMPUTEMODE_DEFAULT)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn preset_device(preset: &str) -> Device {
        cuvisor_sim::model::preset(preset).unwrap().devices[0].clone()
    }

    #[test]
    fn temperature_rises_with_utilization_within_bounds() {
        assert_eq!(temperature_at(0), 33);
        assert_eq!(temperature_at(50), 48);
        assert_eq!(temperature_at(100), 63);
        assert_eq!(temperature_at(250), 63);
    }

    #[test]
    fn power_goes_from_idle_to_the_board_power() {
        let a100 = preset_device("single");
        assert_eq!(board_power_mw(&a100), 250_000);
        assert_eq!(power_at(&a100, 0), 37_500);
        assert_eq!(power_at(&a100, 100), 250_000);
        assert_eq!(board_power_mw(&preset_device("dgx-a100")), 400_000);
        assert_eq!(board_power_mw(&preset_device("dgx1-v100")), 300_000);
        assert_eq!(board_power_mw(&preset_device("pcie-8")), 150_000);
    }

    #[test]
    fn energy_is_idle_power_over_uptime_plus_busy_extra() {
        let a100 = preset_device("single");
        // 10 s up, 2 s of it busy: 37.5 W * 10 s + 212.5 W * 2 s = 800 J.
        assert_eq!(energy_mj(&a100, 10_000_000_000, 2_000_000_000), 800_000);
    }
}
