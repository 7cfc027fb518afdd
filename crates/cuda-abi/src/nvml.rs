//! NVML types, constants and structs (`nvml.h`, API version 12/13).
//!
//! Only what the simulated `libnvidia-ml.so.1` (and, later, libcuvisor's NVML wrappers) speak. The
//! tests at the bottom compare every value and layout with nvml-wrapper-sys's bindgen output of
//! `nvml.h` (the version nvml-wrapper 0.13 uses).
use std::ffi::{c_char, c_uint, c_ulonglong, c_void};

pub type nvmlReturn_t = c_uint;
/// Opaque device handle (`struct nvmlDevice_st *`).
pub type nvmlDevice_t = *mut c_void;
/// Opaque event set handle (`struct nvmlEventSet_st *`).
pub type nvmlEventSet_t = *mut c_void;
pub type nvmlEnableState_t = c_uint;
pub type nvmlGpuTopologyLevel_t = c_uint;
pub type nvmlIntNvLinkDeviceType_t = c_uint;
pub type nvmlNvLinkCapability_t = c_uint;
pub type nvmlDeviceArchitecture_t = c_uint;
pub type nvmlAffinityScope_t = c_uint;

/// `nvmlReturn_t` values.
pub mod ret {
    use super::nvmlReturn_t;
    pub const SUCCESS: nvmlReturn_t = 0;
    pub const ERROR_UNINITIALIZED: nvmlReturn_t = 1;
    pub const ERROR_INVALID_ARGUMENT: nvmlReturn_t = 2;
    pub const ERROR_NOT_SUPPORTED: nvmlReturn_t = 3;
    pub const ERROR_NO_PERMISSION: nvmlReturn_t = 4;
    pub const ERROR_ALREADY_INITIALIZED: nvmlReturn_t = 5;
    pub const ERROR_NOT_FOUND: nvmlReturn_t = 6;
    pub const ERROR_INSUFFICIENT_SIZE: nvmlReturn_t = 7;
    pub const ERROR_INSUFFICIENT_POWER: nvmlReturn_t = 8;
    pub const ERROR_DRIVER_NOT_LOADED: nvmlReturn_t = 9;
    pub const ERROR_TIMEOUT: nvmlReturn_t = 10;
    pub const ERROR_IRQ_ISSUE: nvmlReturn_t = 11;
    pub const ERROR_LIBRARY_NOT_FOUND: nvmlReturn_t = 12;
    pub const ERROR_FUNCTION_NOT_FOUND: nvmlReturn_t = 13;
    pub const ERROR_CORRUPTED_INFOROM: nvmlReturn_t = 14;
    pub const ERROR_GPU_IS_LOST: nvmlReturn_t = 15;
    pub const ERROR_RESET_REQUIRED: nvmlReturn_t = 16;
    pub const ERROR_OPERATING_SYSTEM: nvmlReturn_t = 17;
    pub const ERROR_LIB_RM_VERSION_MISMATCH: nvmlReturn_t = 18;
    pub const ERROR_IN_USE: nvmlReturn_t = 19;
    pub const ERROR_MEMORY: nvmlReturn_t = 20;
    pub const ERROR_NO_DATA: nvmlReturn_t = 21;
    pub const ERROR_VGPU_ECC_NOT_SUPPORTED: nvmlReturn_t = 22;
    pub const ERROR_INSUFFICIENT_RESOURCES: nvmlReturn_t = 23;
    pub const ERROR_FREQ_NOT_SUPPORTED: nvmlReturn_t = 24;
    pub const ERROR_ARGUMENT_VERSION_MISMATCH: nvmlReturn_t = 25;
    pub const ERROR_DEPRECATED: nvmlReturn_t = 26;
    pub const ERROR_NOT_READY: nvmlReturn_t = 27;
    pub const ERROR_GPU_NOT_FOUND: nvmlReturn_t = 28;
    pub const ERROR_INVALID_STATE: nvmlReturn_t = 29;
    pub const ERROR_UNKNOWN: nvmlReturn_t = 999;

