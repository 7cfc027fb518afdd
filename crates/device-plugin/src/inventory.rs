//! The devices each resource advertises: whole GPUs (device ID = GPU UUID) and memory units
//! (`<GPU UUID>-mem-<k>`, one per `memory_unit` bytes of the GPU's memory, rounded down).

use crate::api;
use crate::config::Config;
use crate::topology::{Allocator, Topology};
use crate::HealthMap;
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

    /// ListAndWatch's list for whole GPUs.
    pub fn gpu_devices(&self, health: &HealthMap) -> Vec<api::Device> {
        self.gpus
            .iter()
            .map(|g| api::Device {
                id: g.uuid.clone(),
                health: health_of(g, health).into(),
                topology: topology_of(g),
            })
            .collect()
    }

    /// ListAndWatch's list for memory units (a unit has its GPU's health and NUMA node).
    pub fn memory_devices(&self, health: &HealthMap) -> Vec<api::Device> {
        unit_devices(&self.gpus, health).collect()
    }

    /// The encoded size in bytes of ListAndWatch's response (`ListAndWatchResponse`, without
    /// gRPC's 5-byte message prefix) for memory units (`memory`) or whole GPUs, at its longest:
    /// every device Unhealthy. Counting stops once past `limit`.
    pub fn list_len(&self, memory: bool, limit: usize) -> usize {
        let sick: HealthMap = self.gpus.iter().map(|g| (g.uuid.clone(), false)).collect();
        if memory {
            encoded_list_len(unit_devices(&self.gpus, &sick), limit)
        } else {
            encoded_list_len(self.gpu_devices(&sick).into_iter(), limit)
        }
    }

    /// The smallest memory unit, a whole number of MiB, whose memory-unit list
    /// ([`Self::list_len`]) is at most `limit` bytes; None if not even a unit the size of the
    /// largest GPU is.
    pub fn smallest_unit_within(&self, limit: usize) -> Option<u64> {
        const MIB: u64 = 1 << 20;
        let sick: HealthMap = self.gpus.iter().map(|g| (g.uuid.clone(), false)).collect();
        let fits = |mib: u64| {
            let gpus: Vec<GpuInfo> = self
                .gpus
                .iter()
                .map(|g| GpuInfo {
                    units: u32::try_from(g.memory / (mib * MIB)).unwrap_or(u32::MAX),
                    ..g.clone()
                })
                .collect();
            encoded_list_len(unit_devices(&gpus, &sick), limit) <= limit
        };
        // The size only shrinks as the unit grows (fewer units, IDs no longer).
        let (mut lo, mut hi) = (1u64, self.gpus.iter().map(|g| g.memory / MIB).max()?.max(1));
        if !fits(hi) {
            return None;
        }
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if fits(mid) {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        Some(lo)
    }
}

/// Refuses a configuration whose ListAndWatch response, for a resource it advertises, would be
/// longer than kubelet accepts ([`api::KUBELET_MAX_MESSAGE`]): kubelet would drop the stream
/// and the resource would never appear. Checked on the message at its longest (every device
/// Unhealthy); for memory units, the reason names the smallest `memory_unit` that fits.
pub fn check_list_sizes(cfg: &Config, inv: &Inventory) -> Result<(), String> {
    let max = api::KUBELET_MAX_MESSAGE;
    let r = &cfg.resources;
    for (memory, name) in [(false, &r.gpu), (true, &r.gpu_memory)] {
        if name.is_empty() || inv.list_len(memory, max) <= max {
            continue;
        }
        let len = inv.list_len(memory, usize::MAX);
        let gpus = inv.gpus().len();
        let over = format!(
            "would be {len} bytes, over the {max} bytes (4 MiB) kubelet's gRPC client accepts \
             (grpc-go's default maximum receive message size)"
        );
        return Err(if memory {
            let units: u64 = inv.gpus().iter().map(|g| u64::from(g.units)).sum();
            let fix = match inv.smallest_unit_within(max) {
                Some(mib) => format!("; the smallest memory_unit that fits is \"{mib}Mi\""),
                None => String::new(),
            };
            format!(
                "resources.memory_unit = {:?}: the ListAndWatch response for {name} ({units} \
                 memory units on {gpus} GPU(s)) {over}{fix}",
                r.memory_unit
            )
        } else {
            format!("resources.gpu: the ListAndWatch response for {name} ({gpus} GPUs) {over}")
        });
    }
    Ok(())
}

fn unit_id(g: &GpuInfo, k: u32) -> String {
    format!("{}-mem-{k}", g.uuid)
}

fn topology_of(g: &GpuInfo) -> Option<api::TopologyInfo> {
    g.numa_node.map(|n| api::TopologyInfo {
        nodes: vec![api::NumaNode { id: i64::from(n) }],
    })
}

fn health_of(g: &GpuInfo, health: &HealthMap) -> &'static str {
    match health.get(&g.uuid) {
        Some(false) => api::UNHEALTHY,
        _ => api::HEALTHY,
    }
}

