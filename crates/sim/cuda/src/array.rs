//! CUDA arrays and mipmapped arrays: created, charged, backed by memory, described.
//!
//! - An array is charged to its context's device by its size in the format's texel blocks
//!   (`cuvisor_cuda_abi::cuda::array_bytes`), rounded up to 512 bytes, as before this module
//!   existed; a mipmapped array by the sum of its levels.
//! - Its bytes live in host memory of the simulator (an anonymous mapping reserved without swap,
//!   so an array costs no RAM until written), laid out row after row (a row: the width in texel
//!   blocks times the block's bytes), 2D slices one after another (layers, cube faces or depth),
//!   mip levels one after another. Copies move bytes in and out of that (see `copy.rs`).
//! - Level arrays (`cuMipmappedArrayGetLevel`) and plane arrays (`cuArrayGetPlane`) are views of
//!   their parent's memory, charge nothing, and go with the parent.

use crate::{ctx, drv, mem, read, write, Registry, Res};
use cuvisor_cuda_abi::cuda::*;
use cuvisor_sim::arena::ALIGN;
use std::ffi::{c_int, c_uint, c_void};
use std::sync::{Arc, Mutex, OnceLock};

/// Host memory behind an array: an anonymous private mapping (MAP_NORESERVE: untouched pages
/// take no RAM), unmapped when the last array or view using it goes.
struct Backing {
    addr: u64,
    len: u64,
}

impl Backing {
    fn new(len: u64) -> Result<Arc<Backing>, CUresult> {
        let len = len.max(1);
        let size = usize::try_from(len).map_err(|_| err::OUT_OF_MEMORY)?;
        // SAFETY: a fresh anonymous mapping; no existing memory is touched.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(err::OUT_OF_MEMORY);
        }
        Ok(Arc::new(Backing {
            addr: p as u64,
            len,
        }))
    }
}

impl Drop for Backing {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping made in `new`, no longer referenced by any array.
        unsafe { libc::munmap(self.addr as *mut c_void, self.len as usize) };
    }
}

/// Where an array's memory came from.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Owner {
    /// cuArrayCreate / cuArray3DCreate: charged, destroyed by cuArrayDestroy.
    Own,
    /// A level of mipmapped array `usize`.
    Level(usize),
    /// A plane of multi-planar array `usize`.
    Plane(usize),
}

pub(crate) struct ArrayObj {
    pub dev: usize,
    ctx: usize,
    charged: u64,
    pub owner: Owner,
    /// As created (the 2D and v1 forms widened; a level's or plane's own extents and format).
    pub desc: CUDA_ARRAY3D_DESCRIPTOR,
    mem: Arc<Backing>,
    offset: u64,
    /// Plane arrays handed out so far (cuArrayGetPlane answers the same handle each time).
    planes: Mutex<Vec<Option<usize>>>,
}

/// How an array's bytes are laid out: `rows` rows of `row_bytes` per slice, `slices` slices;
/// `elem` bytes per element (a texel, or a block of a block-compressed or subsampled format).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Geometry {
    pub elem: u64,
    pub row_bytes: u64,
    pub rows: u64,
    pub slices: u64,
}

impl Geometry {
    pub fn bytes(&self) -> Option<u64> {
        self.row_bytes
            .checked_mul(self.rows)?
            .checked_mul(self.slices)
    }
}

/// The layout of an array of this descriptor, or None where the format is unknown or the
/// channels are not 1, 2 or 4 (which creation refuses first).
pub(crate) fn geometry(d: &CUDA_ARRAY3D_DESCRIPTOR) -> Option<Geometry> {
    let b = array_format_block(d.Format)?;
    let elem = if b.per_channel {
        if !matches!(d.NumChannels, 1 | 2 | 4) {
            return None;
        }
        b.bytes * d.NumChannels as u64
    } else {
        b.bytes
    };
    let w = (d.Width as u64).max(1).div_ceil(b.w);
    Some(Geometry {
        elem,
        row_bytes: w.checked_mul(elem)?,
        rows: (d.Height as u64).max(1).div_ceil(b.h),
        slices: (d.Depth as u64).max(1),
    })
}

