//! Devices: the device queries (ordinal, name, UUID, PCI ids, memory), the full
//! `CUdevice_attribute` table of CUDA 13.5's `cuda.h` for every modelled GPU, and the peer
//! queries (cuDeviceCanAccessPeer, cuDeviceGetP2PAttribute, atomic capabilities), answered from
//! the machine model (`cuvisor_sim::model`: each board's published figures in `Specs`, each
//! architecture's limits in `arch`, the NVLink/PCIe topology). A leaf: it needs only the driver
//! instance.

use crate::{cstr, drv, export, write, write_cstr, Res};
use cuvisor_cuda_abi::cuda::{err, CUdevice, CUresult, CUuuid};
use cuvisor_fabric::{End, Fabric, RouteKind};
use cuvisor_sim::model::{arch, Device, Model};
use std::ffi::{c_char, c_uint};

/// The device behind an ordinal, after cuInit.
pub(crate) fn device(dev: CUdevice) -> Result<(usize, &'static Device), CUresult> {
    let d = drv()?;
    let i = usize::try_from(dev).map_err(|_| err::INVALID_DEVICE)?;
    d.sim
        .model
        .devices
        .get(i)
        .map(|x| (i, x))
        .ok_or(err::INVALID_DEVICE)
}

/// The value of attribute `a` (a `CUdevice_attribute`) on device `i`; None for a number
/// `cuda.h` 13.5 does not define (the driver's CUDA_ERROR_INVALID_VALUE).
///
/// Sources, by group (each value that is not one of these is commented where it is set):
/// - [G] CUDA C++ Programming Guide, "Features and Technical Specifications", table "Technical
///   Specifications per Compute Capability" (7.0 to 9.0 share every texture, surface, grid and
///   block limit below); the per-SM figures come from `model::arch` (same table, and
///   `cuda_occupancy.h`).
/// - [Q] cross-checks with deviceQuery outputs: a Tesla T4 (sm_75) page,
///   <https://chiemon.github.io/2024/12/25/%E6%98%BE%E5%8D%A1%E4%BF%A1%E6%81%AF.html> (textures
///   1D 131072, 2D 131072x65536, 3D 16384^3, layered 1D 32768x2048 and 2D 32768x32768x2048,
///   constant 65536, registers per block 65536), and an A10 (aalanwyr/face2cuda,
///   `step2cuda/README.md`: the same limits, grid 2147483647 x 65535 x 65535, pitch 2147483647).
/// - [B] the board's figures, `model::Specs` (whitepapers and datasheets, cited there).
/// - [L] what the driver reports on a bare-metal x86-64 Linux host with the R580 driver and no
///   HMM, MPS, NVSwitch multicast or Windows-only feature: the attribute's doc comment in
///   `cuda.h` 13.5 says what it depends on.
pub(crate) fn attribute(m: &Model, i: usize, a: i32) -> Option<i32> {
    let d = &m.devices[i];
    let s = &d.specs;
    let x = arch(d.cc);
    let cc = d.cc.0 * 10 + d.cc.1;
    let ampere = (cc >= 80) as i32;
    let hopper = (cc >= 90) as i32;
    Some(match a {
        1 => 1024,                             // MAX_THREADS_PER_BLOCK [G]
        2 | 3 => 1024,                         // MAX_BLOCK_DIM_X/Y [G]
        4 => 64,                               // MAX_BLOCK_DIM_Z [G]
        5 => i32::MAX,                         // MAX_GRID_DIM_X: 2^31 - 1 [G][Q]
        6 | 7 => 65535,                        // MAX_GRID_DIM_Y/Z [G][Q]
        8 => 49152,     // MAX_SHARED_MEMORY_PER_BLOCK: 48 KiB without opt-in [G]
        9 => 65536,     // TOTAL_CONSTANT_MEMORY [G][Q]
        10 => 32,       // WARP_SIZE
        11 => i32::MAX, // MAX_PITCH [Q]
        12 => 65536,    // MAX_REGISTERS_PER_BLOCK [G][Q]
        13 => s.clock_khz as i32, // CLOCK_RATE [B]
        14 => 512,      // TEXTURE_ALIGNMENT (cudaDeviceProp::textureAlignment)
        15 => 1,        // GPU_OVERLAP
        16 => d.sm_count as i32, // MULTIPROCESSOR_COUNT
        17 => 0,        // KERNEL_EXEC_TIMEOUT: no display watchdog [L]
        18 => 0,        // INTEGRATED
        19 => 1,        // CAN_MAP_HOST_MEMORY
        20 => 0,        // COMPUTE_MODE: CU_COMPUTEMODE_DEFAULT
        21 => 131072,   // MAXIMUM_TEXTURE1D_WIDTH [G][Q]
        22 => 131072,   // MAXIMUM_TEXTURE2D_WIDTH [G][Q]
        23 => 65536,    // MAXIMUM_TEXTURE2D_HEIGHT [G][Q]
        24..=26 => 16384, // MAXIMUM_TEXTURE3D_WIDTH/HEIGHT/DEPTH [G][Q]
        27 | 28 => 32768, // MAXIMUM_TEXTURE2D_LAYERED_WIDTH/HEIGHT [G][Q]
        29 => 2048,     // MAXIMUM_TEXTURE2D_LAYERED_LAYERS [G][Q]
        30 => 512,      // SURFACE_ALIGNMENT
        31 => 1,        // CONCURRENT_KERNELS
        32 => 1,        // ECC_ENABLED: on by default on these boards
        33 => d.pci_bus as i32, // PCI_BUS_ID
        34 => d.pci_device as i32, // PCI_DEVICE_ID (the device number of the bus address)
        35 => 0,        // TCC_DRIVER: Windows only [L]
        36 => s.memory_clock_khz as i32, // MEMORY_CLOCK_RATE [B]
        37 => s.memory_bus_width as i32, // GLOBAL_MEMORY_BUS_WIDTH [B]
        38 => s.l2_cache as i32, // L2_CACHE_SIZE [B]
        39 => x.max_threads_per_sm as i32, // MAX_THREADS_PER_MULTIPROCESSOR [G]
        40 => s.async_engines as i32, // ASYNC_ENGINE_COUNT [B]
        41 => 1,        // UNIFIED_ADDRESSING: 64-bit Linux
        42 => 32768,    // MAXIMUM_TEXTURE1D_LAYERED_WIDTH [G][Q]
        43 => 2048,     // MAXIMUM_TEXTURE1D_LAYERED_LAYERS [G][Q]
        44 => 1,        // CAN_TEX2D_GATHER (deprecated; every sm_20+ GPU)
        45 | 46 => 32768, // MAXIMUM_TEXTURE2D_GATHER_WIDTH/HEIGHT [G]
        47 | 48 => 8192, // MAXIMUM_TEXTURE3D_WIDTH/HEIGHT_ALTERNATE [G]
        49 => 32768,    // MAXIMUM_TEXTURE3D_DEPTH_ALTERNATE [G]
        50 => d.pci_domain as i32, // PCI_DOMAIN_ID
        51 => 32,       // TEXTURE_PITCH_ALIGNMENT
        52 => 32768,    // MAXIMUM_TEXTURECUBEMAP_WIDTH [G]
        53 => 32768,    // MAXIMUM_TEXTURECUBEMAP_LAYERED_WIDTH [G]
        54 => 2046,     // MAXIMUM_TEXTURECUBEMAP_LAYERED_LAYERS [G]
        55 => 32768,    // MAXIMUM_SURFACE1D_WIDTH [G]
        56 => 131072,   // MAXIMUM_SURFACE2D_WIDTH [G]
        57 => 65536,    // MAXIMUM_SURFACE2D_HEIGHT [G]
        58..=60 => 16384, // MAXIMUM_SURFACE3D_WIDTH/HEIGHT/DEPTH [G]
        61 => 32768,    // MAXIMUM_SURFACE1D_LAYERED_WIDTH [G]
        62 => 2048,     // MAXIMUM_SURFACE1D_LAYERED_LAYERS [G]
        63 | 64 => 32768, // MAXIMUM_SURFACE2D_LAYERED_WIDTH/HEIGHT [G]
        65 => 2048,     // MAXIMUM_SURFACE2D_LAYERED_LAYERS [G]
        66 | 67 => 32768, // MAXIMUM_SURFACECUBEMAP(_LAYERED)_WIDTH [G]
        68 => 2046,     // MAXIMUM_SURFACECUBEMAP_LAYERED_LAYERS [G]
        69 => TEXTURE1D_LINEAR_MAX, // MAXIMUM_TEXTURE1D_LINEAR_WIDTH (deprecated) [G]
        70 => 131072,   // MAXIMUM_TEXTURE2D_LINEAR_WIDTH [G]
        71 => 65000,    // MAXIMUM_TEXTURE2D_LINEAR_HEIGHT [G]
        72 => 2_097_120, // MAXIMUM_TEXTURE2D_LINEAR_PITCH: 2^21 - 32 bytes [G]
        73 | 74 => 32768, // MAXIMUM_TEXTURE2D_MIPMAPPED_WIDTH/HEIGHT [G]
        75 => d.cc.0 as i32, // COMPUTE_CAPABILITY_MAJOR
        76 => d.cc.1 as i32, // COMPUTE_CAPABILITY_MINOR
        77 => 32768,    // MAXIMUM_TEXTURE1D_MIPMAPPED_WIDTH [G]
        78 => 1,        // STREAM_PRIORITIES_SUPPORTED (cuCtxGetStreamPriorityRange: 0..-5)
        79 | 80 => 1,   // GLOBAL/LOCAL_L1_CACHE_SUPPORTED
        81 => x.shared_per_sm as i32, // MAX_SHARED_MEMORY_PER_MULTIPROCESSOR [G]
        82 => x.regs_per_sm as i32, // MAX_REGISTERS_PER_MULTIPROCESSOR [G]
        83 => 1,        // MANAGED_MEMORY
        84 => 0,        // MULTI_GPU_BOARD: one GPU per board
        85 => i as i32, // MULTI_GPU_BOARD_GROUP_ID: unique per board
        86 => 0,        // HOST_NATIVE_ATOMIC_SUPPORTED: PCIe to an x86 host [L]
        87 => s.single_to_double_ratio as i32, // SINGLE_TO_DOUBLE_PRECISION_PERF_RATIO [B]
        88 => 0,        // PAGEABLE_MEMORY_ACCESS: no HMM/ATS [L]
        89 => 1,        // CONCURRENT_MANAGED_ACCESS: Linux, sm_60+ [L]
        90 => 1,        // COMPUTE_PREEMPTION_SUPPORTED: sm_60+
        91 => 1,        // CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM (Linux) [L]
        92..=94 => 0,   // *_V1 stream memops: the v1 API is gone (CUDA 12)
        95 => 1,        // COOPERATIVE_LAUNCH
        96 => 1,        // COOPERATIVE_MULTI_DEVICE_LAUNCH (deprecated)
        97 => x.shared_optin_per_block as i32, // MAX_SHARED_MEMORY_PER_BLOCK_OPTIN [G]
        98 => 0,        // CAN_FLUSH_REMOTE_WRITES: not on x86 [L]
        99 => 1,        // HOST_REGISTER_SUPPORTED
        100 => 0,       // PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES: no ATS [L]
        101 => 0,       // DIRECT_MANAGED_MEM_ACCESS_FROM_HOST: no coherent link [L]
        102 => 1,       // VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
        103 => 1,       // HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED (Linux) [L]
        104 | 105 => 0, // HANDLE_TYPE_WIN32(_KMT)_HANDLE_SUPPORTED: Windows only
        106 => x.max_blocks_per_sm as i32, // MAX_BLOCKS_PER_MULTIPROCESSOR [G]
        // GENERIC_COMPRESSION_SUPPORTED: Ampere's compute data compression (A100 whitepaper,
        // "Compute Data Compression"); UNVERIFIED for GA10x, answered as GA100.
        107 => ampere,
        // MAX_PERSISTING_L2_CACHE_SIZE and MAX_ACCESS_POLICY_WINDOW_SIZE: L2 residency control
        // is sm_80+ ([G], "L2 Cache Set-Aside for Persisting Accesses"; a probe's notes found by
        // this project's code search report 0 for both on a TU104, sm_75). The set-aside
        // maximum here is 75 % of the L2, as that guide section's example sizes it
        // (`prop.l2CacheSize * 0.75`); UNVERIFIED for A100/A10: the same probe notes report
        // 37.5 MiB of an H200's L2 and a 128 MiB window there. The window: 128 MiB less 4 KiB
        // (UNVERIFIED: as recalled from cudaDeviceProp dumps).
        108 => ampere * (s.l2_cache as i32 / 4 * 3),
        109 => ampere * 134_213_632,
        110 => 1, // GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED (Linux) [L]
        111 => x.reserved_shared_per_block as i32, // RESERVED_SHARED_MEMORY_PER_BLOCK [G]
        112 => 1, // SPARSE_CUDA_ARRAY_SUPPORTED (Linux) [L]
        113 => 1, // READ_ONLY_HOST_REGISTER_SUPPORTED (Linux) [L]
        114 => 1, // TIMELINE_SEMAPHORE_INTEROP_SUPPORTED (Linux) [L]
        115 => 1, // MEMORY_POOLS_SUPPORTED
        116 => 1, // GPU_DIRECT_RDMA_SUPPORTED (Linux, data-center GPUs) [L]
        117 => 1, // GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS: _OPTION_HOST
        // GPU_DIRECT_RDMA_WRITES_ORDERING: CU_GPU_DIRECT_RDMA_WRITES_ORDERING_OWNER (100) from
        // Ampere on, NONE (0) before (UNVERIFIED).
        118 => ampere * 100,
        119 => 1,      // MEMPOOL_SUPPORTED_HANDLE_TYPES: POSIX fd (0x1) [L]
        120 => hopper, // CLUSTER_LAUNCH: thread block clusters are sm_90+ [G]
        121 => 1,      // DEFERRED_MAPPING_CUDA_ARRAY_SUPPORTED [L]
        122 => 1,      // CAN_USE_64_BIT_STREAM_MEM_OPS (CUDA 12+) [L]
        123 => 1,      // CAN_USE_STREAM_WAIT_VALUE_NOR (CUDA 12+) [L]
        124 => 0,      // DMA_BUF_SUPPORTED: needs the open kernel modules [L]
        125 => 1,      // IPC_EVENT_SUPPORTED (Linux) [L]
        // MEM_SYNC_DOMAIN_COUNT: 4 on Hopper, 1 before ([G], "Memory Synchronization Domains").
        126 => 1 + 3 * hopper,
        127 => hopper,                    // TENSOR_MAP_ACCESS_SUPPORTED: TMA is sm_90+
        128 => 0,  // HANDLE_TYPE_FABRIC_SUPPORTED: no NVLink fabric (IMEX) [L]
        129 => 0,  // UNIFIED_FUNCTION_POINTERS (UNVERIFIED)
        130 => 0,  // NUMA_CONFIG: CU_DEVICE_NUMA_CONFIG_NONE (no GPU NUMA node)
        131 => -1, // NUMA_ID: none, as NUMA_CONFIG says
        132 => 0,  // MULTICAST_SUPPORTED: needs NVSwitch + sm_90 [L]
        133 => 0,  // MPS_ENABLED: no MPS server [L]
        134 => d.numa_node as i32, // HOST_NUMA_ID: the host node nearest the GPU
        135 => 0,  // D3D12_CIG_SUPPORTED: Windows only
        136 | 137 => 0, // MEM_DECOMPRESS_*: Blackwell's decompression engine
        138 => 0,  // VULKAN_CIG_SUPPORTED
        139 => d.pci_device_id as i32, // GPU_PCI_DEVICE_ID: device << 16 | vendor
        140 => s.pci_subsystem_id as i32, // GPU_PCI_SUBSYSTEM_ID [B]
        141 => 1,  // HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED [L]
        142 => 1,  // HOST_NUMA_MEMORY_POOLS_SUPPORTED [L]
        143 => 0,  // HOST_NUMA_MULTINODE_IPC_SUPPORTED: single node
        144 | 145 => 1, // HOST_MEMORY_POOLS / HOST_VIRTUAL_MEMORY_MANAGEMENT [L]
        146 => 0,  // HOST_ALLOC_DMA_BUF_SUPPORTED (as 124)
        147 => 0,  // ONLY_PARTIAL_HOST_NATIVE_ATOMIC_SUPPORTED (as 86)
        148 => 0,  // ATOMIC_REDUCTION_SUPPORTED (stream batch memops)
        149 => 1,  // LOCALITY_DOMAIN_COUNT: the whole GPU is one
        150 => 0,  // MAX_OVERSIZED_SHARED_MEMORY_PER_BLOCK
        151 => 0,  // D3D12_CIG_STREAMS_SUPPORTED
        152 => 0,  // DMA_BUF_MMAP_SUPPORTED (as 124)
        153..=156 => 0, // LOGICAL_ENDPOINT_*: not on these GPUs
        157 => d.sm_count as i32, // LOCALITY_DOMAIN_MULTIPROCESSOR_COUNT: the one domain's
        158 => 0,  // LOGICAL_ENDPOINT_SUPPORTED_HANDLE_TYPES
        159 => 0,  // VULKAN_CIG_STREAMS_SUPPORTED
        160 => 0,  // TENSOR_MAP_LARGE_TENSOR_MIN_SIZE: no large class
        161 => 0,  // GPU_DIRECT_RDMA_WITH_LOCALIZED_MEMORY_SUPPORTED
        _ => return None,
    })
}

