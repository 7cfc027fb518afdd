//! Device handles and per-device queries: identity, PCI, memory, processes, utilization.

use crate::{c_array, cstr, export, read, sim, write, write_array, write_str, Res};
use cuvisor_cuda_abi::nvml::*;
use cuvisor_sim::model::{Device, MAX_DEVICES};
use cuvisor_sim::state::{now_ns, ProcSlot, BUCKET_NS, PROC_BUCKETS};
use cuvisor_sim::Sim;
use std::ffi::{c_char, c_int, c_uint, c_ulonglong};

// ---- handles ------------------------------------------------------------------------------------

/// A device handle is the address of its cell here: stable, unique, never dereferenced by us, and
/// checked on the way back in so a stale or forged handle is NVML_ERROR_INVALID_ARGUMENT.
static HANDLES: [u64; MAX_DEVICES] = [0; MAX_DEVICES];

pub(crate) fn handle(index: usize) -> nvmlDevice_t {
    HANDLES.as_ptr().wrapping_add(index) as nvmlDevice_t
}

/// The simulator and the device index a handle names.
pub(crate) fn dev(h: nvmlDevice_t) -> Result<(&'static Sim, usize), nvmlReturn_t> {
    let sim = sim()?;
    let offset = (h as usize).wrapping_sub(HANDLES.as_ptr() as usize);
    let cell = std::mem::size_of::<u64>();
    let index = offset / cell;
    if index * cell != offset || index >= sim.model.devices.len() {
        return Err(ret::ERROR_INVALID_ARGUMENT);
    }
    Ok((sim, index))
}

pub(crate) fn model_dev(
    h: nvmlDevice_t,
) -> Result<(&'static Sim, usize, &'static Device), nvmlReturn_t> {
    let (sim, d) = dev(h)?;
    Ok((sim, d, &sim.model.devices[d]))
}

/// Parses a PCI bus id as NVML accepts it: `domain:bus:device.function` or `bus:device.function`,
/// hex, any case, any zero padding. Returns (domain, bus, device).
pub(crate) fn parse_bus_id(s: &str) -> Option<(u32, u32, u32)> {
    let s = s.trim();
    let (head, func) = s.rsplit_once('.')?;
    u32::from_str_radix(func, 16).ok()?;
    let parts: Vec<&str> = head.split(':').collect();
    let hex = |t: &str| u32::from_str_radix(t, 16).ok();
    match parts.as_slice() {
        [domain, bus, device] => Some((hex(domain)?, hex(bus)?, hex(device)?)),
        [bus, device] => Some((0, hex(bus)?, hex(device)?)),
        _ => None,
    }
}

/// `nvmlPciInfo_t` for a PCI function, with NVML's bus id formats (upper-case hex).
pub(crate) fn pci_info(domain: u32, bus: u32, device: u32, device_id: u32) -> nvmlPciInfo_t {
    nvmlPciInfo_t {
        busIdLegacy: c_array(&format!("{domain:04X}:{bus:02X}:{device:02X}.0")),
        domain,
        bus,
        device,
        pciDeviceId: device_id,
        // Not modelled; NVML documents the field as "not filled" for NVLink remote ends anyway.
        pciSubSystemId: 0,
        busId: c_array(&format!("{domain:08X}:{bus:02X}:{device:02X}.0")),
    }
}

fn device_pci_info(d: &Device) -> nvmlPciInfo_t {
    nvmlPciInfo_t {
        // The board's subsystem id, as cuDeviceGetAttribute's GPU_PCI_SUBSYSTEM_ID (model::Specs).
        pciSubSystemId: d.specs.pci_subsystem_id,
        ..pci_info(d.pci_domain, d.pci_bus, d.pci_device, d.pci_device_id)
    }
}

fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// A 13-digit board serial derived from the UUID (stable across runs).
fn serial_of(d: &Device) -> String {
    format!("{:013}", fnv(&d.uuid) % 10_000_000_000_000)
}

/// MIG exists on A100/A30 (8.0) and on Hopper and later.
fn mig_capable(d: &Device) -> bool {
    d.cc == (8, 0) || d.cc.0 >= 9
}