    /// `(value, nvmlErrorString text)`. The texts are those pynvml's table and DCGM's copy of
    /// NVML's error strings carry; the last few (codes 21 and up), which neither lists, are
    /// worded after nvml.h's comments.
    pub const TABLE: &[(nvmlReturn_t, &str)] = &[
        (SUCCESS, "Success"),
        (ERROR_UNINITIALIZED, "Uninitialized"),
        (ERROR_INVALID_ARGUMENT, "Invalid Argument"),
        (ERROR_NOT_SUPPORTED, "Not Supported"),
        (ERROR_NO_PERMISSION, "Insufficient Permissions"),
        (ERROR_ALREADY_INITIALIZED, "Already Initialized"),
        (ERROR_NOT_FOUND, "Not Found"),
        (ERROR_INSUFFICIENT_SIZE, "Insufficient Size"),
        (ERROR_INSUFFICIENT_POWER, "Insufficient External Power"),
        (ERROR_DRIVER_NOT_LOADED, "Driver Not Loaded"),
        (ERROR_TIMEOUT, "Timeout"),
        (ERROR_IRQ_ISSUE, "Interrupt Request Issue"),
        (ERROR_LIBRARY_NOT_FOUND, "NVML Shared Library Not Found"),
        (ERROR_FUNCTION_NOT_FOUND, "Function Not Found"),
        (ERROR_CORRUPTED_INFOROM, "Corrupted infoROM"),
        (ERROR_GPU_IS_LOST, "GPU is lost"),
        (ERROR_RESET_REQUIRED, "GPU requires restart"),
        (
            ERROR_OPERATING_SYSTEM,
            "The operating system has blocked the request.",
        ),
        (
            ERROR_LIB_RM_VERSION_MISMATCH,
            "RM has detected an NVML/RM version mismatch.",
        ),
        (ERROR_IN_USE, "The GPU is currently in use"),
        (ERROR_MEMORY, "Insufficient Memory"),
        (ERROR_NO_DATA, "No data"),
        (
            ERROR_VGPU_ECC_NOT_SUPPORTED,
            "The requested vgpu operation is not available on target device, because ECC is enabled",
        ),
        (
            ERROR_INSUFFICIENT_RESOURCES,
            "Ran out of critical resources, other than memory",
        ),
        (
            ERROR_FREQ_NOT_SUPPORTED,
            "The requested frequency is not supported",
        ),
        (ERROR_ARGUMENT_VERSION_MISMATCH, "Argument version mismatch"),
        (ERROR_DEPRECATED, "The requested functionality has been deprecated"),
        (ERROR_NOT_READY, "The system is not ready for the request"),
        (ERROR_GPU_NOT_FOUND, "The GPU was not found"),
        (ERROR_INVALID_STATE, "The GPU is in an invalid state"),
        (ERROR_UNKNOWN, "Unknown Error"),
    ];
}

pub const NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE: usize = 32;
pub const NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE: usize = 16;
pub const NVML_DEVICE_UUID_BUFFER_SIZE: usize = 80;
pub const NVML_DEVICE_UUID_V2_BUFFER_SIZE: usize = 96;
pub const NVML_DEVICE_NAME_BUFFER_SIZE: usize = 64;
pub const NVML_DEVICE_NAME_V2_BUFFER_SIZE: usize = 96;
pub const NVML_DEVICE_SERIAL_BUFFER_SIZE: usize = 30;
pub const NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE: usize = 80;
pub const NVML_SYSTEM_NVML_VERSION_BUFFER_SIZE: usize = 80;
pub const NVML_NVLINK_MAX_LINKS: u32 = 18;
/// `gpuInstanceId` / `computeInstanceId` when MIG is off.
pub const NVML_INVALID_INSTANCE_ID: c_uint = 0xFFFF_FFFF;

pub const NVML_INIT_FLAG_NO_GPUS: c_uint = 1;
pub const NVML_INIT_FLAG_NO_ATTACH: c_uint = 2;

pub const NVML_FEATURE_DISABLED: nvmlEnableState_t = 0;
pub const NVML_FEATURE_ENABLED: nvmlEnableState_t = 1;

