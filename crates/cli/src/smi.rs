//! `cuvisor smi`: the main table of `nvidia-smi`, from NVML queries only.
//!
//! [`gather`] asks NVML; [`render`] draws the table from what it got. Fields NVML does not answer
//! (the simulator has no fans, for one) show as `N/A`, as nvidia-smi shows them.

use crate::args::Target;
use crate::machine::{self, Opened};
use crate::{Failure, Result};
use nvml_wrapper::enum_wrappers::device::{
    ComputeMode, EccCounter, MemoryError, TemperatureSensor,
};
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Device;
use std::fmt::Write as _;

const MIB: u64 = 1 << 20;
/// Inner widths of the three columns of the GPU table (nvidia-smi's since driver 550).
const COLS: [usize; 3] = [41, 24, 22];
/// Inner width of the whole table.
const WIDTH: usize = 41 + 24 + 22 + 2;
const NA: &str = "N/A";

/// Everything the table shows.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    /// Where the data comes from ("NVML", "simulator: dgx1-v100").
    pub origin: String,
    pub driver_version: Option<String>,
    /// As cuDriverGetVersion: 12080 = 12.8.
    pub cuda_version: Option<i32>,
    pub gpus: Vec<Gpu>,
    pub processes: Vec<Process>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Gpu {
    pub index: u32,
    pub name: Option<String>,
    pub bus_id: Option<String>,
    pub persistence: Option<bool>,
    pub display_active: Option<bool>,
    pub ecc_uncorrected: Option<u64>,
    pub fan_percent: Option<u32>,
    pub temperature_c: Option<u32>,
    /// P-state number (0 = P0).
    pub perf_state: Option<u32>,
    pub power_mw: Option<u32>,
    pub power_cap_mw: Option<u32>,
    /// (used, total) bytes.
    pub memory: Option<(u64, u64)>,
    pub utilization: Option<u32>,
    pub compute_mode: Option<ComputeMode>,
    pub mig_enabled: Option<bool>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Process {
    pub gpu: u32,
    pub gpu_instance: Option<u32>,
    pub compute_instance: Option<u32>,
    pub pid: u32,
    pub name: Option<String>,
    pub memory: Option<u64>,
}

pub fn run(target: &Target) -> Result<String> {
    let opened = machine::open_nvml(target)?;
    Ok(render(&gather(&opened)?))
}

fn nvml_err(what: &str) -> impl Fn(NvmlError) -> Failure + '_ {
    move |e| Failure::Runtime(format!("NVML: {what}: {e}"))
}

/// Asks NVML for everything the table shows. Only the device count and handles are required;
/// any other field NVML cannot give is left empty (shown as N/A).
pub fn gather(opened: &Opened) -> Result<Snapshot> {
    let nvml = &opened.nvml;
    let count = nvml.device_count().map_err(nvml_err("device count"))?;
    let mut snap = Snapshot {
        origin: opened.origin(),
        driver_version: nvml.sys_driver_version().ok(),
        cuda_version: nvml.sys_cuda_driver_version().ok(),
        ..Snapshot::default()
    };
    for index in 0..count {
        let dev = nvml
            .device_by_index(index)
            .map_err(|e| Failure::Runtime(format!("NVML: GPU {index}: {e}")))?;
        snap.gpus.push(gpu_row(index, &dev));
        if let Ok(procs) = dev.running_compute_processes() {
            for p in procs {
                snap.processes.push(Process {
                    gpu: index,
                    gpu_instance: p.gpu_instance_id,
                    compute_instance: p.compute_instance_id,
                    pid: p.pid,
                    name: nvml
                        .sys_process_name(p.pid, 256)
                        .ok()
                        .filter(|n| !n.is_empty())
                        .or_else(|| proc_name(p.pid)),
                    memory: match p.used_gpu_memory {
                        UsedGpuMemory::Used(b) => Some(b),
                        UsedGpuMemory::Unavailable => None,
                    },
                });
            }
        }
    }
    snap.processes.sort_by_key(|p| (p.gpu, p.pid));
    Ok(snap)
}

