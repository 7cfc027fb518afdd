//! `cuvisor sim load`: a workload for seeing compute policies on the simulated GPU.
//!
//! It loads `libcuda.so.1` the way an application does (dlopen by name and dlsym, so that the
//! libcuvisor.so that `cuvisor run` preloads wraps the launches), retains GPU 0's primary
//! context, loads a module from any image (the simulator accepts any) and takes its `sim_busy`
//! kernel, whose first parameter (a u64) is its run time in ns. Then it launches kernels of
//! `--kernel` back to back on one stream until `--seconds` have passed.
//!
//! Launches are asynchronous: an event is recorded every ~5 ms of work and, once ~20 ms of work
//! is queued, the oldest is waited for, so the queue stays bounded without ever running dry.
//! Every `--every` it prints the time elapsed, the kernels completed per second and this
//! process's share of GPU 0's time over the interval, read from the simulator's own per-process
//! busy time in its shared state (the state file `cuvisor run --sim` passes in
//! `CUVISOR_SIM_STATE`, or `--state`); at the end, the average over the whole run.
//!
//! Without the simulator (no libcuda.so.1, or a real driver, which has no `sim_busy` kernel) it
//! fails with one line (exit 1) saying that it needs the simulated GPU.

use crate::args::{LoadArgs, Target};
use crate::libcuda::{self, error_name, sym, types::*};
use crate::machine;
use crate::{Failure, Result};
use cuvisor_cuda_abi::cuda::{
    err, CUcontext, CUdevice, CUevent, CUfunction, CUmodule, CUresult, CUstream,
};
use cuvisor_sim::state::{now_ns, ProcSlot, Shared};
use std::collections::VecDeque;
use std::ffi::{c_uint, c_void};
use std::io::Write as _;

/// Work between two recorded events.
const CHUNK_NS: u64 = 5_000_000;
/// At most about this much work is queued on the stream.
const MAX_QUEUED_NS: u64 = 20_000_000;
/// The simulator keeps 5.12 s of per-process history: busy time is read at least this often.
const SAMPLE_NS: u64 = 1_000_000_000;
/// Longest kernel.
const MAX_KERNEL_NS: u64 = 1_000_000_000;
/// Shortest print interval: the simulator counts busy time in 10 ms buckets.
const MIN_EVERY_NS: u64 = 10_000_000;
/// Longest duration any flag takes (a day), which keeps the arithmetic far from overflow.
const MAX_DURATION_NS: f64 = 86_400e9;

/// The CUDA ordinal (and simulator device) the load runs on.
const DEVICE: CUdevice = 0;
/// CU_STREAM_NON_BLOCKING.
const STREAM_NON_BLOCKING: c_uint = 1;
/// CU_EVENT_DISABLE_TIMING.
const EVENT_DISABLE_TIMING: c_uint = 2;

const NEEDS_SIM: &str = "sim load needs the simulated GPU";
const HOW: &str = "run it as `cuvisor run --sim PRESET [--state FILE] --compute POLICY -- cuvisor \
                   sim load`";

/// The parsed flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Plan {
    kernel_ns: u64,
    total_ns: u64,
    every_ns: u64,
}

/// Why a text is not a duration (the caller names the flag and the text).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum DurationError {
    Empty,
    Negative,
    NotANumber,
    NoUnit,
    UnknownUnit(String),
    TooLong,
}

impl std::fmt::Display for DurationError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        const EXAMPLES: &str = "such as 1ms, 50us or 0.5s";
        match self {
            DurationError::Empty => write!(f, "empty (give a duration {EXAMPLES})"),
            DurationError::Negative => write!(f, "a duration cannot be negative"),
            DurationError::NotANumber => {
                write!(f, "not a duration (a number and a unit, {EXAMPLES})")
            }
            DurationError::NoUnit => write!(f, "no unit (give one: ns, us, ms or s, {EXAMPLES})"),
            DurationError::UnknownUnit(u) => write!(f, "unknown unit {u:?} (use ns, us, ms or s)"),
            DurationError::TooLong => write!(f, "too long (at most a day)"),
        }
    }
}

