//! `cuvisor sim job`, the built binary run on the simulator: a data-parallel job over 2, 4 and 8
//! simulated GPUs prints its step split and bandwidths, its JSON parses, bad input is refused,
//! and on the timed interconnect its measured bus bandwidth follows the modelled links.

use serde_json::Value;

mod support;
use support::*;

/// `cuvisor sim job ARGS` on the simulator of `preset` (its libraries on the library path, a
/// state file of the test's own in `scratch`).
fn job(preset: &str, args: &[&str], scratch: &Scratch) -> Ran {
    let mut argv = vec!["sim", "job"];
    argv.extend_from_slice(args);
    let state = scratch.path("sim.state");
    cuvisor_within(
        std::time::Duration::from_secs(60),
        &argv,
        scratch,
        &[
            ("LD_LIBRARY_PATH", built().join("sim").to_str().unwrap()),
            ("CUVISOR_SIM", preset),
            ("CUVISOR_SIM_STATE", state.to_str().unwrap()),
        ],
    )
}

fn json(ran: &Ran) -> Value {
    serde_json::from_str(ran.stdout().trim())
        .unwrap_or_else(|e| panic!("not JSON ({e}):\n{}", ran.show()))
}

fn f(v: &Value, path: &[&str]) -> f64 {
    let mut x = v;
    for p in path {
        x = &x[p];
    }
    x.as_f64()
        .unwrap_or_else(|| panic!("{path:?} is not a number in {v}"))
}

#[test]
fn a_job_on_two_and_four_dgx1_gpus_prints_its_step_split() {
    let scratch = Scratch::new("job-split");
    // Peer access as cuDeviceCanAccessPeer allows it: over NVLink, or PCIe under one root;
    // {0,1,4,5} spans both sockets, and 0-5 and 1-4 have no NVLink: 8 of 12 ordered pairs.
    for (gpus, rings, peers) in [("0,3", 1, "2 of 2"), ("0,1,4,5", 2, "8 of 12")] {
        let ran = job(
            "dgx1-v100",
            &[
                "--kind", "vision", "--gpus", gpus, "--scale", "0.01", "--steps", "3",
            ],
            &scratch,
        )
        .exits(0);
        let out = ran.stdout();
        assert!(
            out.starts_with(&format!(
                "sim job: vision (ResNet-50, gradient 1022284 bytes), 2133333ns per step, pause \
                 7563636ns, on GPUs {gpus} of the dgx1-v100 simulator (scale 0.01)\n"
            )),
            "{}",
            ran.show()
        );
        assert!(
            out.contains(&format!("peer access enabled on {peers} ordered pairs")),
            "{}",
            ran.show()
        );
        let ring_lines = out.lines().filter(|l| l.starts_with("    ring ")).count();
        assert!(ring_lines >= rings, "{}", ran.show());
        let rows: Vec<&str> = out
            .lines()
            .filter(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit()))
            .collect();
        assert_eq!(rows.len(), 3, "{}", ran.show());
        let avg = out
            .lines()
            .find(|l| l.starts_with("  average over 3 step(s): "))
            .unwrap_or_else(|| panic!("{}", ran.show()));
        for part in ["compute", "communication", "idle"] {
            assert!(avg.contains(part), "{avg}");
        }
        assert!(
            out.contains("all-reduce of 1022284 bytes: measured"),
            "{}",
            ran.show()
        );
        assert!(
            out.contains("communication efficiency: measured"),
            "{}",
            ran.show()
        );
    }
}