fn gpu_row(index: u32, dev: &Device) -> Gpu {
    Gpu {
        index,
        name: dev.name().ok(),
        bus_id: dev.pci_info().ok().map(|p| p.bus_id),
        persistence: dev.is_in_persistent_mode().ok(),
        display_active: dev.is_display_active().ok(),
        ecc_uncorrected: dev
            .total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile)
            .ok(),
        fan_percent: dev.fan_speed(0).ok(),
        temperature_c: dev.temperature(TemperatureSensor::Gpu).ok(),
        perf_state: dev
            .performance_state()
            .ok()
            .map(|p| p.as_c())
            .filter(|&p| p <= 15),
        power_mw: dev.power_usage().ok(),
        power_cap_mw: dev.enforced_power_limit().ok(),
        memory: dev.memory_info().ok().map(|m| (m.used, m.total)),
        utilization: dev.utilization_rates().ok().map(|u| u.gpu),
        compute_mode: dev.compute_mode().ok(),
        mig_enabled: dev.mig_mode().ok().map(|m| m.current != 0),
    }
}

/// The program a pid runs, when NVML does not say (the simulator does not): argv[0], else comm.
fn proc_name(pid: u32) -> Option<String> {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let argv0 = cmdline.split(|&b| b == 0).next().unwrap_or_default();
    if !argv0.is_empty() {
        return Some(String::from_utf8_lossy(argv0).into_owned());
    }
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
    Some(comm.trim().to_string()).filter(|c| !c.is_empty())
}

fn opt<T: std::fmt::Display>(v: Option<T>, unit: &str) -> String {
    v.map_or_else(|| NA.to_string(), |v| format!("{v}{unit}"))
}

fn on_off(v: Option<bool>) -> &'static str {
    match v {
        Some(true) => "On",
        Some(false) => "Off",
        None => NA,
    }
}

fn compute_mode_name(m: Option<ComputeMode>) -> &'static str {
    match m {
        Some(ComputeMode::Default) => "Default",
        Some(ComputeMode::ExclusiveThread) => "E. Thread",
        Some(ComputeMode::Prohibited) => "Prohibited",
        Some(ComputeMode::ExclusiveProcess) => "E. Process",
        None => NA,
    }
}

/// One table cell: ` left   right `, `width` characters in all. A `left` too long for the cell
/// is cut and ends in "...", as nvidia-smi cuts long GPU names.
pub fn cell(left: &str, right: &str, width: usize) -> String {
    let room = width.saturating_sub(2);
    let right_len = right.chars().count();
    let mut left_len = left.chars().count();
    let gap = usize::from(!left.is_empty() && !right.is_empty());
    let left = if left_len + gap + right_len > room {
        let keep = room.saturating_sub(right_len + gap + 3);
        left_len = keep + 3;
        format!("{}...", left.chars().take(keep).collect::<String>())
    } else {
        left.to_string()
    };
    let pad = room.saturating_sub(left_len + right_len);
    format!(" {left}{}{right} ", " ".repeat(pad))
}

/// Cuts the start of a long path: "...site-packages/bin/python3".
fn cut_front(s: &str, width: usize) -> String {
    let n = s.chars().count();
    if n <= width {
        return s.to_string();
    }
    let tail: String = s.chars().skip(n - (width - 3)).collect();
    format!("...{tail}")
}

fn row(cells: [String; 3]) -> String {
    format!("|{}|{}|{}|\n", cells[0], cells[1], cells[2])
}

fn rule(fill: char, joint: char, ends: (char, char)) -> String {
    let parts: Vec<String> = COLS.iter().map(|&w| fill.to_string().repeat(w)).collect();
    format!("{}{}{}\n", ends.0, parts.join(&joint.to_string()), ends.1)
}

fn wide_rule(fill: char, ends: char) -> String {
    format!("{ends}{}{ends}\n", fill.to_string().repeat(WIDTH))
}

fn wide_row(text: &str) -> String {
    format!("|{}|\n", cell(text, "", WIDTH))
}

fn process_line(cols: [&str; 7]) -> String {
    let [gpu, gi, ci, pid, kind, name, mem] = cols;
    let fixed = format!("{gpu:>4}   {gi:<3}  {ci:<3} {pid:>10} {kind:>6}   ");
    // The name takes what is left after the fixed columns and a 10-wide memory column.
    let name_room = WIDTH - 2 - fixed.chars().count() - 1 - 10;
    wide_row_lr(&format!("{fixed}{}", cut_front(name, name_room)), mem)
}

