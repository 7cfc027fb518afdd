//! Managed (unified) memory, as the real driver runs it on Linux on GPUs with
//! `CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS` (sm_60 and later; every modelled GPU reports
//! 1): pages live where they were last migrated, and an allocation may be larger than the
//! device's memory.
//!
//! - Oversubscription: a managed allocation may be larger than the device's memory on GPUs with
//!   concurrent managed access (CUDA C++ Programming Guide, "Unified Memory Programming"; CuPy's
//!   `cupy.cuda.malloc_managed` documents it as "device memory oversubscription is possible for
//!   GPUs that have a non-zero value for the device attribute cudaDevAttrConcurrentManagedAccess").
//!   cuMemAllocManaged populates nothing: cuMemPrefetchAsync's documentation (cuda.h 13.5) says
//!   "If no physical memory has been allocated for this region, then this memory region will be
//!   populated and mapped on the destination device". So it charges no device memory and takes
//!   only address space (up to 8 times all device memory together, then
//!   CUDA_ERROR_OUT_OF_MEMORY).
//! - Residency, the simulator's rule: a page is resident on a device once it was prefetched
//!   there (cuMemPrefetchAsync and its forms, cuMemPrefetchBatchAsync). A kernel moves nothing:
//!   the simulator runs no code, so it cannot know which pages a kernel touches, and taking it
//!   to touch every attached allocation would put on the device memory that a real kernel
//!   never reads (an oversubscribed allocation would fill the device at the first launch).
//!   Resident pages are charged to the device and to this process (NVML lists them) up to the
//!   device's capacity; what does not fit stays in host memory (the real driver would evict
//!   other processes' managed pages; the simulator does not). Prefetching to the host, or a
//!   discard, gives the device memory back; so does freeing the allocation.
//! - Advice (cuMemAdvise, _v2) and the range attributes (cuMemRangeGetAttribute(s)) are kept per
//!   page run, with the driver's documented answers for ranges whose pages disagree.
//! - Everything happens when called: a prefetch is done when the call returns (the real one is
//!   asynchronous in its stream, which only the timing would show), and takes no simulated time.
//!
//! A range given to these calls lies inside one managed allocation (the simulator does not
//! join adjacent ones); anything else is CUDA_ERROR_INVALID_VALUE, as for memory that is not
//! managed.

use crate::mem::{self, charge, location_device, uncharge, Kind};
use crate::stream;
use crate::{ctx, drv, export, read, write, Res};
use cuvisor_cuda_abi::cuda::*;
use std::collections::BTreeMap;
use std::ffi::{c_int, c_uint, c_void};
use std::sync::atomic::Ordering::*;
use std::sync::{Mutex, OnceLock};

/// Pages are CPU pages: "The start address and end address of the memory range will be rounded
/// down and rounded up respectively to be aligned to CPU page size" (cuda.h 13.5,
/// cuMemPrefetchAsync).
const PAGE: u64 = 4096;
/// cuda.h 13.5: `#define CU_DEVICE_CPU ((CUdevice)-1)`, `#define CU_DEVICE_INVALID ((CUdevice)-2)`.
const DEVICE_CPU: c_int = -1;
const DEVICE_INVALID: c_int = -2;
/// CUmem_advise (cuda.h 13.5).
const ADVISE_SET_READ_MOSTLY: c_int = 1;
const ADVISE_UNSET_READ_MOSTLY: c_int = 2;
const ADVISE_SET_PREFERRED_LOCATION: c_int = 3;
const ADVISE_UNSET_PREFERRED_LOCATION: c_int = 4;
const ADVISE_SET_ACCESSED_BY: c_int = 5;
const ADVISE_UNSET_ACCESSED_BY: c_int = 6;
/// CUmem_range_attribute (cuda.h 13.5).
const RANGE_READ_MOSTLY: c_int = 1;
const RANGE_PREFERRED_LOCATION: c_int = 2;
const RANGE_ACCESSED_BY: c_int = 3;
const RANGE_LAST_PREFETCH_LOCATION: c_int = 4;
const RANGE_PREFERRED_LOCATION_TYPE: c_int = 5;
const RANGE_PREFERRED_LOCATION_ID: c_int = 6;
const RANGE_LAST_PREFETCH_LOCATION_TYPE: c_int = 7;
const RANGE_LAST_PREFETCH_LOCATION_ID: c_int = 8;
/// CUmemLocationType (cuda.h 13.5).
const LOC_INVALID: c_int = 0;
const LOC_DEVICE: c_int = 1;
const LOC_HOST: c_int = 2;
const LOC_HOST_NUMA: c_int = 3;
const LOC_HOST_NUMA_CURRENT: c_int = 4;