/// A duration in ns: a number and a unit (ns, us, µs, ms, s): "1ms", "50us", "0.5s". A bare
/// number is `bare_unit_ns` ns each, or refused when that is None.
pub(crate) fn parse_duration(
    text: &str,
    bare_unit_ns: Option<f64>,
) -> std::result::Result<u64, DurationError> {
    let t = text.trim();
    if t.is_empty() {
        return Err(DurationError::Empty);
    }
    if t.starts_with('-') {
        return Err(DurationError::Negative);
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    if !number.bytes().any(|b| b.is_ascii_digit()) {
        return Err(DurationError::NotANumber);
    }
    let n: f64 = number.parse().map_err(|_| DurationError::NotANumber)?;
    let scale = match unit.trim_start() {
        "" => bare_unit_ns.ok_or(DurationError::NoUnit)?,
        "ns" => 1.0,
        "us" | "µs" => 1e3,
        "ms" => 1e6,
        "s" => 1e9,
        other => return Err(DurationError::UnknownUnit(other.to_string())),
    };
    let ns = (n * scale).round();
    if ns > MAX_DURATION_NS {
        return Err(DurationError::TooLong);
    }
    Ok(ns as u64)
}

/// "1ms", "50us", "2s", "1500ms", "250ns": the shortest exact form.
pub(crate) fn show_ns(ns: u64) -> String {
    for (unit, size) in [("s", 1_000_000_000), ("ms", 1_000_000), ("us", 1_000)] {
        if ns >= size && ns.is_multiple_of(size) {
            return format!("{}{unit}", ns / size);
        }
    }
    format!("{ns}ns")
}

fn plan(args: &LoadArgs) -> Result<Plan> {
    let flag = |name: &str, text: &str, bare: Option<f64>| {
        parse_duration(text, bare).map_err(|e| {
            let shown = if text.is_empty() || text.contains(char::is_whitespace) {
                format!("{text:?}")
            } else {
                text.to_string()
            };
            Failure::Usage(format!("{name} {shown}: {e}"))
        })
    };
    let kernel_ns = flag("--kernel", &args.kernel, None)?;
    let total_ns = flag("--seconds", &args.seconds, Some(1e9))?;
    let every_ns = flag("--every", &args.every, None)?;
    let range = |name: &str, text: &str, ok: bool, what: &str| {
        if ok {
            Ok(())
        } else {
            Err(Failure::Usage(format!("{name} {text}: {what}")))
        }
    };
    range(
        "--kernel",
        &args.kernel,
        (1..=MAX_KERNEL_NS).contains(&kernel_ns),
        "a kernel runs more than 0 and at most 1s",
    )?;
    range(
        "--seconds",
        &args.seconds,
        total_ns > 0,
        "the load runs for more than 0 seconds",
    )?;
    range(
        "--every",
        &args.every,
        every_ns >= MIN_EVERY_NS,
        "at least 10ms (the simulator counts GPU time in 10 ms buckets)",
    )?;
    Ok(Plan {
        kernel_ns,
        total_ns,
        every_ns,
    })
}

// ---- the driver, through dlopen/dlsym ----------------------------------------------------------

/// The entry points `sim load` calls.
struct Driver {
    init: Init,
    primary_ctx_retain: PrimaryCtxRetain,
    ctx_set_current: CtxSetCurrent,
    module_load_data: ModuleLoadData,
    module_get_function: ModuleGetFunction,
    stream_create: StreamCreate,
    stream_synchronize: StreamSynchronize,
    launch_kernel: LaunchKernel,
    event_create: EventCreate,
    event_record: EventRecord,
    event_query: EventQuery,
    event_synchronize: EventSynchronize,
}

/// `Ok` for CUDA_SUCCESS, else "sim load: CALL: NAME".
fn check(r: CUresult, call: &str) -> Result<()> {
    libcuda::check(r, "sim load", call)
}

impl Driver {
    /// dlopen("libcuda.so.1") and dlsym of every entry point: a library that lacks one is not the
    /// simulator's.
    fn load() -> Result<Driver> {
        let lib = libcuda::open(NEEDS_SIM, HOW)?;
        Ok(Driver {
            init: sym!(lib, c"cuInit", Init),
            primary_ctx_retain: sym!(lib, c"cuDevicePrimaryCtxRetain", PrimaryCtxRetain),
            ctx_set_current: sym!(lib, c"cuCtxSetCurrent", CtxSetCurrent),
            module_load_data: sym!(lib, c"cuModuleLoadData", ModuleLoadData),
            module_get_function: sym!(lib, c"cuModuleGetFunction", ModuleGetFunction),
            stream_create: sym!(lib, c"cuStreamCreate", StreamCreate),
            stream_synchronize: sym!(lib, c"cuStreamSynchronize", StreamSynchronize),
            launch_kernel: sym!(lib, c"cuLaunchKernel", LaunchKernel),
            event_create: sym!(lib, c"cuEventCreate", EventCreate),
            event_record: sym!(lib, c"cuEventRecord", EventRecord),
            event_query: sym!(lib, c"cuEventQuery", EventQuery),
            event_synchronize: sym!(lib, c"cuEventSynchronize", EventSynchronize),
        })
    }
}

/// GPU 0's primary context made current, the `sim_busy` kernel, a stream.
struct Gpu<'d> {
    drv: &'d Driver,
    function: CUfunction,
    stream: CUstream,
}

