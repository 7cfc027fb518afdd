//! Copies, arrays, texture and surface objects: the structs and constants of CUDA 13.5's `cuda.h`
//! ("Memory Management", "Texture Object Management", "Surface Object Management"), checked
//! against cudarc's bindgen output in the tests below.

use super::{CUarray, CUcontext, CUdeviceptr, CUmemLocation, CUmipmappedArray};
use std::ffi::{c_int, c_uint, c_void};

/// `CUmemorytype` values beyond HOST and DEVICE.
pub const CU_MEMORYTYPE_ARRAY: c_uint = 3;
pub const CU_MEMORYTYPE_UNIFIED: c_uint = 4;

/// `CUDA_ARRAY3D_*` creation flags.
pub const CUDA_ARRAY3D_LAYERED: c_uint = 0x01;
pub const CUDA_ARRAY3D_SURFACE_LDST: c_uint = 0x02;
pub const CUDA_ARRAY3D_CUBEMAP: c_uint = 0x04;
pub const CUDA_ARRAY3D_TEXTURE_GATHER: c_uint = 0x08;
pub const CUDA_ARRAY3D_DEPTH_TEXTURE: c_uint = 0x10;
pub const CUDA_ARRAY3D_COLOR_ATTACHMENT: c_uint = 0x20;
pub const CUDA_ARRAY3D_SPARSE: c_uint = 0x40;
pub const CUDA_ARRAY3D_DEFERRED_MAPPING: c_uint = 0x80;
pub const CUDA_ARRAY3D_VIDEO_ENCODE_DECODE: c_uint = 0x100;

/// `CUresourcetype`.
pub const CU_RESOURCE_TYPE_ARRAY: c_int = 0;
pub const CU_RESOURCE_TYPE_MIPMAPPED_ARRAY: c_int = 1;
pub const CU_RESOURCE_TYPE_LINEAR: c_int = 2;
pub const CU_RESOURCE_TYPE_PITCH2D: c_int = 3;

/// `CUmemcpySrcAccessOrder` (CUDA 12.8).
pub const CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: c_int = 1;
pub const CU_MEMCPY_SRC_ACCESS_ORDER_DURING_API_CALL: c_int = 2;
pub const CU_MEMCPY_SRC_ACCESS_ORDER_ANY: c_int = 3;
/// `CUmemcpyFlags`.
pub const CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE: c_uint = 1;
/// `CUmemcpy3DOperandType`.
pub const CU_MEMCPY_OPERAND_TYPE_POINTER: c_int = 1;
pub const CU_MEMCPY_OPERAND_TYPE_ARRAY: c_int = 2;

pub type CUtexObject = u64;
pub type CUsurfObject = u64;

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUDA_MEMCPY2D {
    pub srcXInBytes: usize,
    pub srcY: usize,
    pub srcMemoryType: c_uint,
    pub srcHost: *const c_void,
    pub srcDevice: CUdeviceptr,
    pub srcArray: CUarray,
    pub srcPitch: usize,
    pub dstXInBytes: usize,
    pub dstY: usize,
    pub dstMemoryType: c_uint,
    pub dstHost: *mut c_void,
    pub dstDevice: CUdeviceptr,
    pub dstArray: CUarray,
    pub dstPitch: usize,
    pub WidthInBytes: usize,
    pub Height: usize,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUDA_MEMCPY3D {
    pub srcXInBytes: usize,
    pub srcY: usize,
    pub srcZ: usize,
    pub srcLOD: usize,
    pub srcMemoryType: c_uint,
    pub srcHost: *const c_void,
    pub srcDevice: CUdeviceptr,
    pub srcArray: CUarray,
    pub reserved0: *mut c_void,
    pub srcPitch: usize,
    pub srcHeight: usize,
    pub dstXInBytes: usize,
    pub dstY: usize,
    pub dstZ: usize,
    pub dstLOD: usize,
    pub dstMemoryType: c_uint,
    pub dstHost: *mut c_void,
    pub dstDevice: CUdeviceptr,
    pub dstArray: CUarray,
    pub reserved1: *mut c_void,
    pub dstPitch: usize,
    pub dstHeight: usize,
    pub WidthInBytes: usize,
    pub Height: usize,
    pub Depth: usize,
}

/// `CUDA_MEMCPY3D_PEER`: CUDA_MEMCPY3D with each side's context where the reserved pointers are.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUDA_MEMCPY3D_PEER {
    pub srcXInBytes: usize,
    pub srcY: usize,
    pub srcZ: usize,
    pub srcLOD: usize,
    pub srcMemoryType: c_uint,
    pub srcHost: *const c_void,
    pub srcDevice: CUdeviceptr,
    pub srcArray: CUarray,
    pub srcContext: CUcontext,
    pub srcPitch: usize,
    pub srcHeight: usize,
    pub dstXInBytes: usize,
    pub dstY: usize,
    pub dstZ: usize,
    pub dstLOD: usize,
    pub dstMemoryType: c_uint,
    pub dstHost: *mut c_void,
    pub dstDevice: CUdeviceptr,
    pub dstArray: CUarray,
    pub dstContext: CUcontext,
    pub dstPitch: usize,
    pub dstHeight: usize,
    pub WidthInBytes: usize,
    pub Height: usize,
    pub Depth: usize,
}

