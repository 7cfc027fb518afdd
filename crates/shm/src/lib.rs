//! Shared-memory layouts used across processes: the per-container memory ledger (`ledger`) and
//! the process identity that makes reclaiming a dead process's charges safe (`process`); and the
//! syntax every part accepts for memory limits (`quantity`: "6Gi", "0=6Gi,1=2Gi") and compute
//! policies (`compute`: "limit=30", "share=2", "share=memory", "none").
//!
//! The layouts are `#[repr(C)]`, versioned, made of atomics, and mirrored for C tools in
//! `include/cuvisor.h` (a test keeps the two in step). This crate holds no hooks: the plugin and
//! the CLI link it without interposing anything.

pub mod compute;
pub mod coordinator;
pub mod ledger;
pub mod process;
pub mod quantity;
pub mod uuid;
