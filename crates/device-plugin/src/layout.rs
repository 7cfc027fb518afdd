//! The names of the plugin's files on disk and of its sockets: one place, so that the rooms that
//! write a file and the rooms that read or remove it agree, and import nothing from each other.
//!
//! Under the state root (`state_root`, default `/var/lib/cuvisor`):
//!
//! ```text
//! <state_root>/ld.so.preload                 PRELOAD: mounted at /etc/ld.so.preload
//! <state_root>/coord/                        COORD: the GPU coordinators (default host.coord_dir)
//! <state_root>/allocations/<id>/             ALLOCATIONS: one directory per allocation
//! <state_root>/allocations/<id>/allocation.json   RECORD: the registry's record
//! <state_root>/allocations/<id>/limits.conf  LIMITS: the library's limits file
//! <state_root>/allocations/<id>/state/       STATE: the ledger directory (a tmpfs of its own)
//! ```
//!
//! Under `socket_dir` (kubelet's device-plugin directory): [`KUBELET_SOCKET`] (kubelet's),
//! [`GPU_SOCKET`], [`MEMORY_SOCKET`] (the plugin's).

/// The allocations' directories under the state root.
pub const ALLOCATIONS: &str = "allocations";
/// The record's file in an allocation's directory.
pub const RECORD: &str = "allocation.json";
/// The limits file's name in an allocation's directory.
pub const LIMITS: &str = "limits.conf";
/// The ledger directory's name in an allocation's directory.
pub const STATE: &str = "state";
/// The preload file's name under the state root.
pub const PRELOAD: &str = "ld.so.preload";
/// The GPU coordinators' directory under the state root (when `host.coord_dir` is not set).
pub const COORD: &str = "coord";

/// kubelet's registration socket, in `socket_dir`.
pub const KUBELET_SOCKET: &str = "kubelet.sock";
/// The socket of the whole-GPU resource's server, in `socket_dir`.
pub const GPU_SOCKET: &str = "cuvisor-gpu.sock";
/// The socket of the memory-unit resource's server, in `socket_dir`.
pub const MEMORY_SOCKET: &str = "cuvisor-gpu-memory.sock";