/// `CUdevprop` (cuda.h 13.5, "Legacy device properties"): ten ints.
#[repr(C)]
pub struct CUdevprop {
    pub max_threads_per_block: i32,
    pub max_threads_dim: [i32; 3],
    pub max_grid_size: [i32; 3],
    pub shared_mem_per_block: i32,
    pub total_constant_memory: i32,
    pub simd_width: i32,
    pub mem_pitch: i32,
    pub regs_per_block: i32,
    pub clock_rate: i32,
    pub texture_align: i32,
}

/// Largest 1D texture on linear memory, in elements: 2^28 ([G], "Maximum width for a 1D texture
/// reference bound to linear memory" for 7.0 to 9.0).
pub const TEXTURE1D_LINEAR_MAX: i32 = 1 << 28;

/// Whether two distinct GPUs can map each other's memory: `Fabric::p2p_supported` (NVLink,
/// direct or through NVSwitch, or PCIe under one root complex, PIX/PXB), as the real driver
/// allows P2P.
/// The one model every peer answer here comes from (and NVML's `nvmlDeviceGetP2PStatus`, see
/// crates/sim/nvml `topology::p2p`): the `Sim`'s fabric.
pub(crate) fn peer_access(f: &Fabric, a: usize, b: usize) -> bool {
    f.p2p_supported(a, b)
}