/// CUmemAttach_flags (cuda.h 13.5): GLOBAL 1, HOST 2, SINGLE 4.
const ATTACH_SINGLE: c_uint = 4;

/// Where a page is, or is advised to be: a device, or host memory (NUMA node `id`; `id` -1
/// for plain CU_MEM_LOCATION_TYPE_HOST).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Loc {
    Device(usize),
    Host(c_int),
}

impl Loc {
    /// A location argument of the CUDA 12.2+ calls. HOST_NUMA_CURRENT is the host node of the
    /// calling thread: node 0 here (the simulated machine's NUMA layout is the model's).
    fn from_location(l: CUmemLocation) -> Result<Loc, CUresult> {
        match l.type_ {
            LOC_DEVICE => Ok(Loc::Device(location_device(l)?.ok_or(err::INVALID_DEVICE)?)),
            LOC_HOST => Ok(Loc::Host(-1)),
            LOC_HOST_NUMA if l.id >= 0 => Ok(Loc::Host(l.id)),
            LOC_HOST_NUMA_CURRENT => Ok(Loc::Host(0)),
            _ => Err(err::INVALID_VALUE),
        }
    }
    /// A `CUdevice` argument of the older forms: an ordinal or CU_DEVICE_CPU.
    fn from_device(d: CUdevice) -> Result<Loc, CUresult> {
        if d == DEVICE_CPU {
            return Ok(Loc::Host(-1));
        }
        let (i, _) = ctx::device(d).map_err(|_| err::INVALID_DEVICE)?;
        Ok(Loc::Device(i))
    }
    /// (CUmemLocationType, id) as the range attributes report it.
    fn type_id(self) -> (c_int, c_int) {
        match self {
            Loc::Device(d) => (LOC_DEVICE, d as c_int),
            Loc::Host(-1) => (LOC_HOST, 0),
            Loc::Host(n) => (LOC_HOST_NUMA, n),
        }
    }
    /// The legacy answer: a device ordinal or CU_DEVICE_CPU.
    fn device_id(self) -> c_int {
        match self {
            Loc::Device(d) => d as c_int,
            Loc::Host(_) => DEVICE_CPU,
        }
    }
}

/// What the driver knows of a run of pages.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
struct Pages {
    read_mostly: bool,
    preferred: Option<Loc>,
    /// Devices advised with SET_ACCESSED_BY (bit per ordinal); bit 63: the host.
    accessed_by: u64,
    last_prefetch: Option<Loc>,
    /// The device whose memory holds these pages (and is charged for them); None: host memory
    /// or not populated yet.
    resident: Option<usize>,
}

const HOST_BIT: u32 = 63;

/// One managed allocation: its page runs, [offset, end) -> what they share, covering it whole.
struct Managed {
    size: u64,
    /// Its stream association (cuMemAllocManaged's flags, then cuStreamAttachMemAsync's):
    /// kept and checked, no effect on where pages are (every modelled GPU has concurrent
    /// managed access, where the association only orders CPU access).
    attach: c_uint,
    /// The size the program asked for (`size` is it rounded up to 512 bytes).
    requested: u64,
    runs: BTreeMap<u64, (u64, Pages)>,
}

