//! Function attributes and occupancy: what `cuFuncGetAttribute` / `cuKernelGetAttribute` answer
//! for a kernel (its registers, shared, local and constant memory, read from the cubin its module
//! holds for the GPU: `cuvisor_image::resources`), what `cuFuncSetAttribute` may change, and the
//! occupancy calculator, computed from those resources and the GPU's per-SM limits
//! (`model::arch`) as the toolkit's `cuda_occupancy.h` (CUDA 13.5) computes it:
//! `cudaOccMaxActiveBlocksPerMultiprocessor` is the least of the warp, register, shared-memory,
//! block and (sm_90) barrier limits; `cudaOccMaxPotentialOccupancyBlockSize` walks block sizes
//! down from the largest in warp steps; `cudaOccAvailableDynamicSMemPerBlock` divides the SM's
//! shared memory among the blocks. The `cudaOcc*` function each step follows is named there.
//!
//! Where the module has no cubin for the GPU (PTX the real driver would JIT-compile, a fat binary
//! without a matching entry, bytes this reader cannot read), the simulator cannot know what the
//! compiler would allocate, and answers [`DEFAULT`]: 32 registers, no shared, local or constant
//! memory, no `__launch_bounds__`. 32 registers is what the simulator answered for every kernel
//! before it read images, and the most at which a block of 1024 threads and a full SM of threads
//! (2048 on sm_70/80/90) still fit the register file (32 x 2048 = 65536): the defaults never make
//! occupancy lower than the thread limits make it, so no program is refused a launch size the
//! real GPU could run for want of knowledge.

use crate::exec::{function_or_kernel, sm_of, FuncState, Function};
use crate::{ctx, device::device, drv, export, read, write, Res};
use cuvisor_cuda_abi::cuda::{err, CUdevice, CUfunction, CUlaunchConfig, CUresult};
use cuvisor_image::resources::Resources;
use cuvisor_sim::model::{arch, Arch, Device};
use std::ffi::{c_uint, c_void};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// The resources assumed where the image has no cubin for the GPU (see the module doc).
pub const DEFAULT: Resources = Resources {
    regs: 32,
    shared: 0,
    local: 0,
    constant: 0,
    max_threads: None,
    barriers: 0,
    arch: 0,
};

/// A function on one GPU: its resources there and the GPU.
struct On<'a> {
    r: Resources,
    d: &'static Device,
    x: Arch,
    st: &'a FuncState,
}

/// Register allocation: `cudaOccRegAllocationGranularity` (256 per warp) and
/// `cudaOccSubPartitionsPerMultiprocessor` (4 on sm_70 and later).
const REG_GRANULARITY: u32 = 256;
const SUB_PARTITIONS: u32 = 4;
/// The per-block shared memory without opt-in (`sharedMemPerBlock`, 48 KiB).
const SHARED_PER_BLOCK: u32 = 48 * 1024;
/// CUDA 13.5 `CUfunction_attribute` values.
mod fa {
    pub const MAX_THREADS_PER_BLOCK: i32 = 0;
    pub const SHARED_SIZE_BYTES: i32 = 1;
    pub const CONST_SIZE_BYTES: i32 = 2;
    pub const LOCAL_SIZE_BYTES: i32 = 3;
    pub const NUM_REGS: i32 = 4;
    pub const PTX_VERSION: i32 = 5;
    pub const BINARY_VERSION: i32 = 6;
    pub const CACHE_MODE_CA: i32 = 7;
    pub const MAX_DYNAMIC_SHARED_SIZE_BYTES: i32 = 8;
    pub const PREFERRED_SHARED_MEMORY_CARVEOUT: i32 = 9;
    pub const CLUSTER_SIZE_MUST_BE_SET: i32 = 10;
    pub const REQUIRED_CLUSTER_WIDTH: i32 = 11;
    pub const REQUIRED_CLUSTER_DEPTH: i32 = 13;
    pub const NON_PORTABLE_CLUSTER_SIZE_ALLOWED: i32 = 14;
    pub const CLUSTER_SCHEDULING_POLICY_PREFERENCE: i32 = 15;
    pub const DEVICE_NODE_UPDATE_SUPPORTED: i32 = 16;
    pub const SHARED_MEMORY_MODE: i32 = 17;
}

