//! `cuvisor sim fault ...`: faults injected into the simulator's shared state, which every process
//! on the simulator (libcuda, NVML, the device plugin) sees at once.
//!
//! An NVLink joins two ends; taking one down takes both down (the link to a peer GPU shows as
//! inactive on both GPUs, as a failed cable does). A link to an NVSwitch has one GPU end.

use crate::args::{FaultCommand, Target};
use crate::machine;
use crate::{Failure, Result};
use cuvisor_sim::model::{LinkPeer, Model};
use cuvisor_sim::state::Shared;
use std::sync::atomic::Ordering::{AcqRel, Acquire, Release};

pub fn run(target: &Target, cmd: &FaultCommand) -> Result<String> {
    let model = machine::sim_model(target)?;
    check(&model, cmd)?;
    let path = machine::state_path(target, &model);
    let shared = Shared::attach_at(&model, &path).map_err(Failure::Runtime)?;
    Ok(apply(&model, &shared, cmd))
}

/// Refuses GPUs and links the model does not have, before the state file is touched.
fn check(model: &Model, cmd: &FaultCommand) -> Result<()> {
    match *cmd {
        FaultCommand::Xid { gpu, .. } | FaultCommand::FailAlloc { gpu, .. } => {
            machine::check_gpu(model, gpu)
        }
        FaultCommand::Clear { gpu } => gpu.map_or(Ok(()), |g| machine::check_gpu(model, g)),
        FaultCommand::NvlinkDown { gpu, link } | FaultCommand::NvlinkUp { gpu, link } => {
            machine::check_gpu(model, gpu)?;
            let n = model.devices[gpu].links.len();
            if link < n {
                return Ok(());
            }
            let which = format!("GPU {gpu} of the {} simulator", model.name);
            Err(Failure::Usage(match n {
                0 => format!("GPU {gpu} has no NVLink {link} ({which} has no NVLinks)"),
                1 => format!("GPU {gpu} has no NVLink {link} ({which} has only NVLink 0)"),
                n => format!(
                    "GPU {gpu} has no NVLink {link} ({which} has NVLinks 0-{})",
                    n - 1
                ),
            }))
        }
    }
}

/// Both ends of link `link` of GPU `gpu`: (gpu, link) and, for a link to a peer GPU, the peer's
/// matching link. Two GPUs joined by k links pair their links in order: the i-th link of A to B is
/// the i-th link of B to A.
pub fn link_ends(model: &Model, gpu: usize, link: usize) -> Vec<(usize, usize)> {
    let mut ends = vec![(gpu, link)];
    if let Some(&LinkPeer::Gpu(peer)) = model.devices[gpu].links.get(link) {
        let nth = model.devices[gpu].links[..link]
            .iter()
            .filter(|&p| *p == LinkPeer::Gpu(peer))
            .count();
        let far = model.devices[peer]
            .links
            .iter()
            .enumerate()
            .filter(|(_, p)| **p == LinkPeer::Gpu(gpu))
            .nth(nth);
        if let Some((far_link, _)) = far {
            ends.push((peer, far_link));
        }
    }
    ends
}

fn describe_far_end(model: &Model, gpu: usize, link: usize) -> String {
    match (
        link_ends(model, gpu, link).get(1),
        &model.devices[gpu].links[link],
    ) {
        (Some((peer, far)), _) => format!(" (and its other end, GPU {peer} NVLink {far})"),
        (None, LinkPeer::Switch(s)) => format!(" (it goes to NVSwitch {s})"),
        (None, _) => String::new(),
    }
}

fn set_link(model: &Model, shared: &Shared, gpu: usize, link: usize, down: bool) {
    for (g, l) in link_ends(model, gpu, link) {
        let bits = &shared.device(g).nvlink_down;
        if down {
            bits.fetch_or(1 << l, AcqRel);
        } else {
            bits.fetch_and(!(1 << l), AcqRel);
        }
    }
}

