//! Tensor maps (CUDA 12.0+, "Tensor Map Object Management" in `cuda.h`): the host-side encoding of
//! a TMA descriptor. The simulator checks every constraint CUDA 13.5's `cuda.h` documents for
//! cuTensorMapEncodeTiled / EncodeIm2col / EncodeIm2colWide (each answers
//! CUDA_ERROR_INVALID_VALUE for a violated one, the only parameter error those functions
//! document) and writes its own encoding of the parameters into the caller's 128-byte
//! `CUtensorMap`, whose format `cuda.h` calls opaque ("should only be accessed through CUDA APIs
//! and PTX"); cuTensorMapReplaceAddress and cuTensorMapSetAllocationClass read it back.
//!
//! Not enforced: the stride formula `cuda.h` shows as an example (`globalStrides[i] =
//! globalStrides[i-1] * (globalDim[i] + padding[i])`), which it words as a layout, not as a
//! "must"; and the compute-capability floors (9.0, and 10.0 for Im2colWide), for which `cuda.h`
//! documents no error code.

use crate::{ctx, export, read, Res};
use cuvisor_cuda_abi::cuda::{err, CUresult};
use std::ffi::{c_int, c_void};

/// `CU_TENSOR_MAP_NUM_QWORDS` (cuda.h): a `CUtensorMap` is 16 u64s, 128 bytes.
const QWORDS: usize = 16;
type Map = [u64; QWORDS];

/// "CUVTMAP\0" in the top 7 bytes of the first word, the kind in its low byte.
const MAGIC: u64 = 0x4355_5654_4d41_5000;
const KIND_TILED: u64 = 1;
const KIND_IM2COL: u64 = 2;
const KIND_IM2COL_WIDE: u64 = 3;

// `CUtensorMapDataType` (cuda.h).
const DT_16U4_ALIGN8B: u32 = 13;
const DT_16U4_ALIGN16B: u32 = 14;
const DT_16U6_ALIGN16B: u32 = 15;
// `CUtensorMapInterleave`.
const INTERLEAVE_NONE: u32 = 0;
const INTERLEAVE_32B: u32 = 2;
// `CUtensorMapSwizzle`.
const SWIZZLE_NONE: u32 = 0;
const SWIZZLE_32B: u32 = 1;
const SWIZZLE_64B: u32 = 2;
const SWIZZLE_128B: u32 = 3;
const SWIZZLE_128B_ATOM_32B: u32 = 4;
const SWIZZLE_128B_ATOM_64B: u32 = 6;
// `CUtensorMapFloatOOBfill`.
const OOB_NAN_REQUEST_ZERO_FMA: u32 = 1;
// `CUtensorMapAllocClass`.
const ALLOC_CLASS_SMALL: u32 = 1;
const ALLOC_CLASS_LARGE: u32 = 2;

fn check(ok: bool) -> Res {
    if ok {
        Ok(())
    } else {
        Err(err::INVALID_VALUE)
    }
}

/// Bits one element takes in memory. The packed types count individual U4/U6 values ("Dimension
/// for the packed data types must reflect the number of individual U# values", cuda.h): 16 U4s
/// in 8 bytes (ALIGN8B), 16 U4s or 16 U6s in 16 bytes (ALIGN16B, with gaps).
fn element_bits(dt: u32) -> Option<u64> {
    Some(match dt {
        0 => 8,                         // UINT8
        1 | 6 | 9 => 16,                // UINT16, FLOAT16, BFLOAT16
        2 | 3 | 7 | 10 | 11 | 12 => 32, // UINT32, INT32, FLOAT32, FLOAT32_FTZ, TFLOAT32(_FTZ)
        4 | 5 | 8 => 64,                // UINT64, INT64, FLOAT64
        DT_16U4_ALIGN8B => 4,
        DT_16U4_ALIGN16B | DT_16U6_ALIGN16B => 8,
        _ => return None,
    })
}

fn packed16(dt: u32) -> bool {
    dt == DT_16U4_ALIGN16B || dt == DT_16U6_ALIGN16B
}

/// The bytes a box's inner dimension of `n` elements takes.
fn inner_bytes(n: u64, dt: u32) -> u64 {
    (n * element_bits(dt).unwrap_or(8)).div_ceil(8)
}