impl On<'_> {
    fn of<'a>(f: &'a Function, dev: usize) -> Result<On<'a>, CUresult> {
        let (_, d) = device(dev as CUdevice)?;
        let sm = sm_of(d);
        let r = crate::exec::function_resources(f, sm).unwrap_or(Resources {
            arch: sm,
            ..DEFAULT
        });
        Ok(On {
            r,
            d,
            x: arch(d.cc),
            st: &f.state,
        })
    }

    fn regs_per_warp(&self) -> u32 {
        (self.r.regs * 32).next_multiple_of(REG_GRANULARITY)
    }

    /// The most threads a block may have: the device's 1024, the kernel's launch bounds, and what
    /// the register file holds (`cudaOccMaxBlocksPerSMRegsLimit`'s hardware check: a block's
    /// warps rounded up to the sub-partitions, times each warp's registers, within the 64 K
    /// registers a block may use).
    fn max_threads(&self) -> u32 {
        let mut t = 1024u32.min(self.r.max_threads.unwrap_or(1024));
        let rpw = self.regs_per_warp();
        if rpw > 0 {
            let warps = (65536 / (rpw * SUB_PARTITIONS)) * SUB_PARTITIONS;
            t = t.min(warps * 32);
        }
        t
    }

    fn max_dynamic_shared(&self) -> u32 {
        match self.st.max_dynamic_shared.load(Relaxed) {
            v if v >= 0 => v as u32,
            _ => SHARED_PER_BLOCK.saturating_sub(self.r.shared),
        }
    }

    /// Whether the function opted in beyond the 48 KiB default (`FUNC_SHMEM_LIMIT_OPTIN`).
    fn opted_in(&self) -> bool {
        self.st.max_dynamic_shared.load(Relaxed) >= 0
    }

    /// `cudaOccSMemPerBlock`: what one block may take, the driver's reserve included.
    fn shared_limit_per_block(&self, smem_per_cta: u64) -> u64 {
        let base = if self.opted_in() && smem_per_cta > SHARED_PER_BLOCK as u64 {
            self.x.shared_optin_per_block
        } else {
            SHARED_PER_BLOCK
        };
        base as u64 + self.x.reserved_shared_per_block as u64
    }

    /// `cudaOccAlignUpShmemSizeVoltaPlus`: the smallest carveout step holding `bytes`.
    fn align_up_carveout(&self, bytes: u64) -> Option<u64> {
        self.x
            .carveouts_kib
            .iter()
            .map(|&k| k as u64 * 1024)
            .find(|&c| c >= bytes)
    }

    /// `cudaOccSMemPreferenceVoltaPlus`: the SM's shared memory under the carveout preference
    /// (the function's, else its cache configuration's: PREFER_SHARED 100 %, PREFER_L1 0 %,
    /// PREFER_EQUAL 50 %).
    fn preferred_shared_per_sm(&self) -> u64 {
        let mut pref = self.st.carveout.load(Relaxed);
        if pref < 0 {
            pref = match self.st.cache_config.load(Relaxed) {
                1 => 100,
                2 => 0,
                3 => 50,
                _ => -1,
            };
        }
        let bytes = if pref < 0 {
            self.x.shared_per_sm as u64
        } else {
            pref as u64 * self.x.shared_per_sm as u64 / 100
        };
        self.align_up_carveout(bytes)
            .unwrap_or(self.x.shared_per_sm as u64)
    }

    /// `cudaOccMaxActiveBlocksPerMultiprocessor`.
    fn active_blocks(&self, block: u32, dynamic: u64) -> u32 {
        if block == 0 || block > self.max_threads() {
            return 0;
        }
        let warps = block.div_ceil(32);
        // Warps (cudaOccMaxBlocksPerSMWarpsLimit).
        let by_warps = (self.x.max_threads_per_sm / 32) / warps;
        // Registers (cudaOccMaxBlocksPerSMRegsLimit).
        let rpw = self.regs_per_warp();
        let by_regs = if rpw == 0 {
            u32::MAX
        } else if rpw * warps.next_multiple_of(SUB_PARTITIONS) > 65536
            || rpw * warps > 65536
            || self.r.regs > 256
        {
            0
        } else {
            ((self.x.regs_per_sm / SUB_PARTITIONS) / rpw) * SUB_PARTITIONS / warps
        };
        // Shared memory (cudaOccMaxBlocksPerSMSmemLimit).
        let fixed = self.r.shared as u64 + self.x.reserved_shared_per_block as u64;
        let per_cta = (fixed + dynamic).next_multiple_of(self.x.shared_granularity as u64);
        let max_per_cta = fixed + self.max_dynamic_shared() as u64;
        let by_smem = if (self.opted_in() && dynamic > self.max_dynamic_shared() as u64)
            || per_cta > self.shared_limit_per_block(max_per_cta)
        {
            0
        } else {
            let pref = self.preferred_shared_per_sm();
            let sm = if pref >= per_cta {
                pref
            } else {
                self.align_up_carveout(per_cta)
                    .unwrap_or(self.x.shared_per_sm as u64)
            };
            // No shared memory at all: no limit from it.
            sm.checked_div(per_cta)
                .map_or(u32::MAX, |n| n.min(u32::MAX as u64) as u32)
        };
        let mut limit = by_warps
            .min(by_regs)
            .min(by_smem)
            .min(self.x.max_blocks_per_sm);
        // Barriers, sm_90 on (cudaOccMaxBlocksPerSMBlockBarrierLimit: two per block slot).
        if self.d.cc.0 >= 9 && self.r.barriers > 0 {
            limit = limit.min(self.x.max_blocks_per_sm * 2 / self.r.barriers);
        }
        limit
    }

    /// `cudaOccAvailableDynamicSMemPerBlock`; None where `blocks` blocks of `block` threads do
    /// not fit (CUDA_OCC_ERROR_INVALID_INPUT).
    fn available_dynamic(&self, blocks: u32, block: u32) -> Option<u64> {
        if blocks == 0 || self.active_blocks(block, 0) < blocks {
            return None;
        }
        let limit = self.shared_limit_per_block(self.x.shared_per_sm as u64);
        let sm = if blocks == 1 {
            limit
        } else {
            match self.preferred_shared_per_sm() {
                0 => self.align_up_carveout(1).unwrap_or(0),
                p => p,
            }
        };
        let mut avail = sm / blocks as u64;
        avail = avail / self.x.shared_granularity as u64 * self.x.shared_granularity as u64;
        avail = avail.min(limit);
        avail = avail.saturating_sub(self.r.shared as u64);
        avail = avail.saturating_sub(self.x.reserved_shared_per_block as u64);
        Some(avail.min(self.max_dynamic_shared() as u64))
    }

    /// `cudaOccMaxPotentialOccupancyBlockSize`: (min grid size, block size).
    fn potential_block_size(&self, smem: impl Fn(u32) -> u64, limit: u32) -> (u32, u32) {
        let mut cap = self.max_threads();
        if limit > 0 {
            cap = cap.min(limit);
        }
        let (mut best, mut blocks, mut most) = (0u32, 0u32, 0u32);
        let mut aligned = cap.next_multiple_of(32);
        while aligned > 0 {
            let b = cap.min(aligned);
            let n = self.active_blocks(b, smem(b));
            if b * n > most {
                (best, blocks, most) = (b, n, b * n);
            }
            if most == self.x.max_threads_per_sm {
                break;
            }
            aligned -= 32;
        }
        (blocks * self.d.sm_count, best)
    }

    fn get(&self, attrib: i32) -> Result<i32, CUresult> {
        Ok(match attrib {
            fa::MAX_THREADS_PER_BLOCK => self.max_threads() as i32,
            fa::SHARED_SIZE_BYTES => self.r.shared as i32,
            fa::CONST_SIZE_BYTES => self.r.constant as i32,
            fa::LOCAL_SIZE_BYTES => self.r.local as i32,
            fa::NUM_REGS => self.r.regs as i32,
            // The cubin's architecture for both: the fat binary's cubins come from PTX of the
            // same virtual architecture where nvcc's `-arch=sm_XX` built them.
            fa::PTX_VERSION | fa::BINARY_VERSION => self.r.arch as i32,
            fa::CACHE_MODE_CA => 0,
            fa::MAX_DYNAMIC_SHARED_SIZE_BYTES => self.max_dynamic_shared() as i32,
            fa::PREFERRED_SHARED_MEMORY_CARVEOUT => self.st.carveout.load(Relaxed),
            fa::CLUSTER_SIZE_MUST_BE_SET => 0,
            11..=13 => self.st.cluster[(attrib - 11) as usize].load(Relaxed),
            fa::NON_PORTABLE_CLUSTER_SIZE_ALLOWED => self.st.non_portable_cluster.load(Relaxed),
            fa::CLUSTER_SCHEDULING_POLICY_PREFERENCE => self.st.cluster_scheduling.load(Relaxed),
            fa::DEVICE_NODE_UPDATE_SUPPORTED => 0,
            fa::SHARED_MEMORY_MODE => self.st.shared_memory_mode.load(Relaxed),
            _ => return Err(err::INVALID_VALUE),
        })
    }

    /// cuFuncSetAttribute / cuKernelSetAttribute: the settable attributes (cuda.h 13.5 lists
    /// them); a read-only or unknown one is CUDA_ERROR_INVALID_VALUE, as is a value out of range
    /// ("The sum of this value and ::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES cannot exceed the
    /// device attribute ::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN").
    fn set(&self, attrib: i32, v: i32) -> Res {
        let st = self.st;
        match attrib {
            fa::MAX_DYNAMIC_SHARED_SIZE_BYTES => {
                if v < 0 || v as u64 + self.r.shared as u64 > self.x.shared_optin_per_block as u64 {
                    return Err(err::INVALID_VALUE);
                }
                st.max_dynamic_shared.store(v, Relaxed);
            }
            fa::PREFERRED_SHARED_MEMORY_CARVEOUT if (-1..=100).contains(&v) => {
                st.carveout.store(v, Relaxed)
            }
            fa::REQUIRED_CLUSTER_WIDTH..=fa::REQUIRED_CLUSTER_DEPTH if v >= 0 => {
                st.cluster[(attrib - 11) as usize].store(v, Relaxed)
            }
            fa::NON_PORTABLE_CLUSTER_SIZE_ALLOWED if v == 0 || v == 1 => {
                st.non_portable_cluster.store(v, Relaxed)
            }
            fa::CLUSTER_SCHEDULING_POLICY_PREFERENCE if (0..=2).contains(&v) => {
                st.cluster_scheduling.store(v, Relaxed)
            }
            fa::SHARED_MEMORY_MODE if (0..=2).contains(&v) => {
                st.shared_memory_mode.store(v, Relaxed)
            }
            _ => return Err(err::INVALID_VALUE),
        }
        Ok(())
    }
}

