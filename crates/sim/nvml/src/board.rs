//! What monitoring tools read about the board besides memory and processes: brand, the PCI
//! forms they still call (the v1 struct, the versioned `Ext`), VBIOS, clocks and performance
//! levels, persistence/display/ECC/virtualization modes, encoder/decoder utilization, MIG
//! device counts, S-class units and the driver branch. Found by running gpustat 1.1.1, nvitop
//! 1.7.2 and nvidia-ml-py's own `example.py` on the simulator with every NVML call traced
//! (crates/sim/tests/monitoring.rs), and from the calls NVIDIA's k8s-device-plugin makes through
//! go-nvlib (`GetBrand`, `GetMaxMigDeviceCount`, ...).
//!
//! The values follow what a datacenter board answers in `nvidia-smi -q` outputs (an H100 80GB
//! HBM3 on driver 560.35.03 and a Tesla T4 on 530.30.02, both found with this project's code
//! search: "Product Brand : NVIDIA", "Display Mode : Enabled", "Display Active : Disabled",
//! "Persistence Mode : Enabled", "Performance State : P0" while idle, "ECC Mode Current/Pending :
//! Enabled", "Virtualization Mode : None", "Utilization Encoder 0 % / Decoder 0 %", "Fan Speed :
//! N/A", VBIOS "96.00.A5.00.01" and "90.04.38.00.03").

use crate::device::{dev, model_dev, pci_info};
use crate::{c_array, export, read, sim, write, write_str, Res};
use cuvisor_cuda_abi::nvml::*;
use cuvisor_sim::model::Device;
use std::ffi::{c_char, c_uint};

// ---- nvml.h values (nvidia-nvml-dev 13.4.92) ----------------------------------------------------

/// `nvmlBrandType_t`.
pub const NVML_BRAND_QUADRO: c_uint = 1;
pub const NVML_BRAND_GEFORCE: c_uint = 5;
pub const NVML_BRAND_TITAN: c_uint = 6;
pub const NVML_BRAND_QUADRO_RTX: c_uint = 12;
pub const NVML_BRAND_NVIDIA_RTX: c_uint = 13;
pub const NVML_BRAND_NVIDIA: c_uint = 14;
pub const NVML_BRAND_GEFORCE_RTX: c_uint = 15;

/// `nvmlGpuVirtualizationMode_t`: NVML_GPU_VIRTUALIZATION_MODE_NONE, bare metal.
pub const NVML_GPU_VIRTUALIZATION_MODE_NONE: c_uint = 0;
/// `nvmlPstates_t`: NVML_PSTATE_0, maximum performance.
pub const NVML_PSTATE_0: c_uint = 0;
/// `nvmlMemoryErrorType_t` and `nvmlEccCounterType_t`: the two of each nvml.h defines.
const NVML_MEMORY_ERROR_TYPE_COUNT: c_uint = 2;
const NVML_ECC_COUNTER_TYPE_COUNT: c_uint = 2;

/// `NVML_PERF_MODES_BUFFER_SIZE`.
pub const NVML_PERF_MODES_BUFFER_SIZE: usize = 2048;

/// The pre-v2 `nvmlPciInfo_t` that `nvmlDeviceGetPciInfo` (v1) fills: a 16-byte bus id in the
/// legacy `%04X:%02X:%02X.0` form, then domain, bus, device, device id and subsystem id. v2
/// (NVML 9.x) renamed the first field `busIdLegacy` and appended the 32-byte `busId`; the old
/// layout ended in four reserved words instead, so v1 writes these 36 bytes and nothing past
/// them (nvml.h still declares v1 with today's struct, which starts with the same 36 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[allow(non_snake_case)]
pub struct nvmlPciInfo_v1_t {
    pub busId: [c_char; 16],
    pub domain: c_uint,
    pub bus: c_uint,
    pub device: c_uint,
    pub pciDeviceId: c_uint,
    pub pciSubSystemId: c_uint,
}
const _: () = assert!(std::mem::size_of::<nvmlPciInfo_v1_t>() == 36);