/// What carries peer traffic between two GPUs once access is enabled: the kind of
/// `Fabric::route(a, b, peer_enabled = true)`; `Staged` where there is no peer path.
pub(crate) fn peer_link(f: &Fabric, a: usize, b: usize) -> RouteKind {
    f.route(End::Gpu(a), End::Gpu(b), true).kind
}

/// NVLink carries the peer traffic (directly or through NVSwitches): where native peer atomics
/// and CUDA-array access are offered.
fn over_nvlink(kind: RouteKind) -> bool {
    matches!(kind, RouteKind::NvLink | RouteKind::NvSwitch)
}

/// `CUdevice_P2PAttribute` (cuda.h 13.5).
const P2P_PERFORMANCE_RANK: i32 = 1;
const P2P_ACCESS_SUPPORTED: i32 = 2;
const P2P_NATIVE_ATOMIC_SUPPORTED: i32 = 3;
const P2P_CUDA_ARRAY_ACCESS_SUPPORTED: i32 = 4;
const P2P_ONLY_PARTIAL_NATIVE_ATOMIC_SUPPORTED: i32 = 5;

/// `CU_ATOMIC_OPERATION_MAX` (cuda.h 13.5: INTEGER_ADD 0 to FLOAT_MAX 12).
const ATOMIC_OPERATION_MAX: u32 = 13;

