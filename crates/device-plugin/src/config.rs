//! The plugin's configuration file (TOML, versioned). Every field has a default, so an empty
//! file (or no file) is a working configuration; unknown keys and bad values are refused with
//! the key's name and the reason.
//!
//! ```toml
//! version = 1
//! socket_dir = "/var/lib/kubelet/device-plugins"   # kubelet.sock lives here; so do our sockets
//!                                                  # (each socket's path: at most 107 bytes)
//! state_root = "/var/lib/cuvisor"                  # per-allocation directories, ld.so.preload
//! metrics_address = "0.0.0.0:9400"               # IP:port of /metrics; "": no endpoint
//!                                                  # (metrics_port = N, the older form, is
//!                                                  # 0.0.0.0:N, 0: none; not both)
//!
//! [nvml]                                 # the NVIDIA driver's management library
//! library = ""                           # "": the loader's search for libnvidia-ml.so.1
//! retry_seconds = 30                     # NVML not there (yet): stay up, not ready, retry
//! fail_on_init_error = false             # true: exit (status 2) when NVML cannot be opened
//!
//! [pod_resources]                        # kubelet's PodResources API: pod names, cleanup
//! socket = "/var/lib/kubelet/pod-resources/kubelet.sock"   # "": not asked
//! refresh_seconds = 10
//!
//! [resources]
//! gpu = "cuvisor.io/gpu"                 # whole GPUs ("" to not advertise)
//! gpu_memory = "cuvisor.io/gpu-memory"   # memory units ("" to not advertise)
//! memory_unit = "1Gi"                    # one device ID per unit; at least 1Mi, and few
//!                                        # enough units that ListAndWatch fits in 4 MiB
//! # compute = "share=2"                  # for memory units; unset: share = memory fraction
//! # context_reserve = "300Mi"
//!
//! [host]                                 # paths on the node
//! library = "/usr/local/lib/cuvisor/libcuvisor.so"
//! tenant_glibc = "2.17"                  # the oldest glibc of the tenant images: a library
//!                                        # that needs newer is refused at startup (exit 2)
//! dev_dir = "/dev"                       # /dev/nvidiaN, /dev/nvidiactl, ...
//! control_devices = ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"]
//! coord_dir = "/var/lib/cuvisor/coord"   # default: <state_root>/coord
//! install_from = ""                      # a library in the plugin's image, copied atomically to
//!                                        # `library` at start-up ("": nothing copied; install.rs)
//!
//! [container]                            # paths inside the container
//! library = "/usr/local/lib/cuvisor/libcuvisor.so"
//! # (the limits file is always at /var/run/cuvisor/limits.conf: the library's fixed path)
//! state_dir = "/var/run/cuvisor/state"
//! coord_dir = "/var/run/cuvisor/coord"       # every GPU's coordinator, read-only
//! coord_own_dir = "/var/run/cuvisor/compute" # the container's own coordinator states
//!
//! [topology]                             # topology::Weights
//! policy = "allreduce"                   # or "weighted" (the seeds' score; topology::objective)
//! bandwidth = 0.5
//! topology = 0.3
//! balance = 0.1
//! domain = 0.1
//!
//! [health]
//! xid_critical = [48, 62, 63, 64, 74, 79, 92, 95, 119, 120, 140]   # config::DEFAULT_CRITICAL_XIDS
//! xid_hold_seconds = 300                 # Unhealthy this long after the last one; 0: until restart
//! nvlink_min_gbps = 0.0                  # 0: only a link that is down counts
//! poll_ms = 1000                         # NVLink reads, and the longest an XID wait blocks
//!
//! [cleanup]
//! grace_seconds = 300                    # an allocation younger than this is never removed
//! interval_seconds = 60
//!
//! [ledger_dir]                           # each memory allocation's ledger directory
//! mount = "tmpfs"                        # a tmpfs of its own, bounded (needs CAP_SYS_ADMIN);
//!                                        # "none": a plain directory, unbounded (ledger_dir.rs)
//! size = "1Mi"                           # the tmpfs's size= (the ledger is ~150 KiB)
//! inodes = 64                            # the tmpfs's nr_inodes=
//!
//! [cdi]                                  # how Allocate names devices to the runtime (cdi.rs)
//! strategy = "envvar"                    # "envvar" | "cdi-cri" | "cdi-annotations"
//! spec_dir = "/var/run/cdi"              # where cuvisor writes its per-allocation CDI specs
//! nvidia_kind = "nvidia.com/gpu"         # the kind of NVIDIA's CDI spec on the node
//! nvidia_device_name = "uuid"            # how that spec names a GPU: "uuid" | "index"
//! ```

use crate::topology::Weights;
use crate::{cdi, layout};
use cuvisor_elf_needs::GlibcVersion;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The configuration format this build reads.
pub const VERSION: u32 = 1;

/// The longest path a Unix socket can be bound or connected at, in bytes: Linux's `sun_path`
/// is 108 bytes and Rust's standard library keeps one for the terminating NUL.
pub const MAX_SOCKET_PATH: usize = 107;

/// The metrics endpoint when neither `metrics_address` nor `metrics_port` is set.
pub const DEFAULT_METRICS_ADDRESS: &str = "0.0.0.0:9400";

/// The longest `[nvml] retry_seconds`.
pub const MAX_NVML_RETRY_SECONDS: u64 = 3600;

/// Where kubelet serves its PodResources API (`[pod_resources] socket`).
pub const POD_RESOURCES_SOCKET: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";

/// `host.tenant_glibc`'s default: CentOS 7's glibc, the oldest of the images CUDA's containers
/// are built on, and the floor HAMi documents for its library (docs/glibc.md).
pub const DEFAULT_TENANT_GLIBC: GlibcVersion = GlibcVersion::new(2, 17);

