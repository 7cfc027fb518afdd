//! Copies take time over the modelled interconnect (crates/sim/cuda/src/copy_engine.rs and
//! `cuvisor_sim::state::Shared::reserve`), as a C program measures it (tests/c/timed_copies.c,
//! built against CUDA 13.5's cuda.h and linked with the simulated libcuda): events around
//! asynchronous copies, the wall clock around synchronous ones.
//!
//! Expected figures come from `cuvisor_fabric` (the one interconnect model): PCIe Gen3 x16
//! 15.75 GB/s per direction, NVLink 2 25 GB/s per link (two links 0-3 on the DGX-1), A100's 12
//! NVLinks to the NVSwitches 300 GB/s. Each test's sizes keep it to about a second or two.
//!
//! Needs the CUDA 13.5 wheels (cuda.h): where they cannot be installed the tests print SKIPPED,
//! or fail when `CI` is set (see `cuvisor_testkit::wheels::venv`).
mod common;
#[path = "common/python.rs"]
mod python;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

const MIB: f64 = 1024.0 * 1024.0;

fn build(test: &str) -> Option<PathBuf> {
    let cu13 = cuvisor_testkit::wheels::nvcc_13_5(test)?;
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/timed_copies.c");
    let exe = std::env::temp_dir().join(format!("cuvisor-c-timed-{test}-{}", std::process::id()));
    let built = Command::new("cc")
        .args(["-O1", "-Wall", "-Werror", "-I"])
        .arg(cu13.join("include"))
        .arg("-o")
        .arg(&exe)
        .arg(&src)
        .arg("-L")
        .arg(common::sim_dir())
        .args(["-lcuda", "-ldl"])
        .output()
        .expect("run cc");
    assert!(
        built.status.success(),
        "cc {}: {}",
        src.display(),
        String::from_utf8_lossy(&built.stderr)
    );
    Some(exe)
}

/// The program's "name value" lines, after checking it succeeded.
fn figures(out: std::process::Output) -> HashMap<String, f64> {
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(
        out.status.success() && stdout.lines().any(|l| l == "OK"),
        "timed_copies failed:\n{stdout}\n{stderr}"
    );
    eprintln!("{stdout}");
    stdout
        .lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(' ')?;
            Some((k.to_string(), v.trim().parse().ok()?))
        })
        .collect()
}

fn run(exe: &Path, preset: &str, state: &Path, args: &[&str]) -> HashMap<String, f64> {
    let mut cmd = python::on_sim(exe, &[], preset, state);
    figures(cmd.args(args).output().expect("run timed_copies"))
}

/// ms of `bytes` at `gbps` (10^9 bytes/s) after `latency_us`.
fn ms(bytes: f64, gbps: f64, latency_us: f64) -> f64 {
    bytes / gbps / 1e6 + latency_us / 1e3
}

fn near(what: &str, got: f64, want: f64, tolerance: f64) {
    assert!(
        (got - want).abs() <= want * tolerance,
        "{what}: {got:.3} ms, the model says {want:.3} ms (+-{:.0} %)",
        tolerance * 100.0
    );
}