impl ArrayObj {
    /// The address of the array's first byte in the simulator's memory.
    pub fn base(&self) -> u64 {
        self.mem.addr + self.offset
    }
    pub fn geometry(&self) -> Geometry {
        // Every live array's descriptor passed `geometry` at creation.
        geometry(&self.desc).unwrap_or(Geometry {
            elem: 1,
            row_bytes: 0,
            rows: 0,
            slices: 0,
        })
    }
}

fn arrays() -> &'static Registry<ArrayObj> {
    static R: OnceLock<Registry<ArrayObj>> = OnceLock::new();
    R.get_or_init(Registry::new)
}

/// A live array (own, level or plane), or CUDA_ERROR_INVALID_HANDLE ("hArray - Array to get
/// descriptor of ... CUDA_ERROR_INVALID_HANDLE", cuArrayGetDescriptor and the copies taking one).
pub(crate) fn get(h: CUarray) -> Result<Arc<ArrayObj>, CUresult> {
    arrays().get(h as usize)
}

struct Mipmap {
    dev: usize,
    ctx: usize,
    charged: u64,
    desc: CUDA_ARRAY3D_DESCRIPTOR,
    /// Each level's array handle (registered in `arrays` as a view of the mipmap's memory), set
    /// once the levels exist.
    levels: OnceLock<Vec<usize>>,
}

fn mipmaps() -> &'static Registry<Mipmap> {
    static R: OnceLock<Registry<Mipmap>> = OnceLock::new();
    R.get_or_init(Registry::new)
}

/// Bytes charged for an array, or CUDA_ERROR_INVALID_VALUE where the driver refuses its
/// descriptor (see `array_bytes` in cuda-abi: every format of the CUDA 13 headers, checked
/// arithmetic; a size that does not fit in 64 bits needs extents beyond every device's maximum,
/// which the real driver refuses with CUDA_ERROR_INVALID_VALUE).
fn array_bytes(d: &CUDA_ARRAY3D_DESCRIPTOR, levels: u32) -> Result<u64, CUresult> {
    cuvisor_cuda_abi::cuda::array_bytes(
        d.Width as u64,
        d.Height as u64,
        d.Depth as u64,
        d.Format,
        d.NumChannels,
        levels,
    )
    .ok_or(err::INVALID_VALUE)
}

/// Level `l`'s descriptor: width, height and depth halved (at least 1; a missing dimension, 0,
/// stays 0), except the depth of a layered or cube map array, which counts layers or faces.
fn level_desc(d: &CUDA_ARRAY3D_DESCRIPTOR, l: u32) -> CUDA_ARRAY3D_DESCRIPTOR {
    let shrink = |x: usize| if x == 0 { 0 } else { (x >> l).max(1) };
    let layers = d.Flags & (CUDA_ARRAY3D_LAYERED | CUDA_ARRAY3D_CUBEMAP) != 0;
    CUDA_ARRAY3D_DESCRIPTOR {
        Width: shrink(d.Width),
        Height: shrink(d.Height),
        Depth: if layers { d.Depth } else { shrink(d.Depth) },
        ..*d
    }
}

fn charge_for(dev: usize, bytes: u64) -> Result<u64, CUresult> {
    let charged = bytes
        .checked_next_multiple_of(ALIGN)
        .ok_or(err::INVALID_VALUE)?;
    mem::charge(dev, charged)?;
    Ok(charged)
}

fn create(out: *mut CUarray, d: CUDA_ARRAY3D_DESCRIPTOR) -> Res {
    let (ch, c) = ctx::current()?;
    if out.is_null() {
        return Err(err::INVALID_VALUE);
    }
    let bytes = array_bytes(&d, 1)?;
    let layout = geometry(&d)
        .and_then(|g| g.bytes())
        .ok_or(err::INVALID_VALUE)?;
    let charged = charge_for(c.dev, bytes)?;
    let mem = match Backing::new(layout.max(bytes)) {
        Ok(m) => m,
        Err(e) => {
            mem::uncharge(c.dev, charged);
            return Err(e);
        }
    };
    let (h, _) = arrays().insert(ArrayObj {
        dev: c.dev,
        ctx: ch,
        charged,
        owner: Owner::Own,
        desc: d,
        mem,
        offset: 0,
        planes: Mutex::new(Vec::new()),
    });
    write(out, h as CUarray)
}

