//! cudarc (the crate, unmodified, loading libcuda dynamically) runs on the simulator: context,
//! allocation, copies, module load, `sim_busy` launches, stream sync and event timing.
mod common;

use cudarc::driver::{sys::CUevent_flags, CudaContext, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use std::time::Instant;

fn busy_fn(ctx: &std::sync::Arc<CudaContext>) -> cudarc::driver::CudaFunction {
    // Any image loads on the simulator; the function's name picks its behaviour.
    let module = ctx
        .load_module(Ptx::from_src("// simulated image\n"))
        .unwrap();
    module.load_function("sim_busy").unwrap()
}

#[test]
fn cudarc_context_memory_copies_and_timed_kernels() {
    if !common::is_child() {
        common::Child::new("cudarc_context_memory_copies_and_timed_kernels")
            .run()
            .success();
        return;
    }
    let ctx = CudaContext::new(0).unwrap();
    assert_eq!(CudaContext::device_count().unwrap(), 1);
    assert_eq!(ctx.total_mem().unwrap(), 16 << 30);
    assert!(ctx.name().unwrap().contains("simulated"));
    assert!(
        ctx.has_async_alloc(),
        "the simulator supports memory pools, so cudarc uses cuMemAllocAsync"
    );
    let stream = ctx.default_stream();

    // Allocation shows in cuMemGetInfo; the copy round-trips the bytes.
    let (free0, total) = ctx.mem_get_info().unwrap();
    let data: Vec<u32> = (0..4096).map(|i| i * 7 + 1).collect();
    let dev = stream.clone_htod(&data).unwrap();
    let (free1, _) = ctx.mem_get_info().unwrap();
    assert_eq!(total, 16 << 30);
    assert!(free1 < free0, "allocation is visible: {free0} -> {free1}");
    let back = stream.clone_dtoh(&dev).unwrap();
    assert_eq!(back, data);
    let zeros = stream.alloc_zeros::<u64>(1000).unwrap();
    assert!(stream.clone_dtoh(&zeros).unwrap().iter().all(|&x| x == 0));

    // sim_busy kernels run for the ns in their first argument; events time them.
    let f = busy_fn(&ctx);
    let cfg = LaunchConfig::for_num_elems(1);
    // cudarc's default events have timing disabled (as the real driver would refuse to time them).
    let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let start = stream.record_event(timing).unwrap();
    let t0 = Instant::now();
    for _ in 0..5 {
        let ns: u64 = 20_000_000; // 5 x 20 ms = 100 ms
        let mut b = stream.launch_builder(&f);
        b.arg(&ns);
        // SAFETY: the simulated kernel reads one u64 argument, which we pass.
        unsafe { b.launch(cfg) }.unwrap();
    }
    let launched = t0.elapsed();
    let end = stream.record_event(timing).unwrap();
    stream.synchronize().unwrap();
    let waited = t0.elapsed();
    let gpu_ms = start.elapsed_ms(&end).unwrap();
    let untimed = stream.record_event(None).unwrap();
    assert!(
        start.elapsed_ms(&untimed).is_err(),
        "an event without timing cannot be timed"
    );
    assert!(
        launched.as_millis() < 50,
        "launches are asynchronous: {launched:?}"
    );
    assert!(
        (90.0..=110.0).contains(&gpu_ms),
        "event time {gpu_ms} ms, expected 100 ms +/- 10 %"
    );
    assert!(
        waited.as_millis() >= 100 && waited.as_millis() < 150,
        "synchronize waited {waited:?}"
    );
}

#[test]
fn cudarc_streams_events_and_default_kernels() {
    if !common::is_child() {
        common::Child::new("cudarc_streams_events_and_default_kernels")
            .preset("dgx1-v100")
            .run()
            .success();
        return;
    }
    assert_eq!(CudaContext::device_count().unwrap(), 8);
    let ctx = CudaContext::new(3).unwrap();
    assert_eq!(ctx.total_mem().unwrap(), 16 << 30);
    let s1 = ctx.new_stream().unwrap();
    let f = busy_fn(&ctx);
    let ns: u64 = 50_000_000;
    let mut b = s1.launch_builder(&f);
    b.arg(&ns);
    // SAFETY: one u64 argument, as the simulated kernel expects.
    unsafe { b.launch(LaunchConfig::for_num_elems(1)) }.unwrap();
    let ev = s1.record_event(None).unwrap();
    assert!(!ev.is_complete(), "the 50 ms kernel is still running");
    ev.synchronize().unwrap();
    assert!(ev.is_complete());
    // A kernel that is not sim_busy runs for the model's default (10 us).
    let module = ctx.load_module(Ptx::from_src("x")).unwrap();
    let other = module.load_function("vector_add").unwrap();
    let t0 = Instant::now();
    for _ in 0..100 {
        let x: u64 = 1;
        let mut b = s1.launch_builder(&other);
        b.arg(&x);
        // SAFETY: the simulated kernel ignores its arguments.
        unsafe { b.launch(LaunchConfig::for_num_elems(1)) }.unwrap();
    }
    s1.synchronize().unwrap();
    let el = t0.elapsed();
    assert!(el.as_micros() >= 1000, "100 x 10 us kernels took {el:?}");
}