#[test]
fn copies_take_the_time_of_their_links_on_a_dgx1() {
    let test = "copies_take_the_time_of_their_links_on_a_dgx1";
    let Some(exe) = build(test) else { return };
    let state = common::state_file(test);
    let f = run(&exe, "dgx1-v100", &state, &["dgx1"]);
    python::remove_state(&state);
    let big = 256.0 * MIB;
    // 256 MiB pinned host to device: 256 MiB / 15.75 GB/s = 17.04 ms.
    let pcie = 15.7536;
    // The bytes move inside the call, on this machine's memcpy, while the 1 s kernel the copy
    // is queued behind runs: the events see the model unless the call outlasted the kernel.
    assert!(
        f["h2d_pinned_call"] < 1000.0,
        "moving 256 MiB took {} ms here, longer than the kernel hiding it: too busy to measure",
        f["h2d_pinned_call"]
    );
    near(
        "pinned H2D 256 MiB",
        f["h2d_pinned_256mib"],
        ms(big, pcie, 5.0),
        0.10,
    );
    // Pageable host memory is staged: 0.4 of the rate (copy_engine::PAGEABLE_RATE), and the
    // asynchronous copy blocks the host until it is done (behind the 300 ms kernel it was
    // queued after). The event after it is recorded once the host thread wakes, so it may be
    // late by the machine's scheduling delay (several ms on a busy 2-core box), never early.
    near(
        "pinned H2D 64 MiB",
        f["h2d_pinned_64mib"],
        ms(64.0 * MIB, pcie, 5.0),
        0.10,
    );
    let pageable = ms(64.0 * MIB, pcie * 0.4, 5.0);
    let got = f["h2d_pageable_64mib"];
    assert!(
        got >= pageable * 0.95 && got <= pageable * 1.5,
        "pageable H2D 64 MiB: {got:.3} ms, the model says {pageable:.3} ms"
    );
    assert!(
        f["h2d_pageable_call"] >= 300.0 + pageable * 0.95,
        "a pageable cuMemcpyHtoDAsync returned after {} ms",
        f["h2d_pageable_call"]
    );
    // Peer 0 -> 3: two NVLinks, 50 GB/s, once peer access is on; staged through the host
    // (PCIe, 15.75 GB/s at best, 12 us) before.
    near("peer 0->3", f["peer_0_3"], ms(big, 50.0, 2.0), 0.10);
    near("DtoD 0->3", f["dtod_0_3"], ms(big, 50.0, 2.0), 0.10);
    near(
        "graph DtoD 0->3",
        f["graph_dtod_0_3"],
        ms(big, 50.0, 2.0),
        0.10,
    );
    // A memset writes its bytes at the device's memory bandwidth (V100: 877 MHz x 2 x 512 B =
    // 898 GB/s), after a 2 us start.
    near(
        "memset 16 MiB (us)",
        f["memset_16mib_us"],
        1e3 * ms(16.0 * MIB, 877e6 * 2.0 * 512.0 / 1e9, 2.0),
        0.10,
    );
    near(
        "peer 0->3 staged",
        f["peer_0_3_no_access"],
        ms(big, pcie, 12.0),
        0.10,
    );
    // 0 -> 5: no NVLink, other socket: staged even with every grant the program could get.
    near("peer 0->5 staged", f["peer_0_5"], ms(big, pcie, 12.0), 0.10);
    // Two copies at once: on one link they take it in turns, on two links side by side.
    let one = ms(big, 50.0, 2.0);
    near(
        "two copies, one link",
        f["two_on_one_link"],
        2.0 * one,
        0.10,
    );
    near("two copies, two links", f["two_on_two_links"], one, 0.10);
    // A copy beside a 20 ms kernel (other stream) hides behind it.
    near("kernel alone", f["kernel_alone"], 20.0, 0.02);
    near("kernel and copy", f["kernel_and_copy"], 20.0, 0.02);
    // A synchronous device-to-device copy returns at once; the context's synchronization
    // waits for its modelled end.
    assert!(
        f["sync_dtod_returned"] < one / 2.0,
        "cuMemcpyDtoD waited: {} ms",
        f["sync_dtod_returned"]
    );
    assert!(f["sync_dtod_done"] >= one * 0.95, "{}", f["sync_dtod_done"]);
}

#[test]
fn a_dgx_a100_peer_copy_runs_at_nvswitch_speed() {
    let test = "a_dgx_a100_peer_copy_runs_at_nvswitch_speed";
    let Some(exe) = build(test) else { return };
    let state = common::state_file(test);
    let f = run(&exe, "dgx-a100", &state, &["a100"]);
    python::remove_state(&state);
    // 12 NVLink 3 links into the NVSwitches, 25 GB/s each: 300 GB/s per direction.
    near(
        "NVSwitch 0->1",
        f["nvswitch_0_1"],
        ms(256.0 * MIB, 300.0, 2.0),
        0.10,
    );
}

/// Review finding (issue 18): cuMemcpyPeer follows only the current context's work, where the
/// runtime's reference (cudaMemcpyPeer, cudaMemcpy3DPeer) serializes it after the pending work
/// of its source and destination devices too. Ignored until fixed (fails: about 0.1 ms).
#[test]
fn a_synchronous_peer_copy_waits_for_its_source_contexts_work() {
    let test = "a_synchronous_peer_copy_waits_for_its_source_contexts_work";
    let Some(exe) = build(test) else { return };
    let state = common::state_file(test);
    let f = run(&exe, "dgx1-v100", &state, &["serial"]);
    python::remove_state(&state);
    let got = f["peer_sync_after_source_work"];
    assert!(got >= 95.0, "cuMemcpyPeer ended {got:.3} ms after it was issued, before the 100 ms kernel pending in its source context");
}

/// Review finding (issue 18, pre-existing ordering now charged as copy time): a synchronous
/// copy waits for work on a CU_STREAM_NON_BLOCKING stream of its context, which the legacy
/// stream does not synchronize with. Ignored until fixed (fails: about 100 ms).
#[test]
fn a_synchronous_copy_does_not_wait_for_a_non_blocking_stream() {
    let test = "a_synchronous_copy_does_not_wait_for_a_non_blocking_stream";
    let Some(exe) = build(test) else { return };
    let state = common::state_file(test);
    let f = run(&exe, "dgx1-v100", &state, &["serial"]);
    python::remove_state(&state);
    let got = f["sync_copy_beside_non_blocking_work"];
    assert!(got < 20.0, "a 1 MiB pinned cuMemcpyHtoD took {got:.3} ms beside a 100 ms kernel on a non-blocking stream");
}

