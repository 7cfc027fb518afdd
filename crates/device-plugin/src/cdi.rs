//! The Container Device Interface (CDI): what Allocate answers when the container runtime, not
//! the NVIDIA container runtime's environment variable, brings the GPU into the container.
//!
//! # What CDI is, and what this file relies on
//!
//! CDI (cncf-tags/container-device-interface, `SPEC.md` at tag v1.1.0, commit 98a7d735) is a
//! JSON (or YAML) file per vendor that tells a CDI-enabled runtime (containerd >= 1.7, CRI-O,
//! podman) how to edit a container's OCI runtime spec for each device it names:
//! - a spec has `cdiVersion` (semver), `kind` (`vendor/class`: the vendor a DNS-style name
//!   starting with a letter, the class letters, digits, `_-.`; `pkg/parser/parser.go`
//!   `ValidateVendorName`/`ValidateClassName`), `devices` (at least one; each a `name` — letters,
//!   digits, `_-.:`, starting and ending with a letter or digit, a digit first only from 0.5.0 —
//!   and non-empty `containerEdits`; `pkg/cdi/device.go` refuses a device with empty edits), and
//!   optionally spec-wide `containerEdits`, applied once when any of its devices is asked for;
//! - a device is asked for by its fully qualified name `vendor/class=name`;
//! - `containerEdits`: `env` (`NAME=VALUE`; `pkg/cdi/container-edits.go` applies them with
//!   runtime-tools' `AddMultipleProcessEnv`, which replaces a variable of the same name),
//!   `mounts` (`hostPath`, `containerPath`, `options`; a mount at the same container path is
//!   replaced, then mounts are sorted, stably, by the depth of their destination),
//!   `deviceNodes` (`path`, `hostPath`, permissions `rwm` by default; type and numbers taken
//!   from the host node), `hooks` (OCI hooks), `additionalGids`, `intelRdt`, `netDevices`;
//! - spec files are every `*.json`/`*.yaml` in the spec directories, by default `/etc/cdi`
//!   (static) then `/var/run/cdi` (dynamic, generated); a device name found in two directories
//!   is taken from the later one (higher priority), one found twice in the same directory is a
//!   conflict and neither is used (`pkg/cdi/cache.go` `refresh`, `pkg/cdi/spec-dirs.go`).
//!   Several files may hold the same kind: their devices share one namespace;
//! - a spec whose lifetime is an external entity's ("transient") is named
//!   `<vendor>-<class>_<id>` + `.json` (`pkg/cdi/spec.go` `GenerateTransientSpecName`), and the
//!   library writes it to a temporary file in the same directory and renames it into place;
//! - `cdiVersion`: loading fails when a spec uses a field newer than its version; writers (the
//!   CDI library's `MinimumRequiredVersion`, NVIDIA's `nvidia-ctk cdi generate` through
//!   `pkg/nvcdi/spec/set-minimum-version.go`) write the oldest version that holds what the spec
//!   uses, so that older runtimes (containerd 1.7 vendors CDI 0.5.x) read it. So does
//!   [`min_version`] (`specs-go/version.go`: 0.4.0 mount `type`; 0.5.0 a device name starting
//!   with a digit, a device node `hostPath`; 0.6.0 annotations, a `.` in the class; 0.7.0
//!   `additionalGids`).
//!
//! # How a device plugin names CDI devices (NVIDIA/k8s-device-plugin v0.20.0)
//!
//! `internal/plugin/server.go`: with `DEVICE_LIST_STRATEGY` `cdi-cri`, each GPU's qualified name
//! goes into `ContainerAllocateResponse.cdi_devices` (kubelet's `DevicePluginCDIDevices`, KEP
//! 4009: alpha in Kubernetes 1.28, beta and on by default in 1.29, GA in 1.31), which kubelet
//! passes to the runtime in the CRI's `CDIDevices`; with `cdi-annotations`, one annotation
//! `cdi.k8s.io/<plugin>_<response id>` whose value is the names joined by `,` (the CDI library's
//! `pkg/cdi/annotations.go` `AnnotationKey`/`AnnotationValue`: the part after the prefix at
//! most 63 characters). When only CDI strategies are on, NVIDIA's plugin sets no environment
//! (no `NVIDIA_VISIBLE_DEVICES`), no mounts and no device specs; the GPU Operator configures it
//! with `cdi-annotations,cdi-cri` (NVIDIA/gpu-operator `controllers/object_controls.go`,
//! `transformDevicePluginCtrForCDI`). NVIDIA's generated specs set `NVIDIA_VISIBLE_DEVICES=void`
//! in their spec-wide edits (nvidia-container-toolkit `pkg/nvcdi/wrapper.go`, since v1.15.0),
//! so that the NVIDIA runtime, where it is still installed, adds nothing more: cuvisor's own
//! spec therefore never sets that variable.
//!
//! # NVIDIA's device names
//!
//! `nvidia-ctk cdi generate` (nvidia-container-toolkit v1.20.0,
//! `cmd/nvidia-ctk/cdi/generate/generate.go`) writes kind `nvidia.com/gpu` and, by default
//! (`--device-name-strategy`, default `[index, uuid]` since v1.15.0), two names for each GPU:
//! its index (`0`) and its UUID (`GPU-...`), plus `all`; the driver's libraries, binaries and
//! control nodes are in the spec-wide edits, each GPU's `/dev/nvidiaN` in its device's. The
//! toolkit's `nvidia-cdi-refresh` service (since v1.18.0) writes it to `/var/run/cdi/nvidia.yaml`.
//! NVIDIA's own device plugin, in its CDI modes, writes its spec with kind
//! `k8s.device-plugin.nvidia.com/gpu` and UUID names. cuvisor names a GPU by its UUID by default
//! (an index can name another GPU after a reboot; a UUID cannot), under the kind configured in
//! `[cdi] nvidia_kind`.
//!
//! # cuvisor's own spec
//!
//! For each memory allocation, a spec of kind [`KIND`] with one device named by the allocation's
//! id, whose edits are exactly what the `envvar` answer mounts for cuvisor (the library,
//! `/etc/ld.so.preload`, the limits file, the ledger directory, the coordinators) and the
//! environment it sets besides `NVIDIA_VISIBLE_DEVICES`; no device nodes (NVIDIA's spec brings
//! them). It is written when the allocation is made ([`write_spec`]) and removed with it
//! ([`remove_spec`], from the sweeper). Whole GPUs get NVIDIA's names only.
//!
//! Pure: no gRPC, no configuration file (the plugin passes what it configured).

