//! Which machine a command talks to: the system's NVML, or the simulator (its model, its state
//! file, and the simulated libnvidia-ml.so.1 built next to this executable).
//!
//! The simulator is chosen by `--sim` or, failing that, `CUVISOR_SIM` (the variable the simulated
//! libraries read). With neither, `smi` uses the system's NVML, so that `cuvisor smi` on a GPU node
//! behaves like `nvidia-smi`; the `sim` verbs use the `single` preset, as the libraries do.

use crate::args::Target;
use crate::files::{self, Links, NotOpened};
use crate::{Failure, Result};
use cuvisor_sim::model::{self, Model, PRESETS};
use cuvisor_sim::state::{self, Shared};
use nvml_wrapper::Nvml;
use std::path::{Path, PathBuf};

/// Where `smi` gets its GPUs from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// The simulator, with the preset name or file path, and whether it came from `--sim`.
    Sim {
        spec: String,
        from_flag: bool,
    },
    System,
}

pub fn source(target: &Target) -> Source {
    source_from(target, std::env::var("CUVISOR_SIM").ok())
}

fn source_from(target: &Target, env: Option<String>) -> Source {
    if let Some(spec) = &target.sim {
        return Source::Sim {
            spec: spec.trim().to_string(),
            from_flag: true,
        };
    }
    match env {
        Some(v) if !v.trim().is_empty() => Source::Sim {
            spec: v.trim().to_string(),
            from_flag: false,
        },
        _ => Source::System,
    }
}

/// The simulator's model for `spec`, with errors that say where the bad value came from.
pub fn load_model(spec: &str, from_flag: bool) -> Result<Model> {
    let origin = if from_flag {
        format!("--sim {spec}")
    } else {
        format!("CUVISOR_SIM={spec}")
    };
    if let Some(m) = model::preset(spec) {
        return Ok(m);
    }
    let looks_like_path = spec.contains('/') || spec.ends_with(".toml") || spec.ends_with(".json");
    if spec.is_empty() || !looks_like_path {
        return Err(Failure::Usage(format!(
            "{origin}: no such simulator preset; the presets are {} (see `cuvisor sim presets`), \
             or give the path of a .toml/.json machine file",
            PRESETS.join(", ")
        )));
    }
    Model::load(spec).map_err(|e| {
        let detail = e.strip_prefix("CUVISOR_SIM: ").unwrap_or(&e);
        Failure::Usage(format!("{origin}: {detail}"))
    })
}

/// The simulator model the `sim` verbs act on: `--sim`, else `CUVISOR_SIM`, else `single`.
pub fn sim_model(target: &Target) -> Result<Model> {
    match source(target) {
        Source::Sim { spec, from_flag } => load_model(&spec, from_flag),
        Source::System => load_model("single", false),
    }
}

/// The state file, found as the simulated libraries find it: `--state`, else
/// `CUVISOR_SIM_STATE`, else the default for this model.
pub fn state_path(target: &Target, model: &Model) -> PathBuf {
    if let Some(p) = &target.state {
        return p.clone();
    }
    match std::env::var_os("CUVISOR_SIM_STATE") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => state::default_state_path(model),
    }
}

/// How long [`check_state_file`] waits for a state file that another process is creating (the
/// simulator makes it, sizes it and writes its header under an flock, in well under a
/// millisecond) to get its header.
const STATE_HEADER_WAIT: std::time::Duration = std::time::Duration::from_millis(500);