/// The CUDA 2.x ABI's 2D copy (`cuMemcpy2D` without `_v2`; cuda.h declares it for the driver's
/// own build only, `CUDA_MEMCPY2D_v1`): 32-bit offsets, pitches, extents and device pointers.
/// Its layout is checked by `crates/sim/tests/c/copies_v1.c`, built against that declaration.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUDA_MEMCPY2D_v1 {
    pub srcXInBytes: c_uint,
    pub srcY: c_uint,
    pub srcMemoryType: c_uint,
    pub srcHost: *const c_void,
    pub srcDevice: c_uint,
    pub srcArray: CUarray,
    pub srcPitch: c_uint,
    pub dstXInBytes: c_uint,
    pub dstY: c_uint,
    pub dstMemoryType: c_uint,
    pub dstHost: *mut c_void,
    pub dstDevice: c_uint,
    pub dstArray: CUarray,
    pub dstPitch: c_uint,
    pub WidthInBytes: c_uint,
    pub Height: c_uint,
}

/// The CUDA 2.x ABI's 3D copy (`CUDA_MEMCPY3D_v1`, as [`CUDA_MEMCPY2D_v1`]).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUDA_MEMCPY3D_v1 {
    pub srcXInBytes: c_uint,
    pub srcY: c_uint,
    pub srcZ: c_uint,
    pub srcLOD: c_uint,
    pub srcMemoryType: c_uint,
    pub srcHost: *const c_void,
    pub srcDevice: c_uint,
    pub srcArray: CUarray,
    pub reserved0: *mut c_void,
    pub srcPitch: c_uint,
    pub srcHeight: c_uint,
    pub dstXInBytes: c_uint,
    pub dstY: c_uint,
    pub dstZ: c_uint,
    pub dstLOD: c_uint,
    pub dstMemoryType: c_uint,
    pub dstHost: *mut c_void,
    pub dstDevice: c_uint,
    pub dstArray: CUarray,
    pub reserved1: *mut c_void,
    pub dstPitch: c_uint,
    pub dstHeight: c_uint,
    pub WidthInBytes: c_uint,
    pub Height: c_uint,
    pub Depth: c_uint,
}

impl From<CUDA_MEMCPY2D_v1> for CUDA_MEMCPY2D {
    fn from(c: CUDA_MEMCPY2D_v1) -> Self {
        CUDA_MEMCPY2D {
            srcXInBytes: c.srcXInBytes as usize,
            srcY: c.srcY as usize,
            srcMemoryType: c.srcMemoryType,
            srcHost: c.srcHost,
            srcDevice: c.srcDevice as CUdeviceptr,
            srcArray: c.srcArray,
            srcPitch: c.srcPitch as usize,
            dstXInBytes: c.dstXInBytes as usize,
            dstY: c.dstY as usize,
            dstMemoryType: c.dstMemoryType,
            dstHost: c.dstHost,
            dstDevice: c.dstDevice as CUdeviceptr,
            dstArray: c.dstArray,
            dstPitch: c.dstPitch as usize,
            WidthInBytes: c.WidthInBytes as usize,
            Height: c.Height as usize,
        }
    }
}

