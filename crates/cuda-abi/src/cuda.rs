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

/// `CUgraphMem_attribute` (cuDeviceGetGraphMemAttribute / cuDeviceSetGraphMemAttribute, CUDA 11.4).
pub const CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT: c_int = 0;
pub const CU_GRAPH_MEM_ATTR_USED_MEM_HIGH: c_int = 1;
pub const CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT: c_int = 2;
pub const CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH: c_int = 3;
/// `CUgraphNodeType` of memory-allocation and memory-free nodes.
pub const CU_GRAPH_NODE_TYPE_KERNEL: c_int = 0;
pub const CU_GRAPH_NODE_TYPE_MEM_ALLOC: c_int = 10;
pub const CU_GRAPH_NODE_TYPE_MEM_FREE: c_int = 11;
/// `CUgraphInstantiate_flags`.
pub const CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH: u64 = 1;
pub const CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD: u64 = 2;

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

/// `CUDA_MEM_ALLOC_NODE_PARAMS` (v1, CUDA 11.4): what cuGraphAddMemAllocNode takes, and where it
/// returns the allocation's address (`dptr`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUDA_MEM_ALLOC_NODE_PARAMS {
    pub poolProps: CUmemPoolProps,
    pub accessDescs: *const CUmemAccessDesc,
    pub accessDescCount: usize,
    pub bytesize: usize,
    pub dptr: CUdeviceptr,
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

mod copies;
pub use copies::*;

/// How a `CUarray_format` lays out texels: blocks of `w` x `h` texels, `bytes` each, and
/// whether the descriptor's NumChannels multiplies them (the plain integer and float formats,
/// whose element is one channel) or the format fixes its own channels (all the others).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TexelBlock {
    pub w: u64,
    pub h: u64,
    pub bytes: u64,
    pub per_channel: bool,
}