/// cuArrayDestroy: an array of cuArrayCreate/cuArray3DCreate, with the planes handed out for it.
/// A level or plane array belongs to its parent and is not destroyed alone: INVALID_HANDLE
/// (an assumption; the reference documents no answer for it).
fn destroy(h: usize) -> Res {
    drv()?;
    let a = arrays().get(h)?;
    if a.owner != Owner::Own {
        return Err(err::INVALID_HANDLE);
    }
    let a = arrays().remove(h)?;
    remove_views(Owner::Plane(h));
    mem::uncharge(a.dev, a.charged);
    Ok(())
}

fn remove_views(of: Owner) {
    arrays().retain(|_, a| a.owner != of);
}

fn mipmap_create(out: *mut CUmipmappedArray, d: CUDA_ARRAY3D_DESCRIPTOR, levels: c_uint) -> Res {
    let (ch, c) = ctx::current()?;
    if out.is_null() {
        return Err(err::INVALID_VALUE);
    }
    let total = array_bytes(&d, levels)?;
    let mut offsets = Vec::with_capacity(levels as usize);
    let mut layout = 0u64;
    for l in 0..levels {
        offsets.push(layout);
        let g = geometry(&level_desc(&d, l))
            .and_then(|g| g.bytes())
            .ok_or(err::INVALID_VALUE)?;
        layout = layout.checked_add(g).ok_or(err::INVALID_VALUE)?;
    }
    let charged = charge_for(c.dev, total)?;
    let mem = match Backing::new(layout.max(total)) {
        Ok(m) => m,
        Err(e) => {
            mem::uncharge(c.dev, charged);
            return Err(e);
        }
    };
    let (h, m) = mipmaps().insert(Mipmap {
        dev: c.dev,
        ctx: ch,
        charged,
        desc: d,
        levels: OnceLock::new(),
    });
    let handles = offsets
        .into_iter()
        .enumerate()
        .map(|(l, off)| {
            arrays()
                .insert(ArrayObj {
                    dev: c.dev,
                    ctx: ch,
                    charged: 0,
                    owner: Owner::Level(h),
                    desc: level_desc(&d, l as u32),
                    mem: mem.clone(),
                    offset: off,
                    planes: Mutex::new(Vec::new()),
                })
                .0
        })
        .collect();
    let _ = m.levels.set(handles);
    write(out, h as CUmipmappedArray)
}

fn mipmap_destroy(h: usize) -> Res {
    drv()?;
    let m = mipmaps().remove(h)?;
    remove_views(Owner::Level(h));
    for l in m.levels.get().into_iter().flatten() {
        remove_views(Owner::Plane(*l));
    }
    mem::uncharge(m.dev, m.charged);
    Ok(())
}

/// A context's teardown takes its arrays and mipmapped arrays (and their views) with it.
pub(crate) fn free_context(ch: usize) {
    let mut gone = Vec::new();
    arrays().retain(|_, a| {
        if a.ctx == ch {
            gone.push((a.dev, a.charged));
            false
        } else {
            true
        }
    });
    mipmaps().retain(|_, m| {
        if m.ctx == ch {
            gone.push((m.dev, m.charged));
            false
        } else {
            true
        }
    });
    for (dev, charged) in gone {
        mem::uncharge(dev, charged);
    }
}

