//! The simulated driver API, entry point by entry point, from a real client: cudarc's raw `sys`
//! bindings (dynamic loading of libcuda.so), plus dlsym for the v1 and `_ptsz` symbols that
//! bindgen does not declare. Each test runs in a child process on its own simulator state.
mod common;

use cu::CUresult::{self as R, *};
use cudarc::driver::sys as cu;
use std::ffi::{c_void, CString};
use std::ptr::null_mut;

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

/// Runs the calling test in a child on `preset` unless we are that child.
macro_rules! in_child {
    ($name:literal) => {
        in_child!($name, "single")
    };
    ($name:literal, $preset:literal) => {
        if !common::is_child() {
            common::Child::new($name).preset($preset).run().success();
            return;
        }
    };
}

fn ok(r: R) {
    assert_eq!(r, CUDA_SUCCESS);
}

// SAFETY (for every `unsafe` block in this file): these are calls into the simulated driver with
// arguments that follow the CUDA driver API's documented contract (valid out-pointers, live
// handles), which is what the tests exercise.

fn setup() -> cu::CUcontext {
    let mut ctx = null_mut();
    // SAFETY: see the file-level note.
    unsafe {
        ok(cu::cuInit(0));
        ok(cu::cuDevicePrimaryCtxRetain(&mut ctx, 0));
        ok(cu::cuCtxSetCurrent(ctx));
    }
    ctx
}

fn free_mem() -> usize {
    let (mut free, mut total) = (0, 0);
    // SAFETY: see the file-level note.
    unsafe { ok(cu::cuMemGetInfo_v2(&mut free, &mut total)) };
    free
}

fn busy_function(name: &str) -> cu::CUfunction {
    let (mut m, mut f) = (null_mut(), null_mut());
    let name = CString::new(name).unwrap();
    // SAFETY: see the file-level note.
    unsafe {
        ok(cu::cuModuleLoadData(
            &mut m,
            c"image".as_ptr() as *const c_void,
        ));
        ok(cu::cuModuleGetFunction(&mut f, m, name.as_ptr()));
    }
    f
}

fn launch_busy(f: cu::CUfunction, ns: u64, stream: cu::CUstream) -> R {
    let mut ns = ns;
    let mut args = [&mut ns as *mut u64 as *mut c_void];
    // SAFETY: see the file-level note.
    unsafe {
        cu::cuLaunchKernel(
            f,
            1,
            1,
            1,
            32,
            1,
            1,
            0,
            stream,
            args.as_mut_ptr(),
            null_mut(),
        )
    }
}