export! {
    fn nvmlDeviceGetCount(count: *mut c_uint) {
        write(count, sim()?.model.devices.len() as c_uint)
    }

    fn nvmlDeviceGetCount_v2(count: *mut c_uint) {
        write(count, sim()?.model.devices.len() as c_uint)
    }

    fn nvmlDeviceGetHandleByIndex(index: c_uint, device: *mut nvmlDevice_t) {
        by_index(index, device)
    }

    fn nvmlDeviceGetHandleByIndex_v2(index: c_uint, device: *mut nvmlDevice_t) {
        by_index(index, device)
    }

    /// NVML_ERROR_NOT_FOUND when no device has that UUID (compared without regard to case);
    /// NVML_ERROR_INVALID_ARGUMENT for NULL.
    fn nvmlDeviceGetHandleByUUID(uuid: *const c_char, device: *mut nvmlDevice_t) {
        let sim = sim()?;
        let want = cstr(uuid)?.trim();
        let found = sim.model.devices.iter().position(|d| d.uuid.eq_ignore_ascii_case(want));
        write(device, handle(found.ok_or(ret::ERROR_NOT_FOUND)?))
    }

    /// The versioned form (R575): the UUID as text (`NVML_UUID_TYPE_ASCII`, compared without
    /// regard to case) or as its 16 bytes (`NVML_UUID_TYPE_BINARY`). Documented:
    /// NVML_ERROR_ARGUMENT_VERSION_MISMATCH for another struct version, INVALID_ARGUMENT for
    /// another type, NOT_FOUND when no device has it.
    fn nvmlDeviceGetHandleByUUIDV(uuid: *const nvmlUUID_v1_t, device: *mut nvmlDevice_t) {
        let sim = sim()?;
        let u = read(uuid)?;
        if u.version != NVML_UUID_V1 {
            return Err(ret::ERROR_ARGUMENT_VERSION_MISMATCH);
        }
        if device.is_null() {
            return Err(ret::ERROR_INVALID_ARGUMENT);
        }
        let found = match u.kind {
            NVML_UUID_TYPE_ASCII => {
                let text: Vec<u8> = u.value.iter().take_while(|c| **c != 0).map(|c| *c as u8).collect();
                let text = String::from_utf8_lossy(&text);
                sim.model.devices.iter().position(|d| d.uuid.eq_ignore_ascii_case(text.trim()))
            }
            NVML_UUID_TYPE_BINARY => {
                let bytes: Vec<u8> = u.value[..16].iter().map(|c| *c as u8).collect();
                sim.model.devices.iter().position(|d| d.uuid_bytes()[..] == bytes[..])
            }
            _ => return Err(ret::ERROR_INVALID_ARGUMENT),
        };
        write(device, handle(found.ok_or(ret::ERROR_NOT_FOUND)?))
    }

    fn nvmlDeviceGetHandleByPciBusId(bus_id: *const c_char, device: *mut nvmlDevice_t) {
        by_pci_bus_id(bus_id, device)
    }

    fn nvmlDeviceGetHandleByPciBusId_v2(bus_id: *const c_char, device: *mut nvmlDevice_t) {
        by_pci_bus_id(bus_id, device)
    }

    fn nvmlDeviceGetIndex(device: nvmlDevice_t, index: *mut c_uint) {
        write(index, dev(device)?.1 as c_uint)
    }

    fn nvmlDeviceGetName(device: nvmlDevice_t, name: *mut c_char, length: c_uint) {
        write_str(name, length, &model_dev(device)?.2.name)
    }

    fn nvmlDeviceGetUUID(device: nvmlDevice_t, uuid: *mut c_char, length: c_uint) {
        write_str(uuid, length, &model_dev(device)?.2.uuid)
    }

    /// The board's peak clocks in MHz, the figures cuDeviceGetAttribute's CLOCK_RATE and
    /// MEMORY_CLOCK_RATE give in kHz (`model::Specs`): NVML_CLOCK_GRAPHICS (0) and NVML_CLOCK_SM
    /// (1) the SM boost clock, NVML_CLOCK_MEM (2) the memory clock. The video clock (3) is not
    /// modelled (NVML_ERROR_NOT_SUPPORTED); another type is NVML_ERROR_INVALID_ARGUMENT.
    fn nvmlDeviceGetMaxClockInfo(device: nvmlDevice_t, kind: c_uint, clock: *mut c_uint) {
        let s = model_dev(device)?.2.specs;
        let mhz = match kind {
            0 | 1 => s.clock_khz / 1000,
            2 => s.memory_clock_khz / 1000,
            3 => return Err(ret::ERROR_NOT_SUPPORTED),
            _ => return Err(ret::ERROR_INVALID_ARGUMENT),
        };
        write(clock, mhz)
    }

    /// The memory bus width in bits (CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH's figure).
    fn nvmlDeviceGetMemoryBusWidth(device: nvmlDevice_t, width: *mut c_uint) {
        write(width, model_dev(device)?.2.specs.memory_bus_width)
    }

    fn nvmlDeviceGetPciInfo_v2(device: nvmlDevice_t, pci: *mut nvmlPciInfo_t) {
        write(pci, device_pci_info(model_dev(device)?.2))
    }

    fn nvmlDeviceGetPciInfo_v3(device: nvmlDevice_t, pci: *mut nvmlPciInfo_t) {
        write(pci, device_pci_info(model_dev(device)?.2))
    }

    /// The N of /dev/nvidiaN: the model's `minor` (the index unless a model file says otherwise).
    fn nvmlDeviceGetMinorNumber(device: nvmlDevice_t, minor: *mut c_uint) {
        write(minor, model_dev(device)?.2.minor as c_uint)
    }

    /// A 13-digit board serial derived from the UUID (stable across runs).
    fn nvmlDeviceGetSerial(device: nvmlDevice_t, serial: *mut c_char, length: c_uint) {
        let d = model_dev(device)?.2;
        write_str(serial, length, &serial_of(d))
    }

    /// The device whose nvmlDeviceGetSerial is `serial` (each board has its own); documented:
    /// NVML_ERROR_NOT_FOUND when none matches, NVML_ERROR_INVALID_ARGUMENT for NULL.
    fn nvmlDeviceGetHandleBySerial(serial: *const c_char, device: *mut nvmlDevice_t) {
        let sim = sim()?;
        let want = cstr(serial)?.trim();
        let found = sim.model.devices.iter().position(|d| serial_of(d) == want);
        write(device, handle(found.ok_or(ret::ERROR_NOT_FOUND)?))
    }

    /// One board per GPU (SXM modules and PCIe cards alike): an id unique to its PCI location.
    fn nvmlDeviceGetBoardId(device: nvmlDevice_t, board: *mut c_uint) {
        let d = model_dev(device)?.2;
        write(board, (d.pci_domain << 16) | (d.pci_bus << 8) | d.pci_device)
    }

    fn nvmlDeviceGetMultiGpuBoard(device: nvmlDevice_t, multi: *mut c_uint) {
        dev(device)?;
        write(multi, 0)
    }

    fn nvmlDeviceGetArchitecture(device: nvmlDevice_t, arch_out: *mut nvmlDeviceArchitecture_t) {
        let a = match model_dev(device)?.2.cc {
            (3, _) => arch::KEPLER,
            (5, _) => arch::MAXWELL,
            (6, _) => arch::PASCAL,
            (7, 0) | (7, 2) => arch::VOLTA,
            (7, _) => arch::TURING,
            (8, 9) => arch::ADA,
            (8, _) => arch::AMPERE,
            (9, _) => arch::HOPPER,
            (10.., _) => arch::BLACKWELL,
            _ => arch::UNKNOWN,
        };
        write(arch_out, a)
    }

    fn nvmlDeviceGetCudaComputeCapability(device: nvmlDevice_t, major: *mut c_int, minor: *mut c_int) {
        let d = model_dev(device)?.2;
        if major.is_null() || minor.is_null() {
            return Err(ret::ERROR_INVALID_ARGUMENT);
        }
        write(major, d.cc.0 as c_int)?;
        write(minor, d.cc.1 as c_int)
    }

    /// MIG-capable devices report it disabled (the simulator has no MIG); others NOT_SUPPORTED.
    fn nvmlDeviceGetMigMode(device: nvmlDevice_t, current: *mut c_uint, pending: *mut c_uint) {
        let d = model_dev(device)?.2;
        if current.is_null() || pending.is_null() {
            return Err(ret::ERROR_INVALID_ARGUMENT);
        }
        if !mig_capable(d) {
            return Err(ret::ERROR_NOT_SUPPORTED);
        }
        write(current, NVML_DEVICE_MIG_DISABLE)?;
        write(pending, NVML_DEVICE_MIG_DISABLE)
    }

    fn nvmlDeviceIsMigDeviceHandle(device: nvmlDevice_t, is_mig: *mut c_uint) {
        dev(device)?;
        write(is_mig, 0)
    }

    /// used = what every process has charged on the device (after dead processes' memory went
    /// back), total = the model's memory, free = total - used.
    fn nvmlDeviceGetMemoryInfo(device: nvmlDevice_t, memory: *mut nvmlMemory_t) {
        let (total, used) = memory_of(device)?;
        write(memory, nvmlMemory_t { total, free: total - used, used })
    }

    /// As v1, with the version check: `version` must be nvmlMemory_v2, else
    /// NVML_ERROR_ARGUMENT_VERSION_MISMATCH. `reserved` (memory the driver and firmware keep) is 0:
    /// the simulated driver keeps none outside its contexts, which show in `used`.
    fn nvmlDeviceGetMemoryInfo_v2(device: nvmlDevice_t, memory: *mut nvmlMemory_v2_t) {
        let (total, used) = memory_of(device)?;
        let version = read(memory as *const c_uint)?;
        if version != NVML_MEMORY_V2 {
            return Err(ret::ERROR_ARGUMENT_VERSION_MISMATCH);
        }
        write(memory, nvmlMemory_v2_t { version, total, reserved: 0, free: total - used, used })
    }

    /// gpu = percent of the last second during which the device's timeline ran a kernel: "Percent
    /// of time over the past sample period during which one or more kernels was executing on the
    /// GPU" (nvmlUtilization_t), so copies, which run on the copy engines, do not count. memory:
    /// "Percent of time over the past sample period during which global (device) memory was
    /// being read or written": the time copies and memsets moved the device's bytes (kernels'
    /// own memory traffic is unknown to the simulator and not counted).
    fn nvmlDeviceGetUtilizationRates(device: nvmlDevice_t, utilization: *mut nvmlUtilization_t) {
        let (sim, d) = dev(device)?;
        let gpu = sim.shared.device_utilization(d, UTIL_WINDOW_NS);
        let memory = sim.shared.memory_utilization(d, UTIL_WINDOW_NS);
        write(utilization, nvmlUtilization_t { gpu, memory })
    }

    /// One sample per process that ran kernels on the device since `lastSeenTimeStamp` (CPU time
    /// in µs since the epoch; 0 = the whole sample buffer, here the last second), as documented:
    /// utilization NULL asks for the count (NVML_ERROR_INSUFFICIENT_SIZE with the count, the
    /// protocol pynvml relies on); NVML_ERROR_NOT_FOUND when no process has a sample. A buffer
    /// smaller than the sample count also gets NVML_ERROR_INSUFFICIENT_SIZE and the count (the
    /// docs do not say; this is what the other NVML list queries do).
    fn nvmlDeviceGetProcessUtilization(
        device: nvmlDevice_t,
        utilization: *mut nvmlProcessUtilizationSample_t,
        count: *mut c_uint,
        last_seen: c_ulonglong,
    ) {
        let (sim, d) = dev(device)?;
        let room = read(count)?;
        let samples = process_samples(sim, d, last_seen);
        if samples.is_empty() {
            write(count, 0)?;
            return Err(ret::ERROR_NOT_FOUND);
        }
        write(count, samples.len() as c_uint)?;
        if utilization.is_null() || (room as usize) < samples.len() {
            return Err(ret::ERROR_INSUFFICIENT_SIZE);
        }
        write_array(utilization, &samples)
    }

    /// The struct-versioned successor of nvmlDeviceGetProcessUtilization (R550), with the same
    /// samples (jpg and ofa engines read 0: the simulator has none) and the same protocol inside
    /// the struct: `processSamplesCount` is the room in `procUtilArray`; with too little room (or
    /// no array), NVML_ERROR_INSUFFICIENT_SIZE and the count needed there, which is how pynvml's
    /// wrapper asks; NVML_ERROR_NOT_FOUND (count 0) when no process has a sample since
    /// `lastSeenTimeStamp`. A struct whose `version` is not nvmlProcessesUtilizationInfo_v1 is
    /// NVML_ERROR_ARGUMENT_VERSION_MISMATCH; a NULL struct NVML_ERROR_INVALID_ARGUMENT.
    fn nvmlDeviceGetProcessesUtilizationInfo(device: nvmlDevice_t, info: *mut nvmlProcessesUtilizationInfo_v1_t) {
        let (sim, d) = dev(device)?;
        let mut i = read(info)?;
        if i.version != NVML_PROCESSES_UTILIZATION_INFO_V1 {
            return Err(ret::ERROR_ARGUMENT_VERSION_MISMATCH);
        }
        let samples: Vec<nvmlProcessUtilizationInfo_v1_t> = process_samples(sim, d, i.lastSeenTimeStamp)
            .into_iter()
            .map(|s| nvmlProcessUtilizationInfo_v1_t {
                timeStamp: s.timeStamp,
                pid: s.pid,
                smUtil: s.smUtil,
                memUtil: s.memUtil,
                encUtil: s.encUtil,
                decUtil: s.decUtil,
                jpgUtil: 0,
                ofaUtil: 0,
            })
            .collect();
        let room = i.processSamplesCount as usize;
        i.processSamplesCount = samples.len() as c_uint;
        write(info, i)?;
        if samples.is_empty() {
            return Err(ret::ERROR_NOT_FOUND);
        }
        if i.procUtilArray.is_null() || room < samples.len() {
            return Err(ret::ERROR_INSUFFICIENT_SIZE);
        }
        write_array(i.procUtilArray, &samples)
    }

    /// The oldest ABI: 16-byte `nvmlProcessInfo_v1_t` entries.
    fn nvmlDeviceGetComputeRunningProcesses(device: nvmlDevice_t, count: *mut c_uint, infos: *mut nvmlProcessInfo_v1_t) {
        process_list(device, count, infos, |pid, mem| nvmlProcessInfo_v1_t { pid, usedGpuMemory: mem })
    }

    fn nvmlDeviceGetComputeRunningProcesses_v2(device: nvmlDevice_t, count: *mut c_uint, infos: *mut nvmlProcessInfo_t) {
        process_list(device, count, infos, process_info)
    }

    fn nvmlDeviceGetComputeRunningProcesses_v3(device: nvmlDevice_t, count: *mut c_uint, infos: *mut nvmlProcessInfo_t) {
        process_list(device, count, infos, process_info)
    }

    // Nothing draws on the simulated GPU and there is no MPS server: those lists are empty.
    fn nvmlDeviceGetGraphicsRunningProcesses(device: nvmlDevice_t, count: *mut c_uint, _infos: *mut nvmlProcessInfo_v1_t) {
        empty_list(device, count)
    }
    fn nvmlDeviceGetGraphicsRunningProcesses_v2(device: nvmlDevice_t, count: *mut c_uint, _infos: *mut nvmlProcessInfo_t) {
        empty_list(device, count)
    }
    fn nvmlDeviceGetGraphicsRunningProcesses_v3(device: nvmlDevice_t, count: *mut c_uint, _infos: *mut nvmlProcessInfo_t) {
        empty_list(device, count)
    }
    fn nvmlDeviceGetMPSComputeRunningProcesses(device: nvmlDevice_t, count: *mut c_uint, _infos: *mut nvmlProcessInfo_v1_t) {
        empty_list(device, count)
    }
    fn nvmlDeviceGetMPSComputeRunningProcesses_v2(device: nvmlDevice_t, count: *mut c_uint, _infos: *mut nvmlProcessInfo_t) {
        empty_list(device, count)
    }
    fn nvmlDeviceGetMPSComputeRunningProcesses_v3(device: nvmlDevice_t, count: *mut c_uint, _infos: *mut nvmlProcessInfo_t) {
        empty_list(device, count)
    }
}