#[test]
fn the_json_report_parses_and_its_split_adds_up() {
    let scratch = Scratch::new("job-json");
    let ran = job(
        "dgx1-v100",
        &[
            "--kind", "nlp", "--gpus", "0,3", "--scale", "0.01", "--steps", "2", "--json",
        ],
        &scratch,
    )
    .exits(0);
    let v = json(&ran);
    assert_eq!(v["kind"], "nlp");
    assert_eq!(v["machine"], "dgx1-v100");
    assert_eq!(v["gpus"], serde_json::json!([0, 3]));
    assert_eq!(f(&v, &["gradient_bytes"]), 6_800_000.0);
    assert_eq!(v["per_step"].as_array().map(Vec::len), Some(2), "{v}");
    for s in v["per_step"].as_array().unwrap() {
        let sum = f(s, &["compute_ns"]) + f(s, &["comm_ns"]) + f(s, &["idle_ns"]);
        assert_eq!(sum, f(s, &["step_ns"]), "{s}");
        assert!(f(s, &["compute_ns"]) >= 1_392_760.0, "{s}");
    }
    // Two GPUs joined by two NVLinks 2: one ring at 2 x 25 GB/s.
    assert_eq!(f(&v, &["model", "busbw_gbps"]), 50.0);
    assert_eq!(v["model"]["best_group"].as_array().map(Vec::len), Some(2));
    // One key per name: the kind's network is "network", the interconnect model's figures "model".
    let text = ran.stdout();
    assert_eq!(text.matches("\"model\":").count(), 1, "{text}");
    assert!(v["network"].is_string(), "{text}");
    assert_eq!(f(&v, &["model", "topology_loss"]), 0.0);
    for key in [
        "allreduce_ns",
        "algbw_gbps",
        "busbw_gbps",
        "efficiency_gbps",
        "topology_loss",
    ] {
        assert!(v["measured"][key].is_number(), "{key}: {v}");
    }
}

#[test]
fn bad_job_input_is_refused_with_one_line_and_exit_2() {
    let scratch = Scratch::new("job-bad");
    for (args, says) in [
        (
            &["--kind", "audio", "--gpus", "0,1"][..],
            "--kind audio: unknown kind",
        ),
        (&["--gpus", "0,3,0"], "--gpus 0,3,0: GPU 0 is listed twice"),
        (&["--gpus", ""], "--gpus \"\": empty"),
        (
            &["--gpus", "0,8"],
            "--gpus: GPU 8 does not exist: the dgx1-v100 simulator has 8 GPUs",
        ),
        (
            &["--gpus", "0,1", "--gradient", "1Ti"],
            "--gradient 1Ti: between 4Ki and 64Gi",
        ),
        (&["--gpus", "0,1", "--gradient", "lots"], "--gradient lots:"),
        (
            &["--gpus", "0,1", "--compute", "0s"],
            "--compute 0s: between 1us and 60s",
        ),
        (
            &["--gpus", "0,1", "--pause", "2days"],
            "--pause 2days: unknown unit",
        ),
        (
            &["--gpus", "0,1", "--scale", "5"],
            "--scale 5: between 0.0001 and 1",
        ),
        (
            &["--gpus", "0,1", "--steps", "-3"],
            "--steps -3: not a whole number",
        ),
    ] {
        let ran = job("dgx1-v100", args, &scratch).exits(2);
        let err = ran.stderr();
        assert_eq!(err.lines().count(), 1, "{}", ran.show());
        assert!(err.starts_with(&format!("error: {says}")), "{}", ran.show());
        assert!(ran.stdout().is_empty(), "{}", ran.show());
    }
}

/// A job whose bytes dominate its copies' start-up costs and whose compute kernel outlasts the
/// host's issuing of the all-reduce (the simulator moves the bytes as copies are issued):
/// (measured busbw, model busbw, measured all-reduce ns, model all-reduce ns).
fn allreduce(preset: &str, gpus: &str, gradient: &str, compute: &str) -> (f64, f64, f64, f64) {
    let scratch = Scratch::new(&format!("job-bw-{preset}-{}", gpus.replace(',', "_")));
    let ran = job(
        preset,
        &[
            "--kind",
            "nlp",
            "--gpus",
            gpus,
            "--gradient",
            gradient,
            "--compute",
            compute,
            "--pause",
            "1ms",
            "--steps",
            "2",
            "--json",
        ],
        &scratch,
    )
    .exits(0);
    let v = json(&ran);
    println!("{preset} {{{gpus}}}: {}", v["measured"]);
    println!("{preset} {{{gpus}}}: {}", v["model"]);
    assert_eq!(
        v["host_bound_steps"],
        0,
        "the host issued copies late: the measurement would be the host's\n{}",
        ran.show()
    );
    (
        f(&v, &["measured", "busbw_gbps"]),
        f(&v, &["model", "busbw_gbps"]),
        f(&v, &["measured", "allreduce_ns"]),
        f(&v, &["model", "allreduce_ns"]),
    )
}