/// The XIDs that mark a GPU Unhealthy by default (`[health] xid_critical`), from NVIDIA's XID
/// catalog (docs.nvidia.com/deploy/xid-errors): those whose resolution is a GPU reset / node
/// reboot or that mean broken hardware, not a faulty application: 48 (double-bit ECC error), 62
/// (internal micro-controller halt), 63 and 64 (page retirement / row remapping event and its
/// failure: a reset is needed to activate it), 74 (NVLink error), 79 (GPU has fallen off the
/// bus), 92 (high single-bit ECC error rate), 95 (uncontained ECC error: reset needed), 119 and
/// 120 (GSP RPC timeout / GSP error), 140 (unrecovered ECC error). Left out: application-caused
/// XIDs (13 graphics engine exception, 31 MMU fault, 43 channel reset, 45 preemptive cleanup, 68
/// video processor exception, 109 context switch timeout) — NVIDIA's device plugin skips the
/// same ones — and 94 (contained ECC error: only the faulting application is affected; NVIDIA's
/// resolution is restarting the application).
pub const DEFAULT_CRITICAL_XIDS: &[u64] = &[48, 62, 63, 64, 74, 79, 92, 95, 119, 120, 140];

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub version: u32,
    pub socket_dir: PathBuf,
    pub state_root: PathBuf,
    /// The metrics endpoint, `IP:port`; "": none. Unset: `metrics_port`, else
    /// [`DEFAULT_METRICS_ADDRESS`]. See [`Config::metrics_address`].
    pub metrics_address: Option<String>,
    /// The older form of `metrics_address`: 0 = none, N = `0.0.0.0:N`. Not both.
    pub metrics_port: Option<u16>,
    pub nvml: Nvml,
    pub pod_resources: PodResources,
    pub resources: Resources,
    pub host: HostPaths,
    pub container: ContainerPaths,
    pub topology: Weights,
    pub health: Health,
    pub cleanup: Cleanup,
    /// Each memory allocation's ledger directory (`crate::ledger_dir`).
    pub ledger_dir: LedgerDir,
    /// How Allocate names devices to the container runtime (`crate::cdi`).
    pub cdi: Cdi,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Resources {
    /// Whole GPUs; "" = not advertised.
    pub gpu: String,
    /// Memory units; "" = not advertised.
    pub gpu_memory: String,
    /// The size of one memory unit (a Kubernetes quantity: "1Gi", "512Mi").
    pub memory_unit: String,
    /// The `compute` line of the limits file for memory units (`share=W`, `limit=P`, `none`);
    /// unset: the library's default, a share proportional to the memory fraction.
    pub compute: Option<String>,
    /// `context_reserve` of the limits file.
    pub context_reserve: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HostPaths {
    pub library: PathBuf,
    /// The oldest glibc of the tenant images ("2.17", CentOS 7's): `library` must need nothing
    /// newer (crate::tenant_glibc, checked at startup; docs/glibc.md).
    pub tenant_glibc: String,
    pub dev_dir: PathBuf,
    /// Device nodes every GPU container gets, besides /dev/nvidiaN (names under dev_dir; those
    /// that do not exist on the host are skipped).
    pub control_devices: Vec<String>,
    /// The GPU coordinators' directory; default `<state_root>/coord`.
    pub coord_dir: Option<PathBuf>,
    /// A library inside the plugin's own file system (its image:
    /// `/usr/local/lib/cuvisor/libcuvisor.so`) that the plugin copies atomically to `library`
    /// at start-up, before anything else (`install::install`); empty: nothing is copied.
    pub install_from: PathBuf,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ContainerPaths {
    pub library: PathBuf,
    /// Accepted only as the library's fixed path (`cuvisor_shm::CONTAINER_LIMITS`), where the
    /// limits file is always mounted: the library reads it there and nowhere else.
    pub limits: Option<PathBuf>,
    pub state_dir: PathBuf,
    pub coord_dir: PathBuf,
    pub coord_own_dir: PathBuf,
}

/// kubelet's PodResources API (pod labels of the metrics; the sweeper's liveness rule).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PodResources {
    /// kubelet's PodResources socket; empty: not asked.
    pub socket: PathBuf,
    /// How often it is asked.
    pub refresh_seconds: u64,
}

/// The health checker's thresholds ([`crate::health::HealthConfig`] is made from this).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Health {
    /// XIDs that mark a GPU unhealthy.
    pub xid_critical: Vec<u64>,
    /// How long a GPU stays Unhealthy after its last critical XID; 0: until the plugin restarts.
    pub xid_hold_seconds: u64,
    /// An NVLink below this many GB/s marks its GPU unhealthy (0: only a link down does).
    pub nvlink_min_gbps: f64,
    /// How often NVLink state is read, and the longest an XID wait blocks (milliseconds).
    pub poll_ms: u64,
}

/// `[nvml]`: where NVML comes from, and what the plugin does while it cannot be opened.
///
/// Without NVML the plugin stays up, not ready (`probe --ready` fails), and tries again every
/// `retry_seconds`; `fail_on_init_error = true` makes it exit instead, as NVIDIA's device plugin
/// does with `FAIL_ON_INIT_ERROR=true` (its `--fail-on-init-error` flag).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Nvml {
    /// The library's path; empty: `libnvidia-ml.so.1` through the dynamic loader's search (as
    /// NVIDIA's plugin). `--sim` uses the simulated library next to the executable instead.
    pub library: PathBuf,
    /// How long between attempts while NVML cannot be opened.
    pub retry_seconds: u64,
    /// Exit (status 2, one line) when NVML cannot be opened, instead of waiting for it.
    pub fail_on_init_error: bool,
}