// ---- nvmlDeviceGetProcessesUtilizationInfo's structs ---------------------------------------------
// As NVIDIA's nvml.h (R550 and later) declares them:
//
//   typedef struct nvmlProcessUtilizationInfo_v1_st {
//       unsigned long long timeStamp; unsigned int pid; unsigned int smUtil; unsigned int memUtil;
//       unsigned int encUtil; unsigned int decUtil; unsigned int jpgUtil; unsigned int ofaUtil;
//   } nvmlProcessUtilizationInfo_v1_t;                                             // 40 bytes
//   typedef struct nvmlProcessesUtilizationInfo_v1_st {
//       unsigned int version; unsigned int processSamplesCount;
//       unsigned long long lastSeenTimeStamp; nvmlProcessUtilizationInfo_v1_t *procUtilArray;
//   } nvmlProcessesUtilizationInfo_v1_t;                                           // 24 bytes
//   #define nvmlProcessesUtilizationInfo_v1 NVML_STRUCT_VERSION(ProcessesUtilizationInfo, 1)
//
// Found with this project's code search (query "nvmlProcessesUtilizationInfo_v1
// nvmlProcessUtilizationInfo_v1"): the same fields in nvml-wrapper-sys 0.10's bindgen output of
// nvml.h, in cuda-bindings 13.5's `cuda/bindings/cynvml.pxd` (`cdef extern from 'nvml.h'`), and in nvidia-ml-py
// 13.615's pynvml.py, which hard-codes the version as 0x01000018. NVIDIA's NVML reference
// (docs.nvidia.com/deploy/nvml-api, "nvmlProcessesUtilizationInfo_v1_t Struct Reference")
// documents `processSamplesCount` as "Caller-supplied array size, and returns number of
// processes running".

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[allow(non_snake_case)]
pub struct nvmlProcessUtilizationInfo_v1_t {
    /// CPU timestamp in microseconds.
    pub timeStamp: c_ulonglong,
    pub pid: c_uint,
    pub smUtil: c_uint,
    pub memUtil: c_uint,
    pub encUtil: c_uint,
    pub decUtil: c_uint,
    pub jpgUtil: c_uint,
    pub ofaUtil: c_uint,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[allow(non_snake_case)]
pub struct nvmlProcessesUtilizationInfo_v1_t {
    pub version: c_uint,
    pub processSamplesCount: c_uint,
    pub lastSeenTimeStamp: c_ulonglong,
    pub procUtilArray: *mut nvmlProcessUtilizationInfo_v1_t,
}

pub const NVML_PROCESSES_UTILIZATION_INFO_V1: c_uint =
    nvml_struct_version(std::mem::size_of::<nvmlProcessesUtilizationInfo_v1_t>(), 1);
const _: () = assert!(NVML_PROCESSES_UTILIZATION_INFO_V1 == 0x0100_0018);
const _: () = assert!(std::mem::size_of::<nvmlProcessUtilizationInfo_v1_t>() == 40);

/// `nvmlUUID_v1_t` (nvml.h): version, `nvmlUUIDType_t`, and a union of the 41-byte ASCII form
/// and the 16 bytes; 52 bytes with its padding.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct nvmlUUID_v1_t {
    pub version: c_uint,
    pub kind: c_uint,
    pub value: [c_char; 41],
}
pub const NVML_UUID_V1: c_uint = nvml_struct_version(std::mem::size_of::<nvmlUUID_v1_t>(), 1);
const _: () = assert!(NVML_UUID_V1 == 0x0100_0034);
/// `nvmlUUIDType_t`.
pub const NVML_UUID_TYPE_ASCII: c_uint = 1;
pub const NVML_UUID_TYPE_BINARY: c_uint = 2;