/// The planes of a multi-planar format: (bytes per sample, chroma subsampling in x and y,
/// whether the chroma is one plane of two channels (semi-planar) or two of one (planar)).
/// cuArrayGetPlane documents NV12: "passing in 0 for planeIdx returns a CUDA array of the same
/// size as hArray but with one channel and CU_AD_FORMAT_UNSIGNED_INT8 as its format. If 1 is
/// passed for planeIdx, then the returned CUDA array has half the height and width of hArray
/// with two channels" (CUDA 13.5 cuda.h); the other YUV formats follow the same rule with their
/// own sample size and subsampling (cuda.h `CUarray_format_enum` comments: 4:2:0, 4:2:2, 4:4:4,
/// planar or semi-planar, 8, 10 or 16 bits; 10-bit samples take 16 bits).
fn planes(format: c_int) -> Option<(u64, usize, usize, bool)> {
    Some(match format {
        0xb0 | 0x53 => (1, 2, 2, true),        // NV12, UINT8_SEMIPLANAR_420
        0x9f | 0xa1 | 0x54 => (2, 2, 2, true), // P010, P016, UINT16_SEMIPLANAR_420
        0xa2 | 0x55 => (1, 2, 1, true),        // NV16, UINT8_SEMIPLANAR_422
        0xa3 | 0xa4 | 0x56 => (2, 2, 1, true), // P210, P216, UINT16_SEMIPLANAR_422
        0xb4 | 0x57 => (1, 1, 1, true),        // YUV444_8bit_SemiPlanar, UINT8_SEMIPLANAR_444
        0xb5 | 0x58 => (2, 1, 1, true),        // YUV444_16bit_SemiPlanar, UINT16_SEMIPLANAR_444
        0x59 => (1, 2, 2, false),              // UINT8_PLANAR_420
        0x5a => (2, 2, 2, false),              // UINT16_PLANAR_420
        0x5b => (1, 2, 1, false),              // UINT8_PLANAR_422
        0x5c => (2, 2, 1, false),              // UINT16_PLANAR_422
        0x5d | 0xb2 => (1, 1, 1, false),       // UINT8_PLANAR_444, Y444_PLANAR8
        0x5e | 0xb3 => (2, 1, 1, false),       // UINT16_PLANAR_444, Y444_PLANAR10
        _ => return None,
    })
}

fn get_plane(out: *mut CUarray, h: CUarray, idx: c_uint) -> Res {
    ctx::current()?;
    if out.is_null() {
        return Err(err::INVALID_VALUE);
    }
    let a = get(h)?;
    let (sample, sx, sy, semi) = planes(a.desc.Format).ok_or(err::INVALID_VALUE)?;
    let count = if semi { 2 } else { 3 };
    if idx >= count {
        return Err(err::INVALID_VALUE);
    }
    let mut handed = a.planes.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(Some(p)) = handed.get(idx as usize) {
        return write(out, *p as CUarray);
    }
    let sub = |x: usize, s: usize| if x == 0 { 0 } else { x.div_ceil(s) };
    let format = if sample == 1 { 0x01 } else { 0x02 }; // UNSIGNED_INT8 / UNSIGNED_INT16
    let luma = CUDA_ARRAY3D_DESCRIPTOR {
        Format: format,
        NumChannels: 1,
        ..a.desc
    };
    let chroma = CUDA_ARRAY3D_DESCRIPTOR {
        Width: sub(a.desc.Width, sx),
        Height: sub(a.desc.Height, sy),
        Format: format,
        NumChannels: if semi { 2 } else { 1 },
        ..a.desc
    };
    let size = |d: &CUDA_ARRAY3D_DESCRIPTOR| geometry(d).and_then(|g| g.bytes()).unwrap_or(0);
    let (desc, offset) = match idx {
        0 => (luma, 0),
        1 => (chroma, size(&luma)),
        _ => (chroma, size(&luma) + size(&chroma)),
    };
    let (p, _) = arrays().insert(ArrayObj {
        dev: a.dev,
        ctx: a.ctx,
        charged: 0,
        owner: Owner::Plane(h as usize),
        desc,
        mem: a.mem.clone(),
        offset: a.offset + offset,
        planes: Mutex::new(Vec::new()),
    });
    if handed.len() <= idx as usize {
        handed.resize(idx as usize + 1, None);
    }
    handed[idx as usize] = Some(p);
    write(out, p as CUarray)
}

fn get_level(out: *mut CUarray, h: CUmipmappedArray, level: c_uint) -> Res {
    ctx::current()?;
    if out.is_null() {
        return Err(err::INVALID_VALUE);
    }
    let m = mipmaps().get(h as usize)?;
    // "If level is greater than the maximum number of levels in this mipmapped array,
    // CUDA_ERROR_INVALID_VALUE is returned." (cuMipmappedArrayGetLevel)
    let l = *m
        .levels
        .get()
        .and_then(|v| v.get(level as usize))
        .ok_or(err::INVALID_VALUE)?;
    write(out, l as CUarray)
}

