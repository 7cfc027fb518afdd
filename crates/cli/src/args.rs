//! The command line, as clap derives it.

use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    name = "cuvisor",
    version,
    about = "GPU sharing for Kubernetes: inspect the GPUs (real or simulated), inject simulator faults",
    after_help = "GPUs: `cuvisor smi` asks the system's NVML (libnvidia-ml.so.1) unless --sim or \
                  CUVISOR_SIM selects the simulator, e.g. `cuvisor smi --sim dgx1-v100`.\n\
                  Exit codes: 0 ok, 1 failure while running, 2 bad usage."
)]
pub struct Cli {
    #[command(flatten)]
    pub target: Target,
    #[command(subcommand)]
    pub command: Command,
}

/// Which machine a command talks to.
#[derive(Args, Debug, Clone, Default)]
pub struct Target {
    /// Use the simulated GPUs: a preset (single, dgx1-v100, dgx-a100, pcie-8) or a .toml/.json
    /// machine file [default: $CUVISOR_SIM; when that is unset too, `smi` uses the system's NVML
    /// and `sim` uses the `single` preset]
    #[arg(long, global = true, value_name = "PRESET|FILE")]
    pub sim: Option<String>,
    /// The simulator's shared state file [default: $CUVISOR_SIM_STATE, else one per machine model
    /// in /dev/shm]
    #[arg(long, global = true, value_name = "FILE")]
    pub state: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Show the GPUs, their memory, utilization and processes, as `nvidia-smi` does (through NVML)
    Smi(SmiArgs),
    /// The simulated GPU: list presets, reset its state, inject faults
    Sim(SimArgs),
}

#[derive(Args, Debug)]
pub struct SmiArgs {
    #[command(subcommand)]
    pub command: Option<SmiCommand>,
}

#[derive(Subcommand, Debug)]
pub enum SmiCommand {
    /// The GPU interconnect matrix, as `nvidia-smi topo -m` prints it
    Topo(TopoArgs),
}

#[derive(Args, Debug)]
pub struct TopoArgs {
    /// Print the topology matrix (the only mode; accepted as `nvidia-smi topo -m` takes it)
    #[arg(short = 'm', long = "matrix")]
    pub matrix: bool,
}

#[derive(Args, Debug)]
pub struct SimArgs {
    #[command(subcommand)]
    pub command: SimCommand,
}

#[derive(Subcommand, Debug)]
pub enum SimCommand {
    /// List the built-in machine presets
    Presets,
    /// Delete the simulator's state file (refused while a live process holds a slot in it)
    Reset,
    /// Inject a fault into the simulator's shared state; every process on the simulator sees it
    #[command(subcommand)]
    Fault(FaultCommand),
}

#[derive(Subcommand, Debug, Clone, PartialEq, Eq)]
pub enum FaultCommand {
    /// Raise an XID error event on a GPU (NVML event sets receive it)
    Xid {
        /// GPU index
        #[arg(long)]
        gpu: usize,
        /// The XID code (79: GPU has fallen off the bus, 48: double-bit ECC error, 13: graphics
        /// engine exception)
        #[arg(long, default_value_t = 79, value_parser = clap::value_parser!(u64).range(1..))]
        code: u64,
    },
    /// Take an NVLink down (both of its ends, when it joins two GPUs)
    NvlinkDown {
        /// GPU index
        #[arg(long)]
        gpu: usize,
        /// NVLink index on that GPU
        #[arg(long)]
        link: usize,
    },
    /// Bring an NVLink back up (both of its ends)
    NvlinkUp {
        /// GPU index
        #[arg(long)]
        gpu: usize,
        /// NVLink index on that GPU
        #[arg(long)]
        link: usize,
    },
    /// Make the next COUNT device-memory allocations on a GPU fail (out of memory)
    FailAlloc {
        /// GPU index
        #[arg(long)]
        gpu: usize,
        /// How many allocations fail (replaces any count left; 0 cancels)
        #[arg(long)]
        count: u64,
    },
    /// Clear the pending allocation failures and bring every NVLink of a GPU back up
    /// (XID events already raised stay in the event history)
    Clear {
        /// GPU index [default: every GPU]
        #[arg(long)]
        gpu: Option<usize>,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn sim_and_state_are_accepted_anywhere() {
        for argv in [
            &["cuvisor", "--sim", "pcie-8", "smi", "topo", "-m"][..],
            &["cuvisor", "smi", "--sim", "pcie-8", "topo", "-m"],
            &["cuvisor", "smi", "topo", "-m", "--sim", "pcie-8"],
        ] {
            let cli = Cli::try_parse_from(argv).unwrap();
            assert_eq!(cli.target.sim.as_deref(), Some("pcie-8"), "{argv:?}");
            assert!(matches!(
                cli.command,
                Command::Smi(SmiArgs {
                    command: Some(SmiCommand::Topo(TopoArgs { matrix: true }))
                })
            ));
        }
        let cli = Cli::try_parse_from([
            "cuvisor", "sim", "fault", "xid", "--gpu", "3", "--state", "/tmp/x",
        ])
        .unwrap();
        assert_eq!(cli.target.state, Some(PathBuf::from("/tmp/x")));
        match cli.command {
            Command::Sim(SimArgs {
                command: SimCommand::Fault(f),
            }) => assert_eq!(f, FaultCommand::Xid { gpu: 3, code: 79 }),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn bad_numbers_are_usage_errors() {
        for argv in [
            &["cuvisor", "sim", "fault", "xid", "--gpu", "x"][..],
            &[
                "cuvisor", "sim", "fault", "xid", "--gpu", "1", "--code", "0",
            ],
            &["cuvisor", "sim", "fault", "nvlink-down", "--gpu", "1"],
            &[
                "cuvisor",
                "sim",
                "fault",
                "fail-alloc",
                "--gpu",
                "1",
                "--count",
                "-3",
            ],
        ] {
            let e = Cli::try_parse_from(argv).unwrap_err();
            assert_eq!(e.exit_code(), 2, "{argv:?}: {e}");
        }
    }
}