/// Documented: NVML_ERROR_INVALID_ARGUMENT for an index past the device count.
fn by_index(index: c_uint, device: *mut nvmlDevice_t) -> Res {
    if index as usize >= sim()?.model.devices.len() {
        return Err(ret::ERROR_INVALID_ARGUMENT);
    }
    write(device, handle(index as usize))
}

/// Documented: NVML_ERROR_INVALID_ARGUMENT for an unparsable id, NVML_ERROR_NOT_FOUND for one
/// that matches no device.
fn by_pci_bus_id(bus_id: *const c_char, device: *mut nvmlDevice_t) -> Res {
    let sim = sim()?;
    let want = parse_bus_id(cstr(bus_id)?).ok_or(ret::ERROR_INVALID_ARGUMENT)?;
    let found = sim
        .model
        .devices
        .iter()
        .position(|d| (d.pci_domain, d.pci_bus, d.pci_device) == want);
    write(device, handle(found.ok_or(ret::ERROR_NOT_FOUND)?))
}

fn memory_of(device: nvmlDevice_t) -> Result<(u64, u64), nvmlReturn_t> {
    let (sim, d, m) = model_dev(device)?;
    // A process that died (SIGKILL included) has no memory on a real GPU any more.
    sim.shared.reclaim_dead();
    let used = sim
        .shared
        .device(d)
        .mem_used
        .load(std::sync::atomic::Ordering::Acquire);
    Ok((m.memory, used.min(m.memory)))
}