/// The memory units of `gpus`, as ListAndWatch lists them (a unit has its GPU's health and
/// NUMA node).
fn unit_devices<'a>(
    gpus: &'a [GpuInfo],
    health: &'a HealthMap,
) -> impl Iterator<Item = api::Device> + 'a {
    gpus.iter().flat_map(move |g| {
        let h = health_of(g, health);
        let t = topology_of(g);
        (0..g.units).map(move |k| api::Device {
            id: unit_id(g, k),
            health: h.into(),
            topology: t.clone(),
        })
    })
}

/// What `ListAndWatchResponse { devices }.encoded_len()` is, one device at a time (so that a
/// list too long to send need not be held), stopping once past `limit`: each device is field 1,
/// length-delimited (a 1-byte key, the length as a varint, the device).
fn encoded_list_len(devices: impl Iterator<Item = api::Device>, limit: usize) -> usize {
    use prost::Message;
    let mut n = 0;
    for d in devices {
        let len = d.encoded_len();
        n += 1 + prost::length_delimiter_len(len) + len;
        if n > limit {
            break;
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::{Gpu, Link, Memory, PcieLevel};

    /// `n` GPUs of `memory` bytes on NUMA node 1, PCIe only.
    fn node(n: usize, memory: u64, unit: u64) -> Inventory {
        let gpus = (0..n)
            .map(|i| {
                let mut g = Gpu::new(i);
                g.uuid = Some(format!("GPU-{i:08x}-0000-0000-0000-000000000000"));
                g.memory = Some(Memory {
                    total: memory,
                    free: memory,
                });
                g.numa_node = Some(1);
                g
            })
            .collect();
        let links = vec![vec![Link::pcie(PcieLevel::Single); n]; n];
        Inventory::new(Topology::new(gpus, links, 16.0).unwrap(), unit).unwrap()
    }

    /// list_len is prost's encoded_len of the ListAndWatchResponse ListAndWatch sends, with
    /// every device Unhealthy, counted without building the list; it stops past its limit.
    #[test]
    fn list_len_is_the_encoded_len_of_the_response_at_its_longest() {
        use prost::Message;
        let inv = node(3, 4 << 30, 64 << 20);
        let sick: HealthMap = inv.gpus().iter().map(|g| (g.uuid.clone(), false)).collect();
        for (memory, devices) in [
            (true, inv.memory_devices(&sick)),
            (false, inv.gpu_devices(&sick)),
        ] {
            let want = api::ListAndWatchResponse {
                devices: devices.clone(),
            }
            .encoded_len();
            assert_eq!(inv.list_len(memory, usize::MAX), want, "memory: {memory}");
            let healthy = api::ListAndWatchResponse {
                devices: devices
                    .into_iter()
                    .map(|d| api::Device {
                        health: api::HEALTHY.into(),
                        ..d
                    })
                    .collect(),
            };
            assert!(healthy.encoded_len() < want, "Unhealthy is the longest");
        }
        let partial = inv.list_len(true, 1000);
        assert!(partial > 1000 && partial < 1200, "{partial}");
    }

    /// 8 GPUs of 16 GiB (a DGX-1) in 1 MiB units: a ListAndWatch response over 4 MiB, refused
    /// with the smallest unit that fits, and that unit does fit while one MiB less does not.
    #[test]
    fn a_memory_unit_whose_list_exceeds_kubelets_4_mib_is_refused_with_the_smallest_that_fits() {
        let max = api::KUBELET_MAX_MESSAGE;
        let cfg = |unit: &str| {
            crate::config::Config::parse(&format!("[resources]\nmemory_unit = {unit:?}")).unwrap()
        };
        let mib = node(8, 16 << 30, 1 << 20);
        assert!(mib.list_len(true, usize::MAX) > max);
        let e = check_list_sizes(&cfg("1Mi"), &mib).unwrap_err();
        let best = mib.smallest_unit_within(max).unwrap();
        assert!(best > 1);
        assert!(
            e.starts_with("resources.memory_unit = \"1Mi\": the ListAndWatch response for cuvisor.io/gpu-memory (131072 memory units on 8 GPU(s)) would be ")
                && e.contains("over the 4194304 bytes (4 MiB)")
                && e.ends_with(&format!("the smallest memory_unit that fits is \"{best}Mi\"")),
            "{e}"
        );
        let at = |m: u64| node(8, 16 << 30, m << 20);
        assert!(at(best).list_len(true, max) <= max);
        assert!(at(best - 1).list_len(true, max) > max);
        let unit = format!("{best}Mi");
        assert_eq!(check_list_sizes(&cfg(&unit), &at(best)), Ok(()));
        // Not advertising memory units: nothing to check.
        let mut no_memory = cfg("1Mi");
        no_memory.resources.gpu_memory.clear();
        assert_eq!(check_list_sizes(&no_memory, &mib), Ok(()));
        // The default, 1Gi: far below the limit.
        assert_eq!(
            check_list_sizes(&cfg("1Gi"), &node(8, 16 << 30, 1 << 30)),
            Ok(())
        );
    }

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