fn wide_row_lr(left: &str, right: &str) -> String {
    format!("|{}|\n", cell(left, right, WIDTH))
}

/// Draws the table.
pub fn render(s: &Snapshot) -> String {
    let mut out = String::new();
    out.push_str(&wide_rule('-', '+'));
    let cuda = s
        .cuda_version
        .map(|v| format!("{}.{}", v / 1000, (v % 1000) / 10));
    let versions = format!(
        "Driver Version: {:<13} CUDA Version: {:<6}",
        s.driver_version.as_deref().unwrap_or(NA),
        cuda.as_deref().unwrap_or(NA)
    );
    out.push_str(&format!(
        "|{}|\n",
        cell(&format!("CUVISOR-SMI ({})", s.origin), &versions, WIDTH)
    ));
    out.push_str(&rule('-', '+', ('|', '+')));
    let w = COLS;
    out.push_str(&row([
        cell("GPU  Name", "Persistence-M", w[0]),
        cell("Bus-Id", "Disp.A", w[1]),
        cell("", "Volatile Uncorr. ECC", w[2]),
    ]));
    out.push_str(&row([
        cell("Fan  Temp   Perf", "Pwr:Usage/Cap", w[0]),
        cell("", "Memory-Usage", w[1]),
        cell("GPU-Util", "Compute M.", w[2]),
    ]));
    out.push_str(&row([
        cell("", "", w[0]),
        cell("", "", w[1]),
        cell("", "MIG M.", w[2]),
    ]));
    out.push_str(&rule('=', '+', ('|', '|')));
    if s.gpus.is_empty() {
        out.push_str(&wide_row("No devices were found"));
        out.push_str(&wide_rule('-', '+'));
    }
    for g in &s.gpus {
        let name = g.name.as_deref().unwrap_or(NA);
        let bus = g.bus_id.as_deref().unwrap_or(NA);
        let power = format!(
            "{:>5} / {:>5}",
            opt(g.power_mw.map(|p| p / 1000), "W"),
            opt(g.power_cap_mw.map(|p| p / 1000), "W")
        );
        let memory = match g.memory {
            Some((used, total)) => format!("{}MiB / {:>6}MiB", used / MIB, total / MIB),
            None => NA.to_string(),
        };
        out.push_str(&row([
            cell(
                &format!("{:>3}  {name}", g.index),
                &format!("{:<3}", on_off(g.persistence)),
                w[0],
            ),
            cell("", &format!("{bus} {}", on_off(g.display_active)), w[1]),
            cell("", &opt(g.ecc_uncorrected, ""), w[2]),
        ]));
        out.push_str(&row([
            cell(
                &format!(
                    "{:>3}   {:>3}    {:<3}",
                    opt(g.fan_percent, "%"),
                    opt(g.temperature_c, "C"),
                    opt(g.perf_state.map(|p| format!("P{p}")), "")
                ),
                &power,
                w[0],
            ),
            cell("", &memory, w[1]),
            cell(
                &format!("{:>7}", opt(g.utilization, "%")),
                compute_mode_name(g.compute_mode),
                w[2],
            ),
        ]));
        let mig = match g.mig_enabled {
            Some(true) => "Enabled",
            Some(false) => "Disabled",
            None => NA,
        };
        out.push_str(&row([
            cell("", "", w[0]),
            cell("", "", w[1]),
            cell("", mig, w[2]),
        ]));
        out.push_str(&rule('-', '+', ('+', '+')));
    }
    out.push('\n');
    out.push_str(&wide_rule('-', '+'));
    out.push_str(&wide_row("Processes:"));
    out.push_str(&process_line([
        "GPU",
        "GI",
        "CI",
        "PID",
        "Type",
        "Process name",
        "GPU Memory",
    ]));
    out.push_str(&process_line(["", "ID", "ID", "", "", "", "Usage     "]));
    out.push_str(&wide_rule('=', '|'));
    if s.processes.is_empty() {
        out.push_str(&wide_row(" No running processes found"));
    }
    for p in &s.processes {
        let mut mem = String::new();
        match p.memory {
            Some(b) => {
                let _ = write!(mem, "{}MiB", b.div_ceil(MIB));
            }
            None => mem.push_str(NA),
        }
        out.push_str(&process_line([
            &p.gpu.to_string(),
            &opt(p.gpu_instance, ""),
            &opt(p.compute_instance, ""),
            &p.pid.to_string(),
            "C",
            p.name.as_deref().unwrap_or(NA),
            &mem,
        ]));
    }
    out.push_str(&wide_rule('-', '+'));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v100(index: u32) -> Gpu {
        Gpu {
            index,
            name: Some("Tesla V100-SXM2-16GB".into()),
            bus_id: Some(format!("00000000:{:02x}:00.0", 7 + index)),
            memory: Some((512 * MIB, 16384 * MIB)),
            utilization: Some(37),
            ..Gpu::default()
        }
    }

    fn snapshot() -> Snapshot {
        Snapshot {
            origin: "simulator: dgx1-v100".into(),
            driver_version: Some("570.124.06".into()),
            cuda_version: Some(12080),
            gpus: vec![v100(0), v100(1)],
            processes: vec![Process {
                gpu: 1,
                pid: 4242,
                name: Some("/usr/bin/python3".into()),
                memory: Some(512 * MIB),
                ..Process::default()
            }],
        }
    }

    #[test]
    fn every_line_has_the_table_width() {
        let text = render(&snapshot());
        for line in text.lines().filter(|l| !l.is_empty()) {
            assert_eq!(line.chars().count(), WIDTH + 2, "{line:?}\n{text}");
        }
    }

    #[test]
    fn gpu_rows_show_what_nvml_said() {
        let text = render(&snapshot());
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[1],
            "| CUVISOR-SMI (simulator: dgx1-v100)   Driver Version: 570.124.06    CUDA Version: 12.8   |"
        );
        let g1 = lines
            .iter()
            .position(|l| l.contains("00000000:08:00.0"))
            .unwrap();
        assert_eq!(
            lines[g1],
            "|   1  Tesla V100-SXM2-16GB           N/A |   00000000:08:00.0 N/A |                  N/A |"
        );
        assert_eq!(
            lines[g1 + 1],
            "| N/A   N/A    N/A            N/A /   N/A |     512MiB /  16384MiB |     37%          N/A |"
        );
        assert!(text.contains(
            "|    1   N/A  N/A       4242      C   /usr/bin/python3                             512MiB |"
        ), "{text}");
    }

    #[test]
    fn no_processes_and_unknown_fields() {
        let mut s = snapshot();
        s.processes.clear();
        s.gpus[0].memory = None;
        s.gpus[0].persistence = Some(true);
        s.gpus[0].compute_mode = Some(ComputeMode::Default);
        s.gpus[0].perf_state = Some(0);
        s.gpus[0].temperature_c = Some(34);
        s.gpus[0].power_mw = Some(43_500);
        s.gpus[0].power_cap_mw = Some(300_000);
        let text = render(&s);
        assert!(text.contains("|  No running processes found"), "{text}");
        assert!(
            text.contains("Tesla V100-SXM2-16GB           On  |"),
            "{text}"
        );
        assert!(
            text.contains("| N/A   34C    P0             43W /  300W |"),
            "{text}"
        );
        assert!(text.contains("|     37%      Default |"), "{text}");
        assert!(text.contains("|                    N/A |"), "{text}");
    }

    #[test]
    fn long_names_are_cut() {
        assert_eq!(cell("abcdefghij", "Off", 12), " abc... Off ");
        assert_eq!(cell("abc", "Off", 12), " abc    Off ");
        assert_eq!(cut_front("/very/long/path/python3", 12), "...h/python3");
        let mut s = snapshot();
        s.gpus[0].name = Some("NVIDIA A100-PCIE-16GB (simulated)".into());
        s.processes[0].name = Some(format!("/opt/{}/bin/python3", "x".repeat(80)));
        for line in render(&s).lines().filter(|l| !l.is_empty()) {
            assert_eq!(line.chars().count(), WIDTH + 2, "{line:?}");
        }
    }
}