/// The swizzle's span in bytes: the most a box's inner dimension may take ("CU_TENSOR_MAP_SWIZZLE_32B
/// requires the bounding box inner dimension to be <= 32", ... "128B* ... <= 128", cuda.h).
fn swizzle_span(s: u32) -> u64 {
    match s {
        SWIZZLE_32B => 32,
        SWIZZLE_64B => 64,
        _ => 128,
    }
}

fn read_n<T: Copy>(p: *const T, n: usize) -> Result<Vec<T>, CUresult> {
    (0..n).map(|i| read(p.wrapping_add(i))).collect()
}

/// What all three encoders share.
struct Common {
    dt: u32,
    rank: u32,
    addr: u64,
    dims: Vec<u64>,
    strides: Vec<u64>,
    estrides: Vec<u32>,
    interleave: u32,
    swizzle: u32,
    l2: u32,
    oob: u32,
}

/// The alignment `globalAddress` needs: 16 bytes, 32 "when interleave is
/// CU_TENSOR_MAP_INTERLEAVE_32B" or the type is 16U6_ALIGN16B / 16U4_ALIGN16B (cuda.h).
fn address_alignment(dt: u32, interleave: u32) -> u64 {
    if interleave == INTERLEAVE_32B || packed16(dt) {
        32
    } else {
        16
    }
}

#[allow(clippy::too_many_arguments)]
fn common(
    map: *mut Map,
    dt: u32,
    rank: u32,
    ranks: std::ops::RangeInclusive<u32>,
    addr: *mut c_void,
    dims: *const u64,
    strides: *const u64,
    estrides: *const u32,
    interleave: u32,
    swizzle: u32,
    l2: u32,
    oob: u32,
) -> Result<Common, CUresult> {
    // cuda.h lists CUDA_ERROR_INVALID_CONTEXT among these functions' codes: a current context is
    // needed.
    ctx::current()?;
    // "tensorMap address must be aligned to 64 bytes."
    check(!map.is_null() && (map as usize).is_multiple_of(64))?;
    check(element_bits(dt).is_some())?;
    check(interleave <= 2 && swizzle <= 6 && l2 <= 3 && oob <= 1)?;
    // Tiled: "non-zero and less than or equal to ... 5. If interleave is not NONE, ... >= 3";
    // im2col: "must be 3, 4, or 5".
    check(ranks.contains(&rank))?;
    check(interleave == INTERLEAVE_NONE || rank >= 3)?;
    let addr = addr as u64;
    check(addr.is_multiple_of(address_alignment(dt, interleave)))?;
    let n = rank as usize;
    // globalDim: "non-zero and less than or equal to 2^31"; packed: globalDim[0] a multiple of 128
    // (ALIGN16B types) or of 2 (16U4_ALIGN8B).
    let dims = read_n(dims, n)?;
    check(dims.iter().all(|&d| (1..=1 << 31).contains(&d)))?;
    check(!packed16(dt) || dims[0].is_multiple_of(128))?;
    check(dt != DT_16U4_ALIGN8B || dims[0].is_multiple_of(2))?;
    // globalStrides (rank - 1 of them): "a multiple of 16 and less than 2^40"; a multiple of 32
    // with INTERLEAVE_32B or the ALIGN16B types.
    let strides = if n > 1 {
        read_n(strides, n - 1)?
    } else {
        Vec::new()
    };
    let stride_unit = if interleave == INTERLEAVE_32B || packed16(dt) {
        32
    } else {
        16
    };
    check(
        strides
            .iter()
            .all(|&s| s.is_multiple_of(stride_unit) && s < 1 << 40),
    )?;
    // elementStrides: "non-zero and less than or equal to 8".
    let estrides = read_n(estrides, n)?;
    check(estrides.iter().all(|&e| (1..=8).contains(&e)))?;
    // "16U6_ALIGN16B requires interleave to be CU_TENSOR_MAP_INTERLEAVE_NONE."
    check(dt != DT_16U6_ALIGN16B || interleave == INTERLEAVE_NONE)?;
    // NAN_REQUEST_ZERO_FMA "can only be used when tensorDataType represents a floating-point data
    // type", not a packed one.
    check(oob != OOB_NAN_REQUEST_ZERO_FMA || (6..=12).contains(&dt))?;
    Ok(Common {
        dt,
        rank,
        addr,
        dims,
        strides,
        estrides,
        interleave,
        swizzle,
        l2,
        oob,
    })
}