/// NVML's "sample period" for utilization.
pub(crate) const UTIL_WINDOW_NS: u64 = 1_000_000_000;

fn realtime_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

fn process_samples(sim: &Sim, d: usize, last_seen_us: u64) -> Vec<nvmlProcessUtilizationSample_t> {
    let now_us = realtime_us();
    if last_seen_us >= now_us {
        return Vec::new();
    }
    let window = if last_seen_us == 0 {
        UTIL_WINDOW_NS
    } else {
        (now_us - last_seen_us)
            .saturating_mul(1000)
            .min(UTIL_WINDOW_NS)
    }
    .max(BUCKET_NS);
    let since = now_ns().saturating_sub(window);
    sim.shared
        .live_procs()
        .filter_map(|(pid, s)| {
            let busy = sim.shared.proc_busy_since(s, d, since);
            (busy > 0).then(|| nvmlProcessUtilizationSample_t {
                pid,
                timeStamp: now_us,
                smUtil: ((busy * 100 + window / 2) / window).min(100) as c_uint,
                memUtil: 0,
                encUtil: 0,
                decUtil: 0,
            })
        })
        .collect()
}

/// A process is on a device when it holds memory there or ran a kernel there within the
/// per-process history (`PROC_BUCKETS` x 10 ms): the simulator does not record contexts across processes, and
/// context creation itself costs 0 bytes in the presets.
fn on_device(sim: &Sim, s: &ProcSlot, d: usize) -> Option<u64> {
    let mem = s.mem[d].load(std::sync::atomic::Ordering::Acquire);
    let horizon = now_ns().saturating_sub((PROC_BUCKETS as u64 - 1) * BUCKET_NS);
    (mem > 0 || sim.shared.proc_busy_since(s, d, horizon) > 0).then_some(mem)
}