use crate::answer::{Answer, Mount};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// The kind of cuvisor's per-allocation specs.
pub const KIND: &str = "cuvisor.io/allocation";
/// The CDI annotation prefix (`pkg/cdi/annotations.go` `AnnotationPrefix`).
pub const ANNOTATION_PREFIX: &str = "cdi.k8s.io/";
/// The plugin part of cuvisor's CDI annotation key (`<prefix><plugin>_<allocation id>`).
pub const ANNOTATION_PLUGIN: &str = "cuvisor-device-plugin";
/// The variable NVIDIA's runtime reads, and NVIDIA's CDI specs set to `void`.
pub const NVIDIA_VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES";

/// How Allocate tells the runtime which devices a container gets (`[cdi] strategy`), as
/// NVIDIA's `DEVICE_LIST_STRATEGY`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strategy {
    /// `NVIDIA_VISIBLE_DEVICES`, device nodes and cuvisor's mounts in the answer's plain
    /// fields; the NVIDIA container runtime brings the driver.
    Envvar,
    /// CDI device names in `cdi_devices`; nothing in the plain fields.
    CdiCri,
    /// CDI device names in a `cdi.k8s.io/...` annotation; nothing in the plain fields.
    CdiAnnotations,
}

impl Strategy {
    pub const NAMES: [&'static str; 3] = ["envvar", "cdi-cri", "cdi-annotations"];

    pub fn parse(s: &str) -> Option<Strategy> {
        match s {
            "envvar" => Some(Strategy::Envvar),
            "cdi-cri" => Some(Strategy::CdiCri),
            "cdi-annotations" => Some(Strategy::CdiAnnotations),
            _ => None,
        }
    }

    /// Whether devices are named through CDI.
    pub fn is_cdi(self) -> bool {
        self != Strategy::Envvar
    }
}

/// How NVIDIA's spec names a GPU (`[cdi] nvidia_device_name`): `nvidia-ctk cdi generate
/// --device-name-strategy`'s `uuid` and `index`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuNaming {
    Uuid,
    Index,
}