/// The swizzles the packed 16-byte types allow (Tiled and Im2col, cuda.h): 16U6_ALIGN16B NONE,
/// 128B, 128B_ATOM_32B, 128B_ATOM_64B; 16U4_ALIGN16B NONE, 128B, 128B_ATOM_32B.
fn packed_swizzle(c: &Common) -> Res {
    let ok = match c.dt {
        DT_16U6_ALIGN16B => matches!(
            c.swizzle,
            SWIZZLE_NONE | SWIZZLE_128B | SWIZZLE_128B_ATOM_32B | SWIZZLE_128B_ATOM_64B
        ),
        DT_16U4_ALIGN16B => matches!(
            c.swizzle,
            SWIZZLE_NONE | SWIZZLE_128B | SWIZZLE_128B_ATOM_32B
        ),
        _ => true,
    };
    check(ok)
}

/// The simulator's encoding (see the module comment): word 0 magic and kind, 1 the address, 2 the
/// enums, 3..8 the dimensions, 8..12 the strides, 12 the element strides (3 bits each, minus one)
/// and the kind's box (`boxed`), 13..16 the kind's own fields.
fn encode(map: *mut Map, kind: u64, c: &Common, boxed: u64, rest: [u64; 3]) -> Res {
    let mut m: Map = [0; QWORDS];
    m[0] = MAGIC | kind;
    m[1] = c.addr;
    m[2] = c.dt as u64
        | (c.rank as u64) << 8
        | (c.interleave as u64) << 16
        | (c.swizzle as u64) << 24
        | (c.l2 as u64) << 32
        | (c.oob as u64) << 40
        | (ALLOC_CLASS_SMALL as u64) << 56;
    m[3..3 + c.dims.len()].copy_from_slice(&c.dims);
    m[8..8 + c.strides.len()].copy_from_slice(&c.strides);
    let es = c
        .estrides
        .iter()
        .enumerate()
        .fold(0u64, |a, (i, &e)| a | ((e as u64 - 1) << (3 * i)));
    m[12] = es | boxed << 16;
    m[13..16].copy_from_slice(&rest);
    crate::write(map, m)
}

/// A map this simulator encoded, or CUDA_ERROR_INVALID_VALUE.
fn decode(map: *mut Map) -> Result<Map, CUresult> {
    check(!map.is_null() && (map as usize).is_multiple_of(64))?;
    let m: Map = read(map)?;
    check(m[0] & !0xff == MAGIC && (KIND_TILED..=KIND_IM2COL_WIDE).contains(&(m[0] & 0xff)))?;
    Ok(m)
}

#[allow(clippy::too_many_arguments)]
fn encode_tiled(
    map: *mut Map,
    dt: u32,
    rank: u32,
    addr: *mut c_void,
    dims: *const u64,
    strides: *const u64,
    box_dim: *const u32,
    estrides: *const u32,
    interleave: u32,
    swizzle: u32,
    l2: u32,
    oob: u32,
) -> Res {
    let c = common(
        map,
        dt,
        rank,
        1..=5,
        addr,
        dims,
        strides,
        estrides,
        interleave,
        swizzle,
        l2,
        oob,
    )?;
    // boxDim: "non-zero and less than or equal to 256"; with INTERLEAVE_NONE "boxDim[0] *
    // elementSizeInBytes must be a multiple of 16 bytes"; ALIGN16B types: "boxDim[0] must be 128".
    let b = read_n(box_dim, rank as usize)?;
    check(b.iter().all(|&x| (1..=256).contains(&x)))?;
    let inner = inner_bytes(b[0] as u64, dt);
    check(interleave != INTERLEAVE_NONE || inner.is_multiple_of(16))?;
    check(!packed16(dt) || b[0] == 128)?;
    // INTERLEAVE_NONE with a swizzle: the box's inner dimension fits the swizzle span.
    check(
        interleave != INTERLEAVE_NONE || swizzle == SWIZZLE_NONE || inner <= swizzle_span(swizzle),
    )?;
    // "When interleave is CU_TENSOR_MAP_INTERLEAVE_32B, swizzle must be CU_TENSOR_MAP_SWIZZLE_32B."
    check(interleave != INTERLEAVE_32B || swizzle == SWIZZLE_32B)?;
    packed_swizzle(&c)?;
    let boxed = b
        .iter()
        .enumerate()
        .fold(0u64, |a, (i, &x)| a | ((x as u64 - 1) << (8 * i)));
    encode(map, KIND_TILED, &c, boxed, [0; 3])
}

