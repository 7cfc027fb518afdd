//! CUDA driver API types, constants and structs (`cuda.h`).
use std::ffi::{c_int, c_uint, c_void};

pub type CUresult = c_uint;
pub type CUdevice = c_int;
pub type CUdeviceptr = u64;
pub type CUcontext = *mut c_void;
pub type CUstream = *mut c_void;
pub type CUevent = *mut c_void;
pub type CUmodule = *mut c_void;
pub type CUfunction = *mut c_void;
pub type CUgraph = *mut c_void;
pub type CUgraphNode = *mut c_void;
pub type CUgraphExec = *mut c_void;
pub type CUmemoryPool = *mut c_void;
pub type CUarray = *mut c_void;
pub type CUmipmappedArray = *mut c_void;
pub type CUmemGenericAllocationHandle = u64;

/// `CUresult` values (`cudaError_enum`).
pub mod err {
    use super::CUresult;
    pub const SUCCESS: CUresult = 0;
    pub const INVALID_VALUE: CUresult = 1;
    pub const OUT_OF_MEMORY: CUresult = 2;
    pub const NOT_INITIALIZED: CUresult = 3;
    pub const DEINITIALIZED: CUresult = 4;
    pub const NO_DEVICE: CUresult = 100;
    pub const INVALID_DEVICE: CUresult = 101;
    pub const INVALID_IMAGE: CUresult = 200;
    pub const INVALID_CONTEXT: CUresult = 201;
    pub const CONTEXT_ALREADY_CURRENT: CUresult = 202;
    pub const FILE_NOT_FOUND: CUresult = 301;
    pub const INVALID_HANDLE: CUresult = 400;
    pub const ILLEGAL_STATE: CUresult = 401;
    pub const NOT_FOUND: CUresult = 500;
    pub const NOT_READY: CUresult = 600;
    pub const ILLEGAL_ADDRESS: CUresult = 700;
    pub const LAUNCH_OUT_OF_RESOURCES: CUresult = 701;
    pub const PRIMARY_CONTEXT_ACTIVE: CUresult = 708;
    pub const CONTEXT_IS_DESTROYED: CUresult = 709;
    pub const COOPERATIVE_LAUNCH_TOO_LARGE: CUresult = 720;
    pub const NOT_PERMITTED: CUresult = 800;
    pub const NOT_SUPPORTED: CUresult = 801;
    pub const STREAM_CAPTURE_UNSUPPORTED: CUresult = 900;
    pub const STREAM_CAPTURE_INVALIDATED: CUresult = 901;
    pub const STREAM_CAPTURE_UNMATCHED: CUresult = 903;
    pub const STREAM_CAPTURE_WRONG_THREAD: CUresult = 908;
    pub const UNKNOWN: CUresult = 999;