impl Managed {
    fn new(size: u64, requested: u64, attach: c_uint) -> Managed {
        let mut runs = BTreeMap::new();
        runs.insert(0, (size, Pages::default()));
        Managed {
            size,
            attach,
            requested,
            runs,
        }
    }
    /// Splits the run holding `at` so that a run starts there.
    fn split(&mut self, at: u64) {
        if at >= self.size || self.runs.contains_key(&at) {
            return;
        }
        let Some((&start, &(end, p))) = self.runs.range(..at).next_back() else {
            return;
        };
        self.runs.insert(start, (at, p));
        self.runs.insert(at, (end, p));
    }
    /// Applies `f` to the pages of [lo, hi), run by run (with the run's length), then joins
    /// neighbours that agree.
    fn update(&mut self, lo: u64, hi: u64, mut f: impl FnMut(u64, &mut Pages)) {
        self.split(lo);
        self.split(hi);
        for (&start, (end, p)) in self.runs.range_mut(lo..hi) {
            f(*end - start, p);
        }
        let keys: Vec<u64> = self.runs.keys().copied().collect();
        let mut prev: Option<u64> = None;
        for k in keys {
            if let Some(p) = prev {
                if let (Some(&(pe, pp)), Some(&(ke, kp))) = (self.runs.get(&p), self.runs.get(&k)) {
                    if pe == k && pp == kp {
                        self.runs.remove(&k);
                        self.runs.insert(p, (ke, pp));
                        continue;
                    }
                }
            }
            prev = Some(k);
        }
    }
    /// The runs of [lo, hi) (each clipped to it): (length, pages).
    fn runs_in(&self, lo: u64, hi: u64) -> Vec<(u64, Pages)> {
        let first = self
            .runs
            .range(..=lo)
            .next_back()
            .map(|(k, _)| *k)
            .unwrap_or(0);
        self.runs
            .range(first..hi)
            .map(|(&s, &(e, p))| (e.min(hi) - s.max(lo), p))
            .collect()
    }
}

fn managed() -> &'static Mutex<BTreeMap<u64, Managed>> {
    static M: OnceLock<Mutex<BTreeMap<u64, Managed>>> = OnceLock::new();
    M.get_or_init(|| Mutex::new(BTreeMap::new()))
}

/// The managed allocation holding [ptr, ptr + count), as (base, page-aligned offsets lo..hi).
fn range_of(
    m: &BTreeMap<u64, Managed>,
    ptr: CUdeviceptr,
    count: usize,
) -> Result<(u64, u64, u64), CUresult> {
    if count == 0 {
        return Err(err::INVALID_VALUE);
    }
    let (&base, a) = m.range(..=ptr).next_back().ok_or(err::INVALID_VALUE)?;
    let end = ptr.checked_add(count as u64).ok_or(err::INVALID_VALUE)?;
    if end > base + a.size {
        return Err(err::INVALID_VALUE);
    }
    let lo = (ptr - base) / PAGE * PAGE;
    let hi = (end - base).div_ceil(PAGE).saturating_mul(PAGE).min(a.size);
    Ok((base, lo, hi))
}

/// Charges up to `bytes` (whole pages) on device `dev`: what fits. Returns what was charged.
fn charge_what_fits(dev: usize, bytes: u64) -> u64 {
    if bytes == 0 || charge(dev, bytes).is_ok() {
        return bytes;
    }
    let Ok(d) = drv() else { return 0 };
    let cap = d.sim.model.devices[dev].memory;
    let used = d.sim.shared.device(dev).mem_used.load(Acquire);
    let fit = cap.saturating_sub(used).min(bytes) / PAGE * PAGE;
    if fit > 0 && charge(dev, fit).is_ok() {
        fit
    } else {
        0
    }
}