/// `nvmlPciInfoExt_v1_t` (nvml.h): version, domain, bus, device, device id, subsystem id, PCI
/// base class and sub class, then the 32-byte bus id.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[allow(non_snake_case)]
pub struct nvmlPciInfoExt_v1_t {
    pub version: c_uint,
    pub domain: c_uint,
    pub bus: c_uint,
    pub device: c_uint,
    pub pciDeviceId: c_uint,
    pub pciSubSystemId: c_uint,
    pub baseClass: c_uint,
    pub subClass: c_uint,
    pub busId: [c_char; 32],
}
pub const NVML_PCI_INFO_EXT_V1: c_uint =
    nvml_struct_version(std::mem::size_of::<nvmlPciInfoExt_v1_t>(), 1);
const _: () = assert!(std::mem::size_of::<nvmlPciInfoExt_v1_t>() == 64);

/// `nvmlSystemDriverBranchInfo_v1_t`: version, then an 80-byte branch string.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct nvmlSystemDriverBranchInfo_v1_t {
    pub version: c_uint,
    pub branch: [c_char; 80],
}
const _: () = assert!(std::mem::size_of::<nvmlSystemDriverBranchInfo_v1_t>() == 84);

/// `nvmlDevicePerfModes_v1_t` and `nvmlDeviceCurrentClockFreqs_v1_t`: the same shape, a version
/// and a 2048-byte string.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct nvmlPerfString_v1_t {
    pub version: c_uint,
    pub str_: [c_char; NVML_PERF_MODES_BUFFER_SIZE],
}
pub const NVML_PERF_STRING_V1: c_uint =
    nvml_struct_version(std::mem::size_of::<nvmlPerfString_v1_t>(), 1);
const _: () = assert!(NVML_PERF_STRING_V1 == 0x0100_0804);

// ---- the board's facts ------------------------------------------------------------------------

/// The brand NVML reports: datacenter boards say NVIDIA (nvidia-smi's "Product Brand : NVIDIA"
/// on an H100 and on a board still named "Tesla T4"); a model file's workstation or consumer
/// board is recognised by its name's prefix.
pub fn brand(d: &Device) -> c_uint {
    let n = d.name.trim_start_matches("NVIDIA ");
    if n.starts_with("GeForce RTX") {
        NVML_BRAND_GEFORCE_RTX
    } else if n.starts_with("GeForce") {
        NVML_BRAND_GEFORCE
    } else if n.starts_with("TITAN") {
        NVML_BRAND_TITAN
    } else if n.starts_with("Quadro RTX") {
        NVML_BRAND_QUADRO_RTX
    } else if n.starts_with("Quadro") {
        NVML_BRAND_QUADRO
    } else if n.starts_with("RTX") {
        NVML_BRAND_NVIDIA_RTX
    } else {
        NVML_BRAND_NVIDIA
    }
}

/// A VBIOS version in NVIDIA's five-byte form. The first byte names the chip family, as real
/// ones do (90 = TU10x in the T4's 90.04.38.00.03, 96 = GH100 in the H100's 96.00.A5.00.01;
/// 88 = GV100, 92 = GA100, 94 = GA10x by the same numbering); the rest names no real release
/// (the simulator has no VBIOS to report), so that no tool mistakes it for one.
pub fn vbios_version(d: &Device) -> String {
    let family = match d.cc {
        (7, 0) | (7, 2) => 0x88,
        (7, 5) => 0x90,
        (8, 0) => 0x92,
        (8, _) => 0x94,
        (9, _) => 0x96,
        (10.., _) => 0x97,
        _ => 0x86,
    };
    format!("{family:02X}.00.00.00.01")
}

/// The lowest SM clock the board runs at, MHz: what `nvidia-smi -q -d SUPPORTED_CLOCKS` lists
/// last (UNVERIFIED: 210 MHz on Ampere and Hopper, 135 MHz on Volta, as recalled from such
/// listings; no stored output found).
pub fn min_sm_clock_mhz(d: &Device) -> u32 {
    if d.cc.0 < 8 {
        135
    } else {
        210
    }
}

/// The clocks the board runs at now, MHz: the peak ones. A datacenter board under persistence
/// mode keeps P0 and its boost clock while idle (an A100-PCIE-40GB system report on driver
/// 470.57.02, found with this project's code search: 29 C, persistence Enabled, "GPU clock
/// frequency 1410 MHz", "Max GPU clock frequency 1410 MHz"); HBM runs at one fixed clock.
fn current_clock_mhz(d: &Device, kind: c_uint) -> Result<u32, nvmlReturn_t> {
    match kind {
        0 | 1 => Ok(d.specs.clock_khz / 1000),
        2 => Ok(d.specs.memory_clock_khz / 1000),
        // The video clock is not modelled (nvmlDeviceGetMaxClockInfo says the same).
        3 => Err(ret::ERROR_NOT_SUPPORTED),
        _ => Err(ret::ERROR_INVALID_ARGUMENT),
    }
}

