//! The command line, as clap derives it.

use clap::{Args, Parser, Subcommand};
use std::ffi::OsString;
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    name = "cuvisor",
    version,
    about = "GPU sharing for Kubernetes: run a program under a GPU-memory quota and/or a GPU-time \
             policy, inspect the GPUs (real or simulated), inject simulator faults, load the \
             simulated GPU",
    after_help = "GPUs: `cuvisor smi` asks the system's NVML (libnvidia-ml.so.1) unless --sim or \
                  CUVISOR_SIM selects the simulator, e.g. `cuvisor smi --sim dgx1-v100`.\n\
                  Exit codes: 0 ok, 1 failure while running, 2 bad usage; `cuvisor run` exits \
                  with its command's status."
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
    /// Use the simulated GPUs: a preset (single, dgx1-v100, dgx-a100, h200, pcie-8) or a .toml/.json
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
    /// The demo: examples/tf_stress's driver-level over-allocation test (built with cc) run under
    /// `cuvisor run --memory SIZE` on the simulated GPU (a --sim preset, default `single`)
    Demo(DemoArgs),
    /// Run a command with libcuvisor.so preloaded, under a device-memory quota and/or a compute
    /// policy, with a fresh ledger
    Run(RunArgs),
    /// Show the GPUs, their memory, utilization and processes, as `nvidia-smi` does (through NVML)
    Smi(SmiArgs),
    /// The simulated GPU: list presets, reset its state, inject faults, load it with kernels
    Sim(SimArgs),
    /// Internal, for `cuvisor run`: dlopen FILE with RTLD_NOW | RTLD_LOCAL in this process and
    /// say why it does not load (exit 1), so that cuvisor itself never loads the library it
    /// checks
    #[command(name = "__probe-library", hide = true)]
    ProbeLibrary {
        /// The shared object
        file: PathBuf,
    },
}

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// The quota to run the test under
    #[arg(
        long,
        value_name = "SIZE",
        default_value = "6Gi",
        allow_hyphen_values = true
    )]
    pub memory: String,
}

#[derive(Args, Debug)]
#[command(after_help = "Examples:\n  \
    cuvisor run --memory 6Gi -- python3 train.py\n  \
    cuvisor run --memory 6Gi --compute limit=30 -- python3 train.py\n  \
    cuvisor run --memory 6Gi --sim single -- ./twin      (on the simulated GPU)\n  \
    cuvisor run --memory-per-device 0=6Gi,1=2Gi -- ./app\n  \
    cuvisor run --compute share=3 --sim single --state /tmp/gpu -- cuvisor sim load\n\
    The command sees LD_PRELOAD=libcuvisor.so, CUVISOR_MEMORY_LIMIT (in bytes; with --compute \
    alone it is removed: memory is not limited) and CUVISOR_STATE_DIR; CUVISOR_COMPUTE (the \
    policy, canonical: limit=30, share=1) only with --compute; with --sim (or CUVISOR_SIM) also \
    LD_LIBRARY_PATH=<simulated libcuda>, CUVISOR_SIM, CUVISOR_SIM_STATE (a fresh state file unless \
    --state or CUVISOR_SIM_STATE names one) and CUVISOR_COORD_DIR=<state file>.coord (created if \
    needed): the compute coordinator belongs to the simulated machine, so runs on one state file \
    share the simulated GPU's time and runs on different ones do not; a CUVISOR_COORD_DIR already \
    in the environment is kept. Refused before anything runs: a library that is not an ELF shared \
    object of this machine that loads (dlopen RTLD_NOW, in a process of its own), a --sim file \
    that is not a regular file of at most 1 MiB, a --state (or CUVISOR_SIM_STATE) that exists \
    and is not a simulator state file of this model (a symbolic link, a FIFO, a device, a \
    directory, any other file): nothing is made beside it. SIGINT, SIGTERM, SIGHUP, SIGQUIT, \
    SIGUSR1 and SIGUSR2 are passed on to the command, which dies with cuvisor (SIGKILL \
    included); a later run removes the temporary directory a killed one left. Exit status: the \
    command's, 128+N when signal N ended it, 127 when it cannot be found, 126 when it cannot be \
    run, 2 for bad usage, 1 when cuvisor itself fails.")]