/// cuArrayGetSparseProperties / cuMipmappedArrayGetSparseProperties: "If the CUDA array is not
/// allocated with flag CUDA_ARRAY3D_SPARSE CUDA_ERROR_INVALID_VALUE will be returned"; "For CUDA
/// arrays obtained using cuMipmappedArrayGetLevel, CUDA_ERROR_INVALID_VALUE will be returned"
/// (cuda.h 13.5); so do plane arrays here. Sparse arrays are not modelled (creating one charges
/// it whole, and there is no tile layout to report): a sparse array answers
/// CUDA_ERROR_NOT_SUPPORTED.
fn sparse_properties(out: *mut CUDA_ARRAY_SPARSE_PROPERTIES, flags: c_uint, owned: bool) -> Res {
    if out.is_null() || !owned || flags & CUDA_ARRAY3D_SPARSE == 0 {
        return Err(err::INVALID_VALUE);
    }
    Err(err::NOT_SUPPORTED)
}

/// cuArrayGetMemoryRequirements: "If the CUDA array is not allocated with flag
/// CUDA_ARRAY3D_DEFERRED_MAPPING CUDA_ERROR_INVALID_VALUE will be returned. The returned value in
/// size represents the total size of the CUDA array" (cuda.h 13.5). The alignment is the
/// granularity the simulator maps at (that of cuMemCreate, 2 MiB).
fn memory_requirements(
    out: *mut CUDA_ARRAY_MEMORY_REQUIREMENTS,
    flags: c_uint,
    bytes: u64,
    dev: CUdevice,
) -> Res {
    ctx::device(dev)?;
    if out.is_null() || flags & CUDA_ARRAY3D_DEFERRED_MAPPING == 0 {
        return Err(err::INVALID_VALUE);
    }
    write(
        out,
        CUDA_ARRAY_MEMORY_REQUIREMENTS {
            size: bytes.next_multiple_of(mem::GRANULARITY) as usize,
            alignment: mem::GRANULARITY as usize,
            reserved: [0; 4],
        },
    )
}

fn desc3(d: CUDA_ARRAY_DESCRIPTOR) -> CUDA_ARRAY3D_DESCRIPTOR {
    CUDA_ARRAY3D_DESCRIPTOR {
        Width: d.Width,
        Height: d.Height,
        Depth: 0,
        Format: d.Format,
        NumChannels: d.NumChannels,
        Flags: 0,
    }
}