/// Moves the pages of [lo, hi) of allocation `a` to `to` (charging what lands on a device, up
/// to its capacity; what does not fit stays where it was, or in host memory).
fn migrate(a: &mut Managed, lo: u64, hi: u64, to: Loc) {
    // Split the range into runs first: a run that only partly fits is split where it stops.
    let plan: Vec<(u64, u64, Pages)> = {
        a.split(lo);
        a.split(hi);
        a.runs
            .range(lo..hi)
            .map(|(&s, &(e, p))| (s, e, p))
            .collect()
    };
    for (s, e, p) in plan {
        match to {
            Loc::Host(_) => {
                if let Some(d) = p.resident {
                    uncharge(d, e - s);
                }
                a.update(s, e, |_, q| q.resident = None);
            }
            Loc::Device(d) => {
                if p.resident == Some(d) {
                    continue;
                }
                let got = charge_what_fits(d, e - s);
                if got == 0 {
                    continue;
                }
                if let Some(old) = p.resident {
                    uncharge(old, got);
                }
                a.update(s, s + got, |_, q| q.resident = Some(d));
            }
        }
    }
}

/// The allocation at `addr` was freed (its `on_release`): its resident pages go back to their
/// devices.
fn released(addr: u64) {
    let mut m = managed().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(a) = m.remove(&addr) {
        for (s, (e, p)) in &a.runs {
            if let Some(d) = p.resident {
                uncharge(d, e - s);
            }
        }
    }
}

fn prefetch(ptr: CUdeviceptr, count: usize, to: Loc, s: CUstream, pt: bool) -> Res {
    stream::stream(s, pt)?;
    let mut m = managed().lock().unwrap_or_else(|e| e.into_inner());
    let (base, lo, hi) = range_of(&m, ptr, count)?;
    let a = m.get_mut(&base).ok_or(err::INVALID_VALUE)?;
    a.update(lo, hi, |_, p| p.last_prefetch = Some(to));
    migrate(a, lo, hi, to);
    Ok(())
}

fn advise(
    ptr: CUdeviceptr,
    count: usize,
    advice: c_int,
    loc: impl FnOnce() -> Result<Loc, CUresult>,
) -> Res {
    drv()?;
    let mut m = managed().lock().unwrap_or_else(|e| e.into_inner());
    let (base, lo, hi) = range_of(&m, ptr, count)?;
    let a = m.get_mut(&base).ok_or(err::INVALID_VALUE)?;
    let bit = |l: Loc| match l {
        Loc::Device(d) => 1u64 << d,
        Loc::Host(_) => 1u64 << HOST_BIT,
    };
    match advice {
        ADVISE_SET_READ_MOSTLY => a.update(lo, hi, |_, p| p.read_mostly = true),
        ADVISE_UNSET_READ_MOSTLY => a.update(lo, hi, |_, p| p.read_mostly = false),
        ADVISE_SET_PREFERRED_LOCATION => {
            let l = loc()?;
            a.update(lo, hi, |_, p| p.preferred = Some(l))
        }
        ADVISE_UNSET_PREFERRED_LOCATION => a.update(lo, hi, |_, p| p.preferred = None),
        ADVISE_SET_ACCESSED_BY => {
            let b = bit(loc()?);
            a.update(lo, hi, |_, p| p.accessed_by |= b)
        }
        ADVISE_UNSET_ACCESSED_BY => {
            let b = bit(loc()?);
            a.update(lo, hi, |_, p| p.accessed_by &= !b)
        }
        _ => return Err(err::INVALID_VALUE),
    }
    Ok(())
}

/// One value of every page of the range, or None when they differ.
fn common<T: PartialEq + Copy>(runs: &[(u64, Pages)], f: impl Fn(&Pages) -> T) -> Option<T> {
    let first = f(&runs.first()?.1);
    runs.iter().all(|(_, p)| f(p) == first).then_some(first)
}