/// The layout of every `CUarray_format` of the CUDA 13 headers (cuda.h `CUarray_format_enum`;
/// the CUDA Driver API reference, "enum CUarray_format", gives each value and its meaning), or
/// None for a value that is none of them.
///
/// - Plain formats: their element per channel (UNSIGNED/SIGNED_INT8/16/32, HALF, FLOAT).
/// - `UNORM_INT8X1` ... `SNORM_INT16X4`: N channels of 8 or 16 bits per texel.
/// - Block-compressed: 4x4 texel blocks of 8 bytes (BC1, BC4) or 16 bytes (BC2, BC3, BC5,
///   BC6H, BC7) (Microsoft, "Texture Block Compression in Direct3D 11" / "BCn formats").
/// - YUV: planar and semi-planar 4:2:0 formats hold a full-size luma plane and chroma planes a
///   quarter of its size (NV12: 12 bits per pixel; P010/P016 the same at 16 bits per sample:
///   24), 4:2:2 ones chroma half its size (NV16: 16 bits per pixel, P210/P216: 32), packed 4:2:2
///   ones 2 samples per pixel (YUY2: 4 bytes per 2 pixels; Y210/Y216: 8), packed 4:4:4 ones one
///   32-bit (AYUV, Y410) or 64-bit (Y416) word per pixel, and 4:4:4 planar ones three samples
///   per pixel (8-bit: 3 bytes; 10- and 16-bit samples take 16 bits: 6) (Microsoft, "Recommended
///   8-Bit YUV Formats for Video Rendering" and "10-bit and 16-bit YUV Video Formats"). A
///   subsampled format is counted in blocks of 2x2 (4:2:0) or 2x1 (4:2:2) pixels, so an odd
///   extent is rounded up, never down.
pub fn array_format_block(format: c_int) -> Option<TexelBlock> {
    let plain = |bytes| TexelBlock {
        w: 1,
        h: 1,
        bytes,
        per_channel: true,
    };
    let px = |bytes| TexelBlock {
        w: 1,
        h: 1,
        bytes,
        per_channel: false,
    };
    let block = |w, h, bytes| TexelBlock {
        w,
        h,
        bytes,
        per_channel: false,
    };
    Some(match format {
        0x01 | 0x08 => plain(1),                      // UNSIGNED_INT8, SIGNED_INT8
        0x02 | 0x09 | 0x10 => plain(2),               // UNSIGNED_INT16, SIGNED_INT16, HALF
        0x03 | 0x0a | 0x20 => plain(4),               // UNSIGNED_INT32, SIGNED_INT32, FLOAT
        0xc0 | 0xc6 => px(1),                         // UNORM_INT8X1, SNORM_INT8X1
        0xc1 | 0xc7 => px(2),                         // UNORM_INT8X2, SNORM_INT8X2
        0xc2 | 0xc8 => px(4),                         // UNORM_INT8X4, SNORM_INT8X4
        0xc3 | 0xc9 => px(2),                         // UNORM_INT16X1, SNORM_INT16X1
        0xc4 | 0xca => px(4),                         // UNORM_INT16X2, SNORM_INT16X2
        0xc5 | 0xcb => px(8),                         // UNORM_INT16X4, SNORM_INT16X4
        0x91 | 0x92 | 0x97 | 0x98 => block(4, 4, 8),  // BC1 (+SRGB), BC4 (UNORM, SNORM)
        0x93..=0x96 | 0x99..=0x9e => block(4, 4, 16), // BC2, BC3 (+SRGB), BC5, BC6H, BC7 (+SRGB)
        0xb0 | 0x53 | 0x59 => block(2, 2, 6), // NV12, UINT8_SEMIPLANAR_420, UINT8_PLANAR_420
        0x9f | 0xa1 | 0x54 | 0x5a => block(2, 2, 12), // P010, P016, UINT16_(SEMI)PLANAR_420
        0xa2 | 0x55 | 0x5b => block(2, 1, 4), // NV16, UINT8_(SEMI)PLANAR_422
        0xa3 | 0xa4 | 0x56 | 0x5c => block(2, 1, 8), // P210, P216, UINT16_(SEMI)PLANAR_422
        0xa5 | 0x51 => block(2, 1, 4),        // YUY2, UINT8_PACKED_422
        0xa6 | 0xa7 => block(2, 1, 8),        // Y210, Y216
        0xa8 | 0xa9 | 0x52 | 0x50 => px(4),   // AYUV, Y410, UINT8_PACKED_444, UNORM_INT_101010_2
        0xb1 => px(8),                        // Y416
        0xb2 | 0xb4 | 0x57 | 0x5d => px(3),   // Y444_PLANAR8, YUV444_8bit_SemiPlanar, UINT8_*_444
        0xb3 | 0xb5 | 0x58 | 0x5e => px(6), // Y444_PLANAR10, YUV444_16bit_SemiPlanar, UINT16_*_444
        _ => return None,
    })
}

/// Bytes of a CUDA array of `levels` mip levels (1 for a plain array): each level's extent is
/// the previous one halved (at least 1; an extent of 0, a 1D or 2D array's missing dimension,
/// counts as 1), in the format's texel blocks, rounded up. None where the driver would refuse
/// the descriptor or its size does not fit in 64 bits: an unknown format, NumChannels other
/// than 1, 2 or 4 for a per-channel format, a zero width, no levels or more than the extent
/// allows (a level beyond 1x1x1), or an overflow anywhere (checked arithmetic: a real array
/// that large exceeds every device's maximum extents, which the driver refuses with
/// CUDA_ERROR_INVALID_VALUE).
pub fn array_bytes(
    w: u64,
    h: u64,
    d: u64,
    format: c_int,
    channels: c_uint,
    levels: u32,
) -> Option<u64> {
    let b = array_format_block(format)?;
    if w == 0 || (b.per_channel && !matches!(channels, 1 | 2 | 4)) {
        return None;
    }
    let max_levels = u64::BITS - w.max(h).max(d).leading_zeros();
    if levels == 0 || levels > max_levels {
        return None;
    }
    let bytes = if b.per_channel {
        b.bytes.checked_mul(channels as u64)?
    } else {
        b.bytes
    };
    let shrink = |x: u64, l: u32| (x >> l).max(1);
    let mut total = 0u64;
    for l in 0..levels {
        let level = shrink(w, l)
            .div_ceil(b.w)
            .checked_mul(shrink(h, l).div_ceil(b.h))?
            .checked_mul(shrink(d, l))?
            .checked_mul(bytes)?;
        total = total.checked_add(level)?;
    }
    Some(total)
}