pub struct RunArgs {
    /// Device-memory quota for every visible GPU: a Kubernetes quantity (6Gi, 512Mi, 4G = 4e9
    /// bytes, 6442450944). Give a quota (--memory or --memory-per-device), a --compute policy, or
    /// both
    #[arg(long, value_name = "SIZE", allow_hyphen_values = true)]
    pub memory: Option<String>,
    /// Quotas per CUDA device ordinal instead of --memory: 0=6Gi,1=2Gi (a GPU not listed gets
    /// no memory)
    #[arg(
        long,
        value_name = "ORDINAL=SIZE,...",
        allow_hyphen_values = true,
        conflicts_with = "memory"
    )]
    pub memory_per_device: Option<String>,
    /// GPU time (sets CUVISOR_COMPUTE): limit=P (at most P % of each GPU's time, even when it is
    /// idle), share=W (weight W among the containers busy on a GPU; idle time is lent),
    /// share=memory (a share weighted by the memory quota), none (not throttled). Alone, without a
    /// memory quota, memory is not limited. Not given: CUVISOR_COMPUTE is not set and the
    /// library's default applies (share=memory)
    #[arg(long, value_name = "POLICY", allow_hyphen_values = true)]
    pub compute: Option<String>,
    /// Directory for the container's ledger, kept afterwards [default: a fresh temporary
    /// directory, removed afterwards]
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// Keep the temporary directory (ledger, simulator state) and say where it is
    #[arg(long)]
    pub keep_state: bool,
    /// The interception library [default: libcuvisor.so next to this executable, or in its deps/]
    #[arg(long, value_name = "FILE")]
    pub library: Option<PathBuf>,
    /// The library's log level (sets CUVISOR_LOG)
    #[arg(long, value_name = "LEVEL", value_parser = ["error", "warn", "info", "debug"])]
    pub log: Option<String>,
    /// Say on stderr how the command is run (quota, compute policy, library, ledger; with the
    /// simulator its state file and the coordinator directory, CUVISOR_COORD_DIR), and after it
    /// ends the ledger's use and refusals (and, under a compute policy, launches, GPU time and
    /// time throttled)
    #[arg(short, long)]
    pub verbose: bool,
    /// The command and its arguments (after `--`)
    #[arg(required = true, trailing_var_arg = true, value_name = "CMD")]
    pub command: Vec<OsString>,
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
    /// Keep the simulated GPU busy with kernels and print this process's share of its time: a
    /// workload for trying compute policies (run it under `cuvisor run --sim ... --compute ...`)
    Load(LoadArgs),
    /// A data-parallel training job over several simulated GPUs: each step a compute kernel on
    /// every GPU, a ring all-reduce of the gradient by peer copies (as NCCL's ring runs it), a
    /// host pause; prints the step time split into compute, communication and idle, and the
    /// bus bandwidth as nccl-tests defines it
    Job(JobArgs),
}

