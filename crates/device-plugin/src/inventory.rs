//! The devices each resource advertises: whole GPUs (device ID = GPU UUID) and memory units
//! (`<GPU UUID>-mem-<k>`, one per `memory_unit` bytes of the GPU's memory, rounded down).

use crate::topology::{Allocator, Topology};
use std::collections::HashMap;

/// One GPU as the plugin sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuInfo {
    /// NVML index.
    pub index: usize,
    /// The N of the GPU's device node `/dev/nvidiaN`: its minor number as NVML reports it
    /// (`nvmlDeviceGetMinorNumber`), which need not equal the index; the index when unknown
    /// (a topology parsed from `nvidia-smi topo -m`, which does not show it).
    pub minor: u32,
    pub uuid: String,
    /// Physical memory in bytes.
    pub memory: u64,
    pub numa_node: Option<u32>,
    /// How many memory units the GPU advertises.
    pub units: u32,
}

/// The node's GPUs, their memory units and the topology allocator.
pub struct Inventory {
    gpus: Vec<GpuInfo>,
    by_uuid: HashMap<String, usize>,
    unit_bytes: u64,
    allocator: Allocator,
}

impl Inventory {
    /// From a discovered topology; every GPU needs a UUID and its memory size.
    pub fn new(topology: Topology, unit_bytes: u64) -> Result<Inventory, String> {
        if unit_bytes == 0 {
            return Err("the memory unit is 0 bytes".into());
        }
        let mut gpus = Vec::new();
        for g in topology.gpus() {
            let uuid = g
                .uuid
                .clone()
                .ok_or_else(|| format!("GPU {} has no UUID", g.index))?;
            let memory = g
                .memory
                .map(|m| m.total)
                .ok_or_else(|| format!("GPU {} ({uuid}) reports no memory size", g.index))?;
            gpus.push(GpuInfo {
                index: g.index,
                minor: g.minor.unwrap_or(g.index as u32),
                uuid,
                memory,
                numa_node: g.numa_node,
                units: u32::try_from(memory / unit_bytes).unwrap_or(u32::MAX),
            });
        }
        let by_uuid = gpus
            .iter()
            .enumerate()
            .map(|(i, g)| (g.uuid.clone(), i))
            .collect::<HashMap<_, _>>();
        if by_uuid.len() != gpus.len() {
            return Err("two GPUs report the same UUID".into());
        }
        let allocator = Allocator::new(topology).map_err(|e| format!("{e:?}"))?;
        Ok(Inventory {
            gpus,
            by_uuid,
            unit_bytes,
            allocator,
        })
    }

    pub fn gpus(&self) -> &[GpuInfo] {
        &self.gpus
    }

    pub fn unit_bytes(&self) -> u64 {
        self.unit_bytes
    }

    pub fn allocator(&self) -> &Allocator {
        &self.allocator
    }

    /// The GPU (position in [`Self::gpus`]) with this UUID.
    pub fn gpu_by_uuid(&self, uuid: &str) -> Option<usize> {
        self.by_uuid.get(uuid).copied()
    }

    /// The device ID of memory unit `k` of GPU `gpu`.
    pub fn unit_id(&self, gpu: usize, k: u32) -> String {
        unit_id(&self.gpus[gpu], k)
    }

    /// (GPU, k) of a memory unit's device ID.
    pub fn parse_unit_id(&self, id: &str) -> Option<(usize, u32)> {
        let (uuid, digits) = id.rsplit_once("-mem-")?;
        let gpu = self.gpu_by_uuid(uuid)?;
        // Only the form unit_id writes: plain decimal, no sign, no leading zero. (Checked in
        // place: formatting the ID again to compare made GetPreferredAllocation over 1280 units
        // take a millisecond.)
        let canonical = !digits.is_empty()
            && digits.bytes().all(|b| b.is_ascii_digit())
            && (digits == "0" || !digits.starts_with('0'));
        let k: u32 = digits.parse().ok().filter(|_| canonical)?;
        (k < self.gpus[gpu].units).then_some((gpu, k))
    }
}

/// A memory unit's device ID.
pub fn unit_id(g: &GpuInfo, k: u32) -> String {
    format!("{}-mem-{k}", g.uuid)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::{Gpu, Link, Memory, PcieLevel};

    #[test]
    fn unit_ids_read_back_only_in_the_form_they_are_written() {
        let mut g = Gpu::new(0);
        g.uuid = Some("GPU-a".into());
        g.memory = Some(Memory {
            total: 16 << 30,
            free: 16 << 30,
        });
        let t = Topology::new(vec![g], vec![vec![Link::pcie(PcieLevel::Single)]], 16.0).unwrap();
        let inv = Inventory::new(t, 1 << 30).unwrap();
        for k in [0, 7, 15] {
            assert_eq!(inv.parse_unit_id(&inv.unit_id(0, k)), Some((0, k)));
        }
        for bad in [
            "GPU-a-mem-16",
            "GPU-a-mem-01",
            "GPU-a-mem-+1",
            "GPU-a-mem-",
            "GPU-a-mem- 1",
            "GPU-b-mem-1",
            "GPU-a-1",
        ] {
            assert_eq!(inv.parse_unit_id(bad), None, "{bad}");
        }
    }
}