/// The function and the device of the calling thread's current context, which the occupancy
/// calls use (libcudart's lazy loading passes `CUkernel` handles here: lupinemachines/lupine
/// PR #749, which also reports a real driver answering 1 block for 60000 B of dynamic shared
/// memory once the function's limit was raised, as this model does on 100 KiB-per-SM GPUs) ("the context to use for calculations will be the current context", cuda.h on a
/// CUkernel passed as a CUfunction; a function's own context is the current one in the
/// simulator, whose modules belong to no context).
fn current_function(f: CUfunction) -> Result<(Arc<Function>, usize), CUresult> {
    drv()?;
    let func = function_or_kernel(f)?;
    let (_, c) = ctx::current()?;
    Ok((func, c.dev))
}

/// The device a function attribute is read for: the current context's, else the first.
fn attribute_device() -> usize {
    ctx::current().map(|(_, c)| c.dev).unwrap_or(0)
}

fn occupancy_flags(flags: c_uint) -> Res {
    // CU_OCCUPANCY_DEFAULT (0) or CU_OCCUPANCY_DISABLE_CACHING_OVERRIDE (1): the global-caching
    // override only matters on sm_52 and earlier (`cudaOccPartitionedGCExpected`), which the
    // simulator does not model.
    if flags > 1 {
        return Err(err::INVALID_VALUE);
    }
    Ok(())
}