/// Review finding (issue 18): an asynchronous copy on the legacy stream is timed after the
/// legacy stream's own work only, not after what was issued to the context's blocking streams,
/// which the legacy stream synchronizes with (kernels get it from the device's one timeline,
/// copies have their own). Ignored until fixed (fails: the copy ends about 99 ms before the
/// kernel it follows).
#[test]
fn a_legacy_stream_copy_follows_a_blocking_streams_kernel() {
    let test = "a_legacy_stream_copy_follows_a_blocking_streams_kernel";
    let Some(exe) = build(test) else { return };
    let state = common::state_file(test);
    let f = run(&exe, "dgx1-v100", &state, &["serial"]);
    python::remove_state(&state);
    let got = f["legacy_copy_after_blocking_kernel"];
    assert!(
        got >= 0.06,
        "the legacy-stream copy ended {got:.3} ms after the blocking stream's kernel"
    );
}

/// Copies from memory that was never written move no bytes (zeros in, zeros out: the
/// destination's pages are dropped instead), and written bytes are copied exactly.
#[test]
fn copies_keep_every_byte_written_or_not() {
    let test = "copies_keep_every_byte_written_or_not";
    let Some(exe) = build(test) else { return };
    let state = common::state_file(test);
    let f = run(&exe, "dgx1-v100", &state, &["bytes"]);
    python::remove_state(&state);
    assert_eq!(f["bytes_checked"], 3.0 * MIB);
}

/// Two processes copying over one PCIe link at once share it (the timelines live in the
/// simulator's shared state): the second is done about one copy's time after the first.
#[test]
fn two_processes_share_one_pcie_link() {
    let test = "two_processes_share_one_pcie_link";
    let Some(exe) = build(test) else { return };
    let mib = 512u64;
    // One copy of 512 MiB staged GPU 0 -> 5 (PCIe up, switch, SMP, switch, PCIe down): 34 ms.
    let one = ms(mib as f64 * MIB, 15.7536, 12.0);
    let at = |delay_ms: u64| (cuvisor_sim::state::now_ns() + delay_ms * 1_000_000).to_string();
    let state = common::state_file(test);
    let alone = run(
        &exe,
        "dgx1-v100",
        &state,
        &["share", &at(1500), &mib.to_string()],
    );
    near(
        "one process",
        alone["share_done"] - alone["share_started"],
        one,
        0.15,
    );
    let start = at(2500);
    let spawn = || {
        let mut c = python::on_sim(&exe, &[], "dgx1-v100", &state);
        c.args(["share", &start, &mib.to_string()])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("start timed_copies")
    };
    let (a, b) = (spawn(), spawn());
    let (fa, fb) = (
        figures(a.wait_with_output().unwrap()),
        figures(b.wait_with_output().unwrap()),
    );
    python::remove_state(&state);
    // Each process starts its copy at the agreed instant, give or take its scheduling: as long
    // as the second starts before the first is done, the link is busy until the first's start
    // plus two copies' time.
    let started = fa["share_started"].min(fb["share_started"]);
    let apart = (fa["share_started"] - fb["share_started"]).abs();
    assert!(
        apart < one * 0.8,
        "the processes started {apart:.1} ms apart: too far to share the link (busy machine?)"
    );
    let (first, last) = if fa["share_done"] < fb["share_done"] {
        (&fa, &fb)
    } else {
        (&fb, &fa)
    };
    near(
        "the first of two",
        first["share_done"] - first["share_started"],
        one,
        0.15,
    );
    near(
        "the second of two",
        last["share_done"] - started,
        2.0 * one,
        0.15,
    );
}

/// NVML sees copies as the real one does: PCIe throughput (KB/s over 20 ms) from the bytes
/// timed over the device's link, NVLink data counters (KiB) from those over its NVLinks, GPU
/// utilization counting kernels only, and memory utilization the time copies moved its bytes.
#[test]
fn nvml_sees_pcie_and_nvlink_traffic_of_copies() {
    let test = "nvml_sees_pcie_and_nvlink_traffic_of_copies";
    let Some(exe) = build(test) else { return };
    let state = common::state_file(test);
    let f = run(&exe, "dgx1-v100", &state, &["nvml"]);
    python::remove_state(&state);
    assert_eq!(
        f["nvlink_tx_kib"],
        256.0 * 1024.0,
        "256 MiB sent over GPU 0's NVLinks"
    );
    // 15.75 GB/s in KiB/s.
    let rate = 15.7536e9 / 1024.0;
    for k in ["pcie_tx_gpu0_kbs", "pcie_rx_gpu5_kbs"] {
        assert!(
            (f[k] - rate).abs() <= rate * 0.10,
            "{k}: {} KB/s, the link carries {rate:.0}",
            f[k]
        );
    }
    assert_eq!(f["gpu_util_gpu0"], 0.0, "copies are no kernels");
    // Memory utilization: the ~65 ms GPU 0's memory was read by the copies (5 ms of NVLink,
    // then 60 ms of PCIe) in NVML's one-second window.
    assert!(
        (4.0..=15.0).contains(&f["mem_util_gpu0"]),
        "memory utilization {} %",
        f["mem_util_gpu0"]
    );
}