impl Default for Nvml {
    fn default() -> Nvml {
        Nvml {
            library: PathBuf::new(),
            retry_seconds: 30,
            fail_on_init_error: false,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Cleanup {
    pub grace_seconds: u64,
    pub interval_seconds: u64,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            version: VERSION,
            socket_dir: PathBuf::from("/var/lib/kubelet/device-plugins"),
            state_root: PathBuf::from("/var/lib/cuvisor"),
            metrics_address: None,
            metrics_port: None,
            nvml: Nvml::default(),
            pod_resources: PodResources::default(),
            resources: Resources::default(),
            host: HostPaths::default(),
            container: ContainerPaths::default(),
            topology: Weights::default(),
            health: Health::default(),
            cleanup: Cleanup::default(),
            ledger_dir: Default::default(),
            cdi: Cdi::default(),
        }
    }
}

impl Default for Resources {
    fn default() -> Resources {
        Resources {
            gpu: "cuvisor.io/gpu".into(),
            gpu_memory: "cuvisor.io/gpu-memory".into(),
            memory_unit: "1Gi".into(),
            compute: None,
            context_reserve: None,
        }
    }
}

impl Default for HostPaths {
    fn default() -> HostPaths {
        HostPaths {
            library: PathBuf::from("/usr/local/lib/cuvisor/libcuvisor.so"),
            tenant_glibc: DEFAULT_TENANT_GLIBC.to_string(),
            dev_dir: PathBuf::from("/dev"),
            control_devices: ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"]
                .map(String::from)
                .to_vec(),
            coord_dir: None,
            install_from: PathBuf::new(),
        }
    }
}

impl Default for ContainerPaths {
    fn default() -> ContainerPaths {
        ContainerPaths {
            library: PathBuf::from("/usr/local/lib/cuvisor/libcuvisor.so"),
            limits: None,
            state_dir: PathBuf::from("/var/run/cuvisor/state"),
            coord_dir: PathBuf::from("/var/run/cuvisor/coord"),
            coord_own_dir: PathBuf::from("/var/run/cuvisor/compute"),
        }
    }
}

impl Default for PodResources {
    fn default() -> PodResources {
        PodResources {
            socket: PathBuf::from(POD_RESOURCES_SOCKET),
            refresh_seconds: 10,
        }
    }
}

impl Default for Health {
    fn default() -> Health {
        Health {
            xid_critical: DEFAULT_CRITICAL_XIDS.to_vec(),
            xid_hold_seconds: 300,
            nvlink_min_gbps: 0.0,
            poll_ms: 1000,
        }
    }
}

impl Default for Cleanup {
    fn default() -> Cleanup {
        Cleanup {
            grace_seconds: 300,
            interval_seconds: 60,
        }
    }
}

/// `[ledger_dir]` of the configuration.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LedgerDir {
    /// "tmpfs": a tmpfs of its own per allocation, bounded by `size` and `inodes`; "none": a
    /// plain directory on the state root's file system, unbounded.
    pub mount: String,
    /// The tmpfs's `size=` (a quantity: "1Mi").
    pub size: String,
    /// The tmpfs's `nr_inodes=` (its root directory counts as one).
    pub inodes: u64,
}

impl Default for LedgerDir {
    fn default() -> LedgerDir {
        LedgerDir {
            mount: "tmpfs".into(),
            size: "1Mi".into(),
            inodes: 64,
        }
    }
}

/// `[cdi]` of the configuration: how Allocate names the devices a container gets (`crate::cdi`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Cdi {
    /// "envvar" (default: `NVIDIA_VISIBLE_DEVICES`, device nodes and mounts, for the NVIDIA
    /// container runtime, as before), "cdi-cri" (CDI names in the CRI's CDI device list; kubelet
    /// 1.29+ or 1.28 with `DevicePluginCDIDevices`), "cdi-annotations" (CDI names in a
    /// `cdi.k8s.io/` annotation). As NVIDIA's `DEVICE_LIST_STRATEGY`, whose default is also
    /// `envvar`: a CDI name the runtime cannot resolve fails the container, so CDI is chosen by
    /// the operator who knows the node has a CDI-enabled runtime and NVIDIA's spec.
    pub strategy: String,
    /// Where cuvisor writes its per-allocation specs: `/var/run/cdi`, the CDI library's
    /// directory for generated specs (the higher priority of its two defaults).
    pub spec_dir: PathBuf,
    /// The kind of NVIDIA's spec: `nvidia.com/gpu` as `nvidia-ctk cdi generate` writes it;
    /// `k8s.device-plugin.nvidia.com/gpu` where NVIDIA's device plugin writes it.
    pub nvidia_kind: String,
    /// How NVIDIA's spec names a GPU: "uuid" (default; `nvidia-ctk cdi generate` writes both
    /// since toolkit v1.15.0) or "index" (the NVML index).
    pub nvidia_device_name: String,
}

impl Default for Cdi {
    fn default() -> Cdi {
        Cdi {
            strategy: "envvar".into(),
            spec_dir: PathBuf::from("/var/run/cdi"),
            nvidia_kind: "nvidia.com/gpu".into(),
            nvidia_device_name: "uuid".into(),
        }
    }
}