fn max_active_blocks(
    blocks: *mut i32,
    f: CUfunction,
    block_size: i32,
    smem: usize,
    flags: c_uint,
) -> Res {
    occupancy_flags(flags)?;
    let (func, dev) = current_function(f)?;
    if blocks.is_null() || block_size <= 0 {
        return Err(err::INVALID_VALUE);
    }
    let on = On::of(&func, dev)?;
    write(
        blocks,
        on.active_blocks(block_size as u32, smem as u64) as i32,
    )
}

type B2DSize = Option<extern "C" fn(i32) -> usize>;

fn potential_block_size(
    grid: *mut i32,
    block: *mut i32,
    f: CUfunction,
    b2d: B2DSize,
    smem: usize,
    limit: i32,
    flags: c_uint,
) -> Res {
    occupancy_flags(flags)?;
    let (func, dev) = current_function(f)?;
    if grid.is_null() || block.is_null() || limit < 0 {
        return Err(err::INVALID_VALUE);
    }
    let on = On::of(&func, dev)?;
    let (g, b) = on.potential_block_size(
        |b| match b2d {
            Some(cb) => cb(b as i32) as u64,
            None => smem as u64,
        },
        limit as u32,
    );
    write(grid, g as i32)?;
    write(block, b as i32)
}

/// The cluster queries need thread block clusters: sm_90 and later (CU_DEVICE_ATTRIBUTE_
/// CLUSTER_LAUNCH). Before, CUDA_ERROR_INVALID_VALUE, one of the codes cuda.h documents for them
/// (UNVERIFIED which one a real driver answers there). The portable cluster size is 8 blocks, 16
/// with NON_PORTABLE_CLUSTER_SIZE_ALLOWED on sm_90 (CUDA C++ Programming Guide, "Thread Block
/// Clusters"); the GPC layout that bounds a cluster on real GPUs is not modelled, so a cluster
/// may take blocks of any SMs.
fn cluster_query(
    f: CUfunction,
    config: *const CUlaunchConfig,
) -> Result<(Arc<Function>, usize, CUlaunchConfig), CUresult> {
    let (func, dev) = current_function(f)?;
    let cfg = read(config)?;
    let (_, d) = device(dev as CUdevice)?;
    if d.cc.0 < 9 {
        return Err(err::INVALID_VALUE);
    }
    Ok((func, dev, cfg))
}

