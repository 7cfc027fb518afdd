//! The limits file: what the device plugin writes for a container (mounted read-only at
//! [`crate::CONTAINER_LIMITS`]) and the library reads. One type, rendered by the one and parsed
//! by the other, so the two cannot drift apart.
//!
//! ```text
//! version = 1
//! state_dir = /var/run/cuvisor/state        # the container's ledger directory
//! coord_dir = /var/run/cuvisor/coord        # the GPU coordinators' directory
//! memory = 6Gi                              # every device
//! memory.0 = 6Gi                            # by CUDA device ordinal
//! memory.GPU-5f2ac1de-0000-4000-8000-000000000001 = 6Gi   # by GPU UUID
//! context_reserve = 300Mi                   # charged per CUDA context
//! compute = limit=30                        # or share=2, share=memory, none
//! coord_own_dir = /var/run/cuvisor/compute  # the container's own coordinator states
//! coord_slot.GPU-5f2ac1de-0000-4000-8000-000000000001 = 3   # its entry on that GPU's board
//! ```
//!
//! `coord_slot.<UUID> = N` says that the plugin listed the container as entry N of that GPU's
//! coordinator board (crate::coordinator), its state mounted read-write at
//! `<coord_own_dir>/gpu-<UUID hex>`; the policy is then the board's.
//!
//! `#` starts a comment. Unknown keys, a missing or other `version`, a missing `state_dir` and a
//! file that grants no memory are errors. `compute` is kept as written: the library reads a
//! malformed policy as its smallest share rather than refusing memory (see src/config.rs).

use crate::quantity::parse_quantity;
use std::fmt::Write as _;
use std::path::PathBuf;

/// The version this build writes and reads.
pub const VERSION: u32 = 1;

/// Which devices a memory limit applies to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    All,
    Ordinal(u32),
    Uuid([u8; 16]),
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LimitsFile {
    pub state_dir: PathBuf,
    pub coord_dir: Option<PathBuf>,
    /// Memory limits in bytes, in file order.
    pub memory: Vec<(Target, u64)>,
    pub context_reserve: Option<u64>,
    /// The compute policy as written (validated by whoever writes it; read leniently).
    pub compute: Option<String>,
    /// Where the container's own coordinator states are mounted.
    pub coord_own_dir: Option<PathBuf>,
    /// The container's entry on each GPU's coordinator board: (GPU UUID, index).
    pub coord_slots: Vec<([u8; 16], u32)>,
}

impl LimitsFile {
    /// The file's text (sizes in plain bytes, GPUs by UUID as NVML spells them).
    pub fn render(&self) -> String {
        let mut t = format!("# written by cuvisor-device-plugin\nversion = {VERSION}\n");
        let _ = writeln!(t, "state_dir = {}", self.state_dir.display());
        if let Some(d) = &self.coord_dir {
            let _ = writeln!(t, "coord_dir = {}", d.display());
        }
        for (target, bytes) in &self.memory {
            match target {
                Target::All => {
                    let _ = writeln!(t, "memory = {bytes}");
                }
                Target::Ordinal(o) => {
                    let _ = writeln!(t, "memory.{o} = {bytes}");
                }
                Target::Uuid(u) => {
                    let _ = writeln!(t, "memory.{} = {bytes}", crate::uuid::format(u));
                }
            }
        }
        if let Some(c) = self.context_reserve {
            let _ = writeln!(t, "context_reserve = {c}");
        }
        if let Some(c) = &self.compute {
            let _ = writeln!(t, "compute = {c}");
        }
        if let Some(d) = &self.coord_own_dir {
            let _ = writeln!(t, "coord_own_dir = {}", d.display());
        }
        for (u, i) in &self.coord_slots {
            let _ = writeln!(t, "coord_slot.{} = {i}", crate::uuid::format(u));
        }
        t
    }