impl Cdi {
    /// The section parsed, or its first problem, naming the key.
    pub fn settings(&self) -> Result<cdi::Settings, String> {
        let strategy = cdi::Strategy::parse(&self.strategy).ok_or_else(|| {
            format!(
                "cdi.strategy = {:?}: \"envvar\" (NVIDIA_VISIBLE_DEVICES, for the NVIDIA container \
                 runtime), \"cdi-cri\" (CDI device names through kubelet's CDI field) or \
                 \"cdi-annotations\" (CDI device names in a cdi.k8s.io/ annotation)",
                self.strategy
            )
        })?;
        if !self.spec_dir.is_absolute() {
            return Err(format!(
                "cdi.spec_dir = {:?}: must be an absolute path (the runtime's CDI spec \
                 directory, /var/run/cdi)",
                self.spec_dir
            ));
        }
        cdi::check_kind(&self.nvidia_kind)
            .map_err(|e| format!("cdi.nvidia_kind = {:?}: {e}", self.nvidia_kind))?;
        if self.nvidia_kind == cdi::KIND {
            return Err(format!(
                "cdi.nvidia_kind = {:?}: that is cuvisor's own kind",
                self.nvidia_kind
            ));
        }
        let nvidia_naming = cdi::GpuNaming::parse(&self.nvidia_device_name).ok_or_else(|| {
            format!(
                "cdi.nvidia_device_name = {:?}: \"uuid\" (GPU-...) or \"index\" (the NVML \
                 index), as nvidia-ctk cdi generate --device-name-strategy names GPUs",
                self.nvidia_device_name
            )
        })?;
        Ok(cdi::Settings {
            strategy,
            spec_dir: self.spec_dir.clone(),
            nvidia_kind: self.nvidia_kind.clone(),
            nvidia_naming,
        })
    }
}

/// The ledger file's size: what one container needs in its directory.
pub fn ledger_bytes() -> u64 {
    std::mem::size_of::<cuvisor_shm::ledger::Layout>() as u64
}

/// The most the tmpfs may be given (it is memory, not disk).
pub const LEDGER_DIR_MAX_SIZE: u64 = 64 << 20;
/// The fewest and the most inodes: the root, the ledger and a little room; a bound that means
/// something.
pub const LEDGER_DIR_INODES: std::ops::RangeInclusive<u64> = 4..=4096;

impl LedgerDir {
    /// Whether each allocation gets a tmpfs.
    pub fn mounts(&self) -> bool {
        self.mount == "tmpfs"
    }

    /// The tmpfs's size in bytes, and the first problem with the section, naming its key.
    pub fn validate(&self) -> Result<u64, String> {
        match self.mount.as_str() {
            "tmpfs" | "none" => {}
            m => {
                return Err(format!(
                    "ledger_dir.mount = {m:?}: \"tmpfs\" (a bounded tmpfs per allocation) or \
                     \"none\" (a plain directory, unbounded)"
                ))
            }
        }
        let size = cuvisor_shm::quantity::parse_quantity(&self.size)
            .map_err(|e| format!("ledger_dir.size = {:?}: {e}", self.size))?;
        // Twice the ledger: it is created whole, and a tenant's own temporary copy must fit.
        let least = 2 * ledger_bytes();
        if !(least..=LEDGER_DIR_MAX_SIZE).contains(&size) {
            return Err(format!(
                "ledger_dir.size = {:?}: between {least} bytes (twice the {}-byte ledger) and \
                 64Mi",
                self.size,
                ledger_bytes()
            ));
        }
        if !LEDGER_DIR_INODES.contains(&self.inodes) {
            return Err(format!(
                "ledger_dir.inodes = {}: between {} and {}",
                self.inodes,
                LEDGER_DIR_INODES.start(),
                LEDGER_DIR_INODES.end()
            ));
        }
        Ok(size)
    }
}

/// A configuration that could not be read or is wrong: which file, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError(pub String);

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