crate::export! {
    fn cuArrayCreate_v2(out: *mut CUarray, desc: *const CUDA_ARRAY_DESCRIPTOR) {
        create(out, desc3(read(desc)?))
    }
    fn cuArray3DCreate_v2(out: *mut CUarray, desc: *const CUDA_ARRAY3D_DESCRIPTOR) {
        create(out, read(desc)?)
    }
    /// The CUDA 2.x forms: 32-bit extents (cuda.h `CUDA_ARRAY_DESCRIPTOR_v1`), otherwise the
    /// same (libcuda exports both; cuGetProcAddress hands these out below version 3020).
    fn cuArrayCreate(out: *mut CUarray, desc: *const CUDA_ARRAY_DESCRIPTOR_v1) {
        let d: CUDA_ARRAY_DESCRIPTOR_v1 = read(desc)?;
        create(out, desc3(CUDA_ARRAY_DESCRIPTOR { Width: d.Width as usize, Height: d.Height as usize, Format: d.Format, NumChannels: d.NumChannels }))
    }
    fn cuArray3DCreate(out: *mut CUarray, desc: *const CUDA_ARRAY3D_DESCRIPTOR_v1) {
        let d: CUDA_ARRAY3D_DESCRIPTOR_v1 = read(desc)?;
        create(out, CUDA_ARRAY3D_DESCRIPTOR { Width: d.Width as usize, Height: d.Height as usize, Depth: d.Depth as usize, Format: d.Format, NumChannels: d.NumChannels, Flags: d.Flags })
    }
    fn cuArrayDestroy(a: CUarray) { destroy(a as usize) }

    /// "Returns in *pArrayDescriptor a descriptor containing information on the format and
    /// dimensions of the CUDA array hArray" (cuArrayGetDescriptor): the 2D view of it.
    fn cuArrayGetDescriptor_v2(out: *mut CUDA_ARRAY_DESCRIPTOR, h: CUarray) {
        ctx::current()?;
        let d = get(h)?.desc;
        write(out, CUDA_ARRAY_DESCRIPTOR { Width: d.Width, Height: d.Height, Format: d.Format, NumChannels: d.NumChannels })
    }
    fn cuArrayGetDescriptor(out: *mut CUDA_ARRAY_DESCRIPTOR_v1, h: CUarray) {
        ctx::current()?;
        let d = get(h)?.desc;
        write(out, CUDA_ARRAY_DESCRIPTOR_v1 { Width: d.Width as c_uint, Height: d.Height as c_uint, Format: d.Format, NumChannels: d.NumChannels })
    }
    fn cuArray3DGetDescriptor_v2(out: *mut CUDA_ARRAY3D_DESCRIPTOR, h: CUarray) {
        ctx::current()?;
        write(out, get(h)?.desc)
    }
    fn cuArray3DGetDescriptor(out: *mut CUDA_ARRAY3D_DESCRIPTOR_v1, h: CUarray) {
        ctx::current()?;
        let d = get(h)?.desc;
        write(out, CUDA_ARRAY3D_DESCRIPTOR_v1 { Width: d.Width as c_uint, Height: d.Height as c_uint, Depth: d.Depth as c_uint, Format: d.Format, NumChannels: d.NumChannels, Flags: d.Flags })
    }
    fn cuArrayGetSparseProperties(out: *mut CUDA_ARRAY_SPARSE_PROPERTIES, h: CUarray) {
        drv()?;
        let a = get(h).map_err(|_| err::INVALID_VALUE)?;
        sparse_properties(out, a.desc.Flags, a.owner == Owner::Own)
    }
    fn cuMipmappedArrayGetSparseProperties(out: *mut CUDA_ARRAY_SPARSE_PROPERTIES, h: CUmipmappedArray) {
        drv()?;
        let m = mipmaps().get(h as usize).map_err(|_| err::INVALID_VALUE)?;
        sparse_properties(out, m.desc.Flags, true)
    }
    fn cuArrayGetMemoryRequirements(out: *mut CUDA_ARRAY_MEMORY_REQUIREMENTS, h: CUarray, dev: CUdevice) {
        drv()?;
        let a = get(h).map_err(|_| err::INVALID_VALUE)?;
        memory_requirements(out, a.desc.Flags, a.charged, dev)
    }
    fn cuMipmappedArrayGetMemoryRequirements(out: *mut CUDA_ARRAY_MEMORY_REQUIREMENTS, h: CUmipmappedArray, dev: CUdevice) {
        drv()?;
        let m = mipmaps().get(h as usize).map_err(|_| err::INVALID_VALUE)?;
        memory_requirements(out, m.desc.Flags, m.charged, dev)
    }
    fn cuArrayGetPlane(out: *mut CUarray, h: CUarray, plane: c_uint) { get_plane(out, h, plane) }

    fn cuMipmappedArrayCreate(out: *mut CUmipmappedArray, desc: *const CUDA_ARRAY3D_DESCRIPTOR, levels: c_uint) {
        mipmap_create(out, read(desc)?, levels)
    }
    fn cuMipmappedArrayGetLevel(out: *mut CUarray, h: CUmipmappedArray, level: c_uint) { get_level(out, h, level) }
    fn cuMipmappedArrayDestroy(h: CUmipmappedArray) { mipmap_destroy(h as usize) }
}

// ---- texture and surface objects ----------------------------------------------------------------

/// `CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT` of every modelled GPU: 512 bytes (`deviceQuery`'s
/// "Texture alignment: 512 bytes" on Volta, Ampere and Hopper GPUs, CUDA samples). A linear or
/// pitched resource's devPtr "must be set to a valid device pointer, that is aligned to
/// CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT" (cuTexObjectCreate).
pub(crate) const TEXTURE_ALIGNMENT: u64 = 512;
/// `CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT` (`cudaDeviceProp::texturePitchAlignment`):
/// 32 bytes on the modelled GPUs; a pitch2D resource's pitch "has to be aligned to" it.
pub(crate) const TEXTURE_PITCH_ALIGNMENT: u64 = 32;