impl GpuNaming {
    pub const NAMES: [&'static str; 2] = ["uuid", "index"];

    pub fn parse(s: &str) -> Option<GpuNaming> {
        match s {
            "uuid" => Some(GpuNaming::Uuid),
            "index" => Some(GpuNaming::Index),
            _ => None,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The spec's types (specs-go/config.go at v1.1.0; JSON names as there). Unknown fields are
// refused, as the CDI library refuses them when it loads a spec.

/// A CDI spec file.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Spec {
    pub cdi_version: String,
    pub kind: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    pub devices: Vec<Device>,
    #[serde(default, skip_serializing_if = "ContainerEdits::is_empty")]
    pub container_edits: ContainerEdits,
}

/// One device of a spec.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Device {
    pub name: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    pub container_edits: ContainerEdits,
}

/// Edits to a container's OCI spec.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ContainerEdits {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_nodes: Vec<DeviceNode>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<CdiMount>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hooks: Vec<Hook>,
    #[serde(
        default,
        rename = "additionalGids",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub additional_gids: Vec<u32>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DeviceNode {
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_path: Option<String>,
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub major: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minor: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file_mode: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permissions: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gid: Option<u32>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CdiMount {
    pub host_path: String,
    pub container_path: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Hook {
    pub hook_name: String,
    pub path: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<i64>,
}

impl ContainerEdits {
    pub fn is_empty(&self) -> bool {
        self.env.is_empty()
            && self.device_nodes.is_empty()
            && self.mounts.is_empty()
            && self.hooks.is_empty()
            && self.additional_gids.is_empty()
    }

    /// The first problem, as `pkg/cdi/container-edits.go` `Validate` finds it.
    fn validate(&self) -> Result<(), String> {
        for e in &self.env {
            if e.find('=').unwrap_or(0) == 0 {
                return Err(format!("invalid environment variable {e:?}"));
            }
        }
        for d in &self.device_nodes {
            if d.path.is_empty() {
                return Err("invalid (empty) device path".into());
            }
            if !matches!(d.kind.as_deref(), None | Some("" | "b" | "c" | "u" | "p")) {
                return Err(format!("device {:?}: invalid type {:?}", d.path, d.kind));
            }
            if let Some(p) = &d.permissions {
                if !p.chars().all(|c| matches!(c, 'r' | 'w' | 'm')) {
                    return Err(format!("device {:?}: invalid permissions {p:?}", d.path));
                }
            }
        }
        for h in &self.hooks {
            const NAMES: [&str; 6] = [
                "prestart",
                "createRuntime",
                "createContainer",
                "startContainer",
                "poststart",
                "poststop",
            ];
            if !NAMES.contains(&h.hook_name.as_str()) {
                return Err(format!("invalid hook name {:?}", h.hook_name));
            }
            if h.path.is_empty() {
                return Err(format!("invalid hook {:?} with empty path", h.hook_name));
            }
        }
        for m in &self.mounts {
            if m.host_path.is_empty() {
                return Err("invalid mount, empty host path".into());
            }
            if m.container_path.is_empty() {
                return Err("invalid mount, empty container path".into());
            }
        }
        Ok(())
    }
}

/// `vendor/class=name`.
pub fn qualified(kind: &str, name: &str) -> String {
    format!("{kind}={name}")
}

fn alnum(c: char) -> bool {
    c.is_ascii_alphanumeric()
}

/// A vendor or class name (`pkg/parser/parser.go` `validateVendorOrClassName`): a letter, then
/// letters, digits, `_`, `-`, `.`, ending with a letter or digit.
fn check_vendor_or_class(what: &str, s: &str) -> Result<(), String> {
    let mut cs = s.chars();
    match cs.next() {
        None => return Err(format!("invalid {what}: empty")),
        Some(c) if !c.is_ascii_alphabetic() => {
            return Err(format!("invalid {what} {s:?}: should start with a letter"))
        }
        _ => {}
    }
    if let Some(c) = s
        .chars()
        .find(|c| !(alnum(*c) || matches!(c, '_' | '-' | '.')))
    {
        return Err(format!("invalid {what} {s:?}: invalid character {c:?}"));
    }
    if !s.ends_with(alnum) {
        return Err(format!(
            "invalid {what} {s:?}: should end with a letter or digit"
        ));
    }
    Ok(())
}

/// A kind, `vendor/class` (`pkg/parser/parser.go` `ParseQualifier` then the two name checks).
pub fn check_kind(kind: &str) -> Result<(), String> {
    let (vendor, class) = kind
        .split_once('/')
        .ok_or_else(|| format!("{kind:?}: a kind is vendor/class (\"nvidia.com/gpu\")"))?;
    check_vendor_or_class("vendor", vendor)?;
    check_vendor_or_class("class", class)
}

/// A device name (`pkg/parser/parser.go` `ValidateDeviceName`): letters, digits, `_-.:`,
/// starting and ending with a letter or digit.
pub fn check_device_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("invalid (empty) device name".into());
    }
    if !name.starts_with(alnum) || !name.ends_with(alnum) {
        return Err(format!(
            "invalid device name {name:?}: should start and end with a letter or digit"
        ));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(alnum(*c) || matches!(c, '_' | '-' | '.' | ':')))
    {
        return Err(format!(
            "invalid device name {name:?}: invalid character {c:?}"
        ));
    }
    Ok(())
}

/// The oldest `cdiVersion` that holds what `spec` uses (`specs-go/version.go`
/// `MinimumRequiredVersion`, for the fields these types have); never below 0.3.0, the oldest
/// the library reads.
pub fn min_version(spec: &Spec) -> &'static str {
    let edits = || {
        spec.devices
            .iter()
            .map(|d| &d.container_edits)
            .chain([&spec.container_edits])
    };
    if edits().any(|e| !e.additional_gids.is_empty()) {
        return "0.7.0";
    }
    let class_has_dot = spec
        .kind
        .split_once('/')
        .is_some_and(|(_, c)| c.contains('.'));
    if !spec.annotations.is_empty()
        || spec.devices.iter().any(|d| !d.annotations.is_empty())
        || class_has_dot
    {
        return "0.6.0";
    }
    if spec
        .devices
        .iter()
        .any(|d| d.name.starts_with(|c: char| c.is_ascii_digit()))
        || edits().any(|e| e.device_nodes.iter().any(|n| n.host_path.is_some()))
    {
        return "0.5.0";
    }
    if edits().any(|e| e.mounts.iter().any(|m| m.kind.is_some())) {
        return "0.4.0";
    }
    "0.3.0"
}

fn version_tuple(v: &str) -> Option<(u32, u32, u32)> {
    let mut it = v.split('.').map(|p| p.parse::<u32>().ok());
    let t = (it.next()??, it.next()??, it.next()??);
    it.next().is_none().then_some(t)
}

impl Spec {
    /// The first problem, as the CDI library finds it when it loads a spec: the version (a
    /// release, not older than what the spec uses), the kind, each device (its name, unique,
    /// non-empty edits) and every edit.
    pub fn validate(&self) -> Result<(), String> {
        const RELEASED: [&str; 10] = [
            "0.1.0", "0.2.0", "0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0",
            "1.1.0",
        ];
        let v = self.cdi_version.trim_start_matches('v');
        if !RELEASED.contains(&v) {
            return Err(format!("invalid version {:?}", self.cdi_version));
        }
        let need = min_version(self);
        if version_tuple(need) > version_tuple(v) {
            return Err(format!("the spec version must be at least v{need}"));
        }
        check_kind(&self.kind)?;
        if self.devices.is_empty() {
            return Err("a spec must list at least one device".into());
        }
        let mut seen = std::collections::BTreeSet::new();
        for d in &self.devices {
            check_device_name(&d.name)?;
            if !seen.insert(&d.name) {
                return Err(format!("device {:?} listed twice", d.name));
            }
            if d.container_edits.is_empty() {
                return Err(format!("invalid device {:?}: empty device edits", d.name));
            }
            d.container_edits
                .validate()
                .map_err(|e| format!("invalid device {:?}: {e}", d.name))?;
        }
        self.container_edits.validate()
    }
}

// ---------------------------------------------------------------------------------------------
// cuvisor's spec and Allocate's answer.

/// A bind mount as a CDI mount: the options NVIDIA's generated specs give the driver's files
/// (`ro`, `nosuid`, `nodev`, `bind`; nvidia-container-toolkit `internal/discover/mounts.go`),
/// `rw` for the directories a container writes.
fn cdi_mount(m: &Mount) -> CdiMount {
    CdiMount {
        host_path: m.host_path.to_string_lossy().into_owned(),
        container_path: m.container_path.to_string_lossy().into_owned(),
        options: [
            if m.read_only { "ro" } else { "rw" },
            "nosuid",
            "nodev",
            "bind",
        ]
        .map(String::from)
        .to_vec(),
        kind: None,
    }
}

/// cuvisor's spec for allocation `id`: one device named `id` whose edits are the `envvar`
/// answer's mounts and its environment less `NVIDIA_VISIBLE_DEVICES` (NVIDIA's spec owns it).
pub fn allocation_spec(id: &str, envvar: &Answer) -> Spec {
    let mut spec = Spec {
        cdi_version: String::new(),
        kind: KIND.into(),
        devices: vec![Device {
            name: id.into(),
            annotations: BTreeMap::new(),
            container_edits: ContainerEdits {
                env: envvar
                    .envs
                    .iter()
                    .filter(|(k, _)| k.as_str() != NVIDIA_VISIBLE_DEVICES)
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect(),
                mounts: envvar.mounts.iter().map(cdi_mount).collect(),
                ..ContainerEdits::default()
            },
        }],
        ..Spec::default()
    };
    spec.cdi_version = min_version(&spec).into();
    spec
}

/// The file of allocation `id`'s spec in `spec_dir`: `cuvisor.io-allocation_<id>.json`
/// (`GenerateTransientSpecName`).
pub fn spec_file(spec_dir: &Path, id: &str) -> PathBuf {
    let (vendor, class) = KIND.split_once('/').unwrap_or((KIND, ""));
    spec_dir.join(format!("{vendor}-{class}_{}.json", id.replace('/', "_")))
}

fn io(p: &Path, e: std::io::Error) -> String {
    format!("{}: {e}", p.display())
}

/// Writes allocation `id`'s spec into `spec_dir` (created 0755 if missing), atomically (see
/// [`write_spec_file`]). Refuses a spec the CDI library would refuse.
pub fn write_spec(spec_dir: &Path, id: &str, spec: &Spec) -> Result<PathBuf, String> {
    spec.validate()
        .map_err(|e| format!("CDI spec {KIND}={id}: {e}"))?;
    if !spec_dir.is_dir() {
        std::fs::create_dir_all(spec_dir).map_err(|e| io(spec_dir, e))?;
        std::fs::set_permissions(spec_dir, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| io(spec_dir, e))?;
    }
    let path = spec_file(spec_dir, id);
    write_spec_file(&path, spec)?;
    Ok(path)
}

/// Writes `spec` as JSON at `path`, atomically: a temporary file in the same directory (a name
/// the runtime does not read: not `.json` or `.yaml`), written, synced, mode 0644, renamed
/// into place. A runtime that reads the directory meanwhile sees the whole file or none.
pub fn write_spec_file(path: &Path, spec: &Spec) -> Result<(), String> {
    let text = serde_json::to_vec_pretty(spec).map_err(|e| e.to_string())?;
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = dir.join(format!(
        ".{}.tmp",
        path.file_name().unwrap_or_default().to_string_lossy()
    ));
    let _ = std::fs::remove_file(&tmp);
    let written = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&tmp)?;
        f.write_all(&text)?;
        f.set_permissions(std::fs::Permissions::from_mode(0o644))?;
        f.sync_all()
    })();
    if let Err(e) = written.and_then(|()| std::fs::rename(&tmp, path)) {
        let _ = std::fs::remove_file(&tmp);
        return Err(io(path, e));
    }
    Ok(())
}