impl<'d> Gpu<'d> {
    fn open(drv: &'d Driver) -> Result<Gpu<'d>> {
        // (For each driver call below: the entry points are the driver's, called with the
        // arguments cuda.h documents: valid out-pointers to locals, handles the driver gave.)
        // SAFETY: see the line above.
        let r = unsafe { (drv.init)(0) };
        if r != err::SUCCESS {
            return Err(Failure::Runtime(format!(
                "{NEEDS_SIM}, and cuInit failed: {}; {HOW}",
                error_name(r)
            )));
        }
        let mut ctx: CUcontext = std::ptr::null_mut();
        check(
            // SAFETY: see above.
            unsafe { (drv.primary_ctx_retain)(&mut ctx, DEVICE) },
            "cuDevicePrimaryCtxRetain(0)",
        )?;
        // SAFETY: see above.
        check(unsafe { (drv.ctx_set_current)(ctx) }, "cuCtxSetCurrent")?;
        let not_sim = |call: &str, r: CUresult| {
            Failure::Runtime(format!(
                "{NEEDS_SIM}, and this libcuda.so.1 is not the simulator ({call}: {}); {HOW}",
                error_name(r)
            ))
        };
        let mut module: CUmodule = std::ptr::null_mut();
        // SAFETY: see above; the image is a NUL-terminated string, which the simulator accepts
        // as a module (a real driver refuses it).
        let r = unsafe { (drv.module_load_data)(&mut module, c"image".as_ptr().cast()) };
        if r != err::SUCCESS {
            return Err(not_sim("cuModuleLoadData", r));
        }
        let mut function: CUfunction = std::ptr::null_mut();
        // SAFETY: see above.
        let r = unsafe { (drv.module_get_function)(&mut function, module, c"sim_busy".as_ptr()) };
        if r != err::SUCCESS {
            return Err(not_sim("cuModuleGetFunction(sim_busy)", r));
        }
        let mut stream: CUstream = std::ptr::null_mut();
        check(
            // SAFETY: see above.
            unsafe { (drv.stream_create)(&mut stream, STREAM_NON_BLOCKING) },
            "cuStreamCreate",
        )?;
        Ok(Gpu {
            drv,
            function,
            stream,
        })
    }

    /// Queues one `sim_busy` kernel of `ns` (its parameter is read at the launch).
    fn launch(&self, ns: u64) -> Result<()> {
        let mut param = ns;
        let mut params = [(&mut param as *mut u64).cast::<c_void>()];
        // SAFETY: the function and stream are the driver's; `params` holds one pointer to a u64,
        // sim_busy's one parameter, read during the call; no `extra`.
        let r = unsafe {
            (self.drv.launch_kernel)(
                self.function,
                1,
                1,
                1,
                32,
                1,
                1,
                0,
                self.stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        check(r, "cuLaunchKernel")
    }

    fn event(&self) -> Result<CUevent> {
        let mut e: CUevent = std::ptr::null_mut();
        check(
            // SAFETY: a valid out-pointer; the context is current.
            unsafe { (self.drv.event_create)(&mut e, EVENT_DISABLE_TIMING) },
            "cuEventCreate",
        )?;
        Ok(e)
    }

    fn record(&self, e: CUevent) -> Result<()> {
        // SAFETY: an event and a stream of this context.
        check(
            unsafe { (self.drv.event_record)(e, self.stream) },
            "cuEventRecord",
        )
    }

    /// Whether the work before `e` has completed.
    fn done(&self, e: CUevent) -> Result<bool> {
        // SAFETY: an event the driver gave.
        match unsafe { (self.drv.event_query)(e) } {
            err::SUCCESS => Ok(true),
            err::NOT_READY => Ok(false),
            r => check(r, "cuEventQuery").map(|_| false),
        }
    }

    fn wait(&self, e: CUevent) -> Result<()> {
        // SAFETY: an event the driver gave.
        check(
            unsafe { (self.drv.event_synchronize)(e) },
            "cuEventSynchronize",
        )
    }

    fn drain(&self) -> Result<()> {
        // SAFETY: a stream the driver gave.
        check(
            unsafe { (self.drv.stream_synchronize)(self.stream) },
            "cuStreamSynchronize",
        )
    }
}

/// Launched kernels, and which of them are known to have completed.
struct Queue {
    /// Events recorded, oldest first, with the launch count they follow.
    pending: VecDeque<(CUevent, u64)>,
    spare: Vec<CUevent>,
    launched: u64,
    completed: u64,
    /// Launches between two events; events kept at most.
    chunk: u64,
    max_pending: usize,
}

impl Queue {
    fn new(kernel_ns: u64) -> Queue {
        let chunk = CHUNK_NS.div_ceil(kernel_ns).max(1);
        Queue {
            pending: VecDeque::new(),
            spare: Vec::new(),
            launched: 0,
            completed: 0,
            chunk,
            max_pending: (MAX_QUEUED_NS / (chunk * kernel_ns)).max(1) as usize,
        }
    }

    /// One more launch: every `chunk` launches an event, and a wait for the oldest once more than
    /// `max_pending` are out.
    fn launched(&mut self, gpu: &Gpu) -> Result<()> {
        self.launched += 1;
        if !self.launched.is_multiple_of(self.chunk) {
            return Ok(());
        }
        let e = match self.spare.pop() {
            Some(e) => e,
            None => gpu.event()?,
        };
        gpu.record(e)?;
        self.pending.push_back((e, self.launched));
        if self.pending.len() > self.max_pending {
            if let Some((oldest, upto)) = self.pending.pop_front() {
                gpu.wait(oldest)?;
                self.completed = upto;
                self.spare.push(oldest);
            }
        }
        Ok(())
    }

    /// Takes in the events that have completed, without waiting.
    fn poll(&mut self, gpu: &Gpu) -> Result<()> {
        while let Some(&(e, upto)) = self.pending.front() {
            if !gpu.done(e)? {
                break;
            }
            self.completed = upto;
            self.pending.pop_front();
            self.spare.push(e);
        }
        Ok(())
    }

    /// Waits for everything launched.
    fn drain(&mut self, gpu: &Gpu) -> Result<()> {
        gpu.drain()?;
        self.completed = self.launched;
        self.spare.extend(self.pending.drain(..).map(|(e, _)| e));
        Ok(())
    }
}

/// This process's busy time on the simulated GPU, as the simulator counted it.
struct Meter<'s> {
    sim: &'s Shared,
    slot: &'s ProcSlot,
    /// Busy time is read up to here.
    read_at: u64,
    /// The current print interval: its start, busy time so far, kernels completed before it.
    since: u64,
    busy: u64,
    completed_before: u64,
    total_busy: u64,
}

impl Meter<'_> {
    /// Adds the busy time since the last reading.
    fn sample(&mut self) -> u64 {
        let t = now_ns();
        let busy = self
            .sim
            .proc_busy_since(self.slot, DEVICE as usize, self.read_at);
        self.read_at = t;
        self.busy += busy;
        self.total_busy += busy;
        t
    }

    /// Ends the print interval now: (its length, busy ns, kernels completed in it).
    fn interval(&mut self, completed: u64) -> (u64, u64, u64) {
        let t = self.sample();
        let out = (
            t.saturating_sub(self.since),
            self.busy,
            completed - self.completed_before,
        );
        self.since = t;
        self.busy = 0;
        self.completed_before = completed;
        out
    }
}

/// A line on stdout; a closed stdout (`| head`) is not worth a panic, and the load goes on.
fn say(line: &str) {
    let _ = writeln!(std::io::stdout(), "{line}");
}

fn percent(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 * 100.0 / whole as f64
    }
}