/// An exported symbol of libcuda.so.1 that bindgen does not declare (v1 and `_ptsz` forms).
fn raw<T: Copy>(name: &str) -> T {
    let lib = c"libcuda.so.1";
    let name = CString::new(name).unwrap();
    // SAFETY: RTLD_NOLOAD only finds the already loaded driver; the symbol is then reinterpreted
    // as the function-pointer type T that the caller names for it (pointer-sized).
    unsafe {
        let h = libc::dlopen(lib.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        assert!(!h.is_null());
        let p = libc::dlsym(h, name.as_ptr());
        assert!(!p.is_null(), "{name:?} not exported");
        std::mem::transmute_copy(&p)
    }
}

fn elapsed_ms(start: cu::CUevent, end: cu::CUevent) -> f32 {
    let mut ms = 0f32;
    // SAFETY: see the file-level note.
    unsafe {
        ok(cu::cuEventSynchronize(end));
        ok(cu::cuEventElapsedTime_v2(&mut ms, start, end));
    }
    ms
}

fn event() -> cu::CUevent {
    let mut e = null_mut();
    // SAFETY: see the file-level note.
    unsafe { ok(cu::cuEventCreate(&mut e, 0)) };
    e
}

#[test]
fn calls_before_cu_init_are_not_initialized() {
    in_child!("calls_before_cu_init_are_not_initialized");
    let mut n = 0;
    let mut v = 0;
    // SAFETY: see the file-level note.
    unsafe {
        assert_eq!(cu::cuDeviceGetCount(&mut n), CUDA_ERROR_NOT_INITIALIZED);
        ok(cu::cuDriverGetVersion(&mut v)); // allowed before cuInit
        assert_eq!(v, cuvisor_sim::model::DEFAULT_DRIVER_VERSION);
        assert_eq!(v, 13000, "CUDA 13.0, as R580 drivers report");
        assert_eq!(cu::cuInit(1), CUDA_ERROR_INVALID_VALUE, "flags must be 0");
        ok(cu::cuInit(0));
        ok(cu::cuDeviceGetCount(&mut n));
        assert_eq!(n, 1);
        let mut p = 0;
        assert_eq!(
            cu::cuMemAlloc_v2(&mut p, 1),
            CUDA_ERROR_INVALID_CONTEXT,
            "no current context"
        );
        let mut name = null_mut::<i8>() as *const i8;
        ok(cu::cuGetErrorName(CUDA_ERROR_OUT_OF_MEMORY, &mut name));
        assert_eq!(
            std::ffi::CStr::from_ptr(name).to_str().unwrap(),
            "CUDA_ERROR_OUT_OF_MEMORY"
        );
    }
}

#[test]
fn device_queries_follow_the_model() {
    in_child!("device_queries_follow_the_model", "dgx1-v100");
    // SAFETY: see the file-level note.
    unsafe {
        ok(cu::cuInit(0));
        let model = cuvisor_sim::model::preset("dgx1-v100").unwrap();
        for (i, d) in model.devices.iter().enumerate() {
            let mut dev = 0;
            ok(cu::cuDeviceGet(&mut dev, i as i32));
            let mut name = [0i8; 64];
            ok(cu::cuDeviceGetName(name.as_mut_ptr(), 64, dev));
            assert_eq!(
                std::ffi::CStr::from_ptr(name.as_ptr()).to_str().unwrap(),
                d.name
            );
            let mut uuid = std::mem::zeroed::<cu::CUuuid>();
            ok(cu::cuDeviceGetUuid_v2(&mut uuid, dev));
            assert_eq!(uuid.bytes.map(|b| b as u8), d.uuid_bytes());
            let mut bus = [0i8; 32];
            ok(cu::cuDeviceGetPCIBusId(bus.as_mut_ptr(), 32, dev));
            let bus = std::ffi::CStr::from_ptr(bus.as_ptr())
                .to_str()
                .unwrap()
                .to_string();
            assert_eq!(bus, d.pci_bus_id_cuda());
            let mut back = -1;
            let c = CString::new(bus).unwrap();
            ok(cu::cuDeviceGetByPCIBusId(&mut back, c.as_ptr()));
            assert_eq!(back, dev);
            let mut sm = 0;
            ok(cu::cuDeviceGetAttribute(
                &mut sm,
                cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                dev,
            ));
            assert_eq!(sm, 80);
            let mut major = 0;
            ok(cu::cuDeviceGetAttribute(
                &mut major,
                cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                dev,
            ));
            assert_eq!(major, 7);
            let mut total = 0;
            ok(cu::cuDeviceTotalMem_v2(&mut total, dev));
            assert_eq!(total, 16 * GIB);
            // v1 reports through 32 bits: clamped, never wrapped.
            let total_v1: extern "C" fn(*mut u32, i32) -> R = raw("cuDeviceTotalMem");
            let mut t32 = 0u32;
            ok(total_v1(&mut t32, dev));
            assert_eq!(t32, u32::MAX);
        }
        let mut dev = 0;
        assert_eq!(cu::cuDeviceGet(&mut dev, 8), CUDA_ERROR_INVALID_DEVICE);
        let mut can = 0;
        ok(cu::cuDeviceCanAccessPeer(&mut can, 0, 3)); // NVLink
        assert_eq!(can, 1);
        ok(cu::cuDeviceCanAccessPeer(&mut can, 0, 5)); // across NUMA nodes, no NVLink
        assert_eq!(can, 0);
    }
}

#[test]
fn contexts_stack_and_destroying_one_frees_its_memory() {
    in_child!("contexts_stack_and_destroying_one_frees_its_memory");
    // SAFETY: see the file-level note.
    unsafe {
        ok(cu::cuInit(0));
        let mut popped = null_mut();
        assert_eq!(
            cu::cuCtxPopCurrent_v2(&mut popped),
            CUDA_ERROR_INVALID_CONTEXT
        );
        let mut ctx = null_mut();
        ok(cu::cuCtxCreate_v2(&mut ctx, 0, 0));
        let mut cur = null_mut();
        ok(cu::cuCtxGetCurrent(&mut cur));
        assert_eq!(cur, ctx, "cuCtxCreate makes the new context current");
        let before = free_mem();
        let mut p = 0;
        ok(cu::cuMemAlloc_v2(&mut p, 64 * MIB));
        assert_eq!(before - free_mem(), 64 * MIB);
        ok(cu::cuCtxPopCurrent_v2(&mut popped));
        assert_eq!(popped, ctx);
        ok(cu::cuCtxDestroy_v2(ctx));
        let primary = setup();
        assert_eq!(
            free_mem(),
            before,
            "destroying a context frees what it allocated"
        );
        assert_eq!(
            cu::cuCtxDestroy_v2(primary),
            CUDA_ERROR_INVALID_CONTEXT,
            "a primary context is released, not destroyed"
        );
        let (mut flags, mut active) = (0, 0);
        ok(cu::cuDevicePrimaryCtxGetState(0, &mut flags, &mut active));
        assert_eq!(active, 1);
        assert_eq!(
            cu::cuDevicePrimaryCtxSetFlags_v2(0, 0x100),
            CUDA_ERROR_INVALID_VALUE
        );
        ok(cu::cuDevicePrimaryCtxSetFlags_v2(0, 4)); // v2 may change flags while active
        ok(cu::cuDevicePrimaryCtxRelease_v2(0));
        ok(cu::cuDevicePrimaryCtxGetState(0, &mut flags, &mut active));
        assert_eq!((flags, active), (4, 0));
    }
}

#[test]
fn allocation_paths_charge_and_free_exactly() {
    in_child!("allocation_paths_charge_and_free_exactly");
    setup();
    let base = free_mem();
    // SAFETY: see the file-level note.
    unsafe {
        let mut p = 0;
        ok(cu::cuMemAlloc_v2(&mut p, 1000));
        assert_eq!(base - free_mem(), 1024, "rounded up to 512 bytes");
        assert_eq!(p % 512, 0);
        let (mut b, mut s) = (0, 0);
        ok(cu::cuMemGetAddressRange_v2(&mut b, &mut s, p + 10));
        assert_eq!((b, s), (p, 1024));
        assert_eq!(
            cu::cuMemFree_v2(p + 512),
            CUDA_ERROR_INVALID_VALUE,
            "interior pointer"
        );
        ok(cu::cuMemFree_v2(p));
        assert_eq!(cu::cuMemAlloc_v2(&mut p, 0), CUDA_ERROR_INVALID_VALUE);

        let mut pitch = 0;
        ok(cu::cuMemAllocPitch_v2(&mut p, &mut pitch, 1000, 100, 4));
        assert_eq!(pitch, 1024);
        assert_eq!(base - free_mem(), 1024 * 100);
        assert_eq!(
            cu::cuMemAllocPitch_v2(&mut p, &mut pitch, 1000, 100, 3),
            CUDA_ERROR_INVALID_VALUE
        );
        ok(cu::cuMemFree_v2(p));

        // Managed memory takes device memory once its pages are there (prefetched, or touched
        // by a kernel), not when allocated: see crates/sim/cuda/src/managed.rs.
        ok(cu::cuMemAllocManaged(&mut p, 4 * MIB, 1));
        assert_eq!(
            base - free_mem(),
            0,
            "managed memory is not on the device until its pages are"
        );
        ok(cu::cuMemFree_v2(p));

        // v1: a 32-bit CUdeviceptr and 32-bit cuMemGetInfo (clamped).
        let alloc_v1: extern "C" fn(*mut u32, u32) -> R = raw("cuMemAlloc");
        let free_v1: extern "C" fn(u32) -> R = raw("cuMemFree");
        let info_v1: extern "C" fn(*mut u32, *mut u32) -> R = raw("cuMemGetInfo");
        let mut p32 = 0u32;
        ok(alloc_v1(&mut p32, 4096));
        assert_ne!(p32, 0);
        let (mut f32_, mut t32) = (0, 0);
        ok(info_v1(&mut f32_, &mut t32));
        assert_eq!((f32_, t32), (u32::MAX, u32::MAX));
        ok(free_v1(p32));

        // Arrays: charged by element size, given back by their destroy.
        let desc = cu::CUDA_ARRAY_DESCRIPTOR {
            Width: 1024,
            Height: 1024,
            Format: cu::CUarray_format::CU_AD_FORMAT_FLOAT,
            NumChannels: 4,
        };
        let mut arr = null_mut();
        ok(cu::cuArrayCreate_v2(&mut arr, &desc));
        assert_eq!(base - free_mem(), 16 * MIB);
        ok(cu::cuArrayDestroy(arr));
        let d3 = cu::CUDA_ARRAY3D_DESCRIPTOR {
            Width: 256,
            Height: 256,
            Depth: 16,
            Format: cu::CUarray_format::CU_AD_FORMAT_UNSIGNED_INT8,
            NumChannels: 2,
            Flags: 0,
        };
        ok(cu::cuArray3DCreate_v2(&mut arr, &d3));
        assert_eq!(base - free_mem(), 2 * MIB);
        ok(cu::cuArrayDestroy(arr));
        let mut mip = null_mut();
        let dm = cu::CUDA_ARRAY3D_DESCRIPTOR {
            Width: 1024,
            Height: 1024,
            Depth: 0,
            Format: cu::CUarray_format::CU_AD_FORMAT_UNSIGNED_INT8,
            NumChannels: 1,
            Flags: 0,
        };
        ok(cu::cuMipmappedArrayCreate(&mut mip, &dm, 3));
        assert_eq!(
            base - free_mem(),
            (1024 * 1024 + 512 * 512 + 256 * 256) as usize
        );
        ok(cu::cuMipmappedArrayDestroy(mip));
        assert_eq!(
            cu::cuMipmappedArrayCreate(&mut mip, &dm, 12),
            CUDA_ERROR_INVALID_VALUE,
            "1024 has 11 levels"
        );
        // Two levels of a float array 4w + 2w = 2^64 + 4 GiB + 4 bytes: the simulator's own
        // arithmetic is checked (it took 4 GiB, the wrapped sum, before), and such extents are
        // beyond every device's maximum, which the real driver refuses with INVALID_VALUE.
        let w = (((1u128 << 64) + (1 << 32) + 4) / 6) as usize;
        let wrap = cu::CUDA_ARRAY3D_DESCRIPTOR {
            Width: w,
            Height: 0,
            Depth: 0,
            Format: cu::CUarray_format::CU_AD_FORMAT_FLOAT,
            NumChannels: 1,
            Flags: 0,
        };
        assert_eq!(
            cu::cuMipmappedArrayCreate(&mut mip, &wrap, 2),
            CUDA_ERROR_INVALID_VALUE,
            "a mipmapped array whose size wraps"
        );
        assert_eq!(free_mem(), base);

        // Data round-trips through memset and the copy entry points.
        ok(cu::cuMemAlloc_v2(&mut p, 4096));
        ok(cu::cuMemsetD32_v2(p, 0xdead_beef, 1024));
        let mut host = vec![0u32; 1024];
        ok(cu::cuMemcpyDtoH_v2(
            host.as_mut_ptr() as *mut c_void,
            p,
            4096,
        ));
        assert!(host.iter().all(|&x| x == 0xdead_beef));
        assert_eq!(
            cu::cuMemcpyDtoH_v2(host.as_mut_ptr() as *mut c_void, p, 4097),
            CUDA_ERROR_INVALID_VALUE,
            "past the end"
        );
        ok(cu::cuMemFree_v2(p));
        assert_eq!(
            cu::cuMemcpyDtoH_v2(host.as_mut_ptr() as *mut c_void, p, 4),
            CUDA_ERROR_INVALID_VALUE,
            "after free"
        );
    }
}

#[test]
fn stream_ordered_pools_keep_memory_until_a_sync_point() {
    in_child!("stream_ordered_pools_keep_memory_until_a_sync_point");
    setup();
    let base = free_mem();
    let attr = |pool: cu::CUmemoryPool, a: cu::CUmemPool_attribute| {
        let mut v = 0u64;
        // SAFETY: see the file-level note.
        unsafe {
            ok(cu::cuMemPoolGetAttribute(
                pool,
                a,
                &mut v as *mut u64 as *mut c_void,
            ))
        };
        v as usize
    };
    use cu::CUmemPool_attribute::*;
    // SAFETY: see the file-level note.
    unsafe {
        let mut pool = null_mut();
        ok(cu::cuDeviceGetDefaultMemPool(&mut pool, 0));
        let mut p = 0;
        ok(cu::cuMemAllocAsync(&mut p, 3 * MIB, null_mut()));
        assert_eq!(attr(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT), 3 * MIB);
        assert_eq!(
            attr(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT),
            4 * MIB,
            "pools grow in 2 MiB steps"
        );
        assert_eq!(base - free_mem(), 4 * MIB);
        ok(cu::cuMemFreeAsync(p, null_mut()));
        assert_eq!(attr(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT), 0);
        assert_eq!(
            base - free_mem(),
            4 * MIB,
            "freed memory stays reserved in the pool"
        );
        ok(cu::cuStreamSynchronize(null_mut()));
        assert_eq!(free_mem(), base, "released at the sync point (threshold 0)");

        let mut keep = 64u64 * MIB as u64;
        ok(cu::cuMemPoolSetAttribute(
            pool,
            CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut keep as *mut u64 as *mut c_void,
        ));
        ok(cu::cuMemAllocAsync(&mut p, 32 * MIB, null_mut()));
        ok(cu::cuMemFreeAsync(p, null_mut()));
        ok(cu::cuStreamSynchronize(null_mut()));
        assert_eq!(
            base - free_mem(),
            32 * MIB,
            "kept under the release threshold"
        );
        ok(cu::cuMemPoolTrimTo(pool, 0));
        assert_eq!(free_mem(), base);
        assert_eq!(attr(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH), 32 * MIB);

        // A created pool, allocation from it, and its destruction.
        let mut props: cu::CUmemPoolProps = std::mem::zeroed();
        props.allocType = cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.location.type_ = cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        let mut mine = null_mut();
        ok(cu::cuMemPoolCreate(&mut mine, &props));
        ok(cu::cuMemAllocFromPoolAsync(&mut p, MIB, mine, null_mut()));
        assert_eq!(base - free_mem(), 2 * MIB);
        let mut which = null_mut::<c_void>();
        ok(cu::cuPointerGetAttribute(
            &mut which as *mut _ as *mut c_void,
            cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
            p,
        ));
        assert_eq!(which as cu::CUmemoryPool, mine);
        // Destroyed with an allocation outstanding: the handle is gone at once, the memory
        // lives until the allocation is freed (the driver API's cuMemPoolDestroy).
        ok(cu::cuMemPoolDestroy(mine));
        assert_eq!(
            base - free_mem(),
            2 * MIB,
            "an outstanding allocation keeps a destroyed pool's memory"
        );
        let mut v = 0u64;
        assert_eq!(
            cu::cuMemPoolGetAttribute(
                mine,
                CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
                &mut v as *mut u64 as *mut c_void
            ),
            CUDA_ERROR_INVALID_VALUE,
            "a destroyed pool's handle is invalid"
        );
        ok(cu::cuMemFreeAsync(p, null_mut()));
        assert_eq!(
            free_mem(),
            base,
            "the last free releases the destroyed pool"
        );
        ok(cu::cuMemPoolCreate(&mut mine, &props));
        ok(cu::cuMemAllocFromPoolAsync(&mut p, MIB, mine, null_mut()));
        ok(cu::cuMemFreeAsync(p, null_mut()));
        ok(cu::cuMemPoolDestroy(mine));
        assert_eq!(
            free_mem(),
            base,
            "destroying an unused pool frees what it held"
        );

        // An event synchronization is a synchronization point too.
        let mut zero = 0u64;
        ok(cu::cuMemPoolSetAttribute(
            pool,
            CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut zero as *mut u64 as *mut c_void,
        ));
        ok(cu::cuMemAllocAsync(&mut p, 8 * MIB, null_mut()));
        ok(cu::cuMemFreeAsync(p, null_mut()));
        assert_eq!(base - free_mem(), 8 * MIB);
        let mut ev = null_mut();
        ok(cu::cuEventCreate(&mut ev, 0));
        ok(cu::cuEventRecord(ev, null_mut()));
        ok(cu::cuEventSynchronize(ev));
        assert_eq!(free_mem(), base, "released at cuEventSynchronize");
        ok(cu::cuEventDestroy_v2(ev));

        // A context's teardown frees what was allocated in it and waits for its work: the pool
        // lets the memory go as at a context synchronization.
        let primary = {
            let mut c = null_mut();
            ok(cu::cuCtxGetCurrent(&mut c));
            c
        };
        let mut other = null_mut();
        ok(cu::cuCtxCreate_v2(&mut other, 0, 0));
        ok(cu::cuMemAllocAsync(&mut p, 8 * MIB, null_mut()));
        ok(cu::cuCtxDestroy_v2(other));
        ok(cu::cuCtxSetCurrent(primary));
        assert_eq!(free_mem(), base, "released when its context went");
        assert_eq!(
            cu::cuMemPoolDestroy(pool),
            CUDA_ERROR_INVALID_VALUE,
            "the default pool cannot be destroyed"
        );
    }
}

#[test]
fn virtual_memory_management_charges_physical_handles() {
    in_child!("virtual_memory_management_charges_physical_handles");
    setup();
    let base = free_mem();
    // SAFETY: see the file-level note.
    unsafe {
        let mut prop: cu::CUmemAllocationProp = std::mem::zeroed();
        prop.type_ = cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type_ = cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        let mut gran = 0;
        ok(cu::cuMemGetAllocationGranularity(
            &mut gran,
            &prop,
            cu::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        ));
        assert_eq!(gran, 2 * MIB);
        let mut h = 0;
        assert_eq!(
            cu::cuMemCreate(&mut h, 3 * MIB, &prop, 0),
            CUDA_ERROR_INVALID_VALUE,
            "not a granularity multiple"
        );
        ok(cu::cuMemCreate(&mut h, 4 * MIB, &prop, 0));
        assert_eq!(base - free_mem(), 4 * MIB);
        let mut va = 0;
        ok(cu::cuMemAddressReserve(&mut va, 8 * MIB, 0, 0, 0));
        assert_eq!(base - free_mem(), 4 * MIB, "address space is not memory");
        ok(cu::cuMemMap(va, 4 * MIB, 0, h, 0));
        let access = cu::CUmemAccessDesc {
            location: prop.location,
            flags: cu::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        ok(cu::cuMemSetAccess(va, 4 * MIB, &access, 1));
        let data = [7u8; 64];
        ok(cu::cuMemcpyHtoD_v2(
            va + 100,
            data.as_ptr() as *const c_void,
            64,
        ));
        let mut back = [0u8; 64];
        ok(cu::cuMemcpyDtoH_v2(
            back.as_mut_ptr() as *mut c_void,
            va + 100,
            64,
        ));
        assert_eq!(back, data);
        ok(cu::cuMemRelease(h));
        assert_eq!(base - free_mem(), 4 * MIB, "still mapped: still charged");
        ok(cu::cuMemUnmap(va, 4 * MIB));
        assert_eq!(free_mem(), base, "released and unmapped: given back");
        ok(cu::cuMemAddressFree(va, 8 * MIB));
        // Host-located physical memory takes no device memory.
        prop.location.type_ = cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST;
        ok(cu::cuMemCreate(&mut h, 2 * MIB, &prop, 0));
        assert_eq!(free_mem(), base);
        ok(cu::cuMemRelease(h));
    }
}

#[test]
fn graphs_capture_and_cooperative_launches_take_device_time() {
    in_child!("graphs_capture_and_cooperative_launches_take_device_time");
    setup();
    let f = busy_function("sim_busy_graph");
    // SAFETY: see the file-level note.
    unsafe {
        let mut s = null_mut();
        ok(cu::cuStreamCreate(&mut s, 0));
        // Captured work does not run until the graph is launched.
        ok(cu::cuStreamBeginCapture_v2(
            s,
            cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
        ));
        let mut status = cu::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        ok(cu::cuStreamIsCapturing(s, &mut status));
        assert_eq!(
            status,
            cu::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE
        );
        ok(launch_busy(f, 10_000_000, s));
        // Synchronizing a capturing stream is refused and invalidates the capture, which then
        // ends with no graph (the real driver: JuliaGPU/CUDA.jl#1229, 900 then 901).
        assert_eq!(
            cu::cuStreamSynchronize(s),
            CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
        );
        let mut g = null_mut();
        assert_eq!(
            cu::cuStreamEndCapture(s, &mut g),
            CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
        );
        assert!(g.is_null());
        ok(cu::cuStreamBeginCapture_v2(
            s,
            cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
        ));
        for _ in 0..3 {
            ok(launch_busy(f, 10_000_000, s));
        }
        ok(cu::cuStreamEndCapture(s, &mut g));
        ok(cu::cuStreamQuery(s));
        let mut exec = null_mut();
        ok(cu::cuGraphInstantiateWithFlags(&mut exec, g, 0));
        let (a, b) = (event(), event());
        ok(cu::cuEventRecord(a, s));
        ok(cu::cuGraphLaunch(exec, s));
        ok(cu::cuEventRecord(b, s));
        let ms = elapsed_ms(a, b);
        assert!(
            (29.0..=33.0).contains(&ms),
            "captured graph of 3 x 10 ms took {ms} ms"
        );

        // A graph built node by node.
        let mut g2 = null_mut();
        ok(cu::cuGraphCreate(&mut g2, 0));
        let mut ns: u64 = 20_000_000;
        let mut args = [&mut ns as *mut u64 as *mut c_void];
        let params = cu::CUDA_KERNEL_NODE_PARAMS {
            func: f,
            gridDimX: 1,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: 1,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: 0,
            kernelParams: args.as_mut_ptr(),
            extra: null_mut(),
            kern: null_mut(),
            ctx: null_mut(),
        };
        let mut n1 = null_mut();
        let mut n2 = null_mut();
        ok(cu::cuGraphAddKernelNode_v2(
            &mut n1,
            g2,
            null_mut(),
            0,
            &params,
        ));
        *(args[0] as *mut u64) = 1; // the second node reads 1 ns; the first copied 20 ms when made
        ok(cu::cuGraphAddKernelNode_v2(&mut n2, g2, &n1, 1, &params));
        let mut exec2 = null_mut();
        ok(cu::cuGraphInstantiateWithFlags(&mut exec2, g2, 0));
        ok(cu::cuEventRecord(a, s));
        ok(cu::cuGraphLaunch(exec2, s));
        ok(cu::cuEventRecord(b, s));
        let ms = elapsed_ms(a, b);
        assert!(
            (19.0..=22.0).contains(&ms),
            "built graph 20 ms + 1 ns took {ms} ms"
        );

        // Cooperative launches run like any kernel, and must fit on the device at once.
        let mut ns: u64 = 5_000_000;
        let mut args = [&mut ns as *mut u64 as *mut c_void];
        ok(cu::cuEventRecord(a, s));
        ok(cu::cuLaunchCooperativeKernel(
            f,
            108,
            1,
            1,
            256,
            1,
            1,
            0,
            s,
            args.as_mut_ptr(),
        ));
        ok(cu::cuEventRecord(b, s));
        let ms = elapsed_ms(a, b);
        assert!(
            (4.5..=6.0).contains(&ms),
            "cooperative 5 ms kernel took {ms} ms"
        );
        // 108 SMs x 8 blocks of 256 threads fit; one more block does not.
        assert_eq!(
            cu::cuLaunchCooperativeKernel(f, 108 * 8 + 1, 1, 1, 256, 1, 1, 0, s, args.as_mut_ptr()),
            CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE
        );
        assert_eq!(
            cu::cuLaunchKernel(f, 0, 1, 1, 1, 1, 1, 0, s, args.as_mut_ptr(), null_mut()),
            CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(
            cu::cuLaunchKernel(f, 1, 1, 1, 1025, 1, 1, 0, s, args.as_mut_ptr(), null_mut()),
            CUDA_ERROR_INVALID_VALUE
        );
    }
}

#[test]
fn the_per_thread_stream_is_not_the_legacy_stream() {
    in_child!("the_per_thread_stream_is_not_the_legacy_stream");
    setup();
    let f = busy_function("sim_busy");
    let query_ptsz: extern "C" fn(cu::CUstream) -> R = raw("cuStreamQuery_ptsz");
    // SAFETY: see the file-level note.
    unsafe {
        ok(launch_busy(f, 100_000_000, null_mut())); // NULL on the legacy entry point = legacy stream
        assert_eq!(cu::cuStreamQuery(null_mut()), CUDA_ERROR_NOT_READY);
        assert_eq!(
            query_ptsz(null_mut()),
            CUDA_SUCCESS,
            "NULL on a _ptsz entry point = the per-thread stream, which is idle"
        );
        assert_eq!(
            cu::cuStreamQuery(2 as cu::CUstream),
            CUDA_SUCCESS,
            "CU_STREAM_PER_THREAD"
        );
        assert_eq!(
            cu::cuStreamQuery(1 as cu::CUstream),
            CUDA_ERROR_NOT_READY,
            "CU_STREAM_LEGACY"
        );
        ok(cu::cuCtxSynchronize());
        ok(cu::cuStreamQuery(null_mut()));
    }
}

#[test]
fn injected_allocation_failures_hit_the_next_allocations() {
    if !common::is_child() {
        let state = common::state_file("fail-alloc");
        let model = cuvisor_sim::model::preset("single").unwrap();
        let shared = cuvisor_sim::state::Shared::attach_at(&model, &state).unwrap();
        shared
            .device(0)
            .fail_allocs
            .store(2, std::sync::atomic::Ordering::SeqCst);
        common::Child::new("injected_allocation_failures_hit_the_next_allocations")
            .state(&state)
            .run()
            .success();
        return;
    }
    setup();
    let mut p = 0;
    // SAFETY: see the file-level note.
    unsafe {
        assert_eq!(cu::cuMemAlloc_v2(&mut p, MIB), CUDA_ERROR_OUT_OF_MEMORY);
        assert_eq!(cu::cuMemAlloc_v2(&mut p, MIB), CUDA_ERROR_OUT_OF_MEMORY);
        ok(cu::cuMemAlloc_v2(&mut p, MIB));
    }
}

#[test]
fn a_killed_process_gives_its_memory_back() {
    if common::is_child() {
        setup();
        let mut p = 0;
        // SAFETY: see the file-level note.
        unsafe { ok(cu::cuMemAlloc_v2(&mut p, 12 * GIB)) };
        if std::env::var("ROLE").as_deref() == Ok("victim") {
            println!("holding");
            std::thread::sleep(std::time::Duration::from_secs(60));
        }
        return;
    }
    use std::io::{BufRead, BufReader};
    let state = common::state_file("sigkill");
    let mut victim = common::Child::new("a_killed_process_gives_its_memory_back")
        .state(&state)
        .env("ROLE", "victim")
        .spawn();
    let mut line = String::new();
    BufReader::new(victim.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    while !line.contains("holding") {
        line.clear();
        BufReader::new(victim.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
    }
    victim.kill().unwrap(); // SIGKILL: no exit handler runs
    victim.wait().unwrap();
    // The next process finds the device full, reclaims the dead one's 12 GiB and allocates.
    common::Child::new("a_killed_process_gives_its_memory_back")
        .state(&state)
        .env("ROLE", "next")
        .run()
        .success();
}

#[test]
fn ipc_and_shareable_handle_imports_are_not_new_memory() {
    in_child!("ipc_and_shareable_handle_imports_are_not_new_memory");
    // One process stands in for both sides of the exchange for the shareable handle; IPC needs
    // a second process, which the sibling test below provides.
    setup();
    let base = free_mem();
    // SAFETY: see the file-level note.
    unsafe {
        let mut prop: cu::CUmemAllocationProp = std::mem::zeroed();
        prop.type_ = cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type_ = cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.requestedHandleTypes =
            cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        let mut h = 0;
        ok(cu::cuMemCreate(&mut h, 2 * MIB, &prop, 0));
        let mut fd: i32 = -1;
        ok(cu::cuMemExportToShareableHandle(
            &mut fd as *mut i32 as *mut c_void,
            h,
            cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        ));
        assert!(fd >= 0);
        let mut imported = 0;
        ok(cu::cuMemImportFromShareableHandle(
            &mut imported,
            fd as usize as *mut c_void,
            cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        ));
        assert_eq!(base - free_mem(), 2 * MIB, "the import adds nothing");
        ok(cu::cuMemRelease(imported));
        ok(cu::cuMemRelease(h));
        assert_eq!(free_mem(), base);

        // The exporter releasing its handle does not free memory another handle still holds
        // (cuMemRelease: freed when all handles, shareable counterparts included, are released
        // and all mappings unmapped).
        ok(cu::cuMemCreate(&mut h, 4 * MIB, &prop, 0));
        ok(cu::cuMemExportToShareableHandle(
            &mut fd as *mut i32 as *mut c_void,
            h,
            cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        ));
        ok(cu::cuMemImportFromShareableHandle(
            &mut imported,
            fd as usize as *mut c_void,
            cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        ));
        ok(cu::cuMemRelease(h));
        assert_eq!(
            base - free_mem(),
            4 * MIB,
            "the imported handle keeps the memory alive"
        );
        let mut va = 0;
        ok(cu::cuMemAddressReserve(&mut va, 4 * MIB, 0, 0, 0));
        ok(cu::cuMemMap(va, 4 * MIB, 0, imported, 0));
        ok(cu::cuMemRelease(imported));
        assert_eq!(base - free_mem(), 4 * MIB, "and so does its mapping");
        ok(cu::cuMemUnmap(va, 4 * MIB));
        assert_eq!(
            free_mem(),
            base,
            "the last mapping of the last handle frees it"
        );
        let mut again = 0;
        assert_eq!(
            cu::cuMemImportFromShareableHandle(
                &mut again,
                fd as usize as *mut c_void,
                cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            ),
            CUDA_ERROR_INVALID_VALUE,
            "memory that is gone cannot be imported"
        );
        ok(cu::cuMemAddressFree(va, 4 * MIB));
        libc::close(fd);

        let mut p = 0;
        ok(cu::cuMemAlloc_v2(&mut p, 8 * MIB));
        let mut handle: cu::CUipcMemHandle = std::mem::zeroed();
        ok(cu::cuIpcGetMemHandle(&mut handle, p));
        let mut opened = 0;
        assert_eq!(
            cu::cuIpcOpenMemHandle_v2(&mut opened, handle, 1),
            CUDA_ERROR_INVALID_CONTEXT,
            "not in the exporting process"
        );
    }
}

#[test]
fn an_opened_ipc_handle_charges_nothing() {
    use std::io::{BufRead, BufReader, Write};
    if common::is_child() {
        setup();
        // SAFETY: see the file-level note.
        unsafe {
            if std::env::var("ROLE").as_deref() == Ok("exporter") {
                let mut p = 0;
                ok(cu::cuMemAlloc_v2(&mut p, 8 * MIB));
                let mut handle: cu::CUipcMemHandle = std::mem::zeroed();
                ok(cu::cuIpcGetMemHandle(&mut handle, p));
                let hex: String = handle
                    .reserved
                    .iter()
                    .map(|b| format!("{:02x}", *b as u8))
                    .collect();
                println!("handle {hex}");
                let mut line = String::new();
                std::io::stdin().lock().read_line(&mut line).unwrap(); // until the importer is done
            } else {
                let hex = std::env::var("HANDLE").unwrap();
                let mut handle: cu::CUipcMemHandle = std::mem::zeroed();
                for (i, b) in handle.reserved.iter_mut().enumerate() {
                    *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap() as _;
                }
                let before = free_mem();
                let mut opened = 0;
                ok(cu::cuIpcOpenMemHandle_v2(&mut opened, handle, 1));
                assert_eq!(
                    free_mem(),
                    before,
                    "opening someone else's memory takes none"
                );
                ok(cu::cuIpcCloseMemHandle(opened));
            }
        }
        return;
    }
    let state = common::state_file("ipc");
    let mut cmd = common::Child::new("an_opened_ipc_handle_charges_nothing")
        .state(&state)
        .env("ROLE", "exporter")
        .command();
    let mut exporter = cmd
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(exporter.stdout.take().unwrap());
    let mut line = String::new();
    // libtest prints "test NAME ... " without a newline before the test's own output.
    while !line.contains("handle ") {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "exporter ended early"
        );
    }
    let hex = line.trim().rsplit("handle ").next().unwrap().to_string();
    common::Child::new("an_opened_ipc_handle_charges_nothing")
        .state(&state)
        .env("ROLE", "importer")
        .env("HANDLE", &hex)
        .run()
        .success();
    writeln!(exporter.stdin.as_mut().unwrap()).unwrap();
    assert!(exporter.wait().unwrap().success());
}

#[test]
fn context_ids_are_unique_and_follow_the_current_context() {
    in_child!("context_ids_are_unique_and_follow_the_current_context");
    let primary = setup();
    // SAFETY: see the file-level note.
    unsafe {
        let id = |c: cu::CUcontext| {
            let mut v = 0;
            ok(cu::cuCtxGetId(c, &mut v));
            v
        };
        let p = id(primary);
        assert_ne!(p, 0);
        assert_eq!(id(null_mut()), p, "NULL is the current context");
        let mut seen = vec![p];
        for _ in 0..4 {
            let mut c = null_mut();
            ok(cu::cuCtxCreate_v2(&mut c, 0, 0));
            let v = id(null_mut());
            assert_eq!(v, id(c));
            assert!(!seen.contains(&v), "a new context has a new id");
            seen.push(v);
            ok(cu::cuCtxPushCurrent_v2(primary));
            assert_eq!(id(null_mut()), p);
            let mut popped = null_mut();
            ok(cu::cuCtxPopCurrent_v2(&mut popped));
            assert_eq!(id(null_mut()), v);
            ok(cu::cuCtxDestroy_v2(c));
            ok(cu::cuCtxSetCurrent(primary));
        }
        assert_eq!(id(primary), p, "the primary context keeps its id");
        assert_eq!(
            cu::cuCtxGetId(primary, null_mut()),
            CUDA_ERROR_INVALID_VALUE
        );
        // Not a CIG (CUDA-in-graphics) context: CU_LIMIT_CIG_ENABLED answers 0, as cuBLASLt
        // 12.8's handle creation asks.
        let mut v = 1;
        ok(cu::cuCtxGetLimit(&mut v, cu::CUlimit::CU_LIMIT_CIG_ENABLED));
        assert_eq!(v, 0);
    }
}

/// CU_LIBRARY_BINARY_IS_PRESERVED takes no value: cuBLASLt 12.8 passes it with a NULL value
/// array, and asks the library for kernels after. An option that does take one still needs the
/// array.
#[test]
fn the_binary_is_preserved_library_option_needs_no_value() {
    in_child!("the_binary_is_preserved_library_option_needs_no_value");
    // SAFETY: see the file-level note.
    unsafe {
        ok(cu::cuInit(0));
        let load = |key: cu::CUlibraryOption| {
            let mut keys = [key];
            let mut lib = null_mut();
            let r = cu::cuLibraryLoadData(
                &mut lib,
                c"image".as_ptr() as *const c_void,
                null_mut(),
                null_mut(),
                0,
                keys.as_mut_ptr(),
                null_mut(),
                1,
            );
            (r, lib)
        };
        let (r, lib) = load(cu::CUlibraryOption::CU_LIBRARY_BINARY_IS_PRESERVED);
        ok(r);
        let mut k = null_mut();
        ok(cu::cuLibraryGetKernel(&mut k, lib, c"busy".as_ptr()));
        ok(cu::cuLibraryUnload(lib));
        let (r, _) = load(cu::CUlibraryOption::CU_LIBRARY_HOST_UNIVERSAL_FUNCTION_AND_DATA_TABLE);
        assert_eq!(
            r, CUDA_ERROR_INVALID_VALUE,
            "this option's value is its table"
        );
    }
}

#[test]
fn a_primary_context_keeps_its_handle_when_released() {
    in_child!("a_primary_context_keeps_its_handle_when_released");
    // SAFETY: see the file-level note.
    unsafe {
        let h = setup();
        let mut p = 0;
        ok(cu::cuMemAlloc_v2(&mut p, 64 * MIB));
        ok(cu::cuDevicePrimaryCtxRelease_v2(0));
        // Still current, no longer retained: cuda.h's CUDA_ERROR_CONTEXT_IS_DESTROYED, "a primary
        // context which has not yet been initialized".
        let mut cur = null_mut();
        ok(cu::cuCtxGetCurrent(&mut cur));
        assert_eq!(cur, h);
        assert_eq!(
            cu::cuMemAlloc_v2(&mut p, MIB),
            CUDA_ERROR_CONTEXT_IS_DESTROYED
        );
        let mut again = null_mut();
        ok(cu::cuDevicePrimaryCtxRetain(&mut again, 0));
        assert_eq!(again, h, "one primary context object per device");
        // Retained again: the context's own memory, and nothing else.
        let ctx = cuvisor_sim::model::preset("single").unwrap().devices[0].context_memory as usize;
        assert_eq!(
            free_mem(),
            16 * GIB - ctx,
            "the last release freed what it held"
        );
    }
}

/// Exported VMM memory lives while another process holds an imported handle to it, after the
/// exporter released its own (cuMemRelease: freed when all handles, shareable counterparts
/// included, are released and all mappings unmapped), and goes when the importer lets go.
#[test]
fn exported_memory_lives_while_another_process_holds_an_import() {
    use std::io::{BufRead, BufReader, Write};
    let wait_line = || {
        let mut line = String::new();
        std::io::stdin().lock().read_line(&mut line).unwrap();
    };
    let fd_type = cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    if common::is_child() {
        setup();
        // SAFETY: see the file-level note.
        unsafe {
            if std::env::var("ROLE").as_deref() == Ok("exporter") {
                let base = free_mem();
                // The importer, started after this, has its own context on the device.
                let importer_ctx = cuvisor_sim::model::preset("single").unwrap().devices[0]
                    .context_memory as usize;
                let mut prop: cu::CUmemAllocationProp = std::mem::zeroed();
                prop.type_ = cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
                prop.location.type_ = cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
                prop.requestedHandleTypes = fd_type;
                let mut h = 0;
                ok(cu::cuMemCreate(&mut h, 8 * MIB, &prop, 0));
                let mut fd: i32 = -1;
                ok(cu::cuMemExportToShareableHandle(
                    &mut fd as *mut i32 as *mut c_void,
                    h,
                    fd_type,
                    0,
                ));
                println!("exported {} {fd}", std::process::id());
                wait_line(); // the importer holds a handle now
                ok(cu::cuMemRelease(h));
                assert_eq!(
                    base - free_mem(),
                    importer_ctx + 8 * MIB,
                    "imported elsewhere: still alive"
                );
                println!("released");
                wait_line(); // the importer released its handle
                             // (The importer has exited by now, its context with it.)
                assert_eq!(
                    free_mem(),
                    base,
                    "the last handle is gone, and so is the memory"
                );
            } else {
                let path = std::env::var("EXPORTED").unwrap();
                // A new description of the exporter's file, as SCM_RIGHTS would pass it on.
                let f = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(&path)
                    .unwrap();
                let mut imported = 0;
                ok(cu::cuMemImportFromShareableHandle(
                    &mut imported,
                    std::os::fd::AsRawFd::as_raw_fd(&f) as usize as *mut c_void,
                    fd_type,
                ));
                println!("imported");
                wait_line();
                ok(cu::cuMemRelease(imported));
            }
        }
        return;
    }
    let state = common::state_file("vmm-export");
    let spawn = |role: &str, extra: Option<(&str, &str)>| {
        let mut c =
            common::Child::new("exported_memory_lives_while_another_process_holds_an_import")
                .state(&state)
                .env("ROLE", role);
        if let Some((k, v)) = extra {
            c = c.env(k, v);
        }
        let mut child = c
            .command()
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        (child, out)
    };
    let until = |out: &mut BufReader<std::process::ChildStdout>, word: &str| {
        let mut line = String::new();
        while !line.contains(word) {
            line.clear();
            assert!(
                out.read_line(&mut line).unwrap() > 0,
                "ended before {word:?}"
            );
        }
        line
    };
    let (mut exporter, mut eout) = spawn("exporter", None);
    let line = until(&mut eout, "exported ");
    let mut words = line.trim().rsplit("exported ").next().unwrap().split(' ');
    let (pid, fd) = (words.next().unwrap(), words.next().unwrap());
    let path = format!("/proc/{pid}/fd/{fd}");
    let (mut importer, mut iout) = spawn("importer", Some(("EXPORTED", path.as_str())));
    until(&mut iout, "imported");
    writeln!(exporter.stdin.as_mut().unwrap()).unwrap();
    until(&mut eout, "released");
    writeln!(importer.stdin.as_mut().unwrap()).unwrap();
    assert!(importer.wait().unwrap().success(), "importer failed");
    writeln!(exporter.stdin.as_mut().unwrap()).unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut eout, &mut rest).unwrap();
    assert!(exporter.wait().unwrap().success(), "exporter: {rest}");
    assert!(rest.contains("1 passed"), "exporter: {rest}");
}

/// The CUDA 13.0 forms that name their context (`cuCtxGetDevice_v2(CUdevice*, CUcontext)`,
/// `cuCtxSynchronize_v2(CUcontext)`; NULL is the current context, CUDA 13 driver API
/// reference) and the stream queries libcudart 13 resolves: `cuStreamGetCtx_v2` (12.5),
/// `cuStreamGetCaptureInfo` v1/v2/v3, `cuThreadExchangeStreamCaptureMode`,
/// `cuGraphInstantiateWithParams`.
#[test]
fn cuda13_entry_points_name_their_context_and_capture() {
    in_child!(
        "cuda13_entry_points_name_their_context_and_capture",
        "dgx1-v100"
    );
    let primary0 = setup(); // loads the driver, in which raw() looks
    type GetDeviceV2 = extern "C" fn(*mut cu::CUdevice, cu::CUcontext) -> R;
    type SynchronizeV2 = extern "C" fn(cu::CUcontext) -> R;
    let get_device: GetDeviceV2 = raw("cuCtxGetDevice_v2");
    let synchronize: SynchronizeV2 = raw("cuCtxSynchronize_v2");
    // The 10.1 form, which cudarc's 12.x bindings no longer declare.
    type CaptureInfoV1 = extern "C" fn(cu::CUstream, *mut cu::CUstreamCaptureStatus, *mut u64) -> R;
    let capture_info_v1: CaptureInfoV1 = raw("cuStreamGetCaptureInfo");
    let f = busy_function("sim_busy13");
    // SAFETY: see the file-level note.
    unsafe {
        // A context of device 3, pushed over device 0's primary one.
        let mut other = null_mut();
        ok(cu::cuCtxCreate_v2(&mut other, 0, 3));
        let mut dev = -1;
        ok(get_device(&mut dev, null_mut()));
        assert_eq!(dev, 3, "NULL: the current context");
        ok(get_device(&mut dev, primary0));
        assert_eq!(dev, 0, "a named context, not the current one");
        assert_eq!(get_device(null_mut(), null_mut()), CUDA_ERROR_INVALID_VALUE);
        assert_eq!(
            get_device(&mut dev, 0x10 as cu::CUcontext),
            CUDA_ERROR_INVALID_CONTEXT
        );

        // cuCtxSynchronize_v2 on the context that is not current waits for that one's work.
        let mut popped = null_mut();
        ok(cu::cuCtxPopCurrent_v2(&mut popped));
        assert_eq!(popped, other);
        ok(launch_busy(f, 100_000_000, null_mut()));
        assert_eq!(cu::cuStreamQuery(null_mut()), CUDA_ERROR_NOT_READY);
        ok(synchronize(other));
        assert_eq!(
            cu::cuStreamQuery(null_mut()),
            CUDA_ERROR_NOT_READY,
            "device 3's context had no work; device 0's is still busy"
        );
        ok(synchronize(null_mut()));
        ok(cu::cuStreamQuery(null_mut()));
        ok(cu::cuCtxDestroy_v2(other));
        assert_eq!(synchronize(other), CUDA_ERROR_INVALID_CONTEXT);

        // cuStreamGetCtx_v2: the stream's context, and no green context.
        let mut s = null_mut();
        ok(cu::cuStreamCreate(&mut s, 0));
        let (mut c, mut green) = (null_mut(), 0x1 as cu::CUgreenCtx);
        ok(cu::cuStreamGetCtx_v2(s, &mut c, &mut green));
        assert_eq!((c, green), (primary0, null_mut()));
        ok(cu::cuStreamGetCtx_v2(null_mut(), &mut c, &mut green));
        assert_eq!(c, primary0, "the NULL stream: the current context");

        // Capture info in its three forms.
        use cu::CUstreamCaptureStatus::*;
        let mut status = CU_STREAM_CAPTURE_STATUS_ACTIVE;
        let mut id = 0u64;
        ok(capture_info_v1(s, &mut status, &mut id));
        assert_eq!(status, CU_STREAM_CAPTURE_STATUS_NONE);
        ok(cu::cuStreamBeginCapture_v2(
            s,
            cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        ));
        let (mut graph, mut deps, mut edges, mut n) =
            (null_mut(), std::ptr::null(), std::ptr::null(), 9);
        ok(cu::cuStreamGetCaptureInfo_v3(
            s,
            &mut status,
            &mut id,
            &mut graph,
            &mut deps,
            &mut edges,
            &mut n,
        ));
        assert_eq!(status, CU_STREAM_CAPTURE_STATUS_ACTIVE);
        assert!(id != 0 && !graph.is_null());
        assert_eq!(n, 0, "nothing captured yet: no dependencies");
        ok(launch_busy(f, 10_000_000, s));
        ok(launch_busy(f, 10_000_000, s));
        let (mut id2, mut graph2) = (0u64, null_mut());
        ok(cu::cuStreamGetCaptureInfo_v2(
            s,
            &mut status,
            &mut id2,
            &mut graph2,
            &mut deps,
            &mut n,
        ));
        assert_eq!((id2, graph2, n), (id, graph, 1), "one sequence, one graph");
        let mut count = 0;
        ok(cu::cuGraphGetNodes(graph, null_mut(), &mut count));
        assert_eq!(count, 2);
        let mut nodes = [null_mut(); 2];
        ok(cu::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut count));
        assert_eq!(
            *deps, nodes[1],
            "the next node depends on the last one captured"
        );
        assert_eq!(
            cu::cuStreamGetCaptureInfo_v3(
                s,
                &mut status,
                null_mut(),
                null_mut(),
                null_mut(),
                &mut edges,
                null_mut()
            ),
            CUDA_ERROR_INVALID_VALUE,
            "edge data without dependencies"
        );
        let mut g = null_mut();
        ok(cu::cuStreamEndCapture(s, &mut g));
        assert_eq!(g, graph, "the graph captured into is the one handed over");
        let mut id3 = 0u64;
        ok(cu::cuStreamBeginCapture_v2(
            s,
            cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
        ));
        ok(capture_info_v1(s, &mut status, &mut id3));
        assert!(id3 != id, "ids are unique per sequence");
        let mut g3 = null_mut();
        ok(cu::cuStreamEndCapture(s, &mut g3));
        ok(cu::cuGraphDestroy(g3));

        // The thread's capture mode: set, and the previous one back.
        use cu::CUstreamCaptureMode::*;
        let mut mode = CU_STREAM_CAPTURE_MODE_RELAXED;
        ok(cu::cuThreadExchangeStreamCaptureMode(&mut mode));
        assert_eq!(
            mode, CU_STREAM_CAPTURE_MODE_GLOBAL,
            "a thread starts global"
        );
        ok(cu::cuThreadExchangeStreamCaptureMode(&mut mode));
        assert_eq!(mode, CU_STREAM_CAPTURE_MODE_RELAXED);
        assert_eq!(
            cu::cuThreadExchangeStreamCaptureMode(null_mut()),
            CUDA_ERROR_INVALID_VALUE
        );

        // Instantiated with parameters (and uploaded), the graph runs its 2 x 10 ms.
        let mut params = cu::CUDA_GRAPH_INSTANTIATE_PARAMS {
            flags: 2, // CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD
            hUploadStream: s,
            hErrNode_out: 0x1 as cu::CUgraphNode,
            result_out: cu::CUgraphInstantiateResult::CUDA_GRAPH_INSTANTIATE_ERROR,
        };
        let mut exec = null_mut();
        ok(cu::cuGraphInstantiateWithParams(&mut exec, g, &mut params));
        assert_eq!(
            params.result_out,
            cu::CUgraphInstantiateResult::CUDA_GRAPH_INSTANTIATE_SUCCESS
        );
        assert!(params.hErrNode_out.is_null());
        let (a, b) = (event(), event());
        ok(cu::cuEventRecord(a, s));
        ok(cu::cuGraphLaunch(exec, s));
        ok(cu::cuEventRecord(b, s));
        let ms = elapsed_ms(a, b);
        assert!((19.0..=23.0).contains(&ms), "2 x 10 ms took {ms} ms");
        params.flags = 1 << 40;
        assert_eq!(
            cu::cuGraphInstantiateWithParams(&mut exec, g, &mut params),
            CUDA_ERROR_INVALID_VALUE
        );
    }
}

/// CUDA 12.0's libraries: loaded without a context, their kernels are context-independent
/// handles that the launches take where a function goes (cuda.h: "f - Function CUfunction or
/// Kernel CUkernel to launch"), and that cuKernelGetFunction turns into the current context's
/// function. cuGetProcAddress resolves each at 12000.
#[test]
fn libraries_load_without_a_context_and_their_kernels_launch() {
    in_child!("libraries_load_without_a_context_and_their_kernels_launch");
    // SAFETY: see the file-level note.
    unsafe {
        ok(cu::cuInit(0));
        let mut lib = null_mut();
        ok(cu::cuLibraryLoadData(
            &mut lib,
            c"image".as_ptr() as *const c_void,
            null_mut(),
            null_mut(),
            0,
            null_mut(),
            null_mut(),
            0,
        ));
        assert_eq!(
            cu::cuLibraryLoadData(
                &mut lib,
                c"image".as_ptr() as *const c_void,
                null_mut(),
                null_mut(),
                1,
                null_mut(),
                null_mut(),
                0
            ),
            CUDA_ERROR_INVALID_VALUE,
            "one JIT option and no array"
        );
        let mut k = null_mut();
        ok(cu::cuLibraryGetKernel(
            &mut k,
            lib,
            c"sim_busy_lib".as_ptr(),
        ));
        let mut again = null_mut();
        ok(cu::cuLibraryGetKernel(
            &mut again,
            lib,
            c"sim_busy_lib".as_ptr(),
        ));
        assert_eq!(k, again, "one kernel per name");
        let mut f = null_mut();
        assert_eq!(
            cu::cuKernelGetFunction(&mut f, k),
            CUDA_ERROR_INVALID_CONTEXT,
            "a function is a context's"
        );

        setup();
        ok(cu::cuKernelGetFunction(&mut f, k));
        let mut m = null_mut();
        ok(cu::cuLibraryGetModule(&mut m, lib));
        let mut from_module = null_mut();
        ok(cu::cuModuleGetFunction(
            &mut from_module,
            m,
            c"sim_busy_lib".as_ptr(),
        ));
        assert_eq!(from_module, f, "the kernel's function is the module's");
        let (mut dptr, mut bytes) = (0, 0);
        assert_eq!(
            cu::cuLibraryGetGlobal(&mut dptr, &mut bytes, lib, c"g".as_ptr()),
            CUDA_ERROR_NOT_FOUND
        );

        // The kernel launches as its function does, and takes its time.
        let mut s = null_mut();
        ok(cu::cuStreamCreate(&mut s, 0));
        let (a, b) = (event(), event());
        ok(cu::cuEventRecord(a, s));
        ok(launch_busy(k as cu::CUfunction, 20_000_000, s));
        let mut ns: u64 = 10_000_000;
        let mut args = [&mut ns as *mut u64 as *mut c_void];
        let cfg = cu::CUlaunchConfig {
            gridDimX: 1,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: 32,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: 0,
            hStream: s,
            attrs: null_mut(),
            numAttrs: 0,
        };
        ok(cu::cuLaunchKernelEx(
            &cfg,
            k as cu::CUfunction,
            args.as_mut_ptr(),
            null_mut(),
        ));
        ok(cu::cuEventRecord(b, s));
        let ms = elapsed_ms(a, b);
        assert!((29.0..=33.0).contains(&ms), "20 + 10 ms took {ms} ms");

        // Resolved by version, to the exported functions.
        type Gpa = extern "C" fn(*const i8, *mut *mut c_void, i32, u64, *mut i32) -> R;
        let gpa: Gpa = raw("cuGetProcAddress_v2");
        for name in [
            "cuLibraryLoadData",
            "cuLibraryLoadFromFile",
            "cuLibraryUnload",
            "cuLibraryGetKernel",
            "cuLibraryGetModule",
            "cuLibraryGetGlobal",
            "cuKernelGetFunction",
        ] {
            let c = CString::new(name).unwrap();
            let (mut p, mut status) = (null_mut(), -1);
            ok(gpa(c.as_ptr(), &mut p, 12000, 0, &mut status));
            assert_eq!(p, raw::<*mut c_void>(name), "{name}");
            assert_eq!(
                gpa(c.as_ptr(), &mut p, 11080, 0, &mut status),
                CUDA_ERROR_NOT_FOUND
            );
            assert_eq!(status, 2, "{name}: VERSION_NOT_SUFFICIENT before 12.0");
        }

        // Unloaded, the library takes its kernels and their functions with it.
        ok(cu::cuLibraryUnload(lib));
        assert_eq!(
            cu::cuKernelGetFunction(&mut f, k),
            CUDA_ERROR_INVALID_HANDLE
        );
        assert_eq!(
            launch_busy(k as cu::CUfunction, 1, s),
            CUDA_ERROR_INVALID_HANDLE
        );
        assert_eq!(launch_busy(f, 1, s), CUDA_ERROR_INVALID_HANDLE);
        assert_eq!(cu::cuLibraryUnload(lib), CUDA_ERROR_INVALID_HANDLE);
        assert_eq!(
            cu::cuLibraryLoadFromFile(
                &mut lib,
                c"/nonexistent/lib.cubin".as_ptr(),
                null_mut(),
                null_mut(),
                0,
                null_mut(),
                null_mut(),
                0
            ),
            CUDA_ERROR_FILE_NOT_FOUND
        );
    }
}

/// PyTorch's cudaMallocAsync backend sets the default pool's release threshold to UINT64_MAX
/// ("never release"): the pool then keeps what it reserved at every sync point, and trimming
/// to that threshold must not overflow (it did: `round_up(u64::MAX, 2 MiB)` panicked inside
/// cuStreamSynchronize, which libcudart saw as an unknown error).
#[test]
fn a_release_threshold_of_u64_max_keeps_the_pool() {
    in_child!("a_release_threshold_of_u64_max_keeps_the_pool");
    setup();
    let base = free_mem();
    use cu::CUmemPool_attribute::*;
    // SAFETY: see the file-level note.
    unsafe {
        let mut pool = null_mut();
        ok(cu::cuDeviceGetDefaultMemPool(&mut pool, 0));
        let mut never = u64::MAX;
        ok(cu::cuMemPoolSetAttribute(
            pool,
            CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut never as *mut u64 as *mut c_void,
        ));
        let mut p = 0;
        ok(cu::cuMemAllocAsync(&mut p, 3 * MIB, null_mut()));
        ok(cu::cuMemFreeAsync(p, null_mut()));
        ok(cu::cuStreamSynchronize(null_mut()));
        ok(cu::cuCtxSynchronize());
        assert_eq!(
            base - free_mem(),
            4 * MIB,
            "kept in the pool at the sync points"
        );
        let mut zero = 0u64;
        ok(cu::cuMemPoolSetAttribute(
            pool,
            CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut zero as *mut u64 as *mut c_void,
        ));
        ok(cu::cuStreamSynchronize(null_mut()));
        assert_eq!(free_mem(), base, "and released once the threshold is 0");
    }
}

/// The driver entry points PyTorch 2.8's c10 DriverAPI resolves (through
/// cudaGetDriverEntryPoint) at its first allocation, asserting each is found: resolvable by
/// version to the exported functions. The multicast ones answer CUDA_ERROR_NOT_SUPPORTED (not
/// modelled); cuStreamWriteValue32 is modelled (tests/c/streams.c).
#[test]
fn entry_points_pytorch_resolves_are_found_and_not_supported() {
    in_child!("entry_points_pytorch_resolves_are_found_and_not_supported");
    setup();
    type Gpa = extern "C" fn(*const i8, *mut *mut c_void, i32, u64, *mut i32) -> R;
    type NoArgs = extern "C" fn() -> R;
    let gpa: Gpa = raw("cuGetProcAddress_v2");
    for (name, version, symbol, stub) in [
        ("cuStreamWriteValue32", 8000, "cuStreamWriteValue32", false),
        (
            "cuStreamWriteValue32",
            12080,
            "cuStreamWriteValue32_v2",
            false,
        ),
        ("cuMulticastCreate", 12080, "cuMulticastCreate", true),
        ("cuMulticastAddDevice", 12080, "cuMulticastAddDevice", true),
        ("cuMulticastBindMem", 12080, "cuMulticastBindMem", true),
    ] {
        let c = CString::new(name).unwrap();
        let (mut p, mut status) = (null_mut(), -1);
        ok(gpa(c.as_ptr(), &mut p, version, 0, &mut status));
        assert_eq!(status, 0, "{name} at {version}");
        assert_eq!(p, raw::<*mut c_void>(symbol), "{name} at {version}");
        if stub {
            // SAFETY: a C function of this library; without arguments it reads none.
            let f: NoArgs = unsafe { std::mem::transmute::<*mut c_void, NoArgs>(p) };
            assert_eq!(f(), CUDA_ERROR_NOT_SUPPORTED, "{symbol}");
        }
    }
    let c = CString::new("cuMulticastCreate").unwrap();
    let (mut p, mut status) = (null_mut(), -1);
    assert_eq!(
        gpa(c.as_ptr(), &mut p, 12000, 0, &mut status),
        CUDA_ERROR_NOT_FOUND
    );
    assert!(p.is_null(), "cuMulticastCreate is CUDA 12.1");
}

/// Every entry point the simulated libcuda exports is also reachable the way libcudart and the
/// frameworks find them, by cuGetProcAddress: its base name (the symbol less `_vN`, `_ptds`,
/// `_ptsz`) resolves at CUDA 13.5, and each exported symbol is what some version of its base
/// name answers (flags 0 and per-thread). The real driver resolves everything it exports (see
/// proc_table.rs, {ZT}); a name left out of the table answered CUDA_ERROR_NOT_FOUND here, so a
/// runtime's cudaDeviceCanAccessPeer or cudaFuncSetCacheConfig failed on the simulator.
/// The exported names come from the library's dynamic symbol table (`nm -D`, binutils). The
/// library exports CUDA 13.5's surface, so this runs on a machine whose driver reports 13.5
/// (13050): a 13.0 driver answers CUDA_ERROR_INVALID_VALUE for the newer versions.
#[test]
fn every_exported_entry_point_is_resolvable() {
    if !common::is_child() {
        let model =
            std::env::temp_dir().join(format!("cuvisor-resolvable-{}.toml", std::process::id()));
        std::fs::write(
            &model,
            "driver_version = 13050\n[[device]]\nmemory = \"16Gi\"\n",
        )
        .unwrap();
        common::Child::new("every_exported_entry_point_is_resolvable")
            .preset(model.to_str().unwrap())
            .run()
            .success();
        let _ = std::fs::remove_file(&model);
        return;
    }
    setup();
    type Gpa = extern "C" fn(*const i8, *mut *mut c_void, i32, u64, *mut i32) -> R;
    let gpa: Gpa = raw("cuGetProcAddress_v2");
    let lib = common::sim_dir().join("libcuda.so.1");
    let nm = std::process::Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(&lib)
        .output()
        .expect("run nm (binutils)");
    assert!(nm.status.success(), "nm -D {}", lib.display());
    let exported: Vec<String> = String::from_utf8_lossy(&nm.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2))
        // cuvisorSimUnsupported: the stub table for tests, not a CUDA entry point.
        .filter(|s| s.starts_with("cu") && !s.starts_with("cuvisor"))
        .map(String::from)
        .collect();
    assert!(exported.len() > 250, "{} exports", exported.len());
    let base_of = |s: &str| -> String {
        let s = s.trim_end_matches("_ptds").trim_end_matches("_ptsz");
        match s.rfind("_v") {
            Some(i) if s[i + 2..].chars().all(|c| c.is_ascii_digit()) && i + 2 < s.len() => {
                s[..i].to_string()
            }
            _ => s.to_string(),
        }
    };
    // Versions at which an ABI changed, from the table's sources; the answers at these reach every
    // versioned symbol.
    // 5050: the CUDA 5.5 linker entry points (cuLinkCreate, cuLinkAddData, cuLinkAddFile v1).
    let versions = [
        2000, 3000, 3020, 4000, 5050, 6050, 7000, 8000, 9020, 10000, 11000, 11020, 11030, 11040,
        11070, 12000, 12020, 12050, 12080, 13000, 13010, 13020, 13030, 13040, 13050,
    ];
    let mut unresolved = Vec::new();
    let mut unreachable = Vec::new();
    for sym in &exported {
        let base = CString::new(base_of(sym)).unwrap();
        let want: *mut c_void = raw(sym);
        let (mut p, mut status) = (null_mut(), -1);
        if gpa(base.as_ptr(), &mut p, 13050, 0, &mut status) != CUDA_SUCCESS {
            unresolved.push(sym.clone());
            continue;
        }
        let reached = versions.iter().any(|&v| {
            [0, 2].iter().any(|&flags| {
                let (mut p, mut status) = (null_mut(), -1);
                gpa(base.as_ptr(), &mut p, v, flags, &mut status) == CUDA_SUCCESS && p == want
            })
        });
        if !reached {
            unreachable.push(sym.clone());
        }
    }
    assert!(
        unresolved.is_empty(),
        "exported, but cuGetProcAddress does not know their base name: {unresolved:?}"
    );
    assert!(
        unreachable.is_empty(),
        "exported, but no version of their base name answers them: {unreachable:?}"
    );
}

/// cuMemSetAccess over mappings of several handles side by side, as PyTorch's expandable
/// segments do (93 handles of 20 MiB, then one cuMemSetAccess over all 1.95 GB): accepted; a
/// range with an unmapped gap, or past the last mapping, is not.
#[test]
fn set_access_spans_adjacent_mappings() {
    in_child!("set_access_spans_adjacent_mappings");
    setup();
    // SAFETY: see the file-level note.
    unsafe {
        let mut prop: cu::CUmemAllocationProp = std::mem::zeroed();
        prop.type_ = cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type_ = cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        let access = cu::CUmemAccessDesc {
            location: prop.location,
            flags: cu::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        let mut va = 0;
        ok(cu::cuMemAddressReserve(&mut va, 16 * MIB, 0, 0, 0));
        let mut h = [0; 3];
        for (i, h) in h.iter_mut().enumerate() {
            ok(cu::cuMemCreate(h, 2 * MIB, &prop, 0));
            // The third leaves a 2 MiB gap after the second.
            let at = if i < 2 { i * 2 * MIB } else { 6 * MIB };
            ok(cu::cuMemMap(va + at as u64, 2 * MIB, 0, *h, 0));
        }
        ok(cu::cuMemSetAccess(va, 4 * MIB, &access, 1));
        ok(cu::cuMemSetAccess(va + MIB as u64, 2 * MIB, &access, 1));
        assert_eq!(
            cu::cuMemSetAccess(va, 8 * MIB, &access, 1),
            CUDA_ERROR_INVALID_VALUE,
            "a gap"
        );
        assert_eq!(
            cu::cuMemSetAccess(va + 6 * MIB as u64, 4 * MIB, &access, 1),
            CUDA_ERROR_INVALID_VALUE,
            "past the last mapping"
        );
        ok(cu::cuMemSetAccess(va + 6 * MIB as u64, 2 * MIB, &access, 1));
        for (i, h) in h.iter().enumerate() {
            let at = if i < 2 { i * 2 * MIB } else { 6 * MIB };
            ok(cu::cuMemUnmap(va + at as u64, 2 * MIB));
            ok(cu::cuMemRelease(*h));
        }
        ok(cu::cuMemAddressFree(va, 16 * MIB));
    }
}

/// cuBLASLt 12.8 resolves these driver entry points with dlsym on libcuda.so.1 when a handle is
/// created (in this order; recorded on the simulator with a breakpoint on dlsym during
/// cublasCreate_v2, PyTorch 2.8 with nvidia-cublas-cu12 12.8.4.1) and fails cublasLtCtxInit with
/// "Driver API initialization failed" when any is missing (cublasCreate: INTERNAL_ERROR).
#[test]
fn every_entry_point_cublaslt_resolves_is_exported() {
    in_child!("every_entry_point_cublaslt_resolves_is_exported");
    setup();
    for name in [
        "cuInit",
        "cuDriverGetVersion",
        "cuKernelGetFunction",
        "cuKernelGetAttribute",
        "cuKernelSetAttribute",
        "cuLibraryGetKernel",
        "cuLibraryLoadData",
        "cuModuleLoadData",
        "cuModuleLoadDataEx",
        "cuModuleUnload",
        "cuModuleGetFunction",
        "cuModuleGetGlobal_v2",
        "cuLaunchKernel",
        "cuLaunchKernelEx",
        "cuGetErrorName",
        "cuLinkCreate_v2",
        "cuLinkAddData_v2",
        "cuLinkComplete",
        "cuLinkDestroy",
        "cuFuncSetAttribute",
        "cuFuncGetAttribute",
        "cuFuncSetCacheConfig",
        "cuOccupancyMaxActiveBlocksPerMultiprocessor",
        "cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags",
        "cuCtxGetCurrent",
        "cuCtxSetCurrent",
        "cuCtxGetLimit",
        "cuCtxSynchronize",
        "cuDevicePrimaryCtxRetain",
        "cuDevicePrimaryCtxRelease",
        "cuEventCreate",
        "cuEventDestroy_v2",
        "cuEventElapsedTime",
        "cuEventQuery",
        "cuEventRecord",
        "cuEventSynchronize",
        "cuStreamWaitEvent",
        "cuCtxPushCurrent_v2",
        "cuCtxPopCurrent_v2",
        "cuCtxGetDevice",
        "cuDeviceGet",
        "cuDeviceGetAttribute",
        "cuStreamWaitValue32",
        "cuStreamBatchMemOp",
        "cuStreamGetCaptureInfo_v2",
        "cuStreamGetCtx",
        "cuDeviceTotalMem_v2",
        "cuDeviceGetName",
        "cuMemGetInfo_v2",
        "cuGraphKernelNodeGetParams",
        "cuGraphExecKernelNodeSetParams",
        "cuGraphExecDestroy",
        "cuGraphLaunch",
        "cuGraphDestroy",
        "cuGraphInstantiate",
        "cuGraphGetNodes",
        "cuGraphNodeGetType",
        "cuMemAlloc_v2",
        "cuMemFree_v2",
        "cuMemcpyHtoD_v2",
        "cuMemcpy",
        "cuMemcpyAsync",
        "cuMemcpy2DAsync_v2",
        "cuMemcpyDtoDAsync_v2",
        "cuMemsetD8_v2",
        "cuMemPrefetchAsync",
        "cuPointerGetAttribute",
        "cuPointerGetAttributes",
        "cuGetExportTable",
        "cuStreamCreate",
        "cuStreamDestroy_v2",
        "cuStreamBeginCapture_v2",
        "cuThreadExchangeStreamCaptureMode",
        "cuStreamEndCapture",
        "cuStreamIsCapturing",
        "cuStreamSynchronize",
        "cuGetErrorString",
        "cuCtxDisablePeerAccess",
        "cuCtxEnablePeerAccess",
        "cuDeviceCanAccessPeer",
    ] {
        let _: *const c_void = raw(name);
    }
}

/// An A100 (sm_80) reserves 1 KiB of shared memory per block, which is why its opt-in maximum
/// per block is the per-SM 164 KiB less 1 KiB; cudaDeviceProp::reservedSharedMemPerBlock reads
/// this attribute.
#[test]
fn reserved_shared_memory_per_block_is_what_sm_80_reserves() {
    in_child!("reserved_shared_memory_per_block_is_what_sm_80_reserves");
    let attr = |a: cu::CUdevice_attribute| {
        let mut v = 0;
        // SAFETY: see the file-level note.
        unsafe { ok(cu::cuDeviceGetAttribute(&mut v, a, 0)) };
        v
    };
    setup();
    let reserved =
        attr(cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK);
    assert_eq!(reserved, 1024);
    assert_eq!(
        attr(cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            + reserved,
        attr(cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)
    );
}

/// The entry points added for cuBLASLt that the simulator models: occupancy with flags answers
/// as without, a library kernel's attributes are its function's, and cuPointerGetAttributes
/// answers each attribute as cuPointerGetAttribute does.
#[test]
fn occupancy_with_flags_kernel_attributes_and_pointer_attributes() {
    in_child!("occupancy_with_flags_kernel_attributes_and_pointer_attributes");
    setup();
    let f = busy_function("sim_busy");
    type Occ = extern "C" fn(*mut i32, cu::CUfunction, i32, usize) -> R;
    type OccFlags = extern "C" fn(*mut i32, cu::CUfunction, i32, usize, u32) -> R;
    type KernelAttr = extern "C" fn(*mut i32, i32, *mut c_void, i32) -> R;
    type KernelSetAttr = extern "C" fn(i32, i32, *mut c_void, i32) -> R;
    type PtrAttrs = extern "C" fn(u32, *const i32, *mut *mut c_void, u64) -> R;
    let (occ, occ_flags): (Occ, OccFlags) = (
        raw("cuOccupancyMaxActiveBlocksPerMultiprocessor"),
        raw("cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags"),
    );
    let (mut a, mut b) = (0, 0);
    assert_eq!(occ(&mut a, f, 256, 0), CUDA_SUCCESS);
    assert_eq!(occ_flags(&mut b, f, 256, 0, 1), CUDA_SUCCESS);
    assert_eq!(a, b);
    assert_eq!(occ_flags(&mut b, f, 256, 0, 2), CUDA_ERROR_INVALID_VALUE);

    let (get, set): (KernelAttr, KernelSetAttr) =
        (raw("cuKernelGetAttribute"), raw("cuKernelSetAttribute"));
    let (mut lib, mut k) = (null_mut(), null_mut());
    // SAFETY: see the file-level note.
    unsafe {
        ok(cu::cuLibraryLoadData(
            &mut lib,
            c"image".as_ptr() as *const c_void,
            null_mut(),
            null_mut(),
            0,
            null_mut(),
            null_mut(),
            0,
        ));
        ok(cu::cuLibraryGetKernel(
            &mut k,
            lib,
            c"sim_busy_lib".as_ptr(),
        ));
    }
    let mut threads = 0;
    // CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0
    assert_eq!(get(&mut threads, 0, k as *mut c_void, 0), CUDA_SUCCESS);
    assert_eq!(threads, 1024);
    assert_eq!(
        get(&mut threads, 0, null_mut(), 0),
        CUDA_ERROR_INVALID_HANDLE
    );
    // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
    assert_eq!(set(8, 65536, k as *mut c_void, 0), CUDA_SUCCESS);

    let attrs: PtrAttrs = raw("cuPointerGetAttributes");
    let mut p = 0;
    // SAFETY: see the file-level note.
    unsafe { ok(cu::cuMemAlloc_v2(&mut p, MIB)) };
    let (mut one, mut many) = (0u32, 0u32);
    // CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
    // SAFETY: see the file-level note.
    unsafe {
        ok(cu::cuPointerGetAttribute(
            &mut one as *mut u32 as *mut c_void,
            cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            p,
        ))
    };
    let mut data = [&mut many as *mut u32 as *mut c_void];
    assert_eq!(attrs(1, [2].as_ptr(), data.as_mut_ptr(), p), CUDA_SUCCESS);
    assert_eq!(one, many);
    assert_eq!(
        attrs(1, null_mut(), data.as_mut_ptr(), p),
        CUDA_ERROR_INVALID_VALUE
    );
}

/// A graph memory attribute of device 0 (cuDeviceGetGraphMemAttribute).
fn graph_mem(attr: cu::CUgraphMem_attribute) -> usize {
    let mut v = 0u64;
    // SAFETY: see the file-level note.
    unsafe {
        ok(cu::cuDeviceGetGraphMemAttribute(
            0,
            attr,
            &mut v as *mut u64 as *mut c_void,
        ))
    };
    v as usize
}

/// A memory-allocation node of `bytes` on device 0, at the root of `g`: (node, address).
fn alloc_node(g: cu::CUgraph, bytes: usize) -> (cu::CUgraphNode, cu::CUdeviceptr) {
    // SAFETY: zeroed is a valid CUDA_MEM_ALLOC_NODE_PARAMS (null pointers, zero counts).
    let mut p: cu::CUDA_MEM_ALLOC_NODE_PARAMS = unsafe { std::mem::zeroed() };
    p.poolProps.allocType = cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.poolProps.location.type_ = cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    p.poolProps.location.id = 0;
    p.bytesize = bytes;
    let mut node = null_mut();
    // SAFETY: see the file-level note.
    unsafe {
        ok(cu::cuGraphAddMemAllocNode(
            &mut node,
            g,
            null_mut(),
            0,
            &mut p,
        ))
    };
    assert_ne!(p.dptr, 0, "the node's address is returned at creation");
    (node, p.dptr)
}

/// The CUDA Programming Guide, "Graph Memory Nodes": a memory-allocation node's address is
/// fixed when it is made, with no memory behind it; "Physical memory cannot be allocated or
/// mapped during graph instantiation ... Mapping is done instead during graph launch" (16.5.1);
/// the memory comes from the device's graph memory pool and stays reserved after it is freed,
/// until cuDeviceGraphMemTrim releases what is not in use (16.6). The four attributes say so.
#[test]
fn graph_memory_is_taken_at_launch_kept_after_free_and_given_back_by_trim() {
    in_child!("graph_memory_is_taken_at_launch_kept_after_free_and_given_back_by_trim");
    setup();
    use cu::CUgraphMem_attribute::*;
    let base = free_mem();
    // SAFETY: see the file-level note.
    unsafe {
        let mut g = null_mut();
        ok(cu::cuGraphCreate(&mut g, 0));
        let (node, dptr) = alloc_node(g, 100 * MIB);
        let mut ty = cu::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL;
        ok(cu::cuGraphNodeGetType(node, &mut ty));
        assert_eq!(ty, cu::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEM_ALLOC);
        let mut p: cu::CUDA_MEM_ALLOC_NODE_PARAMS = std::mem::zeroed();
        ok(cu::cuGraphMemAllocNodeGetParams(node, &mut p));
        assert_eq!((p.bytesize, p.dptr), (100 * MIB, dptr));
        let mut exec = null_mut();
        ok(cu::cuGraphInstantiateWithFlags(&mut exec, g, 0));
        assert_eq!(
            free_mem(),
            base,
            "nothing taken at creation or instantiation"
        );
        assert_eq!(graph_mem(CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT), 0);

        let mut s = null_mut();
        ok(cu::cuStreamCreate(&mut s, 0));
        ok(cu::cuGraphLaunch(exec, s));
        assert_eq!(base - free_mem(), 100 * MIB, "taken when the graph runs");
        assert_eq!(graph_mem(CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT), 100 * MIB);
        assert_eq!(graph_mem(CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT), 100 * MIB);
        ok(cu::cuMemsetD8_v2(dptr, 7, 100 * MIB));
        assert_eq!(
            cu::cuGraphLaunch(exec, s),
            CUDA_ERROR_INVALID_VALUE,
            "its allocation is still unfreed (cuGraphLaunch's documented error)"
        );
        assert_eq!(
            cu::cuDeviceGraphMemTrim(0),
            CUDA_SUCCESS,
            "a live allocation is in use: nothing to trim"
        );
        assert_eq!(base - free_mem(), 100 * MIB);

        ok(cu::cuMemFree_v2(dptr));
        assert_eq!(graph_mem(CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT), 0);
        assert_eq!(
            base - free_mem(),
            100 * MIB,
            "freed, but still reserved by the graph memory pool"
        );
        ok(cu::cuGraphLaunch(exec, s));
        assert_eq!(
            graph_mem(CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT),
            100 * MIB,
            "a relaunch reuses the pool's memory"
        );
        ok(cu::cuMemFreeAsync(dptr, s));
        ok(cu::cuGraphExecDestroy(exec));
        ok(cu::cuGraphDestroy(g));
        assert_eq!(base - free_mem(), 100 * MIB, "destroying keeps the pool");
        ok(cu::cuDeviceGraphMemTrim(0));
        assert_eq!(free_mem(), base, "trimmed back to the device");
        assert_eq!(graph_mem(CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT), 0);
        assert_eq!(graph_mem(CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH), 100 * MIB);
        assert_eq!(graph_mem(CU_GRAPH_MEM_ATTR_USED_MEM_HIGH), 100 * MIB);
        let mut zero = 0u64;
        ok(cu::cuDeviceSetGraphMemAttribute(
            0,
            CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH,
            &mut zero as *mut u64 as *mut c_void,
        ));
        assert_eq!(graph_mem(CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH), 0);
        let mut five = 5u64;
        assert_eq!(
            cu::cuDeviceSetGraphMemAttribute(
                0,
                CU_GRAPH_MEM_ATTR_USED_MEM_HIGH,
                &mut five as *mut u64 as *mut c_void,
            ),
            CUDA_ERROR_INVALID_VALUE,
            "a high watermark can only be reset to zero"
        );
    }
}

/// "During stream capture, this function results in the creation of an allocation node. In this
/// case, the allocation is owned by the graph instead of the memory pool" (cuMemAllocAsync,
/// CUDA driver API reference): the stream's pool does not grow, the device gives nothing at
/// capture; a captured cuMemFreeAsync is a free node. Graphs that free what they allocate share
/// the graph memory pool's memory between launches.
#[test]
fn a_captured_cumemallocasync_becomes_an_allocation_node_that_takes_nothing_at_capture() {
    in_child!(
        "a_captured_cumemallocasync_becomes_an_allocation_node_that_takes_nothing_at_capture"
    );
    setup();
    use cu::CUgraphMem_attribute::*;
    let base = free_mem();
    // SAFETY: see the file-level note.
    unsafe {
        let mut s = null_mut();
        ok(cu::cuStreamCreate(&mut s, 0));
        ok(cu::cuStreamBeginCapture_v2(
            s,
            cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
        ));
        let mut p = 0;
        ok(cu::cuMemAllocAsync(&mut p, 64 * MIB, s));
        assert_ne!(p, 0);
        let mut pool = null_mut();
        ok(cu::cuDeviceGetDefaultMemPool(&mut pool, 0));
        let mut reserved = 0u64;
        ok(cu::cuMemPoolGetAttribute(
            pool,
            cu::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
            &mut reserved as *mut u64 as *mut c_void,
        ));
        assert_eq!(reserved, 0, "the stream's pool does not grow");
        assert_eq!(free_mem(), base, "nothing taken at capture");
        ok(cu::cuMemFreeAsync(p, s));
        let mut g = null_mut();
        ok(cu::cuStreamEndCapture(s, &mut g));
        let mut count = 2;
        let mut nodes = [null_mut(); 2];
        ok(cu::cuGraphGetNodes(g, nodes.as_mut_ptr(), &mut count));
        let mut types = [cu::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL; 2];
        for i in 0..2 {
            ok(cu::cuGraphNodeGetType(nodes[i], &mut types[i]));
        }
        assert_eq!(
            types,
            [
                cu::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEM_ALLOC,
                cu::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEM_FREE
            ]
        );
        let mut freed = 0;
        ok(cu::cuGraphMemFreeNodeGetParams(nodes[1], &mut freed));
        assert_eq!(freed, p);

        let mut exec = null_mut();
        ok(cu::cuGraphInstantiateWithFlags(&mut exec, g, 0));
        assert_eq!(free_mem(), base);
        for _ in 0..3 {
            ok(cu::cuGraphLaunch(exec, s));
        }
        assert_eq!(
            graph_mem(CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT),
            64 * MIB,
            "three launches of a graph that frees what it allocates share one reservation"
        );
        assert_eq!(base - free_mem(), 64 * MIB);
        ok(cu::cuStreamSynchronize(s));
        assert_eq!(graph_mem(CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT), 0);
        ok(cu::cuDeviceGraphMemTrim(0));
        assert_eq!(free_mem(), base);
    }
}

/// A launch (or upload) whose graph memory the device cannot give fails with
/// CUDA_ERROR_OUT_OF_MEMORY and runs nothing: the documented lists name no error for it, and
/// this is the driver's error for an allocation that fails (ROCm's HIP reports the same case
/// as hipErrorOutOfMemory, ROCm/rocm-systems PR 7004). UNVERIFIED on a real GPU.
#[test]
fn a_graph_launch_the_device_cannot_back_fails_with_out_of_memory() {
    in_child!("a_graph_launch_the_device_cannot_back_fails_with_out_of_memory");
    setup();
    use cu::CUgraphMem_attribute::*;
    // SAFETY: see the file-level note.
    unsafe {
        let mut hog = 0;
        ok(cu::cuMemAlloc_v2(&mut hog, free_mem() - GIB));
        let base = free_mem();
        let mut g = null_mut();
        ok(cu::cuGraphCreate(&mut g, 0));
        let (_, dptr) = alloc_node(g, 2 * GIB);
        let mut exec = null_mut();
        ok(cu::cuGraphInstantiateWithFlags(
            &mut exec,
            g,
            cu::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH.0 as u64,
        ));
        let mut s = null_mut();
        ok(cu::cuStreamCreate(&mut s, 0));
        assert_eq!(cu::cuGraphUpload(exec, s), CUDA_ERROR_OUT_OF_MEMORY);
        assert_eq!(cu::cuGraphLaunch(exec, s), CUDA_ERROR_OUT_OF_MEMORY);
        assert_eq!(free_mem(), base, "a failed launch takes nothing");
        assert_eq!(graph_mem(CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT), 0);
        assert_eq!(
            cu::cuMemsetD8_v2(dptr, 1, 1),
            CUDA_ERROR_INVALID_VALUE,
            "not backed"
        );
        ok(cu::cuMemFree_v2(hog));
        ok(cu::cuGraphUpload(exec, s));
        assert_eq!(graph_mem(CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT), 2 * GIB);
        assert_eq!(
            graph_mem(CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT),
            0,
            "mapped, not live"
        );
        ok(cu::cuGraphLaunch(exec, s));
        ok(cu::cuGraphLaunch(exec, s));
        assert_eq!(
            graph_mem(CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT),
            2 * GIB,
            "AUTO_FREE_ON_LAUNCH freed the first launch's allocation"
        );
        ok(cu::cuCtxSynchronize());
    }
}