/// Puts back into `spec_dir` the spec of allocation `id` kept at `kept` (its copy in the
/// allocation's directory) when `spec_dir` lacks it or holds another: at startup, so that a
/// container kubelet starts again still resolves `cuvisor.io/allocation=<id>`. kubelet does not
/// call Allocate for a container that restarts: it finds the devices pre-allocated and reuses
/// the answer it keeps, and checkpoints (kubernetes `pkg/kubelet/cm/devicemanager/manager.go`
/// `devicesToAllocate`, "This can happen if a container restarts"); `/var/run/cdi` is a tmpfs
/// that a reboot empties, and a spec may have been removed by hand. Only a valid spec of
/// cuvisor's kind for that very allocation is put back. True when it was written.
pub fn reinstall(spec_dir: &Path, id: &str, kept: &Path) -> Result<bool, String> {
    let text = match std::fs::read(kept) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(io(kept, e)),
    };
    let spec: Spec =
        serde_json::from_slice(&text).map_err(|e| format!("{}: {e}", kept.display()))?;
    if spec.kind != KIND || spec.devices.len() != 1 || spec.devices[0].name != id {
        return Err(format!("{}: not the spec of {KIND}={id}", kept.display()));
    }
    let live = std::fs::read(spec_file(spec_dir, id)).ok();
    if live
        .as_deref()
        .and_then(|t| serde_json::from_slice::<Spec>(t).ok())
        == Some(spec.clone())
    {
        return Ok(false);
    }
    write_spec(spec_dir, id, &spec).map(|_| true)
}