/// The string `nvmlDeviceGetCurrentClockFreqs` and each level of `nvmlDeviceGetPerformanceModes`
/// use: nvidia-settings' `GPUCurrentClockFreqsString` / `GPUPerfModes` key=value list (an NVML
/// 580 answer quoted in a public note reads "nvclock=968, nvclockmin=208, nvclockmax=3003,
/// nvclockeditable=0"; nvidia-settings outputs go on with memclock and memTransferRate, twice
/// the memory clock). Clocks are not editable on the simulator.
fn clock_string(d: &Device) -> String {
    let nv = d.specs.clock_khz / 1000;
    let mem = d.specs.memory_clock_khz / 1000;
    format!(
        "nvclock={nv}, nvclockmin={}, nvclockmax={nv}, nvclockeditable=0, memclock={mem}, \
         memclockmin={mem}, memclockmax={mem}, memclockeditable=0, memTransferRate={}, \
         memTransferRatemin={}, memTransferRatemax={}, memTransferRateeditable=0",
        min_sm_clock_mhz(d),
        mem * 2,
        mem * 2,
        mem * 2
    )
}

/// NVIDIA's driver branches are named after the release's major version ("r580" for
/// 580.95.05). UNVERIFIED: the exact string nvmlSystemGetDriverBranch answers was not found in
/// any stored output; this is the branch name NVIDIA's release notes use, with the `_00` of the
/// first production branch.
pub fn driver_branch(release: &str) -> String {
    let major = release.split('.').next().unwrap_or("0");
    format!("r{major}_00")
}

fn perf_string(p: *mut nvmlPerfString_v1_t, s: &str) -> Res {
    let v = read(p as *const c_uint)?;
    if v != NVML_PERF_STRING_V1 {
        return Err(ret::ERROR_ARGUMENT_VERSION_MISMATCH);
    }
    write(
        p,
        nvmlPerfString_v1_t {
            version: v,
            str_: c_array(s),
        },
    )
}

