//! GPU topology: what the node has, how its GPUs are wired, and which of them to hand out.
//!
//! - [`Topology`] ([`model`]): N GPUs and the link between every pair (NVLink count and
//!   generation, NVSwitch, or the PCIe path), with pair bandwidth from a documented table.
//! - [`discover`] ([`nvml`]): the topology through NVML (nvml-wrapper), real or simulated.
//! - [`parse_topo_matrix`] ([`parse`]): the topology from `nvidia-smi topo -m` text, for fixtures
//!   and diagnosis.
//! - [`Allocator`] ([`alloc`]): the best group for a request. By default ([`Policy::AllReduce`])
//!   the group minimising [`objective`]'s sum: this job's modelled all-reduce time plus the best
//!   the remaining GPUs allow for the requests that plausibly come next; or (`weighted`) the
//!   group with the best [`score`] (the seeds' four weighted terms), by exact search.
//!
//! - [`fabric::fabric`]: the topology as the interconnect model (`cuvisor_fabric`) sees it, for
//!   all-reduce times and topology loss.
//!
//! Nothing here speaks gRPC; the device-plugin server builds on it.

pub mod alloc;
pub mod fabric;
pub mod model;
pub mod nvml;
pub mod objective;
pub mod parse;
pub mod score;

pub use alloc::{AllocError, Allocator, MAX_GPUS};
pub use model::{Gpu, Link, Memory, NvLink, PcieLevel, Topology, TopologyError};
pub use nvml::{discover, DiscoverError};
pub use objective::Policy;
pub use parse::{parse_topo_matrix, ParseError, ParseErrorKind};
pub use score::{Score, Structure, Weights};