/// Checks a state file given to `cuvisor run` before anything is made beside it (the coordinator
/// directory `<file>.coord`): it may be absent (the simulator creates it), else it must be a
/// regular file, not reached through a symbolic link, that starts with the simulator's header
/// for this layout version and this machine model. The header is read from a descriptor opened
/// with O_NONBLOCK | O_NOFOLLOW after the path was seen to be a regular file (see `files`), so
/// a FIFO, a device or a directory is refused, never read. A file with no header yet (shorter
/// than one, or its magic still 0) is looked at again for [`STATE_HEADER_WAIT`]: the simulator
/// in a run started just before may be writing it. No lock is waited on. Err: the reason.
pub fn check_state_file(path: &Path, model: &Model) -> std::result::Result<(), String> {
    use std::mem::{offset_of, size_of};
    let file = match files::open_regular(path, Links::Refuse) {
        Ok(f) => f,
        Err(NotOpened::Missing) => return Ok(()),
        Err(NotOpened::Refused(why)) => {
            return Err(format!("{why}; give a simulator state file or a new path"))
        }
    };
    let not_ours = || {
        "exists and is not a cuvisor simulator state file: refused, so that nothing is made \
         beside it (give a new path, or one a simulated run made)"
            .to_string()
    };
    let u64_at =
        |h: &[u8], at: usize| u64::from_ne_bytes(h[at..at + 8].try_into().unwrap_or_default());
    let started = std::time::Instant::now();
    let mut head = [0u8; size_of::<state::Header>()];
    loop {
        let got = files::read_head(&file, &mut head).map_err(|e| format!("cannot read: {e}"))?;
        let magic = (got >= 8).then(|| u64_at(&head, offset_of!(state::Header, magic)));
        match magic {
            Some(state::MAGIC) if got == head.len() => break,
            // Nothing there yet, or the header being written.
            None | Some(0) | Some(state::MAGIC) => {
                if started.elapsed() >= STATE_HEADER_WAIT {
                    return Err(not_ours());
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            Some(_) => return Err(not_ours()),
        }
    }
    let at = offset_of!(state::Header, version);
    let version = u32::from_ne_bytes(head[at..at + 4].try_into().unwrap_or_default());
    if version != state::LAYOUT_VERSION {
        return Err(format!(
            "a simulator state file of layout version {version}; this cuvisor's simulator uses \
             version {} (give a new path, or remove it)",
            state::LAYOUT_VERSION
        ));
    }
    if u64_at(&head, offset_of!(state::Header, fingerprint)) != model.fingerprint() {
        return Err(format!(
            "the state of another simulated machine, not {} (give a new path, or remove it)",
            model.name
        ));
    }
    Ok(())
}

/// "the dgx1-v100 simulator has GPUs 0-7"
pub fn gpus_phrase(model: &Model) -> String {
    match model.devices.len() {
        1 => format!("the {} simulator has only GPU 0", model.name),
        n => format!("the {} simulator has GPUs 0-{}", model.name, n - 1),
    }
}

pub fn check_gpu(model: &Model, gpu: usize) -> Result<()> {
    if gpu < model.devices.len() {
        Ok(())
    } else {
        Err(Failure::Usage(format!(
            "GPU {gpu} does not exist ({})",
            gpus_phrase(model)
        )))
    }
}

/// NVML, opened on the system's library or on the simulator's, plus the simulator's model.
pub struct Opened {
    pub nvml: Nvml,
    pub model: Option<Model>,
}

impl Opened {
    /// What the table headers say about where the data comes from.
    pub fn origin(&self) -> String {
        match &self.model {
            Some(m) => format!("simulator: {}", m.name),
            None => "NVML".to_string(),
        }
    }
}

/// Opens NVML for `smi`. For the simulator this sets `CUVISOR_SIM` (and `CUVISOR_SIM_STATE` for
/// `--state`) for the simulated library to read; the process is still single-threaded here.
pub fn open_nvml(target: &Target) -> Result<Opened> {
    match source(target) {
        Source::System => {
            let nvml = Nvml::init().map_err(|e| {
                Failure::Runtime(format!(
                    "cannot initialise NVML (libnvidia-ml.so.1): {e}. Is the NVIDIA driver \
                     installed? To use the simulator instead: cuvisor smi --sim PRESET (presets: {})",
                    PRESETS.join(", ")
                ))
            })?;
            Ok(Opened { nvml, model: None })
        }
        Source::Sim { spec, from_flag } => {
            let model = load_model(&spec, from_flag)?;
            let lib = sim_nvml_path()?;
            // The simulated NVML fails its init on a state file of another model with a bare
            // NVML error code; attaching first gives the reason.
            Shared::attach_at(&model, &state_path(target, &model)).map_err(Failure::Runtime)?;
            std::env::set_var("CUVISOR_SIM", &spec);
            if let Some(state) = &target.state {
                std::env::set_var("CUVISOR_SIM_STATE", state);
            }
            let nvml = Nvml::builder()
                .lib_path(lib.as_os_str())
                .init()
                .map_err(|e| {
                    Failure::Runtime(format!(
                        "cannot initialise the simulated NVML {}: {e}",
                        lib.display()
                    ))
                })?;
            Ok(Opened {
                nvml,
                model: Some(model),
            })
        }
    }
}

/// `sim/libnvidia-ml.so.1` next to this executable, where the workspace build puts it.
fn sim_nvml_path() -> Result<PathBuf> {
    let exe = std::env::current_exe()
        .map_err(|e| Failure::Runtime(format!("cannot find this executable's path: {e}")))?;
    let dir = exe.parent().map(|d| d.join("sim")).unwrap_or_default();
    let lib = dir.join("libnvidia-ml.so.1");
    if lib.exists() {
        Ok(lib)
    } else {
        Err(Failure::Runtime(format!(
            "the simulated NVML is not built: {} does not exist (a `cargo build` of the workspace \
             builds it into target/<profile>/sim/)",
            lib.display()
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(sim: Option<&str>) -> Target {
        Target {
            sim: sim.map(String::from),
            state: None,
        }
    }

    #[test]
    fn the_flag_beats_the_environment_and_nothing_means_the_system() {
        let t = target(Some("pcie-8"));
        assert_eq!(
            source_from(&t, Some("single".into())),
            Source::Sim {
                spec: "pcie-8".into(),
                from_flag: true
            }
        );
        assert_eq!(
            source_from(&target(None), Some("dgx-a100".into())),
            Source::Sim {
                spec: "dgx-a100".into(),
                from_flag: false
            }
        );
        assert_eq!(source_from(&target(None), Some(" ".into())), Source::System);
        assert_eq!(source_from(&target(None), None), Source::System);
    }

    #[test]
    fn unknown_presets_list_the_real_ones() {
        let Err(Failure::Usage(msg)) = load_model("dgx2", true) else {
            panic!("dgx2 is no preset")
        };
        assert!(
            msg.starts_with("--sim dgx2: no such simulator preset"),
            "{msg}"
        );
        for p in PRESETS {
            assert!(msg.contains(p), "{msg}");
        }
        let Err(Failure::Usage(msg)) = load_model("/nonexistent/m.toml", false) else {
            panic!("a missing file loads")
        };
        assert!(
            msg.starts_with("CUVISOR_SIM=/nonexistent/m.toml: cannot read"),
            "{msg}"
        );
    }

    #[test]
    fn gpu_checks_name_the_range() {
        let m = model::preset("dgx1-v100").unwrap();
        assert!(check_gpu(&m, 7).is_ok());
        let Err(Failure::Usage(msg)) = check_gpu(&m, 9) else {
            panic!()
        };
        assert_eq!(
            msg,
            "GPU 9 does not exist (the dgx1-v100 simulator has GPUs 0-7)"
        );
        let s = model::preset("single").unwrap();
        let Err(Failure::Usage(msg)) = check_gpu(&s, 1) else {
            panic!()
        };
        assert_eq!(
            msg,
            "GPU 1 does not exist (the single simulator has only GPU 0)"
        );
    }
}