pub const NVML_DEVICE_MIG_DISABLE: c_uint = 0;
pub const NVML_DEVICE_MIG_ENABLE: c_uint = 1;

pub const NVML_AFFINITY_SCOPE_NODE: nvmlAffinityScope_t = 0;
pub const NVML_AFFINITY_SCOPE_SOCKET: nvmlAffinityScope_t = 1;

/// `nvmlGpuTopologyLevel_t` (values equal `cuvisor_sim::model::PcieLevel`'s discriminants).
pub mod topo {
    use super::nvmlGpuTopologyLevel_t;
    pub const INTERNAL: nvmlGpuTopologyLevel_t = 0;
    pub const SINGLE: nvmlGpuTopologyLevel_t = 10;
    pub const MULTIPLE: nvmlGpuTopologyLevel_t = 20;
    pub const HOSTBRIDGE: nvmlGpuTopologyLevel_t = 30;
    pub const NODE: nvmlGpuTopologyLevel_t = 40;
    pub const SYSTEM: nvmlGpuTopologyLevel_t = 50;
}

/// `nvmlIntNvLinkDeviceType_t`: what sits at the far end of an NVLink.
pub mod nvlink_device {
    use super::nvmlIntNvLinkDeviceType_t;
    pub const GPU: nvmlIntNvLinkDeviceType_t = 0;
    pub const IBMNPU: nvmlIntNvLinkDeviceType_t = 1;
    pub const SWITCH: nvmlIntNvLinkDeviceType_t = 2;
    pub const UNKNOWN: nvmlIntNvLinkDeviceType_t = 255;
}

/// `nvmlNvLinkCapability_t`.
pub mod nvlink_cap {
    use super::nvmlNvLinkCapability_t;
    pub const P2P_SUPPORTED: nvmlNvLinkCapability_t = 0;
    pub const SYSMEM_ACCESS: nvmlNvLinkCapability_t = 1;
    pub const P2P_ATOMICS: nvmlNvLinkCapability_t = 2;
    pub const SYSMEM_ATOMICS: nvmlNvLinkCapability_t = 3;
    pub const SLI_BRIDGE: nvmlNvLinkCapability_t = 4;
    pub const VALID: nvmlNvLinkCapability_t = 5;
    pub const COUNT: nvmlNvLinkCapability_t = 6;
}

/// `nvmlNvlinkVersion_t`: what `nvmlDeviceGetNvLinkVersion` reports (an enum, not the NVLink
/// generation: NVLink 3.0 is 4).
pub mod nvlink_version {
    pub const INVALID: u32 = 0;
    pub const V1_0: u32 = 1;
    pub const V2_0: u32 = 2;
    pub const V2_2: u32 = 3;
    pub const V3_0: u32 = 4;
    pub const V3_1: u32 = 5;
    pub const V4_0: u32 = 6;
    pub const V5_0: u32 = 7;
}

/// `nvmlDeviceArchitecture_t`.
pub mod arch {
    use super::nvmlDeviceArchitecture_t;
    pub const KEPLER: nvmlDeviceArchitecture_t = 2;
    pub const MAXWELL: nvmlDeviceArchitecture_t = 3;
    pub const PASCAL: nvmlDeviceArchitecture_t = 4;
    pub const VOLTA: nvmlDeviceArchitecture_t = 5;
    pub const TURING: nvmlDeviceArchitecture_t = 6;
    pub const AMPERE: nvmlDeviceArchitecture_t = 7;
    pub const ADA: nvmlDeviceArchitecture_t = 8;
    pub const HOPPER: nvmlDeviceArchitecture_t = 9;
    pub const BLACKWELL: nvmlDeviceArchitecture_t = 10;
    pub const UNKNOWN: nvmlDeviceArchitecture_t = 0xFFFF_FFFF;
}