/// Two distinct valid devices, as the peer queries take them: "Returns
/// ::CUDA_ERROR_INVALID_DEVICE if \p srcDevice or \p dstDevice are not valid or if they
/// represent the same device" (cuda.h 13.5, cuDeviceGetP2PAttribute and
/// cuDeviceGetP2PAtomicCapabilities). Checked before the attribute: a real driver answers
/// INVALID_DEVICE for attribute 9999 with src == dst ("device validation precedes enum
/// validation", probed and reported in lupinemachines/lupine issue #445).
fn peer_pair(src: CUdevice, dst: CUdevice) -> Result<(&'static Model, usize, usize), CUresult> {
    let (a, _) = device(src)?;
    let (b, _) = device(dst)?;
    if a == b {
        return Err(err::INVALID_DEVICE);
    }
    Ok((&drv()?.sim.model, a, b))
}

/// The capability bits (`CUatomicCapability`) of one atomic operation over a link with native
/// atomics: 32- and 64-bit, signed and unsigned, reductions for the arithmetic and bitwise ones;
/// float add on 32/64-bit; float min/max none (sm_90 and earlier have no native float min/max
/// over a link; UNVERIFIED).
fn native_atomic_caps(op: u32) -> u32 {
    const SIGNED: u32 = 1;
    const UNSIGNED: u32 = 2;
    const REDUCTION: u32 = 4;
    const S32: u32 = 8;
    const S64: u32 = 16;
    match op {
        0..=7 => SIGNED | UNSIGNED | REDUCTION | S32 | S64,
        8 | 9 => SIGNED | UNSIGNED | S32 | S64,
        10 => S32 | S64,
        _ => 0,
    }
}