#[derive(Args, Debug)]
#[command(
    after_help = "Run it under cuvisor, which throttles its launches, on the simulated GPU:\n  \
    cuvisor run --sim single --state /tmp/gpu --compute share=1 -- cuvisor sim load &\n  \
    cuvisor run --sim single --state /tmp/gpu --compute share=3 -- cuvisor sim load\n\
    The two runs share one simulated GPU (the state file) and its compute coordinator \
    (/tmp/gpu.coord), and get about 25 % and 75 % of its time. `sim load` loads libcuda.so.1 \
    (the simulated driver that `cuvisor run --sim` puts on the library path), launches `sim_busy` \
    kernels back to back on one stream of GPU 0, keeping at most about 20 ms of work queued, and \
    every --every prints the time elapsed, the kernels completed per second and this process's \
    share of GPU 0's time over that interval, as the simulator counted it; at the end, the \
    average. It fails (exit 1) where libcuda.so.1 is not the simulator."
)]
pub struct LoadArgs {
    /// How long each kernel runs on the simulated GPU: a duration with its unit (ns, us, ms, s),
    /// such as 1ms, 50us or 0.5s; at most 1s
    #[arg(
        long,
        value_name = "DURATION",
        default_value = "1ms",
        allow_hyphen_values = true
    )]
    pub kernel: String,
    /// How long to keep launching: seconds (10, 2.5) or a duration (500ms)
    #[arg(
        long,
        value_name = "SECONDS",
        default_value = "10",
        allow_hyphen_values = true
    )]
    pub seconds: String,
    /// How often to print a line: a duration (1s, 500ms), at least 10ms
    #[arg(
        long,
        value_name = "DURATION",
        default_value = "1s",
        allow_hyphen_values = true
    )]
    pub every: String,
}

#[derive(Args, Debug, Clone)]
#[command(after_help = "Run it on the simulator, directly or under cuvisor:\n  \
    cuvisor run --sim dgx1-v100 --memory 16Gi -- cuvisor sim job --kind nlp --gpus 0,3 --scale 0.05\n  \
    cuvisor run --sim dgx-a100 --memory 40Gi -- cuvisor sim job --kind vision --gpus 0-7 --json\n\
    (or directly, with LD_LIBRARY_PATH at the simulated libcuda.so.1 and CUVISOR_SIM or --sim).\n\
    One process drives every GPU of --gpus (as ncclCommInitAll does): a context each, peer access \
    enabled wherever cuDeviceCanAccessPeer allows it, a gradient buffer each. The rings are the \
    interconnect model's (cuvisor_fabric::ring::rings over the simulator's machine), one stream \
    per ring per GPU. Times come from CUDA events, i.e. the simulator's timeline. The kinds' \
    parameters and their sources: docs/multi-gpu-job.md. Exit status: 0, 2 for bad input, 1 when \
    the simulated driver fails (or libcuda.so.1 is not the simulator).")]