/// Whether specs can be written to `spec_dir` (created 0755 if missing): a temporary file made
/// and removed. At startup, so that a plugin that cannot says so once, not at each Allocate.
pub fn probe(spec_dir: &Path) -> Result<(), String> {
    let why = |e: String| {
        format!(
            "[cdi] spec_dir: {e} (the plugin writes its CDI specs there: mount the host's \
             directory read-write)"
        )
    };
    if !spec_dir.is_dir() {
        std::fs::create_dir_all(spec_dir).map_err(|e| why(io(spec_dir, e)))?;
        std::fs::set_permissions(spec_dir, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| why(io(spec_dir, e)))?;
    }
    let p = spec_dir.join(".cuvisor-probe.tmp");
    std::fs::write(&p, b"").map_err(|e| why(io(&p, e)))?;
    std::fs::remove_file(&p).map_err(|e| why(io(&p, e)))
}

/// The CDI directories a runtime reads by default, static then dynamic (`pkg/cdi/spec-dirs.go`).
pub const DEFAULT_SPEC_DIRS: [&str; 2] = ["/etc/cdi", "/var/run/cdi"];

/// Of the device names `wanted` (`kind=name`), those that no spec file in `dirs` declares: a
/// warning at startup, because a container whose answer names one fails to start ("unresolvable
/// CDI devices"). Not a refusal: NVIDIA's spec may be written after the plugin starts
/// (`nvidia-cdi-refresh` at boot). The files are the node's, written by root; still, each is
/// read only up to 4 MiB, at most 256 of them, and whatever does not parse declares nothing.
/// JSON is parsed; YAML (how `nvidia-ctk cdi generate` writes by default) is read by its
/// `kind:` and `name:` lines, which is how that generator lays a spec out.
pub fn undeclared(dirs: &[&Path], wanted: &[String]) -> Vec<String> {
    const MAX_FILES: usize = 256;
    const MAX_BYTES: u64 = 4 << 20;
    let mut declared = std::collections::BTreeSet::new();
    let files = dirs
        .iter()
        .filter_map(|d| std::fs::read_dir(d).ok())
        .flat_map(|r| r.flatten())
        .map(|e| e.path())
        .filter(|p| {
            matches!(
                p.extension().and_then(|e| e.to_str()),
                Some("json" | "yaml" | "yml")
            )
        })
        .take(MAX_FILES);
    for p in files {
        let Ok(f) = std::fs::File::open(&p) else {
            continue;
        };
        let mut text = String::new();
        if std::io::Read::read_to_string(&mut std::io::Read::take(f, MAX_BYTES), &mut text).is_err()
        {
            continue;
        }
        if let Ok(spec) = serde_json::from_str::<Spec>(&text) {
            declared.extend(spec.devices.iter().map(|d| qualified(&spec.kind, &d.name)));
        } else {
            declared.extend(yaml_declared(&text));
        }
    }
    wanted
        .iter()
        .filter(|w| !declared.contains(*w))
        .cloned()
        .collect()
}