/// The signed range one pixel-box corner offset has at each rank (cuda.h, cuTensorMapEncodeIm2col:
/// rank 3 one offset in [-32768, 32767], rank 4 two in [-128, 127], rank 5 three in [-16, 15]).
fn corner_range(rank: u32) -> std::ops::RangeInclusive<i32> {
    match rank {
        3 => -32768..=32767,
        4 => -128..=127,
        _ => -16..=15,
    }
}

#[allow(clippy::too_many_arguments)]
fn encode_im2col(
    map: *mut Map,
    dt: u32,
    rank: u32,
    addr: *mut c_void,
    dims: *const u64,
    strides: *const u64,
    lower: *const c_int,
    upper: *const c_int,
    channels: u32,
    pixels: u32,
    estrides: *const u32,
    interleave: u32,
    swizzle: u32,
    l2: u32,
    oob: u32,
) -> Res {
    let c = common(
        map,
        dt,
        rank,
        3..=5,
        addr,
        dims,
        strides,
        estrides,
        interleave,
        swizzle,
        l2,
        oob,
    )?;
    // rank - 2 spatial offsets {D, H, W}, outermost first; the layout is N[D][H]WC, so offset j
    // is dimension rank - 2 - j of globalDim (innermost first).
    let n = rank as usize - 2;
    let lo = read_n(lower, n)?;
    let hi = read_n(upper, n)?;
    let range = corner_range(rank);
    check(lo.iter().chain(&hi).all(|x| range.contains(x)))?;
    // "The bounding box specified by pixelBoxLowerCorner and pixelBoxUpperCorner must have
    // non-zero area": along each spatial dimension it spans globalDim + upper - lower.
    for j in 0..n {
        let d = c.dims[n - j] as i64;
        check(d + hi[j] as i64 - lo[j] as i64 > 0)?;
    }
    pixel_box(&c, channels, pixels, true)?;
    check(interleave != INTERLEAVE_32B || swizzle == SWIZZLE_32B)?;
    packed_swizzle(&c)?;
    let pack = |v: &[c_int]| {
        v.iter()
            .enumerate()
            .fold(0u64, |a, (i, &x)| a | ((x as u16 as u64) << (16 * i)))
    };
    encode(
        map,
        KIND_IM2COL,
        &c,
        channels as u64 | (pixels as u64) << 16,
        [pack(&lo), pack(&hi), 0],
    )
}

/// channelsPerPixel "less than or equal to 256" (128 for the ALIGN16B types), pixelsPerColumn
/// "less than or equal to 1024" (where it counts); with INTERLEAVE_NONE and a swizzle, the box's
/// inner dimension (channelsPerPixel elements) fits the swizzle span.
fn pixel_box(c: &Common, channels: u32, pixels: u32, pixels_count: bool) -> Res {
    check((1..=256).contains(&channels))?;
    check(!packed16(c.dt) || channels == 128)?;
    check(!pixels_count || (1..=1024).contains(&pixels))?;
    let inner = inner_bytes(channels as u64, c.dt);
    check(
        c.interleave != INTERLEAVE_NONE
            || c.swizzle == SWIZZLE_NONE
            || inner <= swizzle_span(c.swizzle),
    )
}