export! {
    fn nvmlDeviceGetBrand(device: nvmlDevice_t, kind: *mut c_uint) {
        write(kind, brand(model_dev(device)?.2))
    }

    /// The v1 form (see [`nvmlPciInfo_v1_t`]): 36 bytes, the bus id in the legacy form.
    fn nvmlDeviceGetPciInfo(device: nvmlDevice_t, pci: *mut nvmlPciInfo_v1_t) {
        let d = model_dev(device)?.2;
        write(pci, nvmlPciInfo_v1_t {
            busId: c_array(&format!("{:04X}:{:02X}:{:02X}.0", d.pci_domain, d.pci_bus, d.pci_device)),
            domain: d.pci_domain,
            bus: d.pci_bus,
            device: d.pci_device,
            pciDeviceId: d.pci_device_id,
            pciSubSystemId: d.specs.pci_subsystem_id,
        })
    }

    /// Class 0x03 (display controller), subclass 0x02 (3D controller), what a datacenter GPU
    /// without display outputs is on the bus (nvidia-smi -q of an H100: "Base Classcode : 0x3",
    /// "Sub Classcode : 0x2"). A struct of another version: NVML_ERROR_ARGUMENT_VERSION_MISMATCH.
    fn nvmlDeviceGetPciInfoExt(device: nvmlDevice_t, pci: *mut nvmlPciInfoExt_v1_t) {
        let d = model_dev(device)?.2;
        let version = read(pci as *const c_uint)?;
        if version != NVML_PCI_INFO_EXT_V1 {
            return Err(ret::ERROR_ARGUMENT_VERSION_MISMATCH);
        }
        write(pci, nvmlPciInfoExt_v1_t {
            version,
            domain: d.pci_domain,
            bus: d.pci_bus,
            device: d.pci_device,
            pciDeviceId: d.pci_device_id,
            pciSubSystemId: d.specs.pci_subsystem_id,
            baseClass: 0x3,
            subClass: 0x2,
            // NVML's upper-case form, as in nvmlPciInfo_t (device::pci_info).
            busId: pci_info(d.pci_domain, d.pci_bus, d.pci_device, d.pci_device_id).busId,
        })
    }

    fn nvmlDeviceGetVbiosVersion(device: nvmlDevice_t, version: *mut c_char, length: c_uint) {
        write_str(version, length, &vbios_version(model_dev(device)?.2))
    }

    /// Bare metal: NVML_GPU_VIRTUALIZATION_MODE_NONE.
    fn nvmlDeviceGetVirtualizationMode(device: nvmlDevice_t, mode: *mut c_uint) {
        dev(device)?;
        write(mode, NVML_GPU_VIRTUALIZATION_MODE_NONE)
    }

    /// Enabled, as on servers running nvidia-persistenced (NVIDIA's recommendation for
    /// datacenter GPUs, and what the nvidia-smi outputs above show).
    fn nvmlDeviceGetPersistenceMode(device: nvmlDevice_t, mode: *mut nvmlEnableState_t) {
        dev(device)?;
        write(mode, NVML_FEATURE_ENABLED)
    }

    /// Display mode Enabled (the outputs above), no display active: nothing is attached.
    fn nvmlDeviceGetDisplayMode(device: nvmlDevice_t, mode: *mut nvmlEnableState_t) {
        dev(device)?;
        write(mode, NVML_FEATURE_ENABLED)
    }

    fn nvmlDeviceGetDisplayActive(device: nvmlDevice_t, active: *mut nvmlEnableState_t) {
        dev(device)?;
        write(active, NVML_FEATURE_DISABLED)
    }

    /// P0 always: a datacenter board in persistence mode stays there ("Performance State : P0"
    /// on an idle H100 above).
    fn nvmlDeviceGetPerformanceState(device: nvmlDevice_t, state: *mut c_uint) {
        dev(device)?;
        write(state, NVML_PSTATE_0)
    }

    /// The deprecated name of nvmlDeviceGetPerformanceState.
    fn nvmlDeviceGetPowerState(device: nvmlDevice_t, state: *mut c_uint) {
        dev(device)?;
        write(state, NVML_PSTATE_0)
    }

    /// ECC on, now and after the next reset (the boards modelled ship with it on; HBM's cannot
    /// be turned off).
    fn nvmlDeviceGetEccMode(device: nvmlDevice_t, current: *mut nvmlEnableState_t, pending: *mut nvmlEnableState_t) {
        dev(device)?;
        if current.is_null() || pending.is_null() {
            return Err(ret::ERROR_INVALID_ARGUMENT);
        }
        write(current, NVML_FEATURE_ENABLED)?;
        write(pending, NVML_FEATURE_ENABLED)
    }

    fn nvmlDeviceGetDefaultEccMode(device: nvmlDevice_t, mode: *mut nvmlEnableState_t) {
        dev(device)?;
        write(mode, NVML_FEATURE_ENABLED)
    }

    /// No memory errors are modelled: 0 corrected and uncorrected, volatile and aggregate. An
    /// error or counter type nvml.h does not define is NVML_ERROR_INVALID_ARGUMENT (documented).
    fn nvmlDeviceGetTotalEccErrors(device: nvmlDevice_t, error_type: c_uint, counter_type: c_uint, count: *mut u64) {
        dev(device)?;
        if error_type >= NVML_MEMORY_ERROR_TYPE_COUNT || counter_type >= NVML_ECC_COUNTER_TYPE_COUNT {
            return Err(ret::ERROR_INVALID_ARGUMENT);
        }
        write(count, 0)
    }

    /// 0 %: the simulator runs no video work. The sampling period, 167 ms, is what pynvml
    /// users report real boards answer (UNVERIFIED against a stored output).
    fn nvmlDeviceGetEncoderUtilization(device: nvmlDevice_t, utilization: *mut c_uint, period_us: *mut c_uint) {
        video_utilization(device, utilization, period_us)
    }

    fn nvmlDeviceGetDecoderUtilization(device: nvmlDevice_t, utilization: *mut c_uint, period_us: *mut c_uint) {
        video_utilization(device, utilization, period_us)
    }

    /// The clocks now (see [`current_clock_mhz`]).
    fn nvmlDeviceGetClockInfo(device: nvmlDevice_t, kind: c_uint, clock: *mut c_uint) {
        let d = model_dev(device)?.2;
        let mhz = current_clock_mhz(d, kind)?;
        write(clock, mhz)
    }

    /// KB/s over the last 20 ms of the copies the simulated driver timed over the device's PCIe
    /// link (`sensors::pcie_throughput`): NVML_PCIE_UTIL_TX_BYTES (0) what the device sent
    /// (device to host), NVML_PCIE_UTIL_RX_BYTES (1) what it received. A counter nvml.h does
    /// not define is NVML_ERROR_INVALID_ARGUMENT (documented).
    fn nvmlDeviceGetPcieThroughput(device: nvmlDevice_t, counter: c_uint, value: *mut c_uint) {
        let (sim, d) = dev(device)?;
        if counter > 1 {
            return Err(ret::ERROR_INVALID_ARGUMENT);
        }
        write(value, crate::sensors::pcie_throughput(sim, d, counter == 1))
    }

    // vGPU software licensing is for vGPU and passthrough guests: bare metal has none, so the
    // struct says so (`isGridLicenseSupported` 0, no features) and its feature array, which
    // the caller reads only up to `licensableFeaturesCount`, is left as it was. The four
    // versions differ only in that array.
    fn nvmlDeviceGetGridLicensableFeatures(device: nvmlDevice_t, features: *mut [c_uint; 2]) {
        no_grid_license(device, features)
    }
    fn nvmlDeviceGetGridLicensableFeatures_v2(device: nvmlDevice_t, features: *mut [c_uint; 2]) {
        no_grid_license(device, features)
    }
    fn nvmlDeviceGetGridLicensableFeatures_v3(device: nvmlDevice_t, features: *mut [c_uint; 2]) {
        no_grid_license(device, features)
    }
    fn nvmlDeviceGetGridLicensableFeatures_v4(device: nvmlDevice_t, features: *mut [c_uint; 2]) {
        no_grid_license(device, features)
    }

    // The PCIe link, at its generation's best and sixteen lanes wide, as a datacenter board in
    // P0 keeps it (an idle H100's nvidia-smi -q: "PCIe Generation Max 5, Current 5, Device
    // Max 5, Host Max 5; Link Width Max 16x, Current 16x"). The host side is taken to match.
    fn nvmlDeviceGetMaxPcieLinkGeneration(device: nvmlDevice_t, generation: *mut c_uint) {
        write(generation, model_dev(device)?.2.pcie_generation())
    }
    fn nvmlDeviceGetGpuMaxPcieLinkGeneration(device: nvmlDevice_t, generation: *mut c_uint) {
        write(generation, model_dev(device)?.2.pcie_generation())
    }
    fn nvmlDeviceGetCurrPcieLinkGeneration(device: nvmlDevice_t, generation: *mut c_uint) {
        write(generation, model_dev(device)?.2.pcie_generation())
    }
    fn nvmlDeviceGetMaxPcieLinkWidth(device: nvmlDevice_t, width: *mut c_uint) {
        dev(device)?;
        write(width, 16)
    }
    fn nvmlDeviceGetCurrPcieLinkWidth(device: nvmlDevice_t, width: *mut c_uint) {
        dev(device)?;
        write(width, 16)
    }

    /// Documented: "Returns zero if MIG is not supported or enabled". MIG is never enabled on
    /// the simulator.
    fn nvmlDeviceGetMaxMigDeviceCount(device: nvmlDevice_t, count: *mut c_uint) {
        dev(device)?;
        write(count, 0)
    }

    fn nvmlDeviceGetCurrentClockFreqs(device: nvmlDevice_t, freqs: *mut nvmlPerfString_v1_t) {
        let d = model_dev(device)?.2;
        perf_string(freqs, &clock_string(d))
    }

    /// One performance level, P0, the only one the simulated board uses.
    fn nvmlDeviceGetPerformanceModes(device: nvmlDevice_t, modes: *mut nvmlPerfString_v1_t) {
        let d = model_dev(device)?.2;
        perf_string(modes, &format!("perf=0, {}", clock_string(d)))
    }

    /// "Idle" (nvmlClocksEventReasonGpuIdle) while the GPU ran nothing in the last second, as
    /// an idle H100's nvidia-smi -q shows ("Clocks Event Reasons / Idle : Active", every other
    /// reason Not Active); nothing holds the clocks back while it works (no power or thermal
    /// limit is modelled).
    fn nvmlDeviceGetCurrentClocksEventReasons(device: nvmlDevice_t, reasons: *mut u64) {
        current_event_reasons(device, reasons)
    }
    fn nvmlDeviceGetCurrentClocksThrottleReasons(device: nvmlDevice_t, reasons: *mut u64) {
        current_event_reasons(device, reasons)
    }

    /// The reasons that nvidia-smi -q lists for an H100 (idle, applications clocks, SW power
    /// cap, HW slowdown with its thermal and power-brake kinds, sync boost, SW thermal slowdown,
    /// display clock): bits 0 to 8 of nvml.h's nvmlClocksEventReason* values.
    fn nvmlDeviceGetSupportedClocksEventReasons(device: nvmlDevice_t, reasons: *mut u64) {
        dev(device)?;
        write(reasons, SUPPORTED_EVENT_REASONS)
    }
    fn nvmlDeviceGetSupportedClocksThrottleReasons(device: nvmlDevice_t, reasons: *mut u64) {
        dev(device)?;
        write(reasons, SUPPORTED_EVENT_REASONS)
    }

    /// No video work, so no encoder or frame-buffer-capture sessions: counts 0 (nvidia-smi -q
    /// of an H100: "Encoder Stats / Active Sessions : 0", "FBC Stats / Active Sessions : 0").
    fn nvmlDeviceGetEncoderStats(device: nvmlDevice_t, sessions: *mut c_uint, fps: *mut c_uint, latency_us: *mut c_uint) {
        dev(device)?;
        if sessions.is_null() || fps.is_null() || latency_us.is_null() {
            return Err(ret::ERROR_INVALID_ARGUMENT);
        }
        write(sessions, 0)?;
        write(fps, 0)?;
        write(latency_us, 0)
    }

    /// `*count` 0, the session array untouched (it may be NULL when asking for the count).
    fn nvmlDeviceGetEncoderSessions(device: nvmlDevice_t, count: *mut c_uint, _infos: *mut std::ffi::c_void) {
        dev(device)?;
        write(count, 0)
    }

    /// `nvmlFBCStats_t`: sessionsCount, averageFPS, averageLatency, all 0.
    fn nvmlDeviceGetFBCStats(device: nvmlDevice_t, stats: *mut [c_uint; 3]) {
        dev(device)?;
        write(stats, [0; 3])
    }

    fn nvmlDeviceGetFBCSessions(device: nvmlDevice_t, count: *mut c_uint, _infos: *mut std::ffi::c_void) {
        dev(device)?;
        write(count, 0)
    }

    /// No GPU is excluded (a driver option, `NVreg_ExcludedGpus`, never set on the simulator).
    fn nvmlGetExcludedDeviceCount(count: *mut c_uint) {
        sim()?;
        write(count, 0)
    }

    /// Host interface cards are S-class hardware: none. Documented: NVML_ERROR_INVALID_ARGUMENT
    /// if either pointer is NULL; with no entries, `*count` becomes 0.
    fn nvmlSystemGetHicVersion(count: *mut c_uint, entries: *mut std::ffi::c_void) {
        sim()?;
        if count.is_null() || entries.is_null() {
            return Err(ret::ERROR_INVALID_ARGUMENT);
        }
        write(count, 0)
    }

    /// S-class units (the Quadro Plex and Tesla S-series enclosures) are not part of any
    /// modelled machine: 0 units.
    fn nvmlUnitGetCount(count: *mut c_uint) {
        sim()?;
        write(count, 0)
    }

    /// Documented: NVML_ERROR_INVALID_ARGUMENT when `index` is not below the unit count (0).
    fn nvmlUnitGetHandleByIndex(_index: c_uint, _unit: *mut *mut std::ffi::c_void) {
        sim()?;
        Err(ret::ERROR_INVALID_ARGUMENT)
    }

    // With no units no handle is valid: each unit query is NVML_ERROR_INVALID_ARGUMENT, its
    // documented answer for an invalid unit.
    fn nvmlUnitGetUnitInfo(_unit: *mut std::ffi::c_void, _info: *mut std::ffi::c_void) { no_unit() }
    fn nvmlUnitGetLedState(_unit: *mut std::ffi::c_void, _state: *mut std::ffi::c_void) { no_unit() }
    fn nvmlUnitGetPsuInfo(_unit: *mut std::ffi::c_void, _psu: *mut std::ffi::c_void) { no_unit() }
    fn nvmlUnitGetTemperature(_unit: *mut std::ffi::c_void, _kind: c_uint, _temp: *mut c_uint) { no_unit() }
    fn nvmlUnitGetFanSpeedInfo(_unit: *mut std::ffi::c_void, _speeds: *mut std::ffi::c_void) { no_unit() }
    fn nvmlUnitGetDevices(_unit: *mut std::ffi::c_void, _count: *mut c_uint, _devices: *mut nvmlDevice_t) { no_unit() }
    fn nvmlUnitSetLedState(_unit: *mut std::ffi::c_void, _color: c_uint) { no_unit() }

    fn nvmlSystemGetDriverBranch(info: *mut nvmlSystemDriverBranchInfo_v1_t, length: c_uint) {
        let m = &sim()?.model;
        let mut i = read(info)?;
        let branch = driver_branch(&m.driver_release);
        if branch.len() + 1 > (length as usize).min(80) {
            return Err(ret::ERROR_INSUFFICIENT_SIZE);
        }
        i.branch = c_array(&branch);
        write(info, i)
    }
}