#[cfg(test)]
mod tests {
    //! Our constants and layouts against cudarc's bindgen output of cuda.h 12.8.
    use super::*;
    use cudarc::driver::sys as s;
    use std::mem::{offset_of, size_of};

    /// Every `CUarray_format` of cuda.h 12.8 (cudarc's bindgen output) has a layout; the
    /// values CUDA 12.9/13 added after it (YUV444 semi-planar, UNORM_INT_101010_2, the
    /// UINT8/UINT16 packed, semi-planar and planar ones: the CUDA 13 driver API reference) too.
    #[test]
    fn every_array_format_has_a_layout() {
        use s::CUarray_format_enum as F;
        let cuda_12_8 = [
            F::CU_AD_FORMAT_UNSIGNED_INT8,
            F::CU_AD_FORMAT_UNSIGNED_INT16,
            F::CU_AD_FORMAT_UNSIGNED_INT32,
            F::CU_AD_FORMAT_SIGNED_INT8,
            F::CU_AD_FORMAT_SIGNED_INT16,
            F::CU_AD_FORMAT_SIGNED_INT32,
            F::CU_AD_FORMAT_HALF,
            F::CU_AD_FORMAT_FLOAT,
            F::CU_AD_FORMAT_NV12,
            F::CU_AD_FORMAT_UNORM_INT8X1,
            F::CU_AD_FORMAT_UNORM_INT8X2,
            F::CU_AD_FORMAT_UNORM_INT8X4,
            F::CU_AD_FORMAT_UNORM_INT16X1,
            F::CU_AD_FORMAT_UNORM_INT16X2,
            F::CU_AD_FORMAT_UNORM_INT16X4,
            F::CU_AD_FORMAT_SNORM_INT8X1,
            F::CU_AD_FORMAT_SNORM_INT8X2,
            F::CU_AD_FORMAT_SNORM_INT8X4,
            F::CU_AD_FORMAT_SNORM_INT16X1,
            F::CU_AD_FORMAT_SNORM_INT16X2,
            F::CU_AD_FORMAT_SNORM_INT16X4,
            F::CU_AD_FORMAT_BC1_UNORM,
            F::CU_AD_FORMAT_BC1_UNORM_SRGB,
            F::CU_AD_FORMAT_BC2_UNORM,
            F::CU_AD_FORMAT_BC2_UNORM_SRGB,
            F::CU_AD_FORMAT_BC3_UNORM,
            F::CU_AD_FORMAT_BC3_UNORM_SRGB,
            F::CU_AD_FORMAT_BC4_UNORM,
            F::CU_AD_FORMAT_BC4_SNORM,
            F::CU_AD_FORMAT_BC5_UNORM,
            F::CU_AD_FORMAT_BC5_SNORM,
            F::CU_AD_FORMAT_BC6H_UF16,
            F::CU_AD_FORMAT_BC6H_SF16,
            F::CU_AD_FORMAT_BC7_UNORM,
            F::CU_AD_FORMAT_BC7_UNORM_SRGB,
            F::CU_AD_FORMAT_P010,
            F::CU_AD_FORMAT_P016,
            F::CU_AD_FORMAT_NV16,
            F::CU_AD_FORMAT_P210,
            F::CU_AD_FORMAT_P216,
            F::CU_AD_FORMAT_YUY2,
            F::CU_AD_FORMAT_Y210,
            F::CU_AD_FORMAT_Y216,
            F::CU_AD_FORMAT_AYUV,
            F::CU_AD_FORMAT_Y410,
            F::CU_AD_FORMAT_Y416,
            F::CU_AD_FORMAT_Y444_PLANAR8,
            F::CU_AD_FORMAT_Y444_PLANAR10,
        ];
        for f in cuda_12_8 {
            assert!(array_format_block(f as c_int).is_some(), "{f:?}");
        }
        for v in [0xb4, 0xb5, 0x50].into_iter().chain(0x51..=0x5e) {
            assert!(array_format_block(v).is_some(), "{v:#x}");
        }
        assert_eq!(
            array_format_block(0x7fff_ffff),
            None,
            "CU_AD_FORMAT_MAX is no format"
        );
    }