/// The `kind=name` pairs of a YAML CDI spec, by its top-level `kind:` and its devices' `name:`
/// lines (quoted or not).
fn yaml_declared(text: &str) -> Vec<String> {
    let value = |l: &str, key: &str| {
        l.trim_start()
            .trim_start_matches("- ")
            .strip_prefix(key)
            .map(|v| v.trim().trim_matches(|c| c == '"' || c == '\'').to_string())
    };
    let kind = text
        .lines()
        .filter(|l| !l.starts_with(' ') && !l.starts_with('-'))
        .find_map(|l| value(l, "kind:"));
    let Some(kind) = kind else {
        return Vec::new();
    };
    text.lines()
        .filter_map(|l| value(l, "name:"))
        .filter(|n| !n.is_empty())
        .map(|n| qualified(&kind, &n))
        .collect()
}

/// Removes allocation `id`'s spec from `spec_dir`: true when it was there.
pub fn remove_spec(spec_dir: &Path, id: &str) -> Result<bool, String> {
    let p = spec_file(spec_dir, id);
    match std::fs::remove_file(&p) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(io(&p, e)),
    }
}

/// What the plugin configured for CDI (`[cdi]`), parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    pub strategy: Strategy,
    pub spec_dir: PathBuf,
    /// The kind of NVIDIA's spec on the node.
    pub nvidia_kind: String,
    pub nvidia_naming: GpuNaming,
}

/// A GPU as Allocate names it to NVIDIA's spec: UUID and NVML index.
#[derive(Clone, Copy, Debug)]
pub struct GpuRef<'a> {
    pub uuid: &'a str,
    pub index: usize,
}

impl Settings {
    /// NVIDIA's qualified name of a GPU.
    pub fn nvidia_device(&self, gpu: GpuRef<'_>) -> String {
        let name = match self.nvidia_naming {
            GpuNaming::Uuid => gpu.uuid.to_string(),
            GpuNaming::Index => gpu.index.to_string(),
        };
        qualified(&self.nvidia_kind, &name)
    }
}

/// The annotation key for allocation `id` (`AnnotationKey(ANNOTATION_PLUGIN, id)`).
pub fn annotation_key(id: &str) -> String {
    format!(
        "{ANNOTATION_PREFIX}{ANNOTATION_PLUGIN}_{}",
        id.replace('/', "_")
    )
}

