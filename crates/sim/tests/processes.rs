//! Several processes on one simulated device: memory is one pool for all of them, every process
//! sees the others' usage (cuMemGetInfo and NVML's process list), and kernels of different processes never overlap in time.
mod common;

use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use std::path::{Path, PathBuf};
use std::time::Duration;

const GIB: usize = 1 << 30;

fn wait_for(path: &Path) {
    for _ in 0..2000 {
        if path.exists() {
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    panic!("timed out waiting for {}", path.display());
}

fn rendezvous_dir(tag: &str) -> PathBuf {
    cuvisor_testkit::fresh_dir(&format!("rdv-{tag}"))
}

#[test]
fn two_processes_share_one_device_memory() {
    if common::is_child() {
        let dir = PathBuf::from(std::env::var("RDV").unwrap());
        let ctx = CudaContext::new(0).unwrap();
        let stream = ctx.default_stream();
        if std::env::var("ROLE").unwrap() == "first" {
            // SAFETY: uninitialised device memory we never read.
            let held = unsafe { stream.alloc::<u8>(10 * GIB) }.unwrap();
            std::fs::write(dir.join("allocated"), std::process::id().to_string()).unwrap();
            wait_for(&dir.join("done"));
            drop(held);
        } else {
            wait_for(&dir.join("allocated"));
            // Each process's context takes its own memory too (the preset's `context_memory`),
            // and NVML counts it as the process's.
            let each =
                cuvisor_sim::model::preset("single").unwrap().devices[0].context_memory as usize;
            assert!(each > 0, "the preset's contexts take memory");
            let left = 16 * GIB - 10 * GIB - 2 * each;
            let (free, total) = ctx.mem_get_info().unwrap();
            assert_eq!(total, 16 * GIB);
            assert_eq!(
                free, left,
                "the other process's 10 GiB and both contexts show in cuMemGetInfo"
            );
            // SAFETY: as above; these allocations are never read.
            let too_much = unsafe { stream.alloc::<u8>(left + 1) };
            assert!(
                too_much.is_err(),
                "together the processes cannot exceed the device"
            );
            // SAFETY: uninitialised device memory, never read: only its allocation is tested.
            let fits = unsafe { stream.alloc::<u8>(left) }.unwrap();
            assert_eq!(ctx.mem_get_info().unwrap().0, 0);
            // NVML's process list shows both processes with what each holds.
            let first: u32 = std::fs::read_to_string(dir.join("allocated"))
                .unwrap()
                .parse()
                .unwrap();
            let nvml = nvml_wrapper::Nvml::init().unwrap();
            let mut procs: Vec<(u32, u64)> = nvml
                .device_by_index(0)
                .unwrap()
                .running_compute_processes()
                .unwrap()
                .into_iter()
                .map(|p| match p.used_gpu_memory {
                    nvml_wrapper::enums::device::UsedGpuMemory::Used(b) => (p.pid, b),
                    other => panic!("memory of {} not reported: {other:?}", p.pid),
                })
                .collect();
            procs.sort();
            let mut want = vec![
                (first, (10 * GIB + each) as u64),
                (std::process::id(), (left + each) as u64),
            ];
            want.sort();
            assert_eq!(procs, want);
            drop(fits);
            std::fs::write(dir.join("done"), "").unwrap();
        }
        return;
    }
    let dir = rendezvous_dir("mem");
    let state = common::state_file("two-mem");
    let child = |role: &str| {
        common::Child::new("two_processes_share_one_device_memory")
            .state(&state)
            .env("RDV", dir.to_str().unwrap())
            .env("ROLE", role)
            .spawn()
    };
    let (a, b) = (child("first"), child("second"));
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    for o in [a, b] {
        common::Ran(o).success();
    }
    // Both exited: their memory is back.
    let model = cuvisor_sim::model::preset("single").unwrap();
    let shared = cuvisor_sim::state::Shared::attach_at(&model, &state).unwrap();
    assert_eq!(
        shared
            .device(0)
            .mem_used
            .load(std::sync::atomic::Ordering::SeqCst),
        0
    );
}

#[test]
fn kernels_of_two_processes_do_not_overlap() {
    if common::is_child() {
        let dir = PathBuf::from(std::env::var("RDV").unwrap());
        let ctx = CudaContext::new(0).unwrap();
        let stream = ctx.default_stream();
        let f = ctx
            .load_module(Ptx::from_src("image"))
            .unwrap()
            .load_function("sim_busy")
            .unwrap();
        stream.synchronize().unwrap();
        wait_for(&dir.join("go"));
        let start = cuvisor_sim::state::now_ns();
        let ns: u64 = 200_000_000;
        let mut b = stream.launch_builder(&f);
        b.arg(&ns);
        // SAFETY: the simulated kernel takes one u64.
        unsafe { b.launch(LaunchConfig::for_num_elems(1)) }.unwrap();
        stream.synchronize().unwrap();
        let end = cuvisor_sim::state::now_ns();
        std::fs::write(
            dir.join(format!("times-{}", std::process::id())),
            format!("{start} {end}"),
        )
        .unwrap();
        return;
    }
    let dir = rendezvous_dir("time");
    let state = common::state_file("two-time");
    let spawn = || {
        common::Child::new("kernels_of_two_processes_do_not_overlap")
            .state(&state)
            .env("RDV", dir.to_str().unwrap())
            .spawn()
    };
    let (a, b) = (spawn(), spawn());
    std::thread::sleep(Duration::from_millis(300)); // both are up and waiting
    std::fs::write(dir.join("go"), "").unwrap();
    for o in [a.wait_with_output().unwrap(), b.wait_with_output().unwrap()] {
        common::Ran(o).success();
    }
    let times: Vec<(u64, u64)> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| {
            let e = e.unwrap();
            let name = e.file_name().into_string().unwrap();
            name.starts_with("times-").then(|| {
                let t = std::fs::read_to_string(e.path()).unwrap();
                let (s, x) = t.split_once(' ').unwrap();
                (s.parse().unwrap(), x.parse().unwrap())
            })
        })
        .collect();
    assert_eq!(times.len(), 2);
    let first_start = times.iter().map(|t| t.0).min().unwrap();
    let last_end = times.iter().map(|t| t.1).max().unwrap();
    let total_ms = (last_end - first_start) / 1_000_000;
    assert!(
        total_ms >= 400,
        "two 200 ms kernels from two processes took {total_ms} ms: they overlapped"
    );
    assert!(
        total_ms < 600,
        "took {total_ms} ms: far more than serialised run time"
    );
}
