//! cuvisor's Kubernetes device plugin.
//!
//! For now only the [`topology`] module: the GPUs of a node and how they are wired (discovered
//! through NVML or parsed from `nvidia-smi topo -m`), and the allocator that picks the best
//! connected set of GPUs for a multi-GPU request. It needs no gRPC; the kubelet-facing server is
//! built on top of it.
#![forbid(unsafe_code)]

pub mod topology;