    /// Reads a file's text; the error names the line and what is wrong with it.
    pub fn parse(text: &str) -> Result<LimitsFile, String> {
        let mut f = LimitsFile::default();
        let mut version = None;
        let size = |v: &str| parse_quantity(v).map_err(|e| format!("{v:?}: {e}"));
        for (n, raw) in text.lines().enumerate() {
            let line = raw.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let at = |e: String| format!("line {}: {e}", n + 1);
            let (key, value) = line
                .split_once('=')
                .ok_or_else(|| at(format!("{line:?} is not KEY = VALUE")))?;
            let (key, value) = (key.trim(), value.trim());
            match key {
                "version" => version = Some(value.to_string()),
                "state_dir" => f.state_dir = PathBuf::from(value),
                "coord_dir" => f.coord_dir = Some(PathBuf::from(value)),
                "context_reserve" => f.context_reserve = Some(size(value).map_err(at)?),
                "compute" => f.compute = Some(value.to_string()),
                "coord_own_dir" => f.coord_own_dir = Some(PathBuf::from(value)),
                k if k.starts_with("coord_slot.") => {
                    let dev = &k["coord_slot.".len()..];
                    let uuid = crate::uuid::parse(dev)
                        .ok_or_else(|| at(format!("{dev:?} is not a GPU UUID")))?;
                    let i = value
                        .parse::<u32>()
                        .ok()
                        .filter(|i| (*i as usize) < crate::coordinator::MAX_SLOTS)
                        .ok_or_else(|| {
                            at(format!(
                                "{value:?} is not a coordinator entry (0 to {})",
                                crate::coordinator::MAX_SLOTS - 1
                            ))
                        })?;
                    f.coord_slots.push((uuid, i));
                }
                "memory" => f.memory.push((Target::All, size(value).map_err(at)?)),
                k if k.starts_with("memory.") => {
                    let dev = &k["memory.".len()..];
                    let target = match dev.parse::<u32>() {
                        Ok(o) => Target::Ordinal(o),
                        Err(_) => Target::Uuid(crate::uuid::parse(dev).ok_or_else(|| {
                            at(format!(
                                "{dev:?} is neither a device ordinal nor a GPU UUID"
                            ))
                        })?),
                    };
                    f.memory.push((target, size(value).map_err(at)?));
                }
                other => return Err(at(format!("unknown key {other:?}"))),
            }
        }
        match version.as_deref() {
            Some(v) if v == VERSION.to_string() => {}
            Some(v) => {
                return Err(format!(
                    "version {v} (this cuvisor reads version {VERSION})"
                ))
            }
            None => return Err(format!("no `version = {VERSION}` line")),
        }
        if f.state_dir.as_os_str().is_empty() {
            return Err("no state_dir".into());
        }
        if f.memory.is_empty() {
            return Err("no memory limit".into());
        }
        Ok(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_rendered_parses_back_the_same() {
        let f = LimitsFile {
            state_dir: "/var/run/cuvisor/state".into(),
            coord_dir: Some("/var/run/cuvisor/coord".into()),
            memory: vec![
                (Target::Uuid([0x5f; 16]), 6 << 30),
                (Target::Ordinal(1), 1 << 30),
                (Target::All, 12 << 30),
            ],
            context_reserve: Some(300 << 20),
            compute: Some("share=2".into()),
            coord_own_dir: Some("/var/run/cuvisor/compute".into()),
            coord_slots: vec![([0x5f; 16], 3), ([0x60; 16], 63)],
        };
        assert_eq!(LimitsFile::parse(&f.render()).unwrap(), f);
        let minimal = LimitsFile {
            state_dir: "/s".into(),
            memory: vec![(Target::All, 1)],
            ..LimitsFile::default()
        };
        assert_eq!(LimitsFile::parse(&minimal.render()).unwrap(), minimal);
    }

    #[test]
    fn errors_name_the_line_and_the_reason() {
        for (text, why) in [
            ("memory = 6Gi\nstate_dir = /x\n", "no `version = 1` line"),
            ("version = 2\nmemory = 1Gi\nstate_dir = /x\n", "version 2"),
            (
                "version = 1\nmemory = 6GB\nstate_dir = /x\n",
                "line 2: \"6GB\"",
            ),
            (
                "version = 1\nmemroy = 6Gi\nstate_dir = /x\n",
                "unknown key \"memroy\"",
            ),
            (
                "version = 1\nmemory.GPU-zz = 1Gi\nstate_dir = /x\n",
                "neither a device ordinal",
            ),
            ("version = 1\nstate_dir = /x\n", "no memory limit"),
            (
                "version = 1\nmemory = 1Gi\nstate_dir = /x\ncoord_slot.GPU-zz = 1\n",
                "line 4: \"GPU-zz\" is not a GPU UUID",
            ),
            (
                "version = 1\nmemory = 1Gi\nstate_dir = /x\n\
                 coord_slot.GPU-5f5f5f5f-5f5f-5f5f-5f5f-5f5f5f5f5f5f = 64\n",
                "\"64\" is not a coordinator entry (0 to 63)",
            ),
            ("version = 1\nmemory = 1Gi\n", "no state_dir"),
            (
                "version = 1\njust words\n",
                "line 2: \"just words\" is not KEY = VALUE",
            ),
        ] {
            let e = LimitsFile::parse(text).unwrap_err();
            assert!(e.contains(why), "{text:?}: {e}");
        }
    }
}