fn process_info(pid: c_uint, mem: u64) -> nvmlProcessInfo_t {
    nvmlProcessInfo_t {
        pid,
        usedGpuMemory: mem,
        gpuInstanceId: NVML_INVALID_INSTANCE_ID,
        computeInstanceId: NVML_INVALID_INSTANCE_ID,
    }
}

/// The running-process protocol, as documented for the _v3 queries: `*count` is the room in
/// `infos`; with too little room (0 to ask), NVML_ERROR_INSUFFICIENT_SIZE and the number needed;
/// with none running, NVML_SUCCESS and 0 (infos may be NULL then).
fn process_list<T: Copy>(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut T,
    make: impl Fn(c_uint, u64) -> T,
) -> Res {
    let (sim, d) = dev(device)?;
    let room = read(count)?;
    sim.shared.reclaim_dead();
    let list: Vec<T> = sim
        .shared
        .live_procs()
        .filter_map(|(pid, s)| on_device(sim, s, d).map(|mem| make(pid, mem)))
        .collect();
    write(count, list.len() as c_uint)?;
    if (room as usize) < list.len() {
        return Err(ret::ERROR_INSUFFICIENT_SIZE);
    }
    write_array(infos, &list)
}

fn empty_list(device: nvmlDevice_t, count: *mut c_uint) -> Res {
    dev(device)?;
    read(count)?;
    write(count, 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids_parse_in_every_form_nvml_takes() {
        assert_eq!(parse_bus_id("00000000:B7:00.0"), Some((0, 0xb7, 0)));
        assert_eq!(parse_bus_id("0000:b7:00.0"), Some((0, 0xb7, 0)));
        assert_eq!(parse_bus_id("b7:00.0"), Some((0, 0xb7, 0)));
        assert_eq!(parse_bus_id("0001:07:1f.0"), Some((1, 7, 0x1f)));
        assert_eq!(parse_bus_id("GPU-1234"), None);
        assert_eq!(parse_bus_id(""), None);
        assert_eq!(parse_bus_id("0:1:2:3.0"), None);
    }

    #[test]
    fn pci_info_uses_nvml_formats() {
        let p = pci_info(0, 0xb7, 0, 0x1db1_10de);
        let s = |a: &[c_char]| {
            a.iter()
                .take_while(|c| **c != 0)
                .map(|c| *c as u8 as char)
                .collect::<String>()
        };
        assert_eq!(s(&p.busId), "00000000:B7:00.0");
        assert_eq!(s(&p.busIdLegacy), "0000:B7:00.0");
    }

    #[test]
    fn handles_round_trip_and_forgeries_do_not() {
        // dev() needs an initialised library; check the arithmetic it relies on instead.
        let base = HANDLES.as_ptr() as usize;
        assert_eq!(handle(3) as usize - base, 3 * 8);
        assert_ne!(handle(0), std::ptr::null_mut());
    }
}
