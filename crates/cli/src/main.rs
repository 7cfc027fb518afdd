//! `cuvisor`: run a program under a GPU-memory quota and/or a compute policy, inspect the GPUs
//! (real or simulated) the way `nvidia-smi` does, inject faults into the simulator, load the
//! simulated GPU with kernels (`sim load`) to see compute policies at work, and run a
//! data-parallel job over several simulated GPUs (`sim job`) to see what topology costs.
//!
//! Exit codes: 0 success, 2 bad usage (clap's own errors and bad values such as an unknown preset
//! or a GPU that does not exist), 1 a failure while running (NVML, the simulator's state file).
//! `cuvisor run` exits with its command's status (128+N for signal N), 127/126 when the command
//! cannot be found/run. `cuvisor sim load` and `sim job` exit 1 when libcuda.so.1 is not the
//! simulator.

mod args;
mod child;
mod demo;
mod fault;
mod files;
mod job;
mod library;
mod load;
mod machine;
mod run;
mod scratch;
mod sim;
mod smi;
mod state_dir;
mod topo;

use args::{Cli, Command, SimCommand, SmiCommand};
use clap::Parser;
use std::io::Write as _;
use std::process::ExitCode;

/// Why a command failed; decides the exit code.
#[derive(Debug)]
pub enum Failure {
    /// The input was wrong (exit 2).
    Usage(String),
    /// The input was fine but running it failed (exit 1).
    Runtime(String),
    /// `cuvisor run` could not start its command: exit 127 when it does not exist, 126 when it
    /// cannot be executed, as shells and env(1) answer, so that neither reads as the command's
    /// own failure.
    Launch { code: u8, message: String },
}

/// What a successful command leaves: text for stdout, or `cuvisor run`'s exit status.
enum Done {
    Print(String),
    Exit(u8),
}

pub type Result<T> = std::result::Result<T, Failure>;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(r) => run::run(&cli.target, &r).map(Done::Exit),
        Command::Demo(d) => demo::run(&cli.target, &d).map(Done::Exit),
        Command::Smi(smi) => match smi.command {
            None => smi::run(&cli.target),
            Some(SmiCommand::Topo(t)) => topo::run(&cli.target, &t),
        }
        .map(Done::Print),
        Command::Sim(sim) => match sim.command {
            SimCommand::Presets => sim::presets().map(Done::Print),
            SimCommand::Reset => sim::reset(&cli.target).map(Done::Print),
            SimCommand::Fault(f) => fault::run(&cli.target, &f).map(Done::Print),
            SimCommand::Load(l) => load::run(&cli.target, &l).map(Done::Exit),
            SimCommand::Job(j) => job::run(&cli.target, &j).map(Done::Exit),
        },
        Command::ProbeLibrary { file } => {
            let (said, code) = library::probe_main(&file);
            let _ = std::io::stdout().write_all(said.as_bytes());
            Ok(Done::Exit(code))
        }
    };
    match result {
        Ok(Done::Print(text)) => {
            // Not print!: a closed pipe (`cuvisor smi | head -1`) is not worth a panic.
            let _ = std::io::stdout().write_all(text.as_bytes());
            ExitCode::SUCCESS
        }
        Ok(Done::Exit(code)) => ExitCode::from(code),
        Err(Failure::Usage(msg)) => {
            eprintln!("error: {msg}");
            ExitCode::from(2)
        }
        Err(Failure::Runtime(msg)) => {
            eprintln!("error: {msg}");
            ExitCode::from(1)
        }
        Err(Failure::Launch { code, message }) => {
            eprintln!("error: {message}");
            ExitCode::from(code)
        }
    }
}
