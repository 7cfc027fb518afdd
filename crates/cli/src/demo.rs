//! `cuvisor demo`: the README's main job. Builds examples/tf_stress's driver-level twin (its
//! source is compiled into this binary, so the demo works from any directory) with the system C
//! compiler, then runs it exactly as a user would: `cuvisor run --memory 6Gi --sim single --
//! twin`. The twin prints the over-allocation table; its exit status is the demo's.

use crate::args::{Cli, Command, DemoArgs, Target};
use crate::{run, Failure, Result};
use clap::Parser;

const TWIN_SOURCE: &str = include_str!("../../../examples/tf_stress/twin.c");

pub fn run(target: &Target, args: &DemoArgs) -> Result<u8> {
    let dir = std::env::temp_dir().join(format!("cuvisor-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir)
        .map_err(|e| Failure::Runtime(format!("{}: {e}", dir.display())))?;
    let result = build_and_run(target, args, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn build_and_run(target: &Target, args: &DemoArgs, dir: &std::path::Path) -> Result<u8> {
    let src = dir.join("twin.c");
    let exe = dir.join("tf_stress_twin");
    std::fs::write(&src, TWIN_SOURCE)
        .map_err(|e| Failure::Runtime(format!("{}: {e}", src.display())))?;
    let built = std::process::Command::new("cc")
        .args(["-O2", "-Wall", "-o"])
        .arg(&exe)
        .arg(&src)
        .arg("-ldl")
        .status()
        .map_err(|e| {
            Failure::Runtime(format!("the demo builds its test program with `cc`: {e}"))
        })?;
    if !built.success() {
        return Err(Failure::Runtime(
            "cc could not build the demo's test program".into(),
        ));
    }
    let sim = target.sim.clone().unwrap_or_else(|| "single".into());
    println!(
        "$ cuvisor run --memory {} --sim {sim} -- tf_stress_twin",
        args.memory
    );
    let mut argv = vec![
        "cuvisor".into(),
        "--sim".into(),
        sim,
        "run".into(),
        "--memory".into(),
        args.memory.clone(),
    ];
    if let Some(state) = &target.state {
        argv.extend(["--state".into(), state.display().to_string()]);
    }
    argv.extend(["--".into(), exe.display().to_string()]);
    let cli = Cli::try_parse_from(&argv).map_err(|e| Failure::Usage(e.to_string()))?;
    let Command::Run(r) = cli.command else {
        unreachable!("parsed a run command")
    };
    run::run(&cli.target, &r)
}