fn range_attribute(
    data: *mut c_void,
    size: usize,
    attribute: c_int,
    ptr: CUdeviceptr,
    count: usize,
) -> Res {
    drv()?;
    if data.is_null() {
        return Err(err::INVALID_VALUE);
    }
    let m = managed().lock().unwrap_or_else(|e| e.into_inner());
    let (base, lo, hi) = range_of(&m, ptr, count)?;
    let runs = m.get(&base).ok_or(err::INVALID_VALUE)?.runs_in(lo, hi);
    let int = |v: c_int| {
        if size != 4 {
            return Err(err::INVALID_VALUE);
        }
        write(data as *mut c_int, v)
    };
    let preferred = common(&runs, |p| p.preferred).flatten();
    let prefetched = common(&runs, |p| p.last_prefetch).flatten();
    match attribute {
        RANGE_READ_MOSTLY => int(common(&runs, |p| p.read_mostly).unwrap_or(false) as c_int),
        RANGE_PREFERRED_LOCATION => int(preferred.map_or(DEVICE_INVALID, Loc::device_id)),
        RANGE_LAST_PREFETCH_LOCATION => int(prefetched.map_or(DEVICE_INVALID, Loc::device_id)),
        RANGE_PREFERRED_LOCATION_TYPE => int(preferred.map_or(LOC_INVALID, |l| l.type_id().0)),
        RANGE_PREFERRED_LOCATION_ID => int(preferred.map_or(DEVICE_INVALID, |l| l.type_id().1)),
        RANGE_LAST_PREFETCH_LOCATION_TYPE => int(prefetched.map_or(LOC_INVALID, |l| l.type_id().0)),
        RANGE_LAST_PREFETCH_LOCATION_ID => {
            int(prefetched.map_or(DEVICE_INVALID, |l| l.type_id().1))
        }
        RANGE_ACCESSED_BY => {
            if size == 0 || !size.is_multiple_of(4) {
                return Err(err::INVALID_VALUE);
            }
            let all = runs
                .iter()
                .fold(u64::MAX, |acc, (_, p)| acc & p.accessed_by);
            let mut ids: Vec<c_int> = (0..63)
                .filter(|d| all & (1 << d) != 0)
                .map(|d| d as c_int)
                .collect();
            if all & (1 << HOST_BIT) != 0 {
                ids.push(DEVICE_CPU);
            }
            for i in 0..size / 4 {
                // SAFETY: `data` holds `size` bytes by the API contract; i < size / 4.
                unsafe {
                    (data as *mut c_int)
                        .add(i)
                        .write_unaligned(ids.get(i).copied().unwrap_or(DEVICE_INVALID))
                };
            }
            Ok(())
        }
        _ => Err(err::INVALID_VALUE),
    }
}

/// The (pointer, size) pairs of a batch.
fn batch(
    dptrs: *const CUdeviceptr,
    sizes: *const usize,
    count: usize,
) -> Result<Vec<(CUdeviceptr, usize)>, CUresult> {
    if count == 0 {
        return Err(err::INVALID_VALUE);
    }
    (0..count)
        .map(|i| Ok((read(dptrs.wrapping_add(i))?, read(sizes.wrapping_add(i))?)))
        .collect()
}

/// cuMemPrefetchBatchAsync: "The locations specified in prefetchLocs[k] will be applied to
/// copies starting from prefetchLocIdxs[k] through prefetchLocIdxs[k+1] - 1" (cuda.h 13.5).
#[allow(clippy::too_many_arguments)]
fn prefetch_batch(
    dptrs: *const CUdeviceptr,
    sizes: *const usize,
    count: usize,
    locs: *const CUmemLocation,
    idxs: *const usize,
    nlocs: usize,
    flags: u64,
    s: CUstream,
    pt: bool,
) -> Res {
    drv()?;
    stream::not_legacy(s, pt)?;
    let ops = batch(dptrs, sizes, count)?;
    if flags != 0 || nlocs == 0 || nlocs > count {
        return Err(err::INVALID_VALUE);
    }
    let mut plan = Vec::with_capacity(nlocs);
    for k in 0..nlocs {
        let from: usize = read(idxs.wrapping_add(k))?;
        let loc = Loc::from_location(read(locs.wrapping_add(k))?)?;
        if (k == 0 && from != 0) || plan.last().is_some_and(|&(f, _)| from <= f) || from >= count {
            return Err(err::INVALID_VALUE);
        }
        plan.push((from, loc));
    }
    {
        let m = managed().lock().unwrap_or_else(|e| e.into_inner());
        for &(p, n) in &ops {
            range_of(&m, p, n)?;
        }
    }
    for (i, (p, n)) in ops.into_iter().enumerate() {
        let loc = plan
            .iter()
            .rev()
            .find(|&&(f, _)| f <= i)
            .map(|x| x.1)
            .ok_or(err::INVALID_VALUE)?;
        prefetch(p, n, loc, s, pt)?;
    }
    Ok(())
}