fn row(elapsed_ns: u64, len_ns: u64, busy_ns: u64, completed: u64) -> String {
    let per_s = if len_ns == 0 {
        0.0
    } else {
        completed as f64 * 1e9 / len_ns as f64
    };
    format!(
        "{:>8.2} s  {per_s:>9.0}  {:>7.1} %",
        elapsed_ns as f64 / 1e9,
        percent(busy_ns, len_ns)
    )
}

pub fn run(target: &Target, args: &LoadArgs) -> Result<u8> {
    let plan = plan(args)?;
    let model = machine::sim_model(target)?;
    let state = machine::state_path(target, &model);
    // The simulated driver reads these; the process is still single-threaded here.
    if let Some(spec) = &target.sim {
        std::env::set_var("CUVISOR_SIM", spec);
    }
    if let Some(s) = &target.state {
        std::env::set_var("CUVISOR_SIM_STATE", s);
    }
    let drv = Driver::load()?;
    let gpu = Gpu::open(&drv)?;
    let sim = Shared::attach_at(&model, &state).map_err(Failure::Runtime)?;
    let pid = std::process::id();
    let Some((_, slot)) = sim.live_procs().find(|(p, _)| *p == pid) else {
        return Err(Failure::Runtime(format!(
            "sim load: the simulator's state {} has no slot for this process (pid {pid}): the \
             simulated driver uses another state file",
            state.display()
        )));
    };

    say(&format!(
        "sim load: pid {pid}, {} kernels on GPU 0 of the {} simulator (state {}) for {}",
        show_ns(plan.kernel_ns),
        model.name,
        state.display(),
        show_ns(plan.total_ns)
    ));
    say("   elapsed  kernels/s  GPU share");
    let mut queue = Queue::new(plan.kernel_ns);
    let t0 = now_ns();
    let deadline = t0 + plan.total_ns;
    let mut next_print = t0 + plan.every_ns;
    let mut meter = Meter {
        sim: &sim,
        slot,
        read_at: t0,
        since: t0,
        busy: 0,
        completed_before: 0,
        total_busy: 0,
    };
    loop {
        let now = now_ns();
        if now >= deadline {
            break;
        }
        if now >= next_print {
            queue.poll(&gpu)?;
            let (len, busy, done) = meter.interval(queue.completed);
            say(&row(meter.since - t0, len, busy, done));
            while next_print <= now {
                next_print += plan.every_ns;
            }
        } else if now - meter.read_at >= SAMPLE_NS {
            meter.sample();
        }
        gpu.launch(plan.kernel_ns)?;
        queue.launched(&gpu)?;
    }
    queue.drain(&gpu)?;
    let (len, busy, done) = meter.interval(queue.completed);
    let end = meter.since;
    say(&row(end - t0, len, busy, done));
    let elapsed = end - t0;
    say(&format!(
        "sim load: average GPU share {:.1} % over {:.2} s, {} kernels ({:.0}/s)",
        percent(meter.total_busy, elapsed),
        elapsed as f64 / 1e9,
        queue.completed,
        queue.completed as f64 * 1e9 / elapsed.max(1) as f64
    ));
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load_args(kernel: &str, seconds: &str, every: &str) -> LoadArgs {
        LoadArgs {
            kernel: kernel.into(),
            seconds: seconds.into(),
            every: every.into(),
        }
    }

    #[test]
    fn durations_read_as_people_write_them() {
        for (text, ns) in [
            ("1ms", 1_000_000),
            ("50us", 50_000),
            ("50µs", 50_000),
            ("0.5s", 500_000_000),
            (".25s", 250_000_000),
            ("250ns", 250),
            (" 2 s ", 2_000_000_000),
        ] {
            assert_eq!(parse_duration(text, None), Ok(ns), "{text:?}");
        }
        assert_eq!(parse_duration("4", Some(1e9)), Ok(4_000_000_000));
        assert_eq!(parse_duration("2.5", Some(1e9)), Ok(2_500_000_000));
        use DurationError::*;
        for (text, want) in [
            ("", Empty),
            ("-1ms", Negative),
            ("ms", NotANumber),
            ("1.2.3ms", NotANumber),
            ("5", NoUnit),
            ("5h", UnknownUnit("h".into())),
            ("1e3ms", UnknownUnit("e3ms".into())),
            ("2days", UnknownUnit("days".into())),
            ("100000s", TooLong),
        ] {
            assert_eq!(parse_duration(text, None), Err(want), "{text:?}");
        }
        assert_eq!(show_ns(1_000_000), "1ms");
        assert_eq!(show_ns(50_000), "50us");
        assert_eq!(show_ns(4_000_000_000), "4s");
        assert_eq!(show_ns(1_500_000_000), "1500ms");
        assert_eq!(show_ns(1), "1ns");
    }

    fn usage(r: Result<Plan>) -> String {
        match r {
            Err(Failure::Usage(m)) => m,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn flags_are_checked_and_named() {
        assert_eq!(
            plan(&load_args("1ms", "10", "1s")).ok(),
            Some(Plan {
                kernel_ns: 1_000_000,
                total_ns: 10_000_000_000,
                every_ns: 1_000_000_000
            })
        );
        assert_eq!(
            plan(&load_args("50us", "500ms", "100ms")).ok(),
            Some(Plan {
                kernel_ns: 50_000,
                total_ns: 500_000_000,
                every_ns: 100_000_000
            })
        );
        for (a, want) in [
            (
                load_args("5", "10", "1s"),
                "--kernel 5: no unit (give one: ns, us, ms or s, such as 1ms, 50us or 0.5s)",
            ),
            (
                load_args("5h", "10", "1s"),
                "--kernel 5h: unknown unit \"h\" (use ns, us, ms or s)",
            ),
            (
                load_args("0ms", "10", "1s"),
                "--kernel 0ms: a kernel runs more than 0 and at most 1s",
            ),
            (
                load_args("2s", "10", "1s"),
                "--kernel 2s: a kernel runs more than 0 and at most 1s",
            ),
            (
                load_args("1ms", "0", "1s"),
                "--seconds 0: the load runs for more than 0 seconds",
            ),
            (
                load_args("1ms", "abc", "1s"),
                "--seconds abc: not a duration (a number and a unit, such as 1ms, 50us or 0.5s)",
            ),
            (
                load_args("1ms", "10", "1ms"),
                "--every 1ms: at least 10ms (the simulator counts GPU time in 10 ms buckets)",
            ),
            (
                load_args("1ms", "10", ""),
                "--every \"\": empty (give a duration such as 1ms, 50us or 0.5s)",
            ),
        ] {
            assert_eq!(usage(plan(&a)), want);
        }
    }

    #[test]
    fn the_queue_holds_about_20_ms_in_5_ms_steps() {
        for (kernel, chunk, max_pending) in [
            (1_000_000, 5, 4),
            (50_000, 100, 4),
            (3_000_000, 2, 3),
            (10_000_000, 1, 2),
            (100_000_000, 1, 1),
        ] {
            let q = Queue::new(kernel);
            assert_eq!((q.chunk, q.max_pending), (chunk, max_pending), "{kernel}");
        }
    }
}