struct TexObj {
    res: CUDA_RESOURCE_DESC,
    tex: CUDA_TEXTURE_DESC,
    view: Option<CUDA_RESOURCE_VIEW_DESC>,
}

/// Texture objects (false) and surface objects (true) by handle: opaque 64-bit values, here
/// counted from 1 (0 is never a valid object).
type Objects = std::collections::HashMap<(bool, u64), TexObj>;

fn objects() -> std::sync::MutexGuard<'static, Objects> {
    static O: OnceLock<Mutex<Objects>> = OnceLock::new();
    O.get_or_init(|| Mutex::new(Objects::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

fn new_object(surface: bool, o: TexObj) -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let h = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    objects().insert((surface, h), o);
    h
}

/// The element size of a linear or pitched resource's format and channels: a plain
/// per-channel format of 1, 2 or 4 channels.
fn linear_elem(format: c_int, channels: c_uint) -> Result<u64, CUresult> {
    match array_format_block(format) {
        Some(b) if b.per_channel && matches!(channels, 1 | 2 | 4) => Ok(b.bytes * channels as u64),
        _ => Err(err::INVALID_VALUE),
    }
}

/// Checks a resource descriptor as cuTexObjectCreate documents it; answers whether it is an
/// array or mipmapped array not in a block-compressed format (which a view may describe).
fn check_resource(r: &CUDA_RESOURCE_DESC) -> Result<bool, CUresult> {
    let bad = err::INVALID_VALUE;
    // "flags must be set to zero."
    if r.flags != 0 {
        return Err(bad);
    }
    let blocky = |f: c_int| array_format_block(f).is_some_and(|b| b.w > 1 || b.h > 1);
    match r.resType {
        // "hArray must be set to a valid CUDA array handle."
        CU_RESOURCE_TYPE_ARRAY => Ok(!blocky(
            get(r.handle() as CUarray).map_err(|_| bad)?.desc.Format,
        )),
        // "hMipmappedArray must be set to a valid CUDA mipmapped array handle."
        CU_RESOURCE_TYPE_MIPMAPPED_ARRAY => {
            let m = mipmaps().get(r.mipmap() as usize).map_err(|_| bad)?;
            Ok(!blocky(m.desc.Format))
        }
        CU_RESOURCE_TYPE_LINEAR | CU_RESOURCE_TYPE_PITCH2D => {
            let ptr = r.handle();
            let (format, channels) = r.format_channels();
            let elem = linear_elem(format, channels)?;
            if !ptr.is_multiple_of(TEXTURE_ALIGNMENT) {
                return Err(bad);
            }
            let len = if r.resType == CU_RESOURCE_TYPE_LINEAR {
                r.word2() // sizeInBytes
            } else {
                let (height, pitch) = r.pitch2d_height_pitch();
                let row = r.word2().checked_mul(elem).ok_or(bad)?;
                if !pitch.is_multiple_of(TEXTURE_PITCH_ALIGNMENT) || pitch < row || height == 0 {
                    return Err(bad);
                }
                (height - 1)
                    .checked_mul(pitch)
                    .and_then(|x| x.checked_add(row))
                    .ok_or(bad)?
            };
            if len == 0 {
                return Err(bad);
            }
            // "a valid device pointer": the whole range in one live allocation.
            mem::device_range(ptr, len, false).map_err(|_| bad)?;
            Ok(false)
        }
        _ => Err(bad),
    }
}

fn tex_create(
    out: *mut CUtexObject,
    res: *const CUDA_RESOURCE_DESC,
    tex: *const CUDA_TEXTURE_DESC,
    view: *const CUDA_RESOURCE_VIEW_DESC,
) -> Res {
    ctx::current()?;
    if out.is_null() {
        return Err(err::INVALID_VALUE);
    }
    let (res, tex) = (read(res)?, read(tex)?);
    let viewable = check_resource(&res)?;
    let view = if view.is_null() {
        None
    } else {
        // "pResViewDesc can only be specified if the type of resource is a CUDA array or a CUDA
        // mipmapped array not in a block compressed format."
        if !viewable {
            return Err(err::INVALID_VALUE);
        }
        Some(read(view)?)
    };
    write(out, new_object(false, TexObj { res, tex, view }))
}

fn surf_create(out: *mut CUsurfObject, res: *const CUDA_RESOURCE_DESC) -> Res {
    ctx::current()?;
    if out.is_null() {
        return Err(err::INVALID_VALUE);
    }
    let res: CUDA_RESOURCE_DESC = read(res)?;
    // "CUDA_RESOURCE_DESC::resType must be CU_RESOURCE_TYPE_ARRAY and
    // CUDA_RESOURCE_DESC::res::array::hArray must be set to a valid CUDA array handle.
    // CUDA_RESOURCE_DESC::flags must be set to zero" (cuSurfObjectCreate); the array must have
    // been created with CUDA_ARRAY3D_SURFACE_LDST ("The CUDA_ARRAY3D_SURFACE_LDST flag must have
    // been set for the CUDA array", cuSurfRefSetArray; cudaCreateSurfaceObject documents the
    // same of cudaArraySurfaceLoadStore).
    if res.resType != CU_RESOURCE_TYPE_ARRAY || res.flags != 0 {
        return Err(err::INVALID_VALUE);
    }
    let a = get(res.handle() as CUarray).map_err(|_| err::INVALID_VALUE)?;
    if a.desc.Flags & CUDA_ARRAY3D_SURFACE_LDST == 0 {
        return Err(err::INVALID_VALUE);
    }
    let tex = CUDA_TEXTURE_DESC {
        addressMode: [0; 3],
        filterMode: 0,
        flags: 0,
        maxAnisotropy: 0,
        mipmapFilterMode: 0,
        mipmapLevelBias: 0.0,
        minMipmapLevelClamp: 0.0,
        maxMipmapLevelClamp: 0.0,
        borderColor: [0.0; 4],
        reserved: [0; 12],
    };
    write(
        out,
        new_object(
            true,
            TexObj {
                res,
                tex,
                view: None,
            },
        ),
    )
}

/// Destroying or reading an object that is not one: CUDA_ERROR_INVALID_VALUE, the only
/// argument error these functions document.
fn with_object<T>(surface: bool, h: u64, f: impl FnOnce(&TexObj) -> T) -> Result<T, CUresult> {
    drv()?;
    objects()
        .get(&(surface, h))
        .map(f)
        .ok_or(err::INVALID_VALUE)
}

fn destroy_object(surface: bool, h: u64) -> Res {
    drv()?;
    objects()
        .remove(&(surface, h))
        .map(|_| ())
        .ok_or(err::INVALID_VALUE)
}

crate::export! {
    fn cuTexObjectCreate(out: *mut CUtexObject, res: *const CUDA_RESOURCE_DESC, tex: *const CUDA_TEXTURE_DESC, view: *const CUDA_RESOURCE_VIEW_DESC) {
        tex_create(out, res, tex, view)
    }
    fn cuTexObjectDestroy(h: CUtexObject) { destroy_object(false, h) }
    fn cuTexObjectGetResourceDesc(out: *mut CUDA_RESOURCE_DESC, h: CUtexObject) { write(out, with_object(false, h, |o| o.res)?) }
    fn cuTexObjectGetTextureDesc(out: *mut CUDA_TEXTURE_DESC, h: CUtexObject) { write(out, with_object(false, h, |o| o.tex)?) }
    /// An object made without a view answers a zeroed one (no format change, nothing restricted).
    fn cuTexObjectGetResourceViewDesc(out: *mut CUDA_RESOURCE_VIEW_DESC, h: CUtexObject) {
        let v = with_object(false, h, |o| o.view)?;
        write(out, v.unwrap_or(CUDA_RESOURCE_VIEW_DESC { format: 0, width: 0, height: 0, depth: 0, firstMipmapLevel: 0, lastMipmapLevel: 0, firstLayer: 0, lastLayer: 0, reserved: [0; 16] }))
    }
    fn cuSurfObjectCreate(out: *mut CUsurfObject, res: *const CUDA_RESOURCE_DESC) { surf_create(out, res) }
    fn cuSurfObjectDestroy(h: CUsurfObject) { destroy_object(true, h) }
    fn cuSurfObjectGetResourceDesc(out: *mut CUDA_RESOURCE_DESC, h: CUsurfObject) { write(out, with_object(true, h, |o| o.res)?) }
}
