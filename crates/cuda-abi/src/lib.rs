//! The slice of the CUDA driver API and NVML ABIs that cuvisor speaks, as plain Rust.
//!
//! Both sides of the interposition use these definitions: the simulated driver (crates/sim) that
//! implements the entry points and, later, libcuvisor.so that wraps them. Values and layouts are
//! those of `cuda.h` (CUDA 12.8) and `nvml.h`; the tests at the bottom of each module compare them
//! with the bindgen output of those headers (cudarc's and nvml-wrapper-sys's), so a typo cannot
//! survive.
#![allow(non_camel_case_types, non_snake_case)]

pub mod cuda;
pub mod ffi;
pub mod nvml;