    /// `(value, name, description)` for cuGetErrorName / cuGetErrorString.
    pub const TABLE: &[(CUresult, &str, &str)] = &[
        (SUCCESS, "CUDA_SUCCESS", "no error"),
        (
            INVALID_VALUE,
            "CUDA_ERROR_INVALID_VALUE",
            "invalid argument",
        ),
        (OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"),
        (
            NOT_INITIALIZED,
            "CUDA_ERROR_NOT_INITIALIZED",
            "initialization error",
        ),
        (
            DEINITIALIZED,
            "CUDA_ERROR_DEINITIALIZED",
            "driver shutting down",
        ),
        (
            NO_DEVICE,
            "CUDA_ERROR_NO_DEVICE",
            "no CUDA-capable device is detected",
        ),
        (
            INVALID_DEVICE,
            "CUDA_ERROR_INVALID_DEVICE",
            "invalid device ordinal",
        ),
        (
            INVALID_IMAGE,
            "CUDA_ERROR_INVALID_IMAGE",
            "device kernel image is invalid",
        ),
        (
            INVALID_CONTEXT,
            "CUDA_ERROR_INVALID_CONTEXT",
            "invalid device context",
        ),
        (
            CONTEXT_ALREADY_CURRENT,
            "CUDA_ERROR_CONTEXT_ALREADY_CURRENT",
            "context already current",
        ),
        (
            FILE_NOT_FOUND,
            "CUDA_ERROR_FILE_NOT_FOUND",
            "file not found",
        ),
        (
            INVALID_HANDLE,
            "CUDA_ERROR_INVALID_HANDLE",
            "invalid resource handle",
        ),
        (
            ILLEGAL_STATE,
            "CUDA_ERROR_ILLEGAL_STATE",
            "the operation cannot be performed in the present state",
        ),
        (NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"),
        (NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"),
        (
            ILLEGAL_ADDRESS,
            "CUDA_ERROR_ILLEGAL_ADDRESS",
            "an illegal memory access was encountered",
        ),
        (
            LAUNCH_OUT_OF_RESOURCES,
            "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
            "too many resources requested for launch",
        ),
        (
            PRIMARY_CONTEXT_ACTIVE,
            "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE",
            "primary context active",
        ),
        (
            CONTEXT_IS_DESTROYED,
            "CUDA_ERROR_CONTEXT_IS_DESTROYED",
            "context is destroyed",
        ),
        (
            COOPERATIVE_LAUNCH_TOO_LARGE,
            "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE",
            "too many blocks in cooperative launch",
        ),
        (
            NOT_PERMITTED,
            "CUDA_ERROR_NOT_PERMITTED",
            "operation not permitted",
        ),
        (
            NOT_SUPPORTED,
            "CUDA_ERROR_NOT_SUPPORTED",
            "operation not supported",
        ),
        (
            STREAM_CAPTURE_UNSUPPORTED,
            "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
            "operation not permitted when stream is capturing",
        ),
        (
            STREAM_CAPTURE_INVALIDATED,
            "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
            "operation failed due to a previous error during capture",
        ),
        (
            STREAM_CAPTURE_UNMATCHED,
            "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED",
            "capture was not initiated in this stream",
        ),
        (
            STREAM_CAPTURE_WRONG_THREAD,
            "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
            "attempt to terminate a thread-local capture sequence from another thread",
        ),
        (UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"),
    ];
}

/// `CUdevice_attribute` values the simulator answers.
pub mod attr {
    pub const MAX_THREADS_PER_BLOCK: i32 = 1;
    pub const MAX_BLOCK_DIM_X: i32 = 2;
    pub const MAX_BLOCK_DIM_Y: i32 = 3;
    pub const MAX_BLOCK_DIM_Z: i32 = 4;
    pub const MAX_GRID_DIM_X: i32 = 5;
    pub const MAX_GRID_DIM_Y: i32 = 6;
    pub const MAX_GRID_DIM_Z: i32 = 7;
    pub const MAX_SHARED_MEMORY_PER_BLOCK: i32 = 8;
    pub const TOTAL_CONSTANT_MEMORY: i32 = 9;
    pub const WARP_SIZE: i32 = 10;
    pub const MAX_PITCH: i32 = 11;
    pub const MAX_REGISTERS_PER_BLOCK: i32 = 12;
    pub const CLOCK_RATE: i32 = 13;
    pub const TEXTURE_ALIGNMENT: i32 = 14;
    pub const GPU_OVERLAP: i32 = 15;
    pub const MULTIPROCESSOR_COUNT: i32 = 16;
    pub const KERNEL_EXEC_TIMEOUT: i32 = 17;
    pub const INTEGRATED: i32 = 18;
    pub const CAN_MAP_HOST_MEMORY: i32 = 19;
    pub const COMPUTE_MODE: i32 = 20;
    pub const CONCURRENT_KERNELS: i32 = 31;
    pub const ECC_ENABLED: i32 = 32;
    pub const PCI_BUS_ID: i32 = 33;
    pub const PCI_DEVICE_ID: i32 = 34;
    pub const TCC_DRIVER: i32 = 35;
    pub const MEMORY_CLOCK_RATE: i32 = 36;
    pub const GLOBAL_MEMORY_BUS_WIDTH: i32 = 37;
    pub const L2_CACHE_SIZE: i32 = 38;
    pub const MAX_THREADS_PER_MULTIPROCESSOR: i32 = 39;
    pub const ASYNC_ENGINE_COUNT: i32 = 40;
    pub const UNIFIED_ADDRESSING: i32 = 41;
    pub const PCI_DOMAIN_ID: i32 = 50;
    pub const COMPUTE_CAPABILITY_MAJOR: i32 = 75;
    pub const COMPUTE_CAPABILITY_MINOR: i32 = 76;
    pub const MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: i32 = 81;
    pub const MAX_REGISTERS_PER_MULTIPROCESSOR: i32 = 82;
    pub const MANAGED_MEMORY: i32 = 83;
    pub const MULTI_GPU_BOARD: i32 = 84;
    pub const CONCURRENT_MANAGED_ACCESS: i32 = 89;
    pub const COOPERATIVE_LAUNCH: i32 = 95;
    pub const MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: i32 = 97;
    pub const VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: i32 = 102;
    pub const MAX_BLOCKS_PER_MULTIPROCESSOR: i32 = 106;
    pub const MEMORY_POOLS_SUPPORTED: i32 = 115;
    /// One past the last attribute of CUDA 12.8 (`CU_DEVICE_ATTRIBUTE_MAX`).
    pub const MAX: i32 = 144;
}

pub const CU_STREAM_LEGACY: usize = 0x1;
pub const CU_STREAM_PER_THREAD: usize = 0x2;
pub const CU_STREAM_NON_BLOCKING: u32 = 0x1;
pub const CU_EVENT_DISABLE_TIMING: u32 = 0x2;
pub const CU_EVENT_FLAGS_MASK: u32 = 0xf;
pub const CU_CTX_FLAGS_MASK: u32 = 0xff;

pub const CU_LAUNCH_PARAM_END: usize = 0x00;
pub const CU_LAUNCH_PARAM_BUFFER_POINTER: usize = 0x01;
pub const CU_LAUNCH_PARAM_BUFFER_SIZE: usize = 0x02;
pub const CU_LAUNCH_ATTRIBUTE_COOPERATIVE: u32 = 2;

pub const CU_GET_PROC_ADDRESS_DEFAULT: u64 = 0;
pub const CU_GET_PROC_ADDRESS_LEGACY_STREAM: u64 = 1;
pub const CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM: u64 = 2;
pub const CU_GET_PROC_ADDRESS_SUCCESS: c_int = 0;
pub const CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND: c_int = 1;
pub const CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT: c_int = 2;

pub const CU_MEM_ATTACH_GLOBAL: u32 = 1;
pub const CU_MEM_ATTACH_HOST: u32 = 2;
pub const CU_MEM_LOCATION_TYPE_DEVICE: c_int = 1;
pub const CU_MEM_ALLOCATION_TYPE_PINNED: c_int = 1;
/// `CUmemAllocationHandleType`: a POSIX file descriptor (`int`), and a fabric handle
/// (`CUmemFabricHandle`, 64 bytes).
pub const CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: c_int = 1;
pub const CU_MEM_HANDLE_TYPE_FABRIC: c_int = 8;
/// Bytes of a `CUipcMemHandle` and of a `CUmemFabricHandle` (`CU_IPC_HANDLE_SIZE`).
pub const CU_IPC_HANDLE_SIZE: usize = 64;

/// `CUipcMemHandle`: 64 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUipcMemHandle {
    pub reserved: [u8; CU_IPC_HANDLE_SIZE],
}
pub const CU_MEM_ALLOC_GRANULARITY_MINIMUM: c_int = 0;
pub const CU_MEM_ALLOC_GRANULARITY_RECOMMENDED: c_int = 1;
pub const CU_MEM_ACCESS_FLAGS_PROT_NONE: c_int = 0;
pub const CU_MEM_ACCESS_FLAGS_PROT_READWRITE: c_int = 3;

pub const CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES: c_int = 1;
pub const CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC: c_int = 2;
pub const CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES: c_int = 3;
pub const CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: c_int = 4;
pub const CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: c_int = 5;
pub const CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: c_int = 6;
pub const CU_MEMPOOL_ATTR_USED_MEM_CURRENT: c_int = 7;
pub const CU_MEMPOOL_ATTR_USED_MEM_HIGH: c_int = 8;

pub const CU_STREAM_CAPTURE_STATUS_NONE: c_int = 0;
pub const CU_STREAM_CAPTURE_STATUS_ACTIVE: c_int = 1;

pub const CU_POINTER_ATTRIBUTE_CONTEXT: c_int = 1;
pub const CU_POINTER_ATTRIBUTE_MEMORY_TYPE: c_int = 2;
pub const CU_POINTER_ATTRIBUTE_DEVICE_POINTER: c_int = 3;
pub const CU_POINTER_ATTRIBUTE_IS_MANAGED: c_int = 8;
pub const CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: c_int = 9;
pub const CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: c_int = 11;
pub const CU_POINTER_ATTRIBUTE_RANGE_SIZE: c_int = 12;
pub const CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE: c_int = 17;
pub const CU_MEMORYTYPE_HOST: c_uint = 1;
pub const CU_MEMORYTYPE_DEVICE: c_uint = 2;

pub const CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: c_int = 0;
pub const CU_FUNC_ATTRIBUTE_NUM_REGS: c_int = 4;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CUuuid {
    pub bytes: [u8; 16],
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUlaunchConfig {
    pub gridDimX: c_uint,
    pub gridDimY: c_uint,
    pub gridDimZ: c_uint,
    pub blockDimX: c_uint,
    pub blockDimY: c_uint,
    pub blockDimZ: c_uint,
    pub sharedMemBytes: c_uint,
    pub hStream: CUstream,
    pub attrs: *mut CUlaunchAttribute,
    pub numAttrs: c_uint,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUlaunchAttribute {
    pub id: c_uint,
    pub pad: [u8; 4],
    /// `CUlaunchAttributeValue`, a 64-byte union; for COOPERATIVE its first int is the flag.
    pub value: [u64; 8],
}

/// `CUDA_KERNEL_NODE_PARAMS` (v1); the v2 layout appends `kern` and `ctx`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUDA_KERNEL_NODE_PARAMS {
    pub func: CUfunction,
    pub gridDimX: c_uint,
    pub gridDimY: c_uint,
    pub gridDimZ: c_uint,
    pub blockDimX: c_uint,
    pub blockDimY: c_uint,
    pub blockDimZ: c_uint,
    pub sharedMemBytes: c_uint,
    pub kernelParams: *mut *mut c_void,
    pub extra: *mut *mut c_void,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUmemLocation {
    pub type_: c_int,
    pub id: c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUmemAllocationProp {
    pub type_: c_int,
    pub requestedHandleTypes: c_int,
    pub location: CUmemLocation,
    pub win32HandleMetaData: *mut c_void,
    /// `allocFlags`: compressionType, gpuDirectRDMACapable, usage, reserved[4].
    pub allocFlags: [u8; 8],
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUmemAccessDesc {
    pub location: CUmemLocation,
    pub flags: c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUmemPoolProps {
    pub allocType: c_int,
    pub handleTypes: c_int,
    pub location: CUmemLocation,
    pub win32SecurityAttributes: *mut c_void,
    pub maxSize: usize,
    pub usage: u16,
    pub reserved: [u8; 54],
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUDA_ARRAY_DESCRIPTOR {
    pub Width: usize,
    pub Height: usize,
    pub Format: c_int,
    pub NumChannels: c_uint,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUDA_ARRAY3D_DESCRIPTOR {
    pub Width: usize,
    pub Height: usize,
    pub Depth: usize,
    pub Format: c_int,
    pub NumChannels: c_uint,
    pub Flags: c_uint,
}

/// The descriptors of the CUDA 2.x ABI (`cuArrayCreate`, `cuArray3DCreate` without `_v2`, which
/// libcuda still exports and `cuGetProcAddress` hands out for a `cudaVersion` below 3020): the
/// same fields with 32-bit extents (cuda.h's `CUDA_ARRAY_DESCRIPTOR_v1`,
/// `CUDA_ARRAY3D_DESCRIPTOR_v1`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUDA_ARRAY_DESCRIPTOR_v1 {
    pub Width: c_uint,
    pub Height: c_uint,
    pub Format: c_int,
    pub NumChannels: c_uint,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUDA_ARRAY3D_DESCRIPTOR_v1 {
    pub Width: c_uint,
    pub Height: c_uint,
    pub Depth: c_uint,
    pub Format: c_int,
    pub NumChannels: c_uint,
    pub Flags: c_uint,
}

/// Bytes per channel element of a `CUarray_format`, or None for formats the simulator does not
/// model (block-compressed and video formats).
pub fn array_format_bytes(format: c_int) -> Option<usize> {
    match format {
        1 | 8 => Some(1),       // UNSIGNED_INT8, SIGNED_INT8
        2 | 9 | 16 => Some(2),  // UNSIGNED_INT16, SIGNED_INT16, HALF
        3 | 10 | 32 => Some(4), // UNSIGNED_INT32, SIGNED_INT32, FLOAT
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    //! Our constants and layouts against cudarc's bindgen output of cuda.h 12.8.
    use super::*;
    use cudarc::driver::sys as s;
    use std::mem::{offset_of, size_of};

    #[test]
    fn error_codes_match_cuda_h() {
        use s::cudaError_enum as E;
        let pairs = [
            (err::INVALID_VALUE, E::CUDA_ERROR_INVALID_VALUE),
            (err::OUT_OF_MEMORY, E::CUDA_ERROR_OUT_OF_MEMORY),
            (err::NOT_INITIALIZED, E::CUDA_ERROR_NOT_INITIALIZED),
            (err::NO_DEVICE, E::CUDA_ERROR_NO_DEVICE),
            (err::INVALID_DEVICE, E::CUDA_ERROR_INVALID_DEVICE),
            (err::INVALID_CONTEXT, E::CUDA_ERROR_INVALID_CONTEXT),
            (err::INVALID_HANDLE, E::CUDA_ERROR_INVALID_HANDLE),
            (err::NOT_FOUND, E::CUDA_ERROR_NOT_FOUND),
            (err::NOT_READY, E::CUDA_ERROR_NOT_READY),
            (
                err::PRIMARY_CONTEXT_ACTIVE,
                E::CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE,
            ),
            (
                err::COOPERATIVE_LAUNCH_TOO_LARGE,
                E::CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE,
            ),
            (err::NOT_SUPPORTED, E::CUDA_ERROR_NOT_SUPPORTED),
            (
                err::STREAM_CAPTURE_UNMATCHED,
                E::CUDA_ERROR_STREAM_CAPTURE_UNMATCHED,
            ),
            (err::ILLEGAL_STATE, E::CUDA_ERROR_ILLEGAL_STATE),
        ];
        for (ours, theirs) in pairs {
            assert_eq!(ours, theirs as u32, "{theirs:?}");
        }
        for (v, name, _) in err::TABLE {
            assert!(name.starts_with("CUDA_"), "{v} {name}");
        }
    }

    #[test]
    fn attributes_match_cuda_h() {
        use s::CUdevice_attribute_enum as A;
        assert_eq!(
            attr::MULTIPROCESSOR_COUNT,
            A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT as i32
        );
        assert_eq!(attr::PCI_BUS_ID, A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID as i32);
        assert_eq!(
            attr::PCI_DOMAIN_ID,
            A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID as i32
        );
        assert_eq!(
            attr::COMPUTE_CAPABILITY_MAJOR,
            A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR as i32
        );
        assert_eq!(
            attr::MANAGED_MEMORY,
            A::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY as i32
        );
        assert_eq!(
            attr::COOPERATIVE_LAUNCH,
            A::CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH as i32
        );
        assert_eq!(
            attr::VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
            A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED as i32
        );
        assert_eq!(
            attr::MEMORY_POOLS_SUPPORTED,
            A::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED as i32
        );
        assert_eq!(
            attr::MAX_BLOCKS_PER_MULTIPROCESSOR,
            A::CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR as i32
        );
        assert_eq!(
            attr::MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN as i32
        );
        assert_eq!(attr::MAX, A::CU_DEVICE_ATTRIBUTE_MAX as i32);
    }

    #[test]
    fn struct_layouts_match_cuda_h() {
        assert_eq!(size_of::<CUlaunchConfig>(), size_of::<s::CUlaunchConfig>());
        assert_eq!(
            offset_of!(CUlaunchConfig, hStream),
            offset_of!(s::CUlaunchConfig, hStream)
        );
        assert_eq!(
            offset_of!(CUlaunchConfig, numAttrs),
            offset_of!(s::CUlaunchConfig, numAttrs)
        );
        assert_eq!(
            size_of::<CUlaunchAttribute>(),
            size_of::<s::CUlaunchAttribute>()
        );
        assert_eq!(
            size_of::<CUDA_KERNEL_NODE_PARAMS>(),
            size_of::<s::CUDA_KERNEL_NODE_PARAMS_v1>()
        );
        assert_eq!(
            offset_of!(CUDA_KERNEL_NODE_PARAMS, kernelParams),
            offset_of!(s::CUDA_KERNEL_NODE_PARAMS_v1, kernelParams)
        );
        assert_eq!(
            size_of::<CUmemAllocationProp>(),
            size_of::<s::CUmemAllocationProp>()
        );
        assert_eq!(
            offset_of!(CUmemAllocationProp, location),
            offset_of!(s::CUmemAllocationProp, location)
        );
        assert_eq!(
            size_of::<CUmemAccessDesc>(),
            size_of::<s::CUmemAccessDesc>()
        );
        assert_eq!(size_of::<CUmemPoolProps>(), size_of::<s::CUmemPoolProps>());
        assert_eq!(
            offset_of!(CUmemPoolProps, maxSize),
            offset_of!(s::CUmemPoolProps, maxSize)
        );
        assert_eq!(
            size_of::<CUDA_ARRAY_DESCRIPTOR>(),
            size_of::<s::CUDA_ARRAY_DESCRIPTOR>()
        );
        assert_eq!(
            size_of::<CUDA_ARRAY3D_DESCRIPTOR>(),
            size_of::<s::CUDA_ARRAY3D_DESCRIPTOR>()
        );
        assert_eq!(size_of::<CUuuid>(), size_of::<s::CUuuid>());
    }

    #[test]
    fn enum_constants_match_cuda_h() {
        assert_eq!(
            CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            s::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD as i32
        );
        assert_eq!(
            CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            s::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH as i32
        );
        assert_eq!(
            CU_LAUNCH_ATTRIBUTE_COOPERATIVE,
            s::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE as u32
        );
        assert_eq!(
            CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT,
            s::CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT as i32
        );
        assert_eq!(
            CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM,
            s::CUdriverProcAddress_flags::CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM as u64
        );
        assert_eq!(
            CU_POINTER_ATTRIBUTE_RANGE_SIZE,
            s::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE as i32
        );
        assert_eq!(
            CU_MEM_LOCATION_TYPE_DEVICE,
            s::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE as i32
        );
    }
}
