//! The three placements of the seeds' chart, as plain rules over the free memory units of each
//! GPU (no processes here: the bench asks, then starts the job on the answer).
//!
//! Every GPU is split into [`UNITS`] memory units, as the device plugin advertises a GPU's
//! memory in units (docs/kubernetes.md); a sharing job takes one unit on each GPU of its set, an
//! exclusive job all of them.
//!
//! - **exclusive**: whole GPUs, topology-blind first fit: the `size` lowest-numbered GPUs that
//!   are entirely free (what a scheduler handing out `nvidia.com/gpu` does: the kubelet's
//!   default without GetPreferredAllocation takes devices in list order).
//! - **basic sharing**: one unit on each of the `size` lowest-numbered GPUs with a free unit;
//!   topology-blind.
//! - **topology-optimized sharing**: one unit on each GPU of the set that the plugin's
//!   [`Allocator::preferred`] (GetPreferredAllocation's logic, default weights) picks among the
//!   GPUs with a free unit, each GPU's free memory told to the allocator (its balance term).
//!
//! A request that does not fit waits (the bench's queue is first come, first served).

use cuvisor_device_plugin::topology::{Allocator, Memory, Weights};

/// Memory units per GPU: at most this many sharing jobs on one GPU.
pub const UNITS: u32 = 4;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Exclusive,
    Basic,
    Topology,
}

impl Mode {
    pub const ALL: [Mode; 3] = [Mode::Exclusive, Mode::Basic, Mode::Topology];

    pub fn label(self) -> &'static str {
        match self {
            Mode::Exclusive => "exclusive",
            Mode::Basic => "basic sharing",
            Mode::Topology => "topology-optimized sharing",
        }
    }

    /// Units a job takes on each GPU of its set.
    pub fn units(self) -> u32 {
        match self {
            Mode::Exclusive => UNITS,
            Mode::Basic | Mode::Topology => 1,
        }
    }

    /// Whether a job runs under cuvisor (a memory quota of its units, `--compute share=1`).
    pub fn shared(self) -> bool {
        self != Mode::Exclusive
    }
}

/// Picks GPU sets for one mode on one machine.
pub struct Placer {
    mode: Mode,
    /// The plugin's allocator for the machine (topology mode).
    allocator: Allocator,
    /// Bytes of one GPU's memory (the allocator's balance term sees free units as free bytes).
    gpu_memory: u64,
}

impl Placer {
    pub fn new(mode: Mode, allocator: Allocator, gpu_memory: u64) -> Placer {
        Placer {
            mode,
            allocator,
            gpu_memory,
        }
    }

    /// The GPUs a job of `size` gets, given each GPU's free units; None when it must wait.
    pub fn place(&mut self, free: &[u32], size: usize) -> Option<Vec<usize>> {
        let need = self.mode.units();
        let room: Vec<usize> = (0..free.len()).filter(|&g| free[g] >= need).collect();
        if room.len() < size {
            return None;
        }
        match self.mode {
            Mode::Exclusive | Mode::Basic => Some(room[..size].to_vec()),
            Mode::Topology => {
                let unit = self.gpu_memory / UNITS as u64;
                for (g, &f) in free.iter().enumerate() {
                    let memory = Memory {
                        total: self.gpu_memory,
                        free: f as u64 * unit,
                    };
                    self.allocator.set_memory(g, memory).ok()?;
                }
                self.allocator
                    .preferred(&room, &[], size, &Weights::default())
                    .ok()
            }
        }
    }

    /// Takes (`take`) or gives back the units of a job on `gpus`.
    pub fn account(&self, free: &mut [u32], gpus: &[usize], take: bool) {
        for &g in gpus {
            if take {
                free[g] -= self.mode.units();
            } else {
                free[g] += self.mode.units();
            }
        }
    }
}