#[test]
fn two_nvlinks_measure_near_the_models_50_gbps_and_the_path_through_the_host_far_lower() {
    // GPUs 0 and 3 of a DGX-1 share two NVLinks 2: 2 x 25 GB/s per direction.
    let (nv, nv_model, ..) = allreduce("dgx1-v100", "0,3", "32Mi", "100ms");
    assert_eq!(nv_model, 50.0);
    assert!(
        (nv - nv_model).abs() <= 0.15 * nv_model,
        "{{0,3}}: measured {nv} GB/s, model {nv_model}"
    );
    // GPUs 0 and 5: no NVLink, different sockets: no peer access, copies staged through host
    // memory over PCIe Gen3 and the SMP link.
    let (host, host_model, ..) = allreduce("dgx1-v100", "0,5", "32Mi", "100ms");
    assert!(host_model < 20.0, "{host_model}");
    assert!(
        host < 0.4 * nv,
        "{{0,5}}: {host} GB/s against {{0,3}}: {nv} GB/s"
    );
}

#[test]
fn eight_a100s_and_eight_h200s_on_nvswitch_measure_near_the_models_busbw() {
    // A100: 12 NVLinks 3 into the switches, 300 GB/s per direction; H200: 18 NVLinks 4, 450.
    for (preset, want) in [("dgx-a100", 300.0), ("h200", 450.0)] {
        let (bw, model, ..) = allreduce(preset, "0-7", "128Mi", "200ms");
        assert_eq!(model, want, "{preset}");
        assert!(
            (bw - model).abs() <= 0.15 * model,
            "{preset}: measured {bw} GB/s, model {model}"
        );
    }
}

/// The question: on a DGX-1, {0,1,4,5} is a ring of 6 NVLinks (every GPU has two NVLink
/// neighbours in it); {0,2,3,4} has 7 NVLinks but no NVLink ring (GPU 4 reaches only GPU 0),
/// so its rings close over PCIe. The measured all-reduce time decides which is better for a
/// job, and the model says the same.
#[test]
fn a_ring_of_six_nvlinks_beats_a_tree_of_seven_in_measured_all_reduce_time() {
    let (ring_bw, ring_model_bw, ring_ns, ring_model_ns) =
        allreduce("dgx1-v100", "0,1,4,5", "32Mi", "100ms");
    let (tree_bw, tree_model_bw, tree_ns, tree_model_ns) =
        allreduce("dgx1-v100", "0,2,3,4", "32Mi", "100ms");
    println!(
        "ring {{0,1,4,5}}: measured {:.3} ms ({ring_bw:.1} GB/s), model {:.3} ms ({ring_model_bw} GB/s)",
        ring_ns / 1e6,
        ring_model_ns / 1e6
    );
    println!(
        "tree {{0,2,3,4}}: measured {:.3} ms ({tree_bw:.1} GB/s), model {:.3} ms ({tree_model_bw} GB/s)",
        tree_ns / 1e6,
        tree_model_ns / 1e6
    );
    assert!(ring_model_ns < tree_model_ns, "the model prefers the ring");
    assert!(
        ring_ns < tree_ns,
        "measured: ring {ring_ns} ns, tree {tree_ns} ns"
    );
    for (m, model) in [(ring_ns, ring_model_ns), (tree_ns, tree_model_ns)] {
        assert!(
            (m - model).abs() <= 0.2 * model,
            "measured {m} ns, model {model} ns"
        );
    }
}