    #[test]
    fn array_sizes_are_block_exact_and_checked() {
        assert_eq!(array_bytes(1024, 1024, 0, 0x20, 4, 1), Some(16 << 20));
        assert_eq!(
            array_bytes(5, 5, 0, 0x91, 1, 1),
            Some(4 * 8),
            "BC1: 2x2 blocks of 8"
        );
        assert_eq!(
            array_bytes(3, 3, 0, 0xb0, 1, 1),
            Some(4 * 6),
            "NV12 rounds odd extents up"
        );
        assert_eq!(array_bytes(1, 1, 1, 0x20, 3, 1), None, "three channels");
        assert_eq!(array_bytes(4, 4, 0, 0x20, 1, 4), None, "a level beyond 1x1");
        assert_eq!(
            array_bytes(u64::MAX / 2, 2, 0, 0x20, 4, 1),
            None,
            "overflow"
        );
        let w = (((1u128 << 64) + (1 << 32) + 4) / 6) as u64;
        assert_eq!(
            array_bytes(w, 0, 0, 0x20, 1, 2),
            None,
            "the sum of levels overflows"
        );
    }

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
            size_of::<CUDA_MEM_ALLOC_NODE_PARAMS>(),
            size_of::<s::CUDA_MEM_ALLOC_NODE_PARAMS>()
        );
        assert_eq!(
            offset_of!(CUDA_MEM_ALLOC_NODE_PARAMS, bytesize),
            offset_of!(s::CUDA_MEM_ALLOC_NODE_PARAMS, bytesize)
        );
        assert_eq!(
            offset_of!(CUDA_MEM_ALLOC_NODE_PARAMS, dptr),
            offset_of!(s::CUDA_MEM_ALLOC_NODE_PARAMS, dptr)
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
        use s::CUgraphMem_attribute_enum as G;
        assert_eq!(
            CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT,
            G::CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT as i32
        );
        assert_eq!(
            CU_GRAPH_MEM_ATTR_USED_MEM_HIGH,
            G::CU_GRAPH_MEM_ATTR_USED_MEM_HIGH as i32
        );
        assert_eq!(
            CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT,
            G::CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT as i32
        );
        assert_eq!(
            CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH,
            G::CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH as i32
        );
        use s::CUgraphNodeType_enum as N;
        assert_eq!(
            CU_GRAPH_NODE_TYPE_KERNEL,
            N::CU_GRAPH_NODE_TYPE_KERNEL as i32
        );
        assert_eq!(
            CU_GRAPH_NODE_TYPE_MEM_ALLOC,
            N::CU_GRAPH_NODE_TYPE_MEM_ALLOC as i32
        );
        assert_eq!(
            CU_GRAPH_NODE_TYPE_MEM_FREE,
            N::CU_GRAPH_NODE_TYPE_MEM_FREE as i32
        );
        use s::CUgraphInstantiate_flags_enum as F;
        assert_eq!(
            CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
            F::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH.0 as u64
        );
        assert_eq!(
            CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD,
            F::CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD.0 as u64
        );
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
