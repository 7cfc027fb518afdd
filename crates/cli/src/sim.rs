//! `cuvisor sim presets` and `cuvisor sim reset` (`sim fault` is in fault.rs, `sim load` in
//! load.rs).

use crate::args::Target;
use crate::machine;
use crate::{Failure, Result};
use cuvisor_sim::model::{self, LinkPeer, Model, GIB, PRESETS};
use cuvisor_sim::state::Shared;
use std::fmt::Write as _;

/// One line about a machine's GPU interconnect.
pub fn interconnect(m: &Model) -> String {
    let max_links = m.devices.iter().map(|d| d.links.len()).max().unwrap_or(0);
    let numa = {
        let mut nodes: Vec<u32> = m.devices.iter().map(|d| d.numa_node).collect();
        nodes.sort_unstable();
        nodes.dedup();
        nodes.len()
    };
    let numa = match numa {
        1 => "1 NUMA node".to_string(),
        n => format!("{n} NUMA nodes"),
    };
    let switched = m
        .devices
        .iter()
        .any(|d| d.links.iter().any(|p| matches!(p, LinkPeer::Switch(_))));
    if switched {
        format!(
            "NVSwitch ({} switches, {max_links} NVLinks per GPU), {numa}",
            m.nvswitches.len()
        )
    } else if max_links > 0 {
        format!("direct NVLink (up to {max_links} links per GPU), {numa}")
    } else {
        format!("PCIe only, {numa}")
    }
}

fn memory(bytes: u64) -> String {
    // Whole GiB as "16 GiB"; others to one decimal, as nvidia-smi's 143771 MiB is "140.4 GiB".
    let gib = bytes as f64 / GIB as f64;
    if bytes.is_multiple_of(GIB) {
        format!("{gib} GiB")
    } else {
        format!("{gib:.1} GiB")
    }
}

pub fn presets() -> Result<String> {
    let models: Vec<Model> = PRESETS.iter().filter_map(|p| model::preset(p)).collect();
    let name_w = models.iter().map(|m| m.name.len()).max().unwrap_or(0) + 2;
    let gpu_w = models
        .iter()
        .map(|m| m.devices[0].name.len())
        .max()
        .unwrap_or(0);
    let mem_w = models
        .iter()
        .map(|m| memory(m.devices[0].memory).len())
        .max()
        .unwrap_or(0)
        .max("MEMORY".len());
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<name_w$}{:>4}  {:<gpu_w$}  {:>mem_w$}  INTERCONNECT",
        "PRESET", "GPUS", "GPU", "MEMORY"
    );
    for m in &models {
        let d = &m.devices[0];
        let name = if m.name == "single" {
            format!("{} *", m.name)
        } else {
            m.name.clone()
        };
        let _ = writeln!(
            out,
            "{name:<name_w$}{:>4}  {:<gpu_w$}  {:>mem_w$}  {}",
            m.devices.len(),
            d.name,
            memory(d.memory),
            interconnect(m)
        );
    }
    out.push_str(
        "\n* the default when neither --sim nor CUVISOR_SIM names one (for `cuvisor sim` and the \
         simulated libraries; `cuvisor smi` then uses the system's NVML).\n\
         --sim also takes the path of a .toml/.json machine file (see crates/sim/src/model.rs).\n",
    );
    Ok(out)
}

/// Deletes the state file, unless a live process holds a slot in it.
pub fn reset(target: &Target) -> Result<String> {
    let model = machine::sim_model(target)?;
    let path = machine::state_path(target, &model);
    if !path.exists() {
        return Ok(format!(
            "nothing to reset: {} does not exist\n",
            path.display()
        ));
    }
    let shared = Shared::attach_at(&model, &path).map_err(Failure::Runtime)?;
    shared.reclaim_dead();
    let mut pids: Vec<u32> = shared.live_procs().map(|(pid, _)| pid).collect();
    if !pids.is_empty() {
        pids.sort_unstable();
        let list: Vec<String> = pids.iter().map(u32::to_string).collect();
        return Err(Failure::Runtime(format!(
            "refusing to reset {}: live processes still use the simulator (pid {}); stop them first",
            path.display(),
            list.join(", ")
        )));
    }
    drop(shared);
    std::fs::remove_file(&path)
        .map_err(|e| Failure::Runtime(format!("cannot delete {}: {e}", path.display())))?;
    Ok(format!(
        "reset the {} simulator: deleted {}\n",
        model.name,
        path.display()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_described() {
        let text = presets().unwrap();
        for p in PRESETS {
            assert!(text.lines().any(|l| l.starts_with(p)), "{p}:\n{text}");
        }
        let line = |p: &str| text.lines().find(|l| l.starts_with(p)).unwrap().to_string();
        assert!(line("dgx-a100").contains("NVSwitch (6 switches, 12 NVLinks per GPU)"));
        assert!(line("dgx1-v100").contains("direct NVLink (up to 6 links per GPU), 2 NUMA nodes"));
        assert!(line("pcie-8").contains("PCIe only"));
        assert!(line("single *").contains("16 GiB"));
        assert!(line("dgx-a100").contains("80 GiB"));
        let h200 = line("h200");
        assert!(h200.contains("NVIDIA H200"), "{h200}");
        assert!(h200.contains("140.4 GiB"), "143771 MiB: {h200}");
        assert!(
            h200.contains("NVSwitch (4 switches, 18 NVLinks per GPU), 2 NUMA nodes"),
            "{h200}"
        );
    }
}