/// nvml.h's nvmlClocksEventReason* bits 0x1 to 0x100.
pub const SUPPORTED_EVENT_REASONS: u64 = 0x1ff;
/// `nvmlClocksEventReasonGpuIdle`.
pub const EVENT_REASON_GPU_IDLE: u64 = 0x1;

fn current_event_reasons(device: nvmlDevice_t, reasons: *mut u64) -> Res {
    let (sim, d) = dev(device)?;
    let idle = crate::sensors::utilization(sim, d) == 0;
    write(reasons, if idle { EVENT_REASON_GPU_IDLE } else { 0 })
}

fn no_unit() -> Res {
    sim()?;
    Err(ret::ERROR_INVALID_ARGUMENT)
}

/// `isGridLicenseSupported` (an int) and `licensableFeaturesCount`, the head of
/// `nvmlGridLicensableFeatures_t`: both 0.
fn no_grid_license(device: nvmlDevice_t, features: *mut [c_uint; 2]) -> Res {
    dev(device)?;
    write(features, [0, 0])
}

fn video_utilization(
    device: nvmlDevice_t,
    utilization: *mut c_uint,
    period_us: *mut c_uint,
) -> Res {
    dev(device)?;
    if utilization.is_null() || period_us.is_null() {
        return Err(ret::ERROR_INVALID_ARGUMENT);
    }
    write(utilization, 0)?;
    write(period_us, 167_000)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn preset_device(p: &str) -> Device {
        cuvisor_sim::model::preset(p).unwrap().devices[0].clone()
    }

    #[test]
    fn brands_and_vbios_follow_the_board() {
        assert_eq!(brand(&preset_device("dgx1-v100")), NVML_BRAND_NVIDIA);
        assert_eq!(brand(&preset_device("single")), NVML_BRAND_NVIDIA);
        let mut d = preset_device("single");
        d.name = "NVIDIA GeForce RTX 4090".into();
        assert_eq!(brand(&d), NVML_BRAND_GEFORCE_RTX);
        d.name = "Quadro RTX 6000".into();
        assert_eq!(brand(&d), NVML_BRAND_QUADRO_RTX);
        assert_eq!(vbios_version(&preset_device("single")), "92.00.00.00.01");
        assert_eq!(vbios_version(&preset_device("dgx1-v100")), "88.00.00.00.01");
        assert_eq!(vbios_version(&preset_device("pcie-8")), "94.00.00.00.01");
    }

    #[test]
    fn clock_strings_use_the_nvidia_settings_form() {
        let s = clock_string(&preset_device("single"));
        assert!(
            s.starts_with(
                "nvclock=1410, nvclockmin=210, nvclockmax=1410, nvclockeditable=0, memclock=1215,"
            ),
            "{s}"
        );
        assert!(
            s.ends_with("memTransferRatemax=2430, memTransferRateeditable=0"),
            "{s}"
        );
        assert_eq!(driver_branch("580.95.05"), "r580_00");
    }
}