/// Allocate's answer under the configured strategy, from the `envvar` answer `envvar` for
/// allocation `id` on `gpus`, and cuvisor's spec to write for it (memory allocations, `own`,
/// under a CDI strategy).
///
/// - `envvar`: the answer as it is, no spec.
/// - `cdi-cri`: `cdi_devices` = NVIDIA's name of each GPU, then cuvisor's device
///   (`cuvisor.io/allocation=<id>`) for memory allocations; no environment, mounts or device
///   nodes in the plain fields (they are the specs' edits: the runtime would otherwise get
///   each twice).
/// - `cdi-annotations`: the same names, joined by `,`, in the annotation
///   `cdi.k8s.io/cuvisor-device-plugin_<id>`; `cdi_devices` empty.
///
/// Annotations of the `envvar` answer (`cuvisor.io/allocation`) are kept under every strategy.
pub fn settle(
    cdi: &Settings,
    id: &str,
    gpus: &[GpuRef<'_>],
    own: bool,
    envvar: Answer,
) -> (Answer, Option<Spec>) {
    let spec = (own && cdi.strategy.is_cdi()).then(|| allocation_spec(id, &envvar));
    let mut names: Vec<String> = gpus.iter().map(|g| cdi.nvidia_device(*g)).collect();
    if spec.is_some() {
        names.push(qualified(KIND, id));
    }
    let mut answer = Answer {
        annotations: envvar.annotations.clone(),
        ..Answer::default()
    };
    match cdi.strategy {
        Strategy::Envvar => return (envvar, None),
        Strategy::CdiCri => answer.cdi_devices = names,
        Strategy::CdiAnnotations => {
            answer
                .annotations
                .insert(annotation_key(id), names.join(","));
        }
    }
    (answer, spec)
}

#[cfg(test)]
mod tests {
    use super::*;

    const UUID: &str = "GPU-12345678-1234-1234-1234-123456789abc";

    fn envvar_answer() -> Answer {
        Answer {
            envs: [(NVIDIA_VISIBLE_DEVICES.to_string(), UUID.to_string())].into(),
            mounts: vec![
                Mount::new(
                    Path::new("/usr/local/lib/cuvisor/libcuvisor.so"),
                    Path::new("/h/lib.so"),
                    true,
                ),
                Mount::new(Path::new("/etc/ld.so.preload"), Path::new("/h/pre"), true),
                Mount::new(
                    Path::new("/var/run/cuvisor/state"),
                    Path::new("/h/s"),
                    false,
                ),
            ],
            devices: vec![crate::answer::DeviceNode {
                container_path: "/dev/nvidia0".into(),
                host_path: "/dev/nvidia0".into(),
                permissions: "rw".into(),
            }],
            annotations: [("cuvisor.io/allocation".to_string(), "0a1b".to_string())].into(),
            cdi_devices: vec![],
        }
    }

    fn settings(strategy: Strategy) -> Settings {
        Settings {
            strategy,
            spec_dir: PathBuf::from("/var/run/cdi"),
            nvidia_kind: "nvidia.com/gpu".into(),
            nvidia_naming: GpuNaming::Uuid,
        }
    }

    fn gpu() -> [GpuRef<'static>; 1] {
        [GpuRef {
            uuid: UUID,
            index: 3,
        }]
    }

    #[test]
    fn envvar_keeps_todays_answer_and_writes_no_spec() {
        let (a, spec) = settle(
            &settings(Strategy::Envvar),
            "0a1b",
            &gpu(),
            true,
            envvar_answer(),
        );
        assert_eq!(a, envvar_answer());
        assert!(spec.is_none());
    }

    #[test]
    fn cdi_cri_names_nvidias_gpu_and_cuvisors_allocation_and_nothing_twice() {
        let (a, spec) = settle(
            &settings(Strategy::CdiCri),
            "0a1b",
            &gpu(),
            true,
            envvar_answer(),
        );
        assert_eq!(
            a.cdi_devices,
            [
                format!("nvidia.com/gpu={UUID}"),
                "cuvisor.io/allocation=0a1b".to_string()
            ]
        );
        assert!(
            a.envs.is_empty() && a.mounts.is_empty() && a.devices.is_empty(),
            "{a:?}"
        );
        assert_eq!(
            a.annotations
                .get("cuvisor.io/allocation")
                .map(String::as_str),
            Some("0a1b")
        );
        let spec = spec.expect("a memory allocation gets cuvisor's spec");
        let d = &spec.devices[0];
        assert_eq!((spec.kind.as_str(), d.name.as_str()), (KIND, "0a1b"));
        // Every mount of the envvar answer, read-only where it was; no env (the only one was
        // NVIDIA_VISIBLE_DEVICES, NVIDIA's spec's); no device nodes (NVIDIA's spec's).
        let e = &d.container_edits;
        assert_eq!(e.mounts.len(), 3);
        assert_eq!(e.mounts[1].container_path, "/etc/ld.so.preload");
        assert_eq!(e.mounts[1].options, ["ro", "nosuid", "nodev", "bind"]);
        assert_eq!(e.mounts[2].options[0], "rw");
        assert!(e.env.is_empty() && e.device_nodes.is_empty() && e.hooks.is_empty());
        // The id starts with a digit: 0.5.0 is the oldest version that allows it.
        assert_eq!(spec.cdi_version, "0.5.0");
        spec.validate().unwrap();
    }

    #[test]
    fn cdi_annotations_puts_the_same_names_in_one_annotation() {
        let s = settings(Strategy::CdiAnnotations);
        let (a, _) = settle(&s, "0a1b", &gpu(), true, envvar_answer());
        assert!(a.cdi_devices.is_empty());
        assert_eq!(
            a.annotations
                .get("cdi.k8s.io/cuvisor-device-plugin_0a1b")
                .map(String::as_str),
            Some(format!("nvidia.com/gpu={UUID},cuvisor.io/allocation=0a1b").as_str())
        );
        // The part after the prefix fits the CDI library's 63 characters for a 16-digit id.
        assert!(annotation_key(&"f".repeat(16)).len() - ANNOTATION_PREFIX.len() <= 63);
    }

    #[test]
    fn whole_gpus_get_nvidias_names_only() {
        let mut s = settings(Strategy::CdiCri);
        s.nvidia_naming = GpuNaming::Index;
        s.nvidia_kind = "k8s.device-plugin.nvidia.com/gpu".into();
        let (a, spec) = settle(&s, "0a1b", &gpu(), false, envvar_answer());
        assert_eq!(a.cdi_devices, ["k8s.device-plugin.nvidia.com/gpu=3"]);
        assert!(spec.is_none());
    }

    #[test]
    fn the_version_is_the_oldest_that_holds_what_the_spec_uses() {
        let mut s = allocation_spec("a0", &envvar_answer());
        assert_eq!(s.cdi_version, "0.3.0");
        s.devices[0].container_edits.mounts[0].kind = Some("bind".into());
        assert_eq!(min_version(&s), "0.4.0");
        s.kind = "cuvisor.io/alloc.x".into();
        assert_eq!(min_version(&s), "0.6.0");
        s.devices[0].container_edits.additional_gids = vec![44];
        assert_eq!(min_version(&s), "0.7.0");
        // Claiming an older version than the fields need is refused, as the library refuses it.
        s.cdi_version = "0.5.0".into();
        assert!(s.validate().unwrap_err().contains("at least v0.7.0"));
    }

    #[test]
    fn names_are_checked_as_the_cdi_parser_checks_them() {
        for ok in [
            "nvidia.com/gpu",
            "k8s.device-plugin.nvidia.com/gpu",
            "foo.bar.baz/foo-bar123.B_az",
        ] {
            check_kind(ok).unwrap();
        }
        for bad in [
            "nvidia.com",
            "nvidia.com/gpu/x",
            "1vendor.com/gpu",
            "vendor.com/-gpu",
            "vendor.com/",
        ] {
            assert!(check_kind(bad).is_err(), "{bad}");
        }
        for ok in ["0", "GPU-1234", "MIG-1:2", "a"] {
            check_device_name(ok).unwrap();
        }
        for bad in ["", "-a", "a-", "a/b", "a=b"] {
            assert!(check_device_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_spec_with_an_empty_device_is_refused() {
        let mut s = allocation_spec("a0", &envvar_answer());
        s.devices[0].container_edits = ContainerEdits::default();
        assert!(s.validate().unwrap_err().contains("empty device edits"));
        let mut s = allocation_spec("a0", &envvar_answer());
        s.devices[0].container_edits.env = vec!["=x".into()];
        assert!(s.validate().is_err());
    }

    #[test]
    fn specs_are_written_atomically_0644_and_removed() {
        let dir = std::env::temp_dir().join(format!("cuvisor-cdi-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let spec = allocation_spec("0a1b", &envvar_answer());
        let p = write_spec(&dir.join("cdi"), "0a1b", &spec).unwrap();
        assert_eq!(p, dir.join("cdi/cuvisor.io-allocation_0a1b.json"));
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o644);
        let back: Spec = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
        assert_eq!(back, spec);
        probe(&dir.join("cdi")).unwrap();
        // Only the spec is left: no temporary file.
        let names: Vec<_> = std::fs::read_dir(dir.join("cdi"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
        // Written again (a restart), it is replaced whole.
        write_spec(&dir.join("cdi"), "0a1b", &spec).unwrap();
        assert!(remove_spec(&dir.join("cdi"), "0a1b").unwrap());
        assert!(!remove_spec(&dir.join("cdi"), "0a1b").unwrap());
        assert!(!p.exists());
        // An invalid spec is not written.
        let mut bad = spec.clone();
        bad.devices[0].container_edits = ContainerEdits::default();
        assert!(write_spec(&dir.join("cdi"), "0a1b", &bad).is_err());
        assert!(!p.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_kept_spec_is_put_back_only_when_missing_or_changed_and_only_its_own() {
        let dir = std::env::temp_dir().join(format!("cuvisor-cdi-re-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let spec = allocation_spec("0a1b", &envvar_answer());
        let kept = dir.join("kept.json");
        write_spec_file(&kept, &spec).unwrap();
        let run = dir.join("run");
        assert!(reinstall(&run, "0a1b", &kept).unwrap(), "missing: written");
        assert!(
            !reinstall(&run, "0a1b", &kept).unwrap(),
            "the same: left alone"
        );
        std::fs::write(spec_file(&run, "0a1b"), "{}").unwrap();
        assert!(
            reinstall(&run, "0a1b", &kept).unwrap(),
            "changed: written again"
        );
        let back: Spec =
            serde_json::from_slice(&std::fs::read(spec_file(&run, "0a1b")).unwrap()).unwrap();
        assert_eq!(back, spec);
        // Another allocation's spec under this id is refused; no copy, nothing to do.
        assert!(reinstall(&run, "ffff", &kept).is_err());
        assert!(!reinstall(&run, "0a1b", &dir.join("none.json")).unwrap());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn unknown_fields_are_refused_as_the_cdi_library_refuses_them() {
        let e = serde_json::from_str::<Spec>(
            r#"{"cdiVersion":"0.7.0","kind":"a.b/c","devices":[],"containerEdits":{"intelRdt":{}}}"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("intelRdt"), "{e}");
    }

    /// `nvidia-ctk cdi generate`'s YAML layout (kind at the top, one `- name:` per device) and
    /// a JSON spec both declare their devices; a GPU named by neither is reported, and files
    /// that are not specs declare nothing.
    #[test]
    fn gpus_no_spec_on_the_node_declares_are_reported() {
        let dir =
            std::env::temp_dir().join(format!("cuvisor-cdi-undeclared-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("nvidia.yaml"),
            "---\ncdiVersion: 0.5.0\ncontainerEdits:\n  env:\n  - NVIDIA_VISIBLE_DEVICES=void\n\
             devices:\n- containerEdits:\n    deviceNodes:\n    - path: /dev/nvidia0\n  name: \"0\"\n\
             - containerEdits:\n    deviceNodes:\n    - path: /dev/nvidia0\n  name: GPU-aaaa\n\
             - name: all\nkind: nvidia.com/gpu\n",
        )
        .unwrap();
        std::fs::write(
            dir.join("other.json"),
            r#"{"cdiVersion":"0.5.0","kind":"example.com/gpu","devices":[{"name":"GPU-bbbb","containerEdits":{"env":["A=1"]}}]}"#,
        )
        .unwrap();
        std::fs::write(dir.join("junk.json"), "{not json").unwrap();
        std::fs::write(
            dir.join("notes.txt"),
            "kind: nvidia.com/gpu\nname: GPU-cccc\n",
        )
        .unwrap();
        let wanted: Vec<String> = [
            "nvidia.com/gpu=GPU-aaaa",
            "nvidia.com/gpu=0",
            "nvidia.com/gpu=GPU-bbbb",
            "example.com/gpu=GPU-bbbb",
            "nvidia.com/gpu=GPU-cccc",
        ]
        .map(String::from)
        .to_vec();
        let missing = undeclared(&[&dir, Path::new("/nonexistent-cdi-dir")], &wanted);
        assert_eq!(
            missing,
            ["nvidia.com/gpu=GPU-bbbb", "nvidia.com/gpu=GPU-cccc"]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