fn block_of(cfg: &CUlaunchConfig) -> u32 {
    cfg.blockDimX
        .saturating_mul(cfg.blockDimY)
        .saturating_mul(cfg.blockDimZ)
}

export! {
    fn cuFuncGetAttribute(value: *mut i32, attrib: i32, f: CUfunction) {
        drv()?;
        let func = crate::exec::function(f)?;
        let v = On::of(&func, attribute_device())?.get(attrib)?;
        write(value, v)
    }
    fn cuFuncSetAttribute(f: CUfunction, attrib: i32, value: i32) {
        drv()?;
        let func = crate::exec::function(f)?;
        On::of(&func, attribute_device())?.set(attrib, value)
    }
    /// CU_FUNC_CACHE_PREFER_NONE/SHARED/L1/EQUAL (0..3); it steers the carveout where none is set.
    fn cuFuncSetCacheConfig(f: CUfunction, config: i32) {
        drv()?;
        let func = crate::exec::function(f)?;
        if !(0..=3).contains(&config) {
            return Err(err::INVALID_VALUE);
        }
        func.state.cache_config.store(config, Relaxed);
        Ok(())
    }
    /// cuKernelGetAttribute (CUDA 12.0): a library kernel's attribute on device `dev`.
    fn cuKernelGetAttribute(value: *mut i32, attrib: i32, kernel: *mut c_void, dev: CUdevice) {
        drv()?;
        let func = crate::exec::kernel_function(kernel)?;
        let (i, _) = device(dev)?;
        let v = On::of(&func, i)?.get(attrib)?;
        write(value, v)
    }
    /// cuKernelSetAttribute: as cuFuncSetAttribute, checked against device `dev` (the setting is
    /// kept per kernel, not per device).
    fn cuKernelSetAttribute(attrib: i32, value: i32, kernel: *mut c_void, dev: CUdevice) {
        drv()?;
        let func = crate::exec::kernel_function(kernel)?;
        let (i, _) = device(dev)?;
        On::of(&func, i)?.set(attrib, value)
    }

    fn cuOccupancyMaxActiveBlocksPerMultiprocessor(blocks: *mut i32, f: CUfunction, block_size: i32, smem: usize) {
        max_active_blocks(blocks, f, block_size, smem, 0)
    }
    fn cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(blocks: *mut i32, f: CUfunction, block_size: i32, smem: usize, flags: c_uint) {
        max_active_blocks(blocks, f, block_size, smem, flags)
    }
    fn cuOccupancyMaxPotentialBlockSize(grid: *mut i32, block: *mut i32, f: CUfunction, b2d: B2DSize, smem: usize, limit: i32) {
        potential_block_size(grid, block, f, b2d, smem, limit, 0)
    }
    fn cuOccupancyMaxPotentialBlockSizeWithFlags(grid: *mut i32, block: *mut i32, f: CUfunction, b2d: B2DSize, smem: usize, limit: i32, flags: c_uint) {
        potential_block_size(grid, block, f, b2d, smem, limit, flags)
    }
    /// CUDA_ERROR_INVALID_VALUE where `blocks` blocks of `block_size` threads cannot be resident
    /// at once (`cudaOccAvailableDynamicSMemPerBlock`'s CUDA_OCC_ERROR_INVALID_INPUT).
    fn cuOccupancyAvailableDynamicSMemPerBlock(size: *mut usize, f: CUfunction, blocks: i32, block_size: i32) {
        let (func, dev) = current_function(f)?;
        if size.is_null() || blocks <= 0 || block_size <= 0 {
            return Err(err::INVALID_VALUE);
        }
        let v = On::of(&func, dev)?
            .available_dynamic(blocks as u32, block_size as u32)
            .ok_or(err::INVALID_VALUE)?;
        write(size, v as usize)
    }
    fn cuOccupancyMaxPotentialClusterSize(size: *mut i32, f: CUfunction, config: *const CUlaunchConfig) {
        let (func, dev, cfg) = cluster_query(f, config)?;
        let on = On::of(&func, dev)?;
        let max = if func.state.non_portable_cluster.load(Relaxed) == 1 { 16 } else { 8 };
        let (block, smem) = (block_of(&cfg), cfg.sharedMemBytes as u64);
        let required: Vec<i32> = func.state.cluster.iter().map(|c| c.load(Relaxed)).collect();
        let v = if required.iter().all(|&c| c > 0) {
            required.iter().product::<i32>() as u32
        } else {
            let per_sm = on.active_blocks(block, smem);
            max.min(per_sm.saturating_mul(on.d.sm_count))
        };
        write(size, v as i32)
    }
    /// How many clusters of the configuration's cluster dimension can be resident at once: every
    /// SM's resident blocks, in clusters.
    fn cuOccupancyMaxActiveClusters(n: *mut i32, f: CUfunction, config: *const CUlaunchConfig) {
        let (func, dev, cfg) = cluster_query(f, config)?;
        let on = On::of(&func, dev)?;
        let (block, smem) = (block_of(&cfg), cfg.sharedMemBytes as u64);
        let mut dims = [1u32; 3];
        if cfg.numAttrs > 0 && cfg.attrs.is_null() {
            return Err(err::INVALID_VALUE);
        }
        for k in 0..cfg.numAttrs as usize {
            // SAFETY: `attrs` holds `numAttrs` launch attributes by the API contract.
            let a = unsafe { cfg.attrs.add(k).read_unaligned() };
            // CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION (4): x, y, z, three u32 at the value's start.
            if a.id == 4 {
                dims = [a.value[0] as u32, (a.value[0] >> 32) as u32, a.value[1] as u32];
            }
        }
        let fixed: Vec<i32> = func.state.cluster.iter().map(|c| c.load(Relaxed)).collect();
        if fixed.iter().all(|&c| c > 0) {
            dims = [fixed[0] as u32, fixed[1] as u32, fixed[2] as u32];
        }
        let cluster = dims.iter().map(|&d| d.max(1)).product::<u32>();
        let total = on.active_blocks(block, smem).saturating_mul(on.d.sm_count);
        write(n, (total / cluster) as i32)
    }
}