impl Config {
    /// Reads and checks a configuration file.
    ///
    /// The file must be a regular file of at most [`MAX_FILE_BYTES`]: it is opened without
    /// blocking (`O_NONBLOCK`: a FIFO with no writer does not hang the plugin), checked with
    /// `fstat` on the open descriptor (a FIFO, a device such as `/dev/zero`, a directory or a
    /// socket is refused at once, naming its kind) and read at most one byte past the bound (a
    /// file that grows while read is refused, not read without end).
    ///
    /// Symbolic links are followed: `--config` is given by the operator, and a Kubernetes
    /// ConfigMap volume is a chain of them (`config.toml -> ..data/config.toml`, `..data ->
    /// ..2024_..._01`), which kubelet swaps atomically on an update. No tenant can write the
    /// config's directory (it is the plugin's own mount), so following a link there trusts no
    /// one the operator did not; what the link leads to is held to the same checks.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = read_bounded(path, MAX_FILE_BYTES)
            .map_err(|e| ConfigError(format!("{}: {e}", path.display())))?;
        Config::parse(&text).map_err(|e| ConfigError(format!("{}: {}", path.display(), e.0)))
    }

    /// Parses and checks configuration text.
    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        let c: Config = toml::from_str(text).map_err(|e| ConfigError(e.to_string()))?;
        c.validate()?;
        Ok(c)
    }

    /// Checks every value; the first problem, naming its key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let err = |m: String| Err(ConfigError(m));
        if self.version != VERSION {
            return err(format!(
                "version = {}: this plugin reads configuration version {VERSION}",
                self.version
            ));
        }
        let r = &self.resources;
        if r.gpu.is_empty() && r.gpu_memory.is_empty() {
            return err(
                "resources: both gpu and gpu_memory are empty; nothing to advertise".into(),
            );
        }
        for (key, name) in [("gpu", &r.gpu), ("gpu_memory", &r.gpu_memory)] {
            if !name.is_empty() && !valid_resource_name(name) {
                return err(format!(
                    "resources.{key} = {name:?}: an extended resource name is DOMAIN/NAME \
                     (e.g. cuvisor.io/gpu), lowercase letters, digits, '-' and '.'"
                ));
            }
        }
        if !r.gpu.is_empty() && r.gpu == r.gpu_memory {
            return err(format!(
                "resources.gpu and resources.gpu_memory are both {:?}",
                r.gpu
            ));
        }
        let unit = self.memory_unit_bytes()?;
        if unit < (1 << 20) {
            return err(format!(
                "resources.memory_unit = {:?}: at least 1Mi",
                r.memory_unit
            ));
        }
        if let Some(c) = &r.compute {
            check_compute(c).map_err(|e| ConfigError(format!("resources.compute = {c:?}: {e}")))?;
        }
        if let Some(c) = &r.context_reserve {
            cuvisor_shm::quantity::parse_quantity(c)
                .map_err(|e| ConfigError(format!("resources.context_reserve = {c:?}: {e}")))?;
        }
        for (key, p) in [
            ("socket_dir", &self.socket_dir),
            ("state_root", &self.state_root),
            ("host.library", &self.host.library),
            ("host.dev_dir", &self.host.dev_dir),
            ("container.library", &self.container.library),
            ("container.state_dir", &self.container.state_dir),
            ("container.coord_dir", &self.container.coord_dir),
            ("container.coord_own_dir", &self.container.coord_own_dir),
        ] {
            if !p.is_absolute() {
                return err(format!("{key} = {p:?}: must be an absolute path"));
            }
        }
        let (coord, own) = (&self.container.coord_dir, &self.container.coord_own_dir);
        if own.starts_with(coord) || coord.starts_with(own) {
            return err(format!(
                "container.coord_own_dir = {own:?}: must not be inside container.coord_dir = \
                 {coord:?} or contain it (the one is mounted read-only, the other read-write)"
            ));
        }
        if let Some(l) = &self.container.limits {
            if l != std::path::Path::new(cuvisor_shm::CONTAINER_LIMITS) {
                return err(format!(
                    "container.limits = {l:?}: the limits file is always mounted at {}, the one \
                     path the library reads it from (remove the key)",
                    cuvisor_shm::CONTAINER_LIMITS
                ));
            }
        }
        let pr = &self.pod_resources.socket;
        if !pr.as_os_str().is_empty() && !pr.is_absolute() {
            return err(format!(
                "pod_resources.socket = {pr:?}: must be an absolute path (or \"\": not asked)"
            ));
        }
        // Every socket the plugin binds or connects to must fit in sun_path: a longer one
        // fails at bind or connect, after the plugin has started.
        let mut sockets = vec![("socket_dir", self.socket_dir.join(layout::KUBELET_SOCKET))];
        for (sock, name) in [
            (layout::GPU_SOCKET, &r.gpu),
            (layout::MEMORY_SOCKET, &r.gpu_memory),
        ] {
            if !name.is_empty() {
                sockets.push(("socket_dir", self.socket_dir.join(sock)));
            }
        }
        if !pr.as_os_str().is_empty() {
            sockets.push(("pod_resources.socket", pr.clone()));
        }
        for (key, path) in sockets {
            let len = path.as_os_str().len();
            if len > MAX_SOCKET_PATH {
                return err(format!(
                    "{key}: the Unix socket path {} is {len} bytes; a Unix socket path is at \
                     most {MAX_SOCKET_PATH} bytes (sun_path holds {} with the terminating NUL)",
                    path.display(),
                    MAX_SOCKET_PATH + 1
                ));
            }
        }
        if self.pod_resources.refresh_seconds == 0 {
            return err("pod_resources.refresh_seconds = 0: must be at least 1".into());
        }
        if let Some(p) = &self.host.coord_dir {
            if !p.is_absolute() {
                return err(format!("host.coord_dir = {p:?}: must be an absolute path"));
            }
        }
        let from = &self.host.install_from;
        if !from.as_os_str().is_empty() && !from.is_absolute() {
            return err(format!(
                "host.install_from = {from:?}: must be an absolute path (or \"\": nothing copied)"
            ));
        }
        if GlibcVersion::parse(&self.host.tenant_glibc).is_none() {
            return err(format!(
                "host.tenant_glibc = {:?}: not a glibc version (like \"2.17\")",
                self.host.tenant_glibc
            ));
        }
        for d in &self.host.control_devices {
            if d.is_empty() || d.contains('/') {
                return err(format!(
                    "host.control_devices: {d:?} must be a file name under host.dev_dir"
                ));
            }
        }
        self.topology
            .validate()
            .map_err(|e| ConfigError(format!("topology: {e}")))?;
        let g = self.health.nvlink_min_gbps;
        if !g.is_finite() || g < 0.0 {
            return err(format!(
                "health.nvlink_min_gbps = {g}: must be a finite number >= 0"
            ));
        }
        if self.health.poll_ms == 0 || self.health.poll_ms > 60_000 {
            return err(format!(
                "health.poll_ms = {}: must be in 1..=60000",
                self.health.poll_ms
            ));
        }
        self.metrics_address()?;
        let n = &self.nvml;
        if !n.library.as_os_str().is_empty() && !n.library.is_absolute() {
            return err(format!(
                "nvml.library = {:?}: must be an absolute path (or \"\": the loader's search for \
                 libnvidia-ml.so.1)",
                n.library
            ));
        }
        if !(1..=MAX_NVML_RETRY_SECONDS).contains(&n.retry_seconds) {
            return err(format!(
                "nvml.retry_seconds = {}: must be in 1..={MAX_NVML_RETRY_SECONDS}",
                n.retry_seconds
            ));
        }
        if self.cleanup.interval_seconds == 0 {
            return err("cleanup.interval_seconds = 0: must be at least 1".into());
        }
        self.ledger_dir.validate().map_err(ConfigError)?;
        self.cdi.settings().map_err(ConfigError)?;
        Ok(())
    }

    /// The metrics endpoint's address; `None`: no endpoint. From `metrics_address` (`IP:port`,
    /// "" = none), or the older `metrics_port` (0 = none, N = `0.0.0.0:N`), or
    /// [`DEFAULT_METRICS_ADDRESS`]; both keys given is an error.
    pub fn metrics_address(&self) -> Result<Option<std::net::SocketAddr>, ConfigError> {
        let text = match (&self.metrics_address, self.metrics_port) {
            (Some(a), Some(p)) => {
                return Err(ConfigError(format!(
                    "metrics_address = {a:?} and metrics_port = {p}: both set; metrics_port is \
                     the older form of metrics_address (keep only metrics_address)"
                )))
            }
            (None, Some(0)) => return Ok(None),
            (None, Some(p)) => return Ok(Some(([0, 0, 0, 0], p).into())),
            (Some(a), None) => a.as_str(),
            (None, None) => DEFAULT_METRICS_ADDRESS,
        };
        if text.is_empty() {
            return Ok(None);
        }
        let addr: std::net::SocketAddr = text.parse().map_err(|_| {
            ConfigError(format!(
                "metrics_address = {text:?}: an IP address and a port (\"0.0.0.0:9400\", \
                 \"127.0.0.1:9400\", \"[::]:9400\"), or \"\" for no metrics endpoint"
            ))
        })?;
        if addr.port() == 0 {
            return Err(ConfigError(format!(
                "metrics_address = {text:?}: port 0; give a port (or \"\" for no metrics \
                 endpoint)"
            )));
        }
        Ok(Some(addr))
    }

    /// `host.tenant_glibc` as a version (validated: the default's when it does not parse).
    pub fn tenant_glibc(&self) -> GlibcVersion {
        GlibcVersion::parse(&self.host.tenant_glibc).unwrap_or(DEFAULT_TENANT_GLIBC)
    }

    /// The memory unit in bytes.
    pub fn memory_unit_bytes(&self) -> Result<u64, ConfigError> {
        let u = &self.resources.memory_unit;
        cuvisor_shm::quantity::parse_quantity(u)
            .map_err(|e| ConfigError(format!("resources.memory_unit = {u:?}: {e}")))
    }

    /// The GPU coordinators' directory on the host.
    pub fn host_coord_dir(&self) -> PathBuf {
        self.host
            .coord_dir
            .clone()
            .unwrap_or_else(|| self.state_root.join(layout::COORD))
    }
}