/// `nvmlEventType` bits.
pub mod event {
    pub const NONE: u64 = 0;
    pub const SINGLE_BIT_ECC_ERROR: u64 = 0x1;
    pub const DOUBLE_BIT_ECC_ERROR: u64 = 0x2;
    pub const PSTATE: u64 = 0x4;
    pub const XID_CRITICAL_ERROR: u64 = 0x8;
    pub const CLOCK: u64 = 0x10;
    pub const POWER_SOURCE_CHANGE: u64 = 0x80;
    /// Every event type this NVML version defines (`nvmlEventTypeAll`).
    pub const ALL: u64 = 0xff9f;
}

/// `NVML_STRUCT_VERSION(data, ver)`: the struct's size with the version in the top byte.
pub const fn nvml_struct_version(size: usize, ver: u32) -> c_uint {
    size as c_uint | (ver << 24)
}

/// `nvmlMemory_v2` (0x02000028): what `nvmlMemory_v2_t::version` must hold.
pub const NVML_MEMORY_V2: c_uint = nvml_struct_version(std::mem::size_of::<nvmlMemory_v2_t>(), 2);

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct nvmlPciInfo_t {
    /// `"%04X:%02X:%02X.0"`.
    pub busIdLegacy: [c_char; NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE],
    pub domain: c_uint,
    pub bus: c_uint,
    pub device: c_uint,
    /// Device id in the high 16 bits, vendor id (0x10de) in the low.
    pub pciDeviceId: c_uint,
    pub pciSubSystemId: c_uint,
    /// `"%08X:%02X:%02X.0"`.
    pub busId: [c_char; NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct nvmlMemory_t {
    pub total: c_ulonglong,
    pub free: c_ulonglong,
    pub used: c_ulonglong,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct nvmlMemory_v2_t {
    pub version: c_uint,
    pub total: c_ulonglong,
    pub reserved: c_ulonglong,
    pub free: c_ulonglong,
    pub used: c_ulonglong,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct nvmlUtilization_t {
    pub gpu: c_uint,
    pub memory: c_uint,
}

/// What `nvmlDeviceGetComputeRunningProcesses` (unversioned, the oldest ABI) fills in.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct nvmlProcessInfo_v1_t {
    pub pid: c_uint,
    pub usedGpuMemory: c_ulonglong,
}

/// `nvmlProcessInfo_t` = `nvmlProcessInfo_v2_t`: what the `_v2` and `_v3` process lists fill in.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct nvmlProcessInfo_t {
    pub pid: c_uint,
    pub usedGpuMemory: c_ulonglong,
    pub gpuInstanceId: c_uint,
    pub computeInstanceId: c_uint,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct nvmlProcessUtilizationSample_t {
    pub pid: c_uint,
    /// CPU timestamp in microseconds.
    pub timeStamp: c_ulonglong,
    pub smUtil: c_uint,
    pub memUtil: c_uint,
    pub encUtil: c_uint,
    pub decUtil: c_uint,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct nvmlEventData_t {
    pub device: nvmlDevice_t,
    pub eventType: c_ulonglong,
    /// For XID events, the XID.
    pub eventData: c_ulonglong,
    pub gpuInstanceId: c_uint,
    pub computeInstanceId: c_uint,
}

/// The event record of the unversioned `nvmlEventSetWait` (before MIG added the instance ids):
/// the first three fields of [`nvmlEventData_t`].
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct nvmlEventData_v1_t {
    pub device: nvmlDevice_t,
    pub eventType: c_ulonglong,
    pub eventData: c_ulonglong,
}

#[cfg(test)]
mod tests {
    //! Our constants and layouts against nvml-wrapper-sys's bindgen output of nvml.h.
    use super::*;
    use nvml_wrapper_sys::bindings as s;
    use std::mem::{align_of, offset_of, size_of};

    #[test]
    fn return_codes_match_nvml_h() {
        let pairs = [
            (ret::SUCCESS, s::nvmlReturn_enum_NVML_SUCCESS),
            (
                ret::ERROR_UNINITIALIZED,
                s::nvmlReturn_enum_NVML_ERROR_UNINITIALIZED,
            ),
            (
                ret::ERROR_INVALID_ARGUMENT,
                s::nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT,
            ),
            (
                ret::ERROR_NOT_SUPPORTED,
                s::nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED,
            ),
            (
                ret::ERROR_NO_PERMISSION,
                s::nvmlReturn_enum_NVML_ERROR_NO_PERMISSION,
            ),
            (
                ret::ERROR_ALREADY_INITIALIZED,
                s::nvmlReturn_enum_NVML_ERROR_ALREADY_INITIALIZED,
            ),
            (
                ret::ERROR_NOT_FOUND,
                s::nvmlReturn_enum_NVML_ERROR_NOT_FOUND,
            ),
            (
                ret::ERROR_INSUFFICIENT_SIZE,
                s::nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE,
            ),
            (
                ret::ERROR_INSUFFICIENT_POWER,
                s::nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_POWER,
            ),
            (
                ret::ERROR_DRIVER_NOT_LOADED,
                s::nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED,
            ),
            (ret::ERROR_TIMEOUT, s::nvmlReturn_enum_NVML_ERROR_TIMEOUT),
            (
                ret::ERROR_IRQ_ISSUE,
                s::nvmlReturn_enum_NVML_ERROR_IRQ_ISSUE,
            ),
            (
                ret::ERROR_LIBRARY_NOT_FOUND,
                s::nvmlReturn_enum_NVML_ERROR_LIBRARY_NOT_FOUND,
            ),
            (
                ret::ERROR_FUNCTION_NOT_FOUND,
                s::nvmlReturn_enum_NVML_ERROR_FUNCTION_NOT_FOUND,
            ),
            (
                ret::ERROR_CORRUPTED_INFOROM,
                s::nvmlReturn_enum_NVML_ERROR_CORRUPTED_INFOROM,
            ),
            (
                ret::ERROR_GPU_IS_LOST,
                s::nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST,
            ),
            (
                ret::ERROR_RESET_REQUIRED,
                s::nvmlReturn_enum_NVML_ERROR_RESET_REQUIRED,
            ),
            (
                ret::ERROR_OPERATING_SYSTEM,
                s::nvmlReturn_enum_NVML_ERROR_OPERATING_SYSTEM,
            ),
            (
                ret::ERROR_LIB_RM_VERSION_MISMATCH,
                s::nvmlReturn_enum_NVML_ERROR_LIB_RM_VERSION_MISMATCH,
            ),
            (ret::ERROR_IN_USE, s::nvmlReturn_enum_NVML_ERROR_IN_USE),
            (ret::ERROR_MEMORY, s::nvmlReturn_enum_NVML_ERROR_MEMORY),
            (ret::ERROR_NO_DATA, s::nvmlReturn_enum_NVML_ERROR_NO_DATA),
            (
                ret::ERROR_VGPU_ECC_NOT_SUPPORTED,
                s::nvmlReturn_enum_NVML_ERROR_VGPU_ECC_NOT_SUPPORTED,
            ),
            (
                ret::ERROR_INSUFFICIENT_RESOURCES,
                s::nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES,
            ),
            (
                ret::ERROR_FREQ_NOT_SUPPORTED,
                s::nvmlReturn_enum_NVML_ERROR_FREQ_NOT_SUPPORTED,
            ),
            (
                ret::ERROR_ARGUMENT_VERSION_MISMATCH,
                s::nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
            ),
            (
                ret::ERROR_DEPRECATED,
                s::nvmlReturn_enum_NVML_ERROR_DEPRECATED,
            ),
            (
                ret::ERROR_NOT_READY,
                s::nvmlReturn_enum_NVML_ERROR_NOT_READY,
            ),
            (
                ret::ERROR_GPU_NOT_FOUND,
                s::nvmlReturn_enum_NVML_ERROR_GPU_NOT_FOUND,
            ),
            (
                ret::ERROR_INVALID_STATE,
                s::nvmlReturn_enum_NVML_ERROR_INVALID_STATE,
            ),
            (ret::ERROR_UNKNOWN, s::nvmlReturn_enum_NVML_ERROR_UNKNOWN),
        ];
        for (ours, theirs) in pairs {
            assert_eq!(ours, theirs);
        }
        // Every code has exactly one string.
        for (code, _) in pairs {
            assert_eq!(
                ret::TABLE.iter().filter(|(c, _)| *c == code).count(),
                1,
                "{code}"
            );
        }
        assert_eq!(ret::TABLE.len(), pairs.len());
    }

    #[test]
    fn constants_match_nvml_h() {
        assert_eq!(
            NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE as u32,
            s::NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE
        );
        assert_eq!(
            NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE as u32,
            s::NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE
        );
        assert_eq!(
            NVML_DEVICE_UUID_BUFFER_SIZE as u32,
            s::NVML_DEVICE_UUID_BUFFER_SIZE
        );
        assert_eq!(
            NVML_DEVICE_UUID_V2_BUFFER_SIZE as u32,
            s::NVML_DEVICE_UUID_V2_BUFFER_SIZE
        );
        assert_eq!(
            NVML_DEVICE_NAME_BUFFER_SIZE as u32,
            s::NVML_DEVICE_NAME_BUFFER_SIZE
        );
        assert_eq!(
            NVML_DEVICE_NAME_V2_BUFFER_SIZE as u32,
            s::NVML_DEVICE_NAME_V2_BUFFER_SIZE
        );
        assert_eq!(
            NVML_DEVICE_SERIAL_BUFFER_SIZE as u32,
            s::NVML_DEVICE_SERIAL_BUFFER_SIZE
        );
        assert_eq!(
            NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE as u32,
            s::NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE
        );
        assert_eq!(
            NVML_SYSTEM_NVML_VERSION_BUFFER_SIZE as u32,
            s::NVML_SYSTEM_NVML_VERSION_BUFFER_SIZE
        );
        assert_eq!(NVML_NVLINK_MAX_LINKS, s::NVML_NVLINK_MAX_LINKS);
        assert_eq!(NVML_INVALID_INSTANCE_ID, s::INVALID_GPU_INSTANCE_ID);
        assert_eq!(NVML_INIT_FLAG_NO_GPUS, s::NVML_INIT_FLAG_NO_GPUS);
        assert_eq!(NVML_INIT_FLAG_NO_ATTACH, s::NVML_INIT_FLAG_NO_ATTACH);
        assert_eq!(
            NVML_FEATURE_DISABLED,
            s::nvmlEnableState_enum_NVML_FEATURE_DISABLED
        );
        assert_eq!(
            NVML_FEATURE_ENABLED,
            s::nvmlEnableState_enum_NVML_FEATURE_ENABLED
        );
        assert_eq!(NVML_DEVICE_MIG_DISABLE, s::NVML_DEVICE_MIG_DISABLE);
        assert_eq!(NVML_DEVICE_MIG_ENABLE, s::NVML_DEVICE_MIG_ENABLE);
        assert_eq!(NVML_AFFINITY_SCOPE_NODE, s::NVML_AFFINITY_SCOPE_NODE);
        assert_eq!(NVML_AFFINITY_SCOPE_SOCKET, s::NVML_AFFINITY_SCOPE_SOCKET);
    }

    #[test]
    fn enums_match_nvml_h() {
        assert_eq!(topo::INTERNAL, s::nvmlGpuLevel_enum_NVML_TOPOLOGY_INTERNAL);
        assert_eq!(topo::SINGLE, s::nvmlGpuLevel_enum_NVML_TOPOLOGY_SINGLE);
        assert_eq!(topo::MULTIPLE, s::nvmlGpuLevel_enum_NVML_TOPOLOGY_MULTIPLE);
        assert_eq!(
            topo::HOSTBRIDGE,
            s::nvmlGpuLevel_enum_NVML_TOPOLOGY_HOSTBRIDGE
        );
        assert_eq!(topo::NODE, s::nvmlGpuLevel_enum_NVML_TOPOLOGY_NODE);
        assert_eq!(topo::SYSTEM, s::nvmlGpuLevel_enum_NVML_TOPOLOGY_SYSTEM);

        assert_eq!(
            nvlink_device::GPU,
            s::nvmlIntNvLinkDeviceType_enum_NVML_NVLINK_DEVICE_TYPE_GPU
        );
        assert_eq!(
            nvlink_device::IBMNPU,
            s::nvmlIntNvLinkDeviceType_enum_NVML_NVLINK_DEVICE_TYPE_IBMNPU
        );
        assert_eq!(
            nvlink_device::SWITCH,
            s::nvmlIntNvLinkDeviceType_enum_NVML_NVLINK_DEVICE_TYPE_SWITCH
        );
        assert_eq!(
            nvlink_device::UNKNOWN,
            s::nvmlIntNvLinkDeviceType_enum_NVML_NVLINK_DEVICE_TYPE_UNKNOWN
        );

        assert_eq!(
            nvlink_cap::P2P_SUPPORTED,
            s::nvmlNvLinkCapability_enum_NVML_NVLINK_CAP_P2P_SUPPORTED
        );
        assert_eq!(
            nvlink_cap::SYSMEM_ACCESS,
            s::nvmlNvLinkCapability_enum_NVML_NVLINK_CAP_SYSMEM_ACCESS
        );
        assert_eq!(
            nvlink_cap::P2P_ATOMICS,
            s::nvmlNvLinkCapability_enum_NVML_NVLINK_CAP_P2P_ATOMICS
        );
        assert_eq!(
            nvlink_cap::SYSMEM_ATOMICS,
            s::nvmlNvLinkCapability_enum_NVML_NVLINK_CAP_SYSMEM_ATOMICS
        );
        assert_eq!(
            nvlink_cap::SLI_BRIDGE,
            s::nvmlNvLinkCapability_enum_NVML_NVLINK_CAP_SLI_BRIDGE
        );
        assert_eq!(
            nvlink_cap::VALID,
            s::nvmlNvLinkCapability_enum_NVML_NVLINK_CAP_VALID
        );
        assert_eq!(
            nvlink_cap::COUNT,
            s::nvmlNvLinkCapability_enum_NVML_NVLINK_CAP_COUNT
        );

        assert_eq!(
            nvlink_version::INVALID,
            s::nvmlNvlinkVersion_enum_NVML_NVLINK_VERSION_INVALID
        );
        assert_eq!(
            nvlink_version::V1_0,
            s::nvmlNvlinkVersion_enum_NVML_NVLINK_VERSION_1_0
        );
        assert_eq!(
            nvlink_version::V2_0,
            s::nvmlNvlinkVersion_enum_NVML_NVLINK_VERSION_2_0
        );
        assert_eq!(
            nvlink_version::V2_2,
            s::nvmlNvlinkVersion_enum_NVML_NVLINK_VERSION_2_2
        );
        assert_eq!(
            nvlink_version::V3_0,
            s::nvmlNvlinkVersion_enum_NVML_NVLINK_VERSION_3_0
        );
        assert_eq!(
            nvlink_version::V3_1,
            s::nvmlNvlinkVersion_enum_NVML_NVLINK_VERSION_3_1
        );
        assert_eq!(
            nvlink_version::V4_0,
            s::nvmlNvlinkVersion_enum_NVML_NVLINK_VERSION_4_0
        );
        assert_eq!(
            nvlink_version::V5_0,
            s::nvmlNvlinkVersion_enum_NVML_NVLINK_VERSION_5_0
        );

        assert_eq!(arch::KEPLER, s::NVML_DEVICE_ARCH_KEPLER);
        assert_eq!(arch::MAXWELL, s::NVML_DEVICE_ARCH_MAXWELL);
        assert_eq!(arch::PASCAL, s::NVML_DEVICE_ARCH_PASCAL);
        assert_eq!(arch::VOLTA, s::NVML_DEVICE_ARCH_VOLTA);
        assert_eq!(arch::TURING, s::NVML_DEVICE_ARCH_TURING);
        assert_eq!(arch::AMPERE, s::NVML_DEVICE_ARCH_AMPERE);
        assert_eq!(arch::ADA, s::NVML_DEVICE_ARCH_ADA);
        assert_eq!(arch::HOPPER, s::NVML_DEVICE_ARCH_HOPPER);
        assert_eq!(arch::BLACKWELL, s::NVML_DEVICE_ARCH_BLACKWELL);
        assert_eq!(arch::UNKNOWN, s::NVML_DEVICE_ARCH_UNKNOWN);

        assert_eq!(event::NONE, s::nvmlEventTypeNone as u64);
        assert_eq!(
            event::SINGLE_BIT_ECC_ERROR,
            s::nvmlEventTypeSingleBitEccError as u64
        );
        assert_eq!(
            event::DOUBLE_BIT_ECC_ERROR,
            s::nvmlEventTypeDoubleBitEccError as u64
        );
        assert_eq!(event::PSTATE, s::nvmlEventTypePState as u64);
        assert_eq!(
            event::XID_CRITICAL_ERROR,
            s::nvmlEventTypeXidCriticalError as u64
        );
        assert_eq!(event::CLOCK, s::nvmlEventTypeClock as u64);
        assert_eq!(
            event::POWER_SOURCE_CHANGE,
            s::nvmlEventTypePowerSourceChange as u64
        );
        assert_eq!(event::ALL, s::nvmlEventTypeAll as u64);
    }

    #[test]
    fn struct_layouts_match_nvml_h() {
        macro_rules! same_layout {
            ($ours:ty, $theirs:ty, [$($field:ident),*]) => {{
                assert_eq!(size_of::<$ours>(), size_of::<$theirs>(), stringify!($ours));
                assert_eq!(align_of::<$ours>(), align_of::<$theirs>(), stringify!($ours));
                $(assert_eq!(
                    offset_of!($ours, $field),
                    offset_of!($theirs, $field),
                    concat!(stringify!($ours), ".", stringify!($field))
                );)*
            }};
        }
        same_layout!(
            nvmlPciInfo_t,
            s::nvmlPciInfo_t,
            [
                busIdLegacy,
                domain,
                bus,
                device,
                pciDeviceId,
                pciSubSystemId,
                busId
            ]
        );
        same_layout!(nvmlMemory_t, s::nvmlMemory_t, [total, free, used]);
        same_layout!(
            nvmlMemory_v2_t,
            s::nvmlMemory_v2_t,
            [version, total, reserved, free, used]
        );
        same_layout!(nvmlUtilization_t, s::nvmlUtilization_t, [gpu, memory]);
        same_layout!(
            nvmlProcessInfo_v1_t,
            s::nvmlProcessInfo_v1_t,
            [pid, usedGpuMemory]
        );
        same_layout!(
            nvmlProcessInfo_t,
            s::nvmlProcessInfo_t,
            [pid, usedGpuMemory, gpuInstanceId, computeInstanceId]
        );
        same_layout!(
            nvmlProcessInfo_t,
            s::nvmlProcessInfo_v2_t,
            [pid, usedGpuMemory, gpuInstanceId, computeInstanceId]
        );
        same_layout!(
            nvmlProcessUtilizationSample_t,
            s::nvmlProcessUtilizationSample_t,
            [pid, timeStamp, smUtil, memUtil, encUtil, decUtil]
        );
        same_layout!(
            nvmlEventData_t,
            s::nvmlEventData_t,
            [
                device,
                eventType,
                eventData,
                gpuInstanceId,
                computeInstanceId
            ]
        );
        // The v1 event record is the v2 one without the trailing instance ids.
        assert_eq!(
            size_of::<nvmlEventData_v1_t>(),
            offset_of!(s::nvmlEventData_t, gpuInstanceId)
        );
        assert_eq!(
            offset_of!(nvmlEventData_v1_t, eventData),
            offset_of!(s::nvmlEventData_t, eventData)
        );
    }

    #[test]
    fn memory_v2_version_is_nvml_struct_version() {
        // nvml.h: #define nvmlMemory_v2 NVML_STRUCT_VERSION(Memory, 2); pynvml spells it out as
        // 0x02000028, and nvml-wrapper computes it as below.
        assert_eq!(NVML_MEMORY_V2, 0x0200_0028);
        assert_eq!(
            NVML_MEMORY_V2,
            (size_of::<s::nvmlMemory_v2_t>() | (2 << 24)) as u32
        );
    }
}