/// cuMemDiscardBatchAsync: "the contents of that range are no longer useful [...] can also help
/// reduce memory pressure": the pages leave the device (nothing to migrate) and read as zeros.
fn discard_batch(
    dptrs: *const CUdeviceptr,
    sizes: *const usize,
    count: usize,
    flags: u64,
    s: CUstream,
    pt: bool,
) -> Res {
    drv()?;
    stream::not_legacy(s, pt)?;
    let ops = batch(dptrs, sizes, count)?;
    if flags != 0 {
        return Err(err::INVALID_VALUE);
    }
    let mut m = managed().lock().unwrap_or_else(|e| e.into_inner());
    let mut ranges = Vec::with_capacity(ops.len());
    for &(p, n) in &ops {
        ranges.push(range_of(&m, p, n)?);
    }
    for (base, lo, hi) in ranges {
        if let Some(a) = m.get_mut(&base) {
            migrate(a, lo, hi, Loc::Host(-1));
            // SAFETY: [base + lo, base + hi) lies inside this live managed allocation of ours
            // (page-aligned within it); dropping its pages makes them read as zeros.
            unsafe {
                libc::madvise(
                    (base + lo) as *mut c_void,
                    (hi - lo) as usize,
                    libc::MADV_DONTNEED,
                )
            };
        }
    }
    Ok(())
}

/// cuStreamAttachMemAsync: the start of a managed allocation, `length` 0 or its whole size ("it
/// is not possible to change stream association for a portion of a managed allocation"),
/// one of CUmemAttach_flags; SINGLE on the NULL stream is refused ("It is illegal to attach
/// singly to the NULL stream [...] An error will be returned"), as everything else here, with
/// INVALID_VALUE. Pageable memory is not accepted (CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS
/// is 0 on the simulated GPUs).
fn attach(s: CUstream, ptr: CUdeviceptr, length: usize, flags: c_uint, pt: bool) -> Res {
    drv()?;
    stream::stream(s, pt)?;
    if !matches!(
        flags,
        CU_MEM_ATTACH_GLOBAL | CU_MEM_ATTACH_HOST | ATTACH_SINGLE
    ) {
        return Err(err::INVALID_VALUE);
    }
    if flags == ATTACH_SINGLE && (s.is_null() || s as usize == 1 || s as usize == 2) {
        return Err(err::INVALID_VALUE);
    }
    let mut m = managed().lock().unwrap_or_else(|e| e.into_inner());
    let a = m.get_mut(&ptr).ok_or(err::INVALID_VALUE)?;
    if length != 0 && length as u64 != a.requested && length as u64 != a.size {
        return Err(err::INVALID_VALUE);
    }
    a.attach = flags;
    Ok(())
}