/// The largest configuration file read (the example in deploy/ is under 2 KiB).
pub const MAX_FILE_BYTES: u64 = 1 << 20;

/// The text of `path`, if it is a regular file of at most `max` bytes of UTF-8: opened without
/// blocking, checked on the descriptor, read at most `max + 1` bytes.
fn read_bounded(path: &Path, max: u64) -> Result<String, String> {
    use std::io::Read;
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| e.to_string())?;
    let m = f.metadata().map_err(|e| format!("fstat: {e}"))?;
    let t = m.file_type();
    let kind = if t.is_file() {
        None
    } else if t.is_fifo() {
        Some("a FIFO")
    } else if t.is_char_device() {
        Some("a character device")
    } else if t.is_block_device() {
        Some("a block device")
    } else if t.is_dir() {
        Some("a directory")
    } else if t.is_socket() {
        Some("a socket")
    } else {
        Some("not a regular file")
    };
    if let Some(kind) = kind {
        return Err(format!(
            "{kind}, not a regular file: refused without reading it"
        ));
    }
    let too_big = || format!("larger than {max} bytes (the most a configuration file may be)");
    if m.len() > max {
        return Err(too_big());
    }
    let mut bytes = Vec::with_capacity(m.len() as usize);
    f.take(max + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    if bytes.len() as u64 > max {
        return Err(too_big());
    }
    String::from_utf8(bytes).map_err(|_| "not UTF-8 text".to_string())
}

/// DOMAIN/NAME, as kubelet accepts for an extended resource.
fn valid_resource_name(name: &str) -> bool {
    let Some((domain, rest)) = name.split_once('/') else {
        return false;
    };
    let ok = |s: &str| {
        !s.is_empty()
            && s.len() <= 63
            && s.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
            && !s.starts_with(['-', '.'])
            && !s.ends_with(['-', '.'])
    };
    domain.contains('.') && ok(domain) && ok(rest)
}