/// Writes each requested operation's capabilities (0 for every one where `native` is false);
/// CUDA_ERROR_INVALID_VALUE for NULL arrays, a count of 0 or an unknown operation (cuda.h 13.5).
fn atomic_caps(caps: *mut c_uint, ops: *const u32, count: c_uint, native: bool) -> Res {
    if caps.is_null() || ops.is_null() || count == 0 {
        return Err(err::INVALID_VALUE);
    }
    let mut out = Vec::with_capacity(count as usize);
    for k in 0..count as usize {
        // SAFETY: `ops` is non-null and, by the API contract, `count` elements long.
        let op = unsafe { ops.add(k).read_unaligned() };
        if op >= ATOMIC_OPERATION_MAX {
            return Err(err::INVALID_VALUE);
        }
        out.push(if native { native_atomic_caps(op) } else { 0 });
    }
    for (k, v) in out.into_iter().enumerate() {
        // SAFETY: `caps` is non-null and, by the API contract, `count` elements long.
        write(unsafe { caps.add(k) }, v)?;
    }
    Ok(())
}

export! {
    fn cuDeviceGetCount(count: *mut i32) {
        let d = drv()?;
        write(count, d.sim.model.devices.len() as i32)
    }

    fn cuDeviceGet(out: *mut CUdevice, ordinal: i32) {
        device(ordinal)?;
        write(out, ordinal)
    }

    fn cuDeviceGetName(name: *mut c_char, len: i32, dev: CUdevice) {
        let (_, d) = device(dev)?;
        write_cstr(name, len, &d.name)
    }

    fn cuDeviceGetUuid(uuid: *mut CUuuid, dev: CUdevice) {
        let (_, d) = device(dev)?;
        write(uuid, CUuuid { bytes: d.uuid_bytes() })
    }

    /// Same as v1 on a device without MIG (v2 differs only for MIG instances).
    fn cuDeviceGetUuid_v2(uuid: *mut CUuuid, dev: CUdevice) {
        let (_, d) = device(dev)?;
        write(uuid, CUuuid { bytes: d.uuid_bytes() })
    }

    fn cuDeviceGetAttribute(pi: *mut i32, attrib: i32, dev: CUdevice) {
        let (i, _) = device(dev)?;
        write(pi, attribute(&drv()?.sim.model, i, attrib).ok_or(err::INVALID_VALUE)?)
    }

    /// v1 (CUDA 2.0) reports through a 32-bit `unsigned int`: clamped, not wrapped.
    fn cuDeviceTotalMem(bytes: *mut c_uint, dev: CUdevice) {
        let (_, d) = device(dev)?;
        write(bytes, d.memory.min(u32::MAX as u64) as c_uint)
    }

    fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) {
        let (_, d) = device(dev)?;
        write(bytes, d.memory as usize)
    }

    fn cuDeviceComputeCapability(major: *mut i32, minor: *mut i32, dev: CUdevice) {
        let (_, d) = device(dev)?;
        write(major, d.cc.0 as i32)?;
        write(minor, d.cc.1 as i32)
    }

    fn cuDeviceGetPCIBusId(bus_id: *mut c_char, len: i32, dev: CUdevice) {
        let (_, d) = device(dev)?;
        write_cstr(bus_id, len, &d.pci_bus_id_cuda())
    }

    fn cuDeviceGetByPCIBusId(dev: *mut CUdevice, bus_id: *const c_char) {
        let want = cstr(bus_id)?.to_ascii_lowercase();
        let d = drv()?;
        let i = d
            .sim
            .model
            .devices
            .iter()
            .position(|x| x.pci_bus_id_cuda() == want || x.pci_bus_id_nvml() == want)
            .ok_or(err::INVALID_DEVICE)?;
        write(dev, i as CUdevice)
    }

    fn cuDeviceCanAccessPeer(can: *mut i32, dev: CUdevice, peer: CUdevice) {
        let (a, _) = device(dev)?;
        let (b, _) = device(peer)?;
        write(can, peer_access(&drv()?.sim.fabric, a, b) as i32)
    }


    /// The link between two devices, from the route peer copies take (`peer_link`).
    /// Performance rank: "a relative value indicating the performance of the link between two
    /// devices" (cuda.h 13.5), the lower the better ("0 means best possible link",
    /// lupinemachines/lupine issue #445): 0 over NVLink or NVSwitch, 1 over PCIe P2P (the PCIe
    /// number is the simulator's choice; a real DGX-1V may also rank its one- and two-link
    /// NVLink pairs apart, as lattice/quda PR #648 "Add support for P2P performance ranks ...
    /// useful for DGX-1V where we have different NVLinks" suggests: UNVERIFIED, not modelled),
    /// 0 where there is no peer access. Native atomics and CUDA-array access over NVLink only:
    /// PCIe peer atomics are not native (UNVERIFIED for arrays).
    fn cuDeviceGetP2PAttribute(value: *mut i32, attrib: i32, src: CUdevice, dst: CUdevice) {
        let (_, a, b) = peer_pair(src, dst)?;
        let f = &drv()?.sim.fabric;
        let access = peer_access(f, a, b);
        let kind = peer_link(f, a, b);
        let nvlink = access && over_nvlink(kind);
        let v = match attrib {
            P2P_PERFORMANCE_RANK => (kind == RouteKind::PcieP2p) as i32,
            P2P_ACCESS_SUPPORTED => access as i32,
            P2P_NATIVE_ATOMIC_SUPPORTED | P2P_CUDA_ARRAY_ACCESS_SUPPORTED => nvlink as i32,
            P2P_ONLY_PARTIAL_NATIVE_ATOMIC_SUPPORTED => 0,
            _ => return Err(err::INVALID_VALUE),
        };
        write(value, v)
    }

    /// The deprecated CUDA 2.0 query: the same figures as the attributes it predates
    /// (`SIMDWidth` is the warp size).
    fn cuDeviceGetProperties(prop: *mut CUdevprop, dev: CUdevice) {
        let (i, _) = device(dev)?;
        let m = &drv()?.sim.model;
        let a = |k| attribute(m, i, k).unwrap_or(0);
        write(prop, CUdevprop {
            max_threads_per_block: a(1),
            max_threads_dim: [a(2), a(3), a(4)],
            max_grid_size: [a(5), a(6), a(7)],
            shared_mem_per_block: a(8),
            total_constant_memory: a(9),
            simd_width: a(10),
            mem_pitch: a(11),
            regs_per_block: a(12),
            clock_rate: a(13),
            texture_align: a(14),
        })
    }

    /// CUDA 13.0: per operation, what a link between two GPUs supports natively (NVLink).
    fn cuDeviceGetP2PAtomicCapabilities(caps: *mut c_uint, ops: *const u32, count: c_uint, src: CUdevice, dst: CUdevice) {
        let (_, a, b) = peer_pair(src, dst)?;
        atomic_caps(caps, ops, count, over_nvlink(peer_link(&drv()?.sim.fabric, a, b)))
    }

    /// CUDA 13.0: per operation, what the link to the host supports natively: nothing over PCIe
    /// to an x86 host (as HOST_NATIVE_ATOMIC_SUPPORTED says).
    fn cuDeviceGetHostAtomicCapabilities(caps: *mut c_uint, ops: *const u32, count: c_uint, dev: CUdevice) {
        device(dev)?;
        atomic_caps(caps, ops, count, false)
    }

    /// The LUID identifies a device to Direct3D, on Windows; cudaDeviceProp::luid is "undefined
    /// on TCC and non-Windows platforms" (driver_types.h 13.5). On Linux, with valid arguments,
    /// the driver answers CUDA_ERROR_NOT_SUPPORTED although cuda.h lists no such code for it
    /// (observed by intel/llvm's CUDA adapter reviewers, PR #22574); NULL arguments are
    /// CUDA_ERROR_INVALID_VALUE.
    fn cuDeviceGetLuid(luid: *mut c_char, mask: *mut c_uint, dev: CUdevice) {
        device(dev)?;
        if luid.is_null() || mask.is_null() {
            return Err(err::INVALID_VALUE);
        }
        Err(err::NOT_SUPPORTED)
    }

    /// CU_EXEC_AFFINITY_TYPE_SM_COUNT (0), the only type: supported only for contexts of an MPS
    /// client (cuda.h: "execution affinity ... only supported under MPS"), so 0 here.
    fn cuDeviceGetExecAffinitySupport(pi: *mut i32, kind: i32, dev: CUdevice) {
        device(dev)?;
        if kind != 0 {
            return Err(err::INVALID_VALUE);
        }
        write(pi, 0)
    }

    /// The widest 1D texture on linear memory for an element of `format` x `channels`:
    /// [`TEXTURE1D_LINEAR_MAX`] elements whatever their size (UNVERIFIED: the deprecated
    /// attribute's value). `format` is a `CUarray_format` (cuda.h 13.5: 0x01..0x03, 0x08..0x0a,
    /// 0x10, 0x20, 0x50..0x5e, 0x91..0x9f, 0xa1..0xa9, 0xb0..0xb3, 0xc0..0xcb); `channels` 1, 2 or 4.
    fn cuDeviceGetTexture1DLinearMaxWidth(width: *mut usize, format: c_uint, channels: c_uint, dev: CUdevice) {
        device(dev)?;
        let known = matches!(format, 0x01..=0x03 | 0x08..=0x0a | 0x10 | 0x20 | 0x50..=0x5e | 0x91..=0x9f | 0xa1..=0xa9 | 0xb0..=0xb3 | 0xc0..=0xcb);
        if !known || !matches!(channels, 1 | 2 | 4) {
            return Err(err::INVALID_VALUE);
        }
        write(width, TEXTURE1D_LINEAR_MAX as usize)
    }
}