impl From<CUDA_MEMCPY3D_v1> for CUDA_MEMCPY3D {
    fn from(c: CUDA_MEMCPY3D_v1) -> Self {
        CUDA_MEMCPY3D {
            srcXInBytes: c.srcXInBytes as usize,
            srcY: c.srcY as usize,
            srcZ: c.srcZ as usize,
            srcLOD: c.srcLOD as usize,
            srcMemoryType: c.srcMemoryType,
            srcHost: c.srcHost,
            srcDevice: c.srcDevice as CUdeviceptr,
            srcArray: c.srcArray,
            reserved0: c.reserved0,
            srcPitch: c.srcPitch as usize,
            srcHeight: c.srcHeight as usize,
            dstXInBytes: c.dstXInBytes as usize,
            dstY: c.dstY as usize,
            dstZ: c.dstZ as usize,
            dstLOD: c.dstLOD as usize,
            dstMemoryType: c.dstMemoryType,
            dstHost: c.dstHost,
            dstDevice: c.dstDevice as CUdeviceptr,
            dstArray: c.dstArray,
            reserved1: c.reserved1,
            dstPitch: c.dstPitch as usize,
            dstHeight: c.dstHeight as usize,
            WidthInBytes: c.WidthInBytes as usize,
            Height: c.Height as usize,
            Depth: c.Depth as usize,
        }
    }
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CUDA_ARRAY_SPARSE_PROPERTIES {
    pub tileWidth: c_uint,
    pub tileHeight: c_uint,
    pub tileDepth: c_uint,
    pub miptailFirstLevel: c_uint,
    pub miptailSize: u64,
    pub flags: c_uint,
    pub reserved: [c_uint; 4],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CUDA_ARRAY_MEMORY_REQUIREMENTS {
    pub size: usize,
    pub alignment: usize,
    pub reserved: [c_uint; 4],
}

/// `CUDA_RESOURCE_DESC`: the type, a 128-byte union (read through the accessors), flags.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUDA_RESOURCE_DESC {
    pub resType: c_int,
    pub res: [u64; 16],
    pub flags: c_uint,
}

impl CUDA_RESOURCE_DESC {
    /// `res.array.hArray`, `res.mipmap.hMipmappedArray`, or `devPtr` of `linear`/`pitch2D`:
    /// the union's first word in every case.
    pub fn handle(&self) -> u64 {
        self.res[0]
    }
    /// `format` and `numChannels` of `linear` / `pitch2D` (two 32-bit words after devPtr).
    pub fn format_channels(&self) -> (c_int, c_uint) {
        (self.res[1] as u32 as c_int, (self.res[1] >> 32) as c_uint)
    }
    /// `linear.sizeInBytes`, or `pitch2D.width`.
    pub fn word2(&self) -> u64 {
        self.res[2]
    }
    /// `pitch2D.height` and `pitch2D.pitchInBytes`.
    pub fn pitch2d_height_pitch(&self) -> (u64, u64) {
        (self.res[3], self.res[4])
    }
    /// The mipmapped array of a MIPMAPPED_ARRAY resource.
    pub fn mipmap(&self) -> CUmipmappedArray {
        self.res[0] as usize as CUmipmappedArray
    }
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUDA_TEXTURE_DESC {
    pub addressMode: [c_int; 3],
    pub filterMode: c_int,
    pub flags: c_uint,
    pub maxAnisotropy: c_uint,
    pub mipmapFilterMode: c_int,
    pub mipmapLevelBias: f32,
    pub minMipmapLevelClamp: f32,
    pub maxMipmapLevelClamp: f32,
    pub borderColor: [f32; 4],
    pub reserved: [c_int; 12],
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUDA_RESOURCE_VIEW_DESC {
    pub format: c_int,
    pub width: usize,
    pub height: usize,
    pub depth: usize,
    pub firstMipmapLevel: c_uint,
    pub lastMipmapLevel: c_uint,
    pub firstLayer: c_uint,
    pub lastLayer: c_uint,
    pub reserved: [c_uint; 16],
}

/// `CUmemcpyAttributes` (CUDA 12.8).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUmemcpyAttributes {
    pub srcAccessOrder: c_int,
    pub srcLocHint: CUmemLocation,
    pub dstLocHint: CUmemLocation,
    pub flags: c_uint,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CUoffset3D {
    pub x: usize,
    pub y: usize,
    pub z: usize,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CUextent3D {
    pub width: usize,
    pub height: usize,
    pub depth: usize,
}

/// `CUmemcpy3DOperand`: the type, then a union of `ptr` {ptr, rowLength, layerHeight,
/// locHint} and `array` {array, offset}, both 32 bytes: read through the accessors.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUmemcpy3DOperand {
    pub type_: c_int,
    pub op: [u64; 4],
}

impl CUmemcpy3DOperand {
    /// `op.ptr`: (ptr, rowLength, layerHeight) in elements.
    pub fn ptr(&self) -> (CUdeviceptr, u64, u64) {
        (self.op[0], self.op[1], self.op[2])
    }
    /// `op.array`: the array and its offset in elements.
    pub fn array(&self) -> (CUarray, CUoffset3D) {
        (
            self.op[0] as usize as CUarray,
            CUoffset3D {
                x: self.op[1] as usize,
                y: self.op[2] as usize,
                z: self.op[3] as usize,
            },
        )
    }
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUDA_MEMCPY3D_BATCH_OP {
    pub src: CUmemcpy3DOperand,
    pub dst: CUmemcpy3DOperand,
    pub extent: CUextent3D,
    pub srcAccessOrder: c_int,
    pub flags: c_uint,
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudarc::driver::sys as s;
    use std::mem::{offset_of, size_of};

    #[test]
    fn copy_struct_layouts_match_cuda_h() {
        assert_eq!(size_of::<CUDA_MEMCPY2D>(), size_of::<s::CUDA_MEMCPY2D>());
        assert_eq!(
            offset_of!(CUDA_MEMCPY2D, dstPitch),
            offset_of!(s::CUDA_MEMCPY2D, dstPitch)
        );
        assert_eq!(size_of::<CUDA_MEMCPY3D>(), size_of::<s::CUDA_MEMCPY3D>());
        assert_eq!(
            offset_of!(CUDA_MEMCPY3D, dstHeight),
            offset_of!(s::CUDA_MEMCPY3D, dstHeight)
        );
        assert_eq!(
            offset_of!(CUDA_MEMCPY3D, reserved1),
            offset_of!(s::CUDA_MEMCPY3D, reserved1)
        );
        assert_eq!(
            size_of::<CUDA_MEMCPY3D_PEER>(),
            size_of::<s::CUDA_MEMCPY3D_PEER>()
        );
        assert_eq!(
            offset_of!(CUDA_MEMCPY3D_PEER, dstContext),
            offset_of!(s::CUDA_MEMCPY3D_PEER, dstContext)
        );
        assert_eq!(
            size_of::<CUDA_ARRAY_SPARSE_PROPERTIES>(),
            size_of::<s::CUDA_ARRAY_SPARSE_PROPERTIES>()
        );
        assert_eq!(
            offset_of!(CUDA_ARRAY_SPARSE_PROPERTIES, miptailSize),
            offset_of!(s::CUDA_ARRAY_SPARSE_PROPERTIES, miptailSize)
        );
        assert_eq!(
            size_of::<CUDA_ARRAY_MEMORY_REQUIREMENTS>(),
            size_of::<s::CUDA_ARRAY_MEMORY_REQUIREMENTS>()
        );
        assert_eq!(
            size_of::<CUDA_RESOURCE_DESC>(),
            size_of::<s::CUDA_RESOURCE_DESC>()
        );
        assert_eq!(
            offset_of!(CUDA_RESOURCE_DESC, flags),
            offset_of!(s::CUDA_RESOURCE_DESC, flags)
        );
        assert_eq!(
            size_of::<CUDA_TEXTURE_DESC>(),
            size_of::<s::CUDA_TEXTURE_DESC>()
        );
        assert_eq!(
            offset_of!(CUDA_TEXTURE_DESC, borderColor),
            offset_of!(s::CUDA_TEXTURE_DESC, borderColor)
        );
        assert_eq!(
            size_of::<CUDA_RESOURCE_VIEW_DESC>(),
            size_of::<s::CUDA_RESOURCE_VIEW_DESC>()
        );
        assert_eq!(
            offset_of!(CUDA_RESOURCE_VIEW_DESC, lastLayer),
            offset_of!(s::CUDA_RESOURCE_VIEW_DESC, lastLayer)
        );
        assert_eq!(
            size_of::<CUmemcpyAttributes>(),
            size_of::<s::CUmemcpyAttributes>()
        );
        assert_eq!(
            offset_of!(CUmemcpyAttributes, flags),
            offset_of!(s::CUmemcpyAttributes, flags)
        );
        assert_eq!(
            size_of::<CUmemcpy3DOperand>(),
            size_of::<s::CUmemcpy3DOperand>()
        );
        assert_eq!(
            size_of::<CUDA_MEMCPY3D_BATCH_OP>(),
            size_of::<s::CUDA_MEMCPY3D_BATCH_OP>()
        );
        assert_eq!(
            offset_of!(CUDA_MEMCPY3D_BATCH_OP, extent),
            offset_of!(s::CUDA_MEMCPY3D_BATCH_OP, extent)
        );
        assert_eq!(
            offset_of!(CUDA_MEMCPY3D_BATCH_OP, flags),
            offset_of!(s::CUDA_MEMCPY3D_BATCH_OP, flags)
        );
    }

    #[test]
    fn copy_constants_match_cuda_h() {
        use s::CUmemorytype_enum as M;
        assert_eq!(CU_MEMORYTYPE_ARRAY, M::CU_MEMORYTYPE_ARRAY as u32);
        assert_eq!(CU_MEMORYTYPE_UNIFIED, M::CU_MEMORYTYPE_UNIFIED as u32);
        use s::CUresourcetype_enum as R;
        assert_eq!(CU_RESOURCE_TYPE_ARRAY, R::CU_RESOURCE_TYPE_ARRAY as i32);
        assert_eq!(
            CU_RESOURCE_TYPE_MIPMAPPED_ARRAY,
            R::CU_RESOURCE_TYPE_MIPMAPPED_ARRAY as i32
        );
        assert_eq!(CU_RESOURCE_TYPE_LINEAR, R::CU_RESOURCE_TYPE_LINEAR as i32);
        assert_eq!(CU_RESOURCE_TYPE_PITCH2D, R::CU_RESOURCE_TYPE_PITCH2D as i32);
        assert_eq!(CUDA_ARRAY3D_SURFACE_LDST, s::CUDA_ARRAY3D_SURFACE_LDST);
        assert_eq!(CUDA_ARRAY3D_LAYERED, s::CUDA_ARRAY3D_LAYERED);
        assert_eq!(CUDA_ARRAY3D_CUBEMAP, s::CUDA_ARRAY3D_CUBEMAP);
        assert_eq!(CUDA_ARRAY3D_SPARSE, s::CUDA_ARRAY3D_SPARSE);
        assert_eq!(
            CUDA_ARRAY3D_DEFERRED_MAPPING,
            s::CUDA_ARRAY3D_DEFERRED_MAPPING
        );
        use s::CUmemcpySrcAccessOrder_enum as O;
        assert_eq!(
            CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            O::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM as i32
        );
        assert_eq!(
            CU_MEMCPY_SRC_ACCESS_ORDER_ANY,
            O::CU_MEMCPY_SRC_ACCESS_ORDER_ANY as i32
        );
        use s::CUmemcpy3DOperandType_enum as T;
        assert_eq!(
            CU_MEMCPY_OPERAND_TYPE_POINTER,
            T::CU_MEMCPY_OPERAND_TYPE_POINTER as i32
        );
        assert_eq!(
            CU_MEMCPY_OPERAND_TYPE_ARRAY,
            T::CU_MEMCPY_OPERAND_TYPE_ARRAY as i32
        );
    }
}