/// The limits file's compute values, as the library reads them (crates/shm's `compute`):
/// `limit=P` (0 < P <= 100), `share=W`, `share=memory`, `none`.
fn check_compute(text: &str) -> Result<(), String> {
    cuvisor_shm::compute::parse(text)
        .map(|_| ())
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_glibc_defaults_to_2_17_and_must_be_a_version() {
        let c = Config::parse("version = 1\n").unwrap();
        assert_eq!(c.host.tenant_glibc, "2.17");
        assert_eq!(c.tenant_glibc(), GlibcVersion::new(2, 17));
        let c = Config::parse("version = 1\n[host]\ntenant_glibc = \"2.28\"\n").unwrap();
        assert_eq!(c.tenant_glibc(), GlibcVersion::new(2, 28));
        for bad in ["", "2", "glibc 2.17", "GLIBC_2.17", "2.17.x"] {
            let e = Config::parse(&format!("version = 1\n[host]\ntenant_glibc = {bad:?}\n"))
                .unwrap_err();
            assert_eq!(
                e.0,
                format!("host.tenant_glibc = {bad:?}: not a glibc version (like \"2.17\")")
            );
        }
    }

    #[test]
    fn empty_is_the_default() {
        assert_eq!(Config::parse("").unwrap(), Config::default());
        assert_eq!(Config::default().health.xid_critical, DEFAULT_CRITICAL_XIDS);
        assert_eq!(
            Config::default().memory_unit_bytes().unwrap(),
            1 << 30,
            "1 GiB units"
        );
    }

    #[test]
    fn the_limits_path_is_the_librarys_fixed_one_or_refused() {
        let fixed = format!(
            "[container]\nlimits = \"{}\"\n",
            cuvisor_shm::CONTAINER_LIMITS
        );
        assert!(Config::parse(&fixed).is_ok());
        let e = Config::parse("[container]\nlimits = \"/etc/cuvisor.conf\"\n").unwrap_err();
        assert!(e.to_string().contains("always mounted at"), "{e}");
    }

    #[test]
    fn a_full_file_parses() {
        let c = Config::parse(
            r#"
            version = 1
            socket_dir = "/tmp/dp"
            state_root = "/tmp/st"
            metrics_port = 0
            [nvml]
            library = "/usr/lib64/libnvidia-ml.so.1"
            retry_seconds = 5
            fail_on_init_error = true
            [resources]
            memory_unit = "512Mi"
            compute = "share=2"
            [topology]
            policy = "weighted"
            bandwidth = 1.0
            [pod_resources]
            socket = ""
            [health]
            xid_critical = [79]
            xid_hold_seconds = 1
            nvlink_min_gbps = 20.5
            poll_ms = 50
            [cleanup]
            grace_seconds = 0
            "#,
        )
        .unwrap();
        assert_eq!(c.memory_unit_bytes().unwrap(), 512 << 20);
        assert_eq!(c.topology.bandwidth, 1.0);
        assert_eq!(c.topology.topology, 0.3, "missing weights keep defaults");
        assert_eq!(c.topology.policy, crate::topology::Policy::Weighted);
        assert_eq!(c.health.xid_critical, vec![79]);
        let h = &c.health;
        assert_eq!(
            (h.xid_hold_seconds, h.poll_ms, h.nvlink_min_gbps),
            (1, 50, 20.5)
        );
        assert_eq!(c.pod_resources.socket, PathBuf::new());
        assert_eq!(c.pod_resources.refresh_seconds, 10);
        assert_eq!(c.host_coord_dir(), PathBuf::from("/tmp/st/coord"));
        assert_eq!(
            c.metrics_address(),
            Ok(None),
            "metrics_port = 0: no endpoint"
        );
        assert_eq!(
            c.nvml,
            Nvml {
                library: "/usr/lib64/libnvidia-ml.so.1".into(),
                retry_seconds: 5,
                fail_on_init_error: true
            }
        );
        assert_eq!(
            c.host.install_from,
            PathBuf::new(),
            "nothing copied by default"
        );
        let c = Config::parse("[host]\ninstall_from = \"/usr/local/lib/cuvisor/libcuvisor.so\"\n")
            .unwrap();
        assert_eq!(
            c.host.install_from,
            PathBuf::from("/usr/local/lib/cuvisor/libcuvisor.so")
        );
    }

    /// A socket_dir whose sockets do not fit in sun_path is refused up front, naming the
    /// socket; one whose longest socket is exactly 107 bytes is fine.
    #[test]
    fn a_socket_dir_too_long_for_a_unix_socket_is_refused() {
        // "/" + dir + "/cuvisor-gpu-memory.sock" (24 bytes): the longest socket in it.
        let longest = layout::MEMORY_SOCKET.len() + 2;
        let dir = |n: usize| format!("/{}", "d".repeat(n));
        let fits = format!("socket_dir = {:?}", dir(MAX_SOCKET_PATH - longest));
        let c = Config::parse(&fits).unwrap();
        assert_eq!(
            c.socket_dir.join(layout::MEMORY_SOCKET).as_os_str().len(),
            MAX_SOCKET_PATH
        );
        let over = format!("socket_dir = {:?}", dir(MAX_SOCKET_PATH - longest + 1));
        let e = Config::parse(&over).unwrap_err().0;
        assert!(
            e.starts_with("socket_dir: the Unix socket path ")
                && e.contains("/cuvisor-gpu-memory.sock is 108 bytes")
                && e.contains("at most 107 bytes"),
            "{e}"
        );
        // Without the memory resource, its socket is not served: kubelet.sock is then the
        // longest (the whole-GPU socket is shorter still).
        let only_gpu = format!("{over}\n[resources]\ngpu_memory = \"\"");
        assert!(Config::parse(&only_gpu).is_ok());
        let kubelet = format!(
            "socket_dir = {:?}",
            dir(MAX_SOCKET_PATH - layout::KUBELET_SOCKET.len() - 1)
        );
        let e = Config::parse(&format!("{kubelet}\n[resources]\ngpu_memory = \"\""))
            .unwrap_err()
            .0;
        assert!(e.contains("/kubelet.sock is 108 bytes"), "{e}");
        // The PodResources socket is connected to: the same bound.
        let pr = format!(
            "[pod_resources]\nsocket = {:?}",
            format!("{}/kubelet.sock", dir(100))
        );
        let e = Config::parse(&pr).unwrap_err().0;
        assert!(e.starts_with("pod_resources.socket: "), "{e}");
    }

    /// metrics_address: IP:port or "" (none), the default without either key; the older
    /// metrics_port still read (0: none, N: 0.0.0.0:N); both keys refused, naming both.
    #[test]
    fn metrics_address_or_the_older_metrics_port_but_not_both() {
        let addr = |text: &str| Config::parse(text).map(|c| c.metrics_address().unwrap());
        let some = |a: &str| Ok(Some(a.parse().unwrap()));
        assert_eq!(addr(""), some(DEFAULT_METRICS_ADDRESS));
        assert_eq!(
            addr("metrics_address = \"127.0.0.1:9500\""),
            some("127.0.0.1:9500")
        );
        assert_eq!(addr("metrics_address = \"[::]:9400\""), some("[::]:9400"));
        assert_eq!(addr("metrics_address = \"\""), Ok(None));
        assert_eq!(addr("metrics_port = 9401"), some("0.0.0.0:9401"));
        assert_eq!(addr("metrics_port = 0"), Ok(None));
        let e = Config::parse("metrics_address = \"0.0.0.0:9400\"\nmetrics_port = 9400")
            .unwrap_err()
            .0;
        assert!(
            e.contains("metrics_address") && e.contains("metrics_port"),
            "{e}"
        );
        assert!(e.contains("both set"), "{e}");
        for bad in [
            "localhost:9400",
            "9400",
            "0.0.0.0",
            "0.0.0.0:0",
            "0.0.0.0:70000",
        ] {
            let e = Config::parse(&format!("metrics_address = {bad:?}"))
                .unwrap_err()
                .0;
            assert!(
                e.starts_with(&format!("metrics_address = {bad:?}: ")),
                "{e}"
            );
        }
    }

    /// [nvml]: defaults as NVIDIA's plugin with FAIL_ON_INIT_ERROR=false (stay up, retry);
    /// a relative library path and a retry of 0 are refused.
    #[test]
    fn the_nvml_section_defaults_to_waiting_and_checks_its_values() {
        let d = Config::default().nvml;
        assert_eq!(
            (
                d.library.as_os_str().is_empty(),
                d.retry_seconds,
                d.fail_on_init_error
            ),
            (true, 30, false)
        );
        let e = Config::parse("[nvml]\nlibrary = \"libnvidia-ml.so.1\"")
            .unwrap_err()
            .0;
        assert!(e.starts_with("nvml.library = "), "{e}");
        let e = Config::parse("[nvml]\nretry_seconds = 0").unwrap_err().0;
        assert!(e.starts_with("nvml.retry_seconds = 0: "), "{e}");
        let e = Config::parse("[nvml]\nretry = 3").unwrap_err().0;
        assert!(e.contains("unknown field `retry`"), "{e}");
    }

    fn scratch(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("cuvisor-cfg-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// Loads `path` on another thread: the error, or a panic if it takes over a second (the
    /// thread is left behind: a hang must fail the test, not hold it).
    fn load_within_a_second(path: &Path) -> String {
        let (tx, rx) = std::sync::mpsc::channel();
        let p = path.to_path_buf();
        std::thread::spawn(move || {
            let _ = tx.send(Config::load(&p).map(|_| ()));
        });
        match rx.recv_timeout(std::time::Duration::from_secs(1)) {
            Ok(r) => r.expect_err("refused").0,
            Err(_) => panic!("Config::load({}) still running after 1 s", path.display()),
        }
    }

    #[test]
    fn a_config_that_is_a_fifo_is_refused_within_a_second() {
        let d = scratch("fifo");
        let fifo = d.join("config.toml");
        assert!(std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success());
        let e = load_within_a_second(&fifo);
        assert!(e.contains("a FIFO, not a regular file"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_config_that_is_dev_zero_is_refused_unread() {
        let e = load_within_a_second(Path::new("/dev/zero"));
        assert!(
            e.starts_with("/dev/zero: a character device, not a regular file"),
            "{e}"
        );
    }

    #[test]
    fn an_oversized_config_is_refused_with_the_bound() {
        let d = scratch("big");
        let p = d.join("config.toml");
        // Valid TOML all the way (comments): only its size is wrong.
        let line = format!("# {}\n", "x".repeat(1000));
        std::fs::write(&p, line.repeat((MAX_FILE_BYTES as usize) / line.len() + 1)).unwrap();
        let e = load_within_a_second(&p);
        assert!(e.contains("larger than 1048576 bytes"), "{e}");
        // At the bound it is read.
        std::fs::write(&p, line.repeat((MAX_FILE_BYTES as usize) / line.len())).unwrap();
        assert_eq!(Config::load(&p).unwrap(), Config::default());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_configmap_style_symlink_chain_is_followed() {
        let d = scratch("cm");
        std::fs::create_dir_all(d.join("..2024_01_01")).unwrap();
        std::fs::write(d.join("..2024_01_01/config.toml"), "metrics_port = 0\n").unwrap();
        std::os::unix::fs::symlink("..2024_01_01", d.join("..data")).unwrap();
        std::os::unix::fs::symlink("..data/config.toml", d.join("config.toml")).unwrap();
        assert_eq!(
            Config::load(&d.join("config.toml")).unwrap().metrics_port,
            Some(0)
        );
        // A link to a special file is refused like the file itself.
        std::os::unix::fs::symlink("/dev/zero", d.join("zero.toml")).unwrap();
        let e = load_within_a_second(&d.join("zero.toml"));
        assert!(e.contains("a character device"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn bad_values_are_refused_with_the_key() {
        for (text, want) in [
            ("version = 2", "version = 2"),
            (
                "[resources]\nmemory_unit = \"1GB\"",
                "resources.memory_unit",
            ),
            ("[resources]\nmemory_unit = \"4Ki\"", "at least 1Mi"),
            ("[resources]\ngpu = \"gpu\"", "resources.gpu"),
            ("[resources]\ncompute = \"limit=150\"", "resources.compute"),
            ("socket_dir = \"relative\"", "socket_dir"),
            ("[topology]\nbandwidth = -1.0", "topology"),
            ("[health]\nnvlink_min_gbps = -3.0", "nvlink_min_gbps"),
            ("[health]\npoll_ms = 0", "health.poll_ms"),
            (
                "[pod_resources]\nsocket = \"rel.sock\"",
                "pod_resources.socket",
            ),
            ("bogus = 1", "bogus"),
            ("[cdi]\nstrategy = \"cdi\"", "cdi.strategy = \"cdi\""),
            ("[cdi]\nspec_dir = \"cdi\"", "cdi.spec_dir"),
            ("[cdi]\nnvidia_kind = \"nvidia.com\"", "cdi.nvidia_kind"),
            (
                "[cdi]\nnvidia_kind = \"cuvisor.io/allocation\"",
                "cuvisor's own kind",
            ),
            (
                "[cdi]\nnvidia_device_name = \"name\"",
                "cdi.nvidia_device_name",
            ),
            ("[cdi]\nbogus = 1", "bogus"),
            (
                "[host]\ninstall_from = \"libcuvisor.so\"",
                "host.install_from",
            ),
            (
                "[resources]\ngpu = \"\"\ngpu_memory = \"\"",
                "nothing to advertise",
            ),
        ] {
            let e = Config::parse(text).expect_err(text).0;
            assert!(e.contains(want), "{text:?}: {e:?} lacks {want:?}");
        }
    }
}
