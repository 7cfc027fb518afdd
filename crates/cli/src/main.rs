//! `cuvisor`: inspect the GPUs (real or simulated) the way `nvidia-smi` does, and inject faults into
//! the simulator.
//!
//! Exit codes: 0 success, 2 bad usage (clap's own errors and bad values such as an unknown preset
//! or a GPU that does not exist), 1 a failure while running (NVML, the simulator's state file).

mod args;
mod fault;
mod machine;
mod sim;
mod smi;
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
}

pub type Result<T> = std::result::Result<T, Failure>;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Smi(smi) => match smi.command {
            None => smi::run(&cli.target),
            Some(SmiCommand::Topo(t)) => topo::run(&cli.target, &t),
        },
        Command::Sim(sim) => match sim.command {
            SimCommand::Presets => sim::presets(),
            SimCommand::Reset => sim::reset(&cli.target),
            SimCommand::Fault(f) => fault::run(&cli.target, &f),
        },
    };
    match result {
        Ok(text) => {
            // Not print!: a closed pipe (`cuvisor smi | head -1`) is not worth a panic.
            let _ = std::io::stdout().write_all(text.as_bytes());
            ExitCode::SUCCESS
        }
        Err(Failure::Usage(msg)) => {
            eprintln!("error: {msg}");
            ExitCode::from(2)
        }
        Err(Failure::Runtime(msg)) => {
            eprintln!("error: {msg}");
            ExitCode::from(1)
        }
    }
}