#[allow(clippy::too_many_arguments)]
fn encode_im2col_wide(
    map: *mut Map,
    dt: u32,
    rank: u32,
    addr: *mut c_void,
    dims: *const u64,
    strides: *const u64,
    lower_w: c_int,
    upper_w: c_int,
    channels: u32,
    pixels: u32,
    estrides: *const u32,
    interleave: u32,
    mode: u32,
    swizzle: u32,
    l2: u32,
    oob: u32,
) -> Res {
    let c = common(
        map,
        dt,
        rank,
        3..=5,
        addr,
        dims,
        strides,
        estrides,
        interleave,
        swizzle,
        l2,
        oob,
    )?;
    // mode: CU_TENSOR_MAP_IM2COL_WIDE_MODE_W (0) or _W128 (1).
    check(mode <= 1)?;
    // The W offsets are "within range [-32768, 32767]" and the box has non-zero area along W
    // (dimension 1; D and H boxes are always 1).
    check((-32768..=32767).contains(&lower_w) && (-32768..=32767).contains(&upper_w))?;
    check(c.dims[1] as i64 + upper_w as i64 - lower_w as i64 > 0)?;
    // pixelsPerColumn "is ignored when mode is CU_TENSOR_MAP_IM2COL_WIDE_MODE_W128".
    pixel_box(&c, channels, pixels, mode == 0)?;
    // "swizzle ... must be one of the following ... (other swizzle modes are not supported)":
    // 64B, 128B, 128B_ATOM_32B; 16U6_ALIGN16B: those three; 16U4_ALIGN16B: 128B, 128B_ATOM_32B.
    // (The text also names a CU_TENSOR_MAP_SWIZZLE_96B that CUDA 13.5's enum does not define.)
    let ok = match dt {
        DT_16U4_ALIGN16B => matches!(swizzle, SWIZZLE_128B | SWIZZLE_128B_ATOM_32B),
        _ => matches!(swizzle, SWIZZLE_64B | SWIZZLE_128B | SWIZZLE_128B_ATOM_32B),
    };
    check(ok)?;
    let w = |x: c_int| x as u16 as u64;
    encode(
        map,
        KIND_IM2COL_WIDE,
        &c,
        channels as u64 | (pixels as u64) << 16 | (mode as u64) << 32,
        [w(lower_w), w(upper_w), 0],
    )
}

export! {
    fn cuTensorMapEncodeTiled(map: *mut Map, dt: u32, rank: u32, addr: *mut c_void, dims: *const u64, strides: *const u64, box_dim: *const u32, estrides: *const u32, interleave: u32, swizzle: u32, l2: u32, oob: u32) {
        encode_tiled(map, dt, rank, addr, dims, strides, box_dim, estrides, interleave, swizzle, l2, oob)
    }
    fn cuTensorMapEncodeIm2col(map: *mut Map, dt: u32, rank: u32, addr: *mut c_void, dims: *const u64, strides: *const u64, lower: *const c_int, upper: *const c_int, channels: u32, pixels: u32, estrides: *const u32, interleave: u32, swizzle: u32, l2: u32, oob: u32) {
        encode_im2col(map, dt, rank, addr, dims, strides, lower, upper, channels, pixels, estrides, interleave, swizzle, l2, oob)
    }
    fn cuTensorMapEncodeIm2colWide(map: *mut Map, dt: u32, rank: u32, addr: *mut c_void, dims: *const u64, strides: *const u64, lower_w: c_int, upper_w: c_int, channels: u32, pixels: u32, estrides: *const u32, interleave: u32, mode: u32, swizzle: u32, l2: u32, oob: u32) {
        encode_im2col_wide(map, dt, rank, addr, dims, strides, lower_w, upper_w, channels, pixels, estrides, interleave, mode, swizzle, l2, oob)
    }
    /// The new address "must follow previous alignment requirements" (cuda.h): those of the map's
    /// type and interleave.
    fn cuTensorMapReplaceAddress(map: *mut Map, addr: *mut c_void) {
        ctx::current()?;
        let mut m = decode(map)?;
        let (dt, interleave) = ((m[2] & 0xff) as u32, ((m[2] >> 16) & 0xff) as u32);
        check((addr as u64).is_multiple_of(address_alignment(dt, interleave)))?;
        m[1] = addr as u64;
        crate::write(map, m)
    }
    /// CUDA 13.5. `outAllocClass` is set to SMALL "before validation" and stays SMALL on failure.
    /// The simulated GPUs are architectures "where allocation-class selection has no effect": every
    /// valid request succeeds without changing the map and reports SMALL (cuda.h).
    fn cuTensorMapSetAllocationClass(map: *mut Map, class: u32, out: *mut u32) {
        if !out.is_null() {
            crate::write(out, ALLOC_CLASS_SMALL)?;
        }
        ctx::current()?;
        decode(map)?;
        check(class <= ALLOC_CLASS_LARGE)?;
        Ok(())
    }
}
