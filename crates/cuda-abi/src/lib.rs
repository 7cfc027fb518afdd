//! The slice of the CUDA driver API ABI that cuvisor speaks, as plain Rust.
//!
//! Both sides of the interposition use these definitions: the simulated driver (crates/sim) that
//! implements the entry points and, later, libcuvisor.so that wraps them. Values and layouts are
//! those of `cuda.h` (CUDA 12.8); the tests at the bottom compare them with cudarc's bindgen output
//! of that header, so a typo cannot survive.
#![allow(non_camel_case_types, non_snake_case)]

pub mod cuda;
