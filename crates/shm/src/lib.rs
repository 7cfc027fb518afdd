//! Shared-memory layouts used across processes: the per-container memory ledger (`ledger`) and
//! the process identity that makes reclaiming a dead process's charges safe (`process`); and the
//! syntax every part accepts for memory limits (`quantity`: "6Gi", "0=6Gi,1=2Gi") and compute
//! policies (`compute`: "limit=30", "share=2", "share=memory", "none").
//!
//! The layouts are `#[repr(C)]`, versioned, made of atomics, and mirrored for C tools in
//! `include/cuvisor.h` (a test keeps the two in step). This crate holds no hooks: the plugin and
//! the CLI link it without interposing anything.

/// Where the device plugin mounts a container's limits file (read-only). Where it exists, the
/// library takes its limits from it alone; the environment can only lower them.
pub const CONTAINER_LIMITS: &str = "/var/run/cuvisor/limits.conf";

pub mod compute;
pub mod coordinator;
pub mod lease;
pub mod ledger;
pub mod limits;
pub mod mapped;
pub mod process;
pub mod quantity;
pub mod uuid;