export! {
    fn cuStreamAttachMemAsync(s: CUstream, ptr: CUdeviceptr, length: usize, flags: c_uint) { attach(s, ptr, length, flags, false) }
    fn cuStreamAttachMemAsync_ptsz(s: CUstream, ptr: CUdeviceptr, length: usize, flags: c_uint) { attach(s, ptr, length, flags, true) }

    /// CU_MEM_ATTACH_GLOBAL or CU_MEM_ATTACH_HOST (else INVALID_VALUE; CU_MEM_ATTACH_SINGLE is
    /// for cuStreamAttachMemAsync only); no device memory until pages are resident
    /// (see the module's comment), so it may exceed the device's memory.
    fn cuMemAllocManaged(dptr: *mut CUdeviceptr, size: usize, flags: c_uint) {
        if dptr.is_null() || !matches!(flags, CU_MEM_ATTACH_GLOBAL | CU_MEM_ATTACH_HOST) {
            return Err(err::INVALID_VALUE);
        }
        let (ch, c) = ctx::current()?;
        let a = mem::alloc_in(c.dev, ch, size as u64, Kind::Managed, Some(0), None, Some(Box::new(released)))?;
        let rounded = mem::allocation_size(a).unwrap_or(size as u64);
        managed().lock().unwrap_or_else(|e| e.into_inner()).insert(a, Managed::new(rounded, size as u64, flags));
        write(dptr, a)
    }

    /// The CUDA 8.0 form: a device ordinal or CU_DEVICE_CPU.
    fn cuMemPrefetchAsync(ptr: CUdeviceptr, count: usize, dst: CUdevice, s: CUstream) {
        drv()?;
        prefetch(ptr, count, Loc::from_device(dst)?, s, false)
    }
    fn cuMemPrefetchAsync_ptsz(ptr: CUdeviceptr, count: usize, dst: CUdevice, s: CUstream) {
        drv()?;
        prefetch(ptr, count, Loc::from_device(dst)?, s, true)
    }
    /// The CUDA 12.2 form (what CUDA 13's cuda.h calls cuMemPrefetchAsync): a location and
    /// flags, which "must be zero now".
    fn cuMemPrefetchAsync_v2(ptr: CUdeviceptr, count: usize, loc: CUmemLocation, flags: c_uint, s: CUstream) {
        drv()?;
        if flags != 0 {
            return Err(err::INVALID_VALUE);
        }
        prefetch(ptr, count, Loc::from_location(loc)?, s, false)
    }
    fn cuMemPrefetchAsync_v2_ptsz(ptr: CUdeviceptr, count: usize, loc: CUmemLocation, flags: c_uint, s: CUstream) {
        drv()?;
        if flags != 0 {
            return Err(err::INVALID_VALUE);
        }
        prefetch(ptr, count, Loc::from_location(loc)?, s, true)
    }
    fn cuMemPrefetchBatchAsync(dptrs: *const CUdeviceptr, sizes: *const usize, count: usize, locs: *const CUmemLocation, idxs: *const usize, nlocs: usize, flags: u64, s: CUstream) {
        prefetch_batch(dptrs, sizes, count, locs, idxs, nlocs, flags, s, false)
    }
    fn cuMemPrefetchBatchAsync_ptsz(dptrs: *const CUdeviceptr, sizes: *const usize, count: usize, locs: *const CUmemLocation, idxs: *const usize, nlocs: usize, flags: u64, s: CUstream) {
        prefetch_batch(dptrs, sizes, count, locs, idxs, nlocs, flags, s, true)
    }
    fn cuMemDiscardBatchAsync(dptrs: *const CUdeviceptr, sizes: *const usize, count: usize, flags: u64, s: CUstream) {
        discard_batch(dptrs, sizes, count, flags, s, false)
    }
    fn cuMemDiscardBatchAsync_ptsz(dptrs: *const CUdeviceptr, sizes: *const usize, count: usize, flags: u64, s: CUstream) {
        discard_batch(dptrs, sizes, count, flags, s, true)
    }
    /// Discards, then prefetches: the pages end where the prefetch puts them.
    fn cuMemDiscardAndPrefetchBatchAsync(dptrs: *const CUdeviceptr, sizes: *const usize, count: usize, locs: *const CUmemLocation, idxs: *const usize, nlocs: usize, flags: u64, s: CUstream) {
        discard_batch(dptrs, sizes, count, flags, s, false)?;
        prefetch_batch(dptrs, sizes, count, locs, idxs, nlocs, flags, s, false)
    }
    fn cuMemDiscardAndPrefetchBatchAsync_ptsz(dptrs: *const CUdeviceptr, sizes: *const usize, count: usize, locs: *const CUmemLocation, idxs: *const usize, nlocs: usize, flags: u64, s: CUstream) {
        discard_batch(dptrs, sizes, count, flags, s, true)?;
        prefetch_batch(dptrs, sizes, count, locs, idxs, nlocs, flags, s, true)
    }

    /// The CUDA 8.0 form: the location is a device ordinal or CU_DEVICE_CPU (read only by the
    /// advice that takes one).
    fn cuMemAdvise(ptr: CUdeviceptr, count: usize, advice: c_int, dev: CUdevice) {
        advise(ptr, count, advice, || Loc::from_device(dev))
    }
    fn cuMemAdvise_v2(ptr: CUdeviceptr, count: usize, advice: c_int, loc: CUmemLocation) {
        advise(ptr, count, advice, || Loc::from_location(loc))
    }

    fn cuMemRangeGetAttribute(data: *mut c_void, size: usize, attribute: c_int, ptr: CUdeviceptr, count: usize) {
        range_attribute(data, size, attribute, ptr, count)
    }
    /// Each attribute as cuMemRangeGetAttribute answers it; the first refusal is the answer.
    fn cuMemRangeGetAttributes(data: *mut *mut c_void, sizes: *mut usize, attributes: *mut c_int, n: usize, ptr: CUdeviceptr, count: usize) {
        drv()?;
        if n == 0 {
            return Err(err::INVALID_VALUE);
        }
        for i in 0..n {
            let d: *mut c_void = read(data.wrapping_add(i) as *const *mut c_void)?;
            let sz: usize = read(sizes.wrapping_add(i) as *const usize)?;
            let a: c_int = read(attributes.wrapping_add(i) as *const c_int)?;
            range_attribute(d, sz, a, ptr, count)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_runs_split_on_change_and_join_when_they_agree_again() {
        let mut a = Managed::new(16 * PAGE, 16 * PAGE - 100, CU_MEM_ATTACH_GLOBAL);
        a.update(4 * PAGE, 8 * PAGE, |_, p| p.read_mostly = true);
        assert_eq!(a.runs.len(), 3);
        let runs = a.runs_in(2 * PAGE, 6 * PAGE);
        assert_eq!(runs.len(), 2);
        assert_eq!((runs[0].0, runs[0].1.read_mostly), (2 * PAGE, false));
        assert_eq!((runs[1].0, runs[1].1.read_mostly), (2 * PAGE, true));
        assert_eq!(common(&runs, |p| p.read_mostly), None);
        assert_eq!(
            common(&a.runs_in(5 * PAGE, 7 * PAGE), |p| p.read_mostly),
            Some(true)
        );
        a.update(4 * PAGE, 8 * PAGE, |_, p| p.read_mostly = false);
        assert_eq!(a.runs.len(), 1, "equal neighbours join again");
        assert_eq!(a.runs.get(&0).map(|r| r.0), Some(16 * PAGE));
    }

    #[test]
    fn a_range_is_rounded_out_to_pages_inside_one_allocation() {
        let mut m = BTreeMap::new();
        m.insert(
            0x10_0000u64,
            Managed::new(16 * PAGE, 16 * PAGE, CU_MEM_ATTACH_GLOBAL),
        );
        assert_eq!(range_of(&m, 0x10_0000 + 100, 10), Ok((0x10_0000, 0, PAGE)));
        assert_eq!(
            range_of(&m, 0x10_0000 + PAGE - 1, 2),
            Ok((0x10_0000, 0, 2 * PAGE))
        );
        assert_eq!(range_of(&m, 0x10_0000, 0), Err(err::INVALID_VALUE));
        assert_eq!(
            range_of(&m, 0x10_0000, 17 * PAGE as usize),
            Err(err::INVALID_VALUE)
        );
        assert_eq!(range_of(&m, 0x0f_0000, 1), Err(err::INVALID_VALUE));
    }
}