fn apply(model: &Model, shared: &Shared, cmd: &FaultCommand) -> String {
    match *cmd {
        FaultCommand::Xid { gpu, code } => {
            let seq = shared.raise_xid(gpu, code);
            format!("GPU {gpu}: raised XID {code} (event {seq} on this GPU)\n")
        }
        FaultCommand::NvlinkDown { gpu, link } => {
            set_link(model, shared, gpu, link, true);
            format!(
                "GPU {gpu} NVLink {link} is down{}\n",
                describe_far_end(model, gpu, link)
            )
        }
        FaultCommand::NvlinkUp { gpu, link } => {
            set_link(model, shared, gpu, link, false);
            format!(
                "GPU {gpu} NVLink {link} is up{}\n",
                describe_far_end(model, gpu, link)
            )
        }
        FaultCommand::FailAlloc { gpu, count } => {
            shared.device(gpu).fail_allocs.store(count, Release);
            match count {
                0 => format!("GPU {gpu}: no allocations will be made to fail\n"),
                1 => format!("GPU {gpu}: the next allocation will fail\n"),
                n => format!("GPU {gpu}: the next {n} allocations will fail\n"),
            }
        }
        FaultCommand::Clear { gpu } => {
            let gpus: Vec<usize> = match gpu {
                Some(g) => vec![g],
                None => (0..model.devices.len()).collect(),
            };
            let mut out = String::new();
            for g in gpus {
                let dev = shared.device(g);
                dev.fail_allocs.store(0, Release);
                for link in 0..model.devices[g].links.len() {
                    if dev.nvlink_down.load(Acquire) >> link & 1 == 1 {
                        set_link(model, shared, g, link, false);
                    }
                }
                dev.nvlink_down.store(0, Release);
                out.push_str(&format!(
                    "GPU {g}: faults cleared (NVLinks up, no allocations made to fail; \
                     XID events already raised stay in the history)\n"
                ));
            }
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cuvisor_sim::model::preset;

    #[test]
    fn a_peer_link_has_two_ends_and_a_switch_link_one() {
        let m = preset("dgx1-v100").unwrap();
        // GPU 0's links: 0 -> GPU 1, 1 -> GPU 2, 2 and 3 -> GPU 3, 4 and 5 -> GPU 4.
        assert_eq!(link_ends(&m, 0, 0), vec![(0, 0), (1, 0)]);
        assert_eq!(link_ends(&m, 0, 2), vec![(0, 2), (3, 0)]);
        assert_eq!(link_ends(&m, 0, 3), vec![(0, 3), (3, 1)]);
        for g in 0..8 {
            for l in 0..m.devices[g].links.len() {
                let ends = link_ends(&m, g, l);
                let (p, pl) = ends[1];
                assert_eq!(link_ends(&m, p, pl), vec![(p, pl), (g, l)], "symmetric");
            }
        }
        let a = preset("dgx-a100").unwrap();
        assert_eq!(link_ends(&a, 5, 11), vec![(5, 11)]);
    }

    #[test]
    fn bad_gpus_and_links_are_refused_with_the_range() {
        let m = preset("dgx1-v100").unwrap();
        let msg = |r: Result<()>| match r {
            Err(Failure::Usage(m)) => m,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            msg(check(&m, &FaultCommand::Xid { gpu: 9, code: 79 })),
            "GPU 9 does not exist (the dgx1-v100 simulator has GPUs 0-7)"
        );
        assert_eq!(
            msg(check(&m, &FaultCommand::NvlinkDown { gpu: 2, link: 6 })),
            "GPU 2 has no NVLink 6 (GPU 2 of the dgx1-v100 simulator has NVLinks 0-5)"
        );
        let p = preset("pcie-8").unwrap();
        assert_eq!(
            msg(check(&p, &FaultCommand::NvlinkUp { gpu: 0, link: 0 })),
            "GPU 0 has no NVLink 0 (GPU 0 of the pcie-8 simulator has no NVLinks)"
        );
        assert!(check(&m, &FaultCommand::Clear { gpu: None }).is_ok());
    }
}