pub struct JobArgs {
    /// What kind of job: vision (ResNet-50, compute-heavy), nlp (BERT-large, communication-heavy)
    /// or scientific (mixed)
    #[arg(long, value_name = "KIND", default_value = "vision")]
    pub kind: String,
    /// The GPUs (CUDA ordinals): a list and ranges, 0,3 or 0-3,6
    #[arg(long, value_name = "LIST", allow_hyphen_values = true)]
    pub gpus: String,
    /// How many training steps [default: 10]
    #[arg(
        long,
        value_name = "N",
        conflicts_with = "seconds",
        allow_hyphen_values = true
    )]
    pub steps: Option<String>,
    /// Run steps until this much time has passed instead: seconds (10, 2.5) or a duration
    #[arg(long, value_name = "SECONDS", allow_hyphen_values = true)]
    pub seconds: Option<String>,
    /// The gradient all-reduced each step (a size: 100Mi, 680M) [default: the kind's]
    #[arg(long, value_name = "SIZE", allow_hyphen_values = true)]
    pub gradient: Option<String>,
    /// The compute kernel of each step (a duration: 200ms) [default: the kind's, on this GPU]
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true)]
    pub compute: Option<String>,
    /// The host pause after each step's all-reduce (data loading) [default: the kind's duty cycle]
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true)]
    pub pause: Option<String>,
    /// Shrink compute, pause and gradient together by this factor (0 < F <= 1), to run many
    /// steps quickly: the bandwidths stay what they are while bytes dominate latency
    #[arg(
        long,
        value_name = "F",
        default_value = "1",
        allow_hyphen_values = true
    )]
    pub scale: String,
    /// One JSON object on stdout instead of the table
    #[arg(long)]
    pub json: bool,
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

    fn run_args(argv: &[&str]) -> RunArgs {
        match Cli::try_parse_from(argv).unwrap().command {
            Command::Run(r) => r,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn run_takes_the_command_after_its_options() {
        let r = run_args(&[
            "cuvisor", "run", "--memory", "6Gi", "--sim", "single", "--", "python3", "-c", "pass",
        ]);
        assert_eq!(r.memory.as_deref(), Some("6Gi"));
        assert_eq!(r.command, ["python3", "-c", "pass"]);
        // Without `--` too; the command's own options stay its own.
        let r = run_args(&[
            "cuvisor", "run", "--memory", "1Gi", "ls", "-l", "--sim", "x",
        ]);
        assert_eq!(r.command, ["ls", "-l", "--sim", "x"]);
        // A negative size reaches cuvisor's own check (which names it) instead of clap's.
        let r = run_args(&["cuvisor", "run", "--memory", "-1", "--", "true"]);
        assert_eq!(r.memory.as_deref(), Some("-1"));
        let r = run_args(&[
            "cuvisor",
            "run",
            "--memory-per-device",
            "0=1Gi",
            "--",
            "true",
        ]);
        assert_eq!(r.memory, None);
        assert_eq!(r.memory_per_device.as_deref(), Some("0=1Gi"));
        // No quota at all parses: `run` itself says which flags give one (a usage error too).
        let r = run_args(&["cuvisor", "run", "--", "true"]);
        assert_eq!(
            (r.memory, r.memory_per_device, r.compute),
            (None, None, None)
        );
        // A compute policy alone, or with a quota; odd values reach cuvisor's own check.
        let r = run_args(&["cuvisor", "run", "--compute", "share=1", "--", "true"]);
        assert_eq!(r.compute.as_deref(), Some("share=1"));
        let r = run_args(&[
            "cuvisor",
            "run",
            "--memory",
            "1Gi",
            "--compute",
            "-limit=3",
            "--",
            "true",
        ]);
        assert_eq!(r.memory.as_deref(), Some("1Gi"));
        assert_eq!(r.compute.as_deref(), Some("-limit=3"));
    }

    #[test]
    fn sim_load_has_defaults_and_takes_the_global_flags() {
        let cli = Cli::try_parse_from(["cuvisor", "sim", "load", "--sim", "single"]).unwrap();
        assert_eq!(cli.target.sim.as_deref(), Some("single"));
        let Command::Sim(SimArgs {
            command: SimCommand::Load(l),
        }) = cli.command
        else {
            panic!("not sim load")
        };
        assert_eq!(
            (l.kernel.as_str(), l.seconds.as_str(), l.every.as_str()),
            ("1ms", "10", "1s")
        );
        let cli = Cli::try_parse_from([
            "cuvisor",
            "sim",
            "load",
            "--kernel",
            "-1ms",
            "--seconds",
            "4",
            "--every",
            "0.5s",
        ])
        .unwrap();
        let Command::Sim(SimArgs {
            command: SimCommand::Load(l),
        }) = cli.command
        else {
            panic!("not sim load")
        };
        assert_eq!(
            (l.kernel.as_str(), l.seconds.as_str(), l.every.as_str()),
            ("-1ms", "4", "0.5s")
        );
    }

    #[test]
    fn run_needs_one_quota_form_and_a_command() {
        for argv in [
            &["cuvisor", "run", "--memory", "1Gi"][..],
            &["cuvisor", "run", "--memory", "1Gi", "--"],
            &[
                "cuvisor",
                "run",
                "--memory",
                "1Gi",
                "--memory-per-device",
                "0=1Gi",
                "--",
                "true",
            ],
            &[
                "cuvisor", "run", "--memory", "1Gi", "--log", "loud", "--", "true",
            ],
        ] {
            let e = Cli::try_parse_from(argv).unwrap_err();
            assert_eq!(e.exit_code(), 2, "{argv:?}: {e}");
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
