//! The `nvidia-smi topo -m` reader on fixtures: the simulator presets' matrices (rendered by
//! `Model::topo_matrix()`, checked current here; `CUVISOR_UPDATE_FIXTURES=1` rewrites them) and
//! hand-written outputs of real machines and old drivers; then malformed input.

use cuvisor_device_plugin::topology::{
    parse_topo_matrix, Allocator, ParseErrorKind, PcieLevel, Topology, Weights,
};
use cuvisor_sim::model::{self, DGX1_LINKS};
use std::path::PathBuf;

fn fixture_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn fixture(name: &str) -> String {
    std::fs::read_to_string(fixture_path(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn parse(name: &str) -> Topology {
    parse_topo_matrix(&fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn nv(t: &Topology, a: usize, b: usize) -> u32 {
    t.link(a, b).and_then(|l| l.nvlink).map_or(0, |nv| nv.links)
}

const ALL: &[&str] = &[
    "sim-single.txt",
    "sim-dgx1-v100.txt",
    "sim-dgx-a100.txt",
    "sim-h200.txt",
    "sim-pcie-8.txt",
    "dgx1-v100-nics.txt",
    "dgx1-p100-soc.txt",
    "k80-path-legend.txt",
    "dgx2-nv6.txt",
    "dgx-a100-nics.txt",
];

#[test]
fn simulator_fixtures_are_current() {
    let update = std::env::var_os("CUVISOR_UPDATE_FIXTURES").is_some();
    for preset in model::PRESETS {
        let rendered = model::preset(preset).unwrap().topo_matrix();
        let path = fixture_path(&format!("sim-{preset}.txt"));
        if update {
            std::fs::write(&path, &rendered).unwrap();
        }
        let stored = std::fs::read_to_string(&path).unwrap_or_default();
        assert_eq!(
            stored,
            rendered,
            "{} is stale: rerun with CUVISOR_UPDATE_FIXTURES=1",
            path.display()
        );
    }
}

#[test]
fn every_fixture_parses_and_round_trips() {
    for name in ALL {
        let t = parse(name);
        assert!(!t.is_empty(), "{name}");
        let again = parse_topo_matrix(&t.to_topo_matrix()).unwrap();
        assert_eq!(again, t, "{name}: parse(render(t)) != t");
        // Every fixture is small enough to allocate on.
        let al = Allocator::new(t.clone()).unwrap();
        let all: Vec<usize> = (0..t.len()).collect();
        let pick = al
            .preferred(&all, &[], t.len().min(2), &Weights::default())
            .unwrap();
        assert_eq!(pick.len(), t.len().min(2), "{name}");
    }
}

#[test]
fn simulator_presets_read_back_as_modelled() {
    for preset in ["dgx1-v100", "dgx-a100", "h200", "pcie-8"] {
        let m = model::preset(preset).unwrap();
        let t = parse(&format!("sim-{preset}.txt"));
        assert_eq!(t.len(), m.devices.len());
        for a in 0..t.len() {
            assert_eq!(t.gpus()[a].numa_node, Some(m.devices[a].numa_node));
            assert_eq!(
                t.gpus()[a].cpu_affinity.as_deref(),
                Some(model::cpu_affinity(m.devices[a].numa_node).as_str())
            );
            for b in 0..t.len() {
                if a == b {
                    continue;
                }
                assert_eq!(
                    nv(&t, a, b),
                    m.nvlink_bandwidth_links(a, b),
                    "{preset} {a}-{b}"
                );
                let link = t.link(a, b).unwrap();
                if link.nvlink.is_none() {
                    assert_eq!(
                        link.pcie.map(|l| l.legend()),
                        Some(m.pcie_level(a, b).legend())
                    );
                }
            }
        }
    }
    let a100 = parse("sim-dgx-a100.txt");
    let l = a100.link(0, 7).unwrap().nvlink.unwrap();
    assert!(l.via_switch, "7 x NV12 is more than a GPU has: NVSwitch");
    assert_eq!(a100.bandwidth_gbps(0, 7), 12.0 * 25.0);
    let pcie = parse("sim-pcie-8.txt");
    let switches: Vec<_> = pcie.gpus().iter().map(|g| g.pcie_switch).collect();
    let roots: Vec<_> = pcie.gpus().iter().map(|g| g.pcie_root).collect();
    assert_eq!(switches, [0, 0, 2, 2, 4, 4, 6, 6].map(Some));
    assert_eq!(roots, [0, 0, 0, 0, 4, 4, 4, 4].map(Some));
    let single = parse("sim-single.txt");
    assert_eq!(single.len(), 1);
}

#[test]
fn dgx1_with_nics_is_the_cube_mesh() {
    let t = parse("dgx1-v100-nics.txt");
    assert_eq!(t.len(), 8, "NIC rows and columns are not GPUs");
    for a in 0..8 {
        for b in 0..8 {
            let want = DGX1_LINKS
                .iter()
                .find(|&&(x, y, _)| (x, y) == (a, b) || (y, x) == (a, b))
                .map_or(0, |l| l.2);
            if a != b {
                assert_eq!(nv(&t, a, b), want, "{a}-{b}");
            }
        }
        let g = &t.gpus()[a];
        assert_eq!(g.numa_node, Some(a as u32 / 4));
        let cpus = if a < 4 { "0-19,40-59" } else { "20-39,60-79" };
        assert_eq!(g.cpu_affinity.as_deref(), Some(cpus));
        // NV# hides the PCIe path of those pairs.
        assert_eq!(g.pcie_switch, None);
    }
    assert!(!t.link(0, 3).unwrap().nvlink.unwrap().via_switch);
    assert_eq!(t.link(0, 5).unwrap().pcie, Some(PcieLevel::System));
    assert_eq!(t.link(0, 3).unwrap().pcie, None);
    assert_eq!(t.bandwidth_gbps(0, 3), 50.0);
    // Same links as the simulator's DGX-1.
    let sim = parse("sim-dgx1-v100.txt");
    for a in 0..8 {
        for b in 0..8 {
            assert_eq!(nv(&t, a, b), nv(&sim, a, b));
        }
    }
}

#[test]
fn old_legends() {
    // DGX-1 with P100: SOC for SYS, no NUMA column; four NVLinks per GPU.
    let t = parse("dgx1-p100-soc.txt");
    assert_eq!(t.len(), 8);
    for a in 0..8 {
        let links: u32 = (0..8).filter(|&b| b != a).map(|b| nv(&t, a, b)).sum();
        assert_eq!(links, 4, "GPU{a}");
        assert_eq!(t.gpus()[a].numa_node, None);
    }
    assert_eq!(t.link(0, 5).unwrap().pcie, Some(PcieLevel::System));
    // Two K80 boards on one socket: the oldest legend ("Path traverses ...").
    let k = parse("k80-path-legend.txt");
    assert_eq!(k.len(), 4);
    assert_eq!(k.link(0, 1).unwrap().pcie, Some(PcieLevel::Single));
    assert_eq!(k.link(1, 2).unwrap().pcie, Some(PcieLevel::HostBridge));
    let sw: Vec<_> = k.gpus().iter().map(|g| g.pcie_switch).collect();
    assert_eq!(sw, [0, 0, 2, 2].map(Some));
    assert!(k.gpus().iter().all(|g| g.pcie_root == Some(0)));
    assert_eq!(k.gpus()[3].cpu_affinity.as_deref(), Some("0-11"));
}

#[test]
fn nvswitch_boxes() {
    let t = parse("dgx2-nv6.txt");
    assert_eq!(t.len(), 16);
    for a in 0..16 {
        for b in 0..16 {
            if a != b {
                let l = t.link(a, b).unwrap().nvlink.unwrap();
                assert_eq!((l.links, l.via_switch), (6, true));
            }
        }
    }
    assert_eq!(t.gpus()[9].cpu_affinity.as_deref(), Some("24-47,72-95"));
    let a = parse("dgx-a100-nics.txt");
    assert_eq!(a.len(), 8);
    let numa: Vec<_> = a.gpus().iter().map(|g| g.numa_node).collect();
    assert_eq!(numa, [3, 3, 1, 1, 7, 7, 5, 5].map(Some));
    assert!(a.link(2, 5).unwrap().nvlink.unwrap().via_switch);
}

// ---- malformed input -------------------------------------------------------------------------

fn fails(text: &str) -> (Option<usize>, ParseErrorKind, String) {
    let e = parse_topo_matrix(text).unwrap_err();
    let shown = e.to_string();
    (e.line, e.kind, shown)
}

const HEAD: &str = "\tGPU0\tGPU1\tGPU2\tCPU Affinity\tNUMA Affinity\n";

#[test]
fn malformed_input_is_refused_with_the_reason() {
    assert_eq!(fails("").1, ParseErrorKind::Empty);
    assert_eq!(fails("\n  \n").1, ParseErrorKind::Empty);

    let (line, kind, msg) = fails("$ nvidia-smi topo -m\n\tGPU0\n");
    assert_eq!(line, Some(1));
    assert!(matches!(kind, ParseErrorKind::NoHeader { .. }));
    assert!(msg.contains("expected the header"), "{msg}");

    let ok = "GPU0\t X \tNV2\tSYS\t0-15\t0\nGPU1\tNV2\t X \tSYS\t0-15\t0\nGPU2\tSYS\tSYS\t X \t16-31\t1\n";
    assert_eq!(parse_topo_matrix(&format!("{HEAD}{ok}")).unwrap().len(), 3);

    // A short row (a cell missing) names the GPU and the counts.
    let text = format!("{HEAD}GPU0\t X \tNV2\t0-15\t0\nGPU1\tNV2\t X \tSYS\t0-15\t0\n");
    let (line, kind, msg) = fails(&text);
    assert_eq!(line, Some(2));
    assert!(
        matches!(kind, ParseErrorKind::BadCell { gpu: 0, .. }),
        "{kind:?}"
    );
    assert!(msg.contains("line 2") && msg.contains("0-15"), "{msg}");
    let text = format!("{HEAD}GPU0\t X \tNV2\n");
    assert_eq!(
        fails(&text).1,
        ParseErrorKind::ShortRow {
            gpu: 0,
            expected: 3,
            found: 2
        }
    );
    let text = format!("{HEAD}GPU0\t X \tNV2\tSYS\t0-15\t0\textra\n");
    assert!(matches!(
        fails(&text).1,
        ParseErrorKind::LongRow { gpu: 0, .. }
    ));

    // An unknown cell.
    let text = ok.replace("GPU2\tSYS\tSYS", "GPU2\tSYS\tQPI");
    let (line, kind, msg) = fails(&format!("{HEAD}{text}"));
    assert_eq!(line, Some(4));
    assert_eq!(
        kind,
        ParseErrorKind::BadCell {
            gpu: 2,
            column: "GPU1".into(),
            cell: "QPI".into()
        }
    );
    assert!(msg.contains("\"QPI\" is not a link"), "{msg}");
    assert!(matches!(
        fails(&format!("{HEAD}{}", ok.replace("NV2\t X", "NV0\t X"))).1,
        ParseErrorKind::BadCell { .. }
    ));

    // The halves disagree.
    let text = ok.replacen("GPU1\tNV2", "GPU1\tNV1", 1);
    let (_, kind, msg) = fails(&format!("{HEAD}{text}"));
    assert!(
        matches!(kind, ParseErrorKind::Asymmetric { a: 0, b: 1, .. }),
        "{kind:?}"
    );
    assert!(
        msg.contains("GPU0-GPU1 is NV2 but GPU1-GPU0 is NV1"),
        "{msg}"
    );

    // Diagonal and X elsewhere.
    let text = ok.replacen("GPU0\t X ", "GPU0\tPIX", 1);
    assert!(matches!(
        fails(&format!("{HEAD}{text}")).1,
        ParseErrorKind::NotSelf { gpu: 0, .. }
    ));
    let text = ok.replace("SYS\t0-15\t0\nGPU1", "X\t0-15\t0\nGPU1");
    assert!(matches!(
        fails(&format!("{HEAD}{text}")).1,
        ParseErrorKind::SelfElsewhere { a: 0, b: 2 }
    ));

    // Rows missing, twice, or unknown.
    let text: String = ok.lines().take(2).map(|l| format!("{l}\n")).collect();
    assert_eq!(
        fails(&format!("{HEAD}{text}")).1,
        ParseErrorKind::MissingRow { gpu: 2 }
    );
    let first = ok.lines().next().unwrap_or_default();
    assert_eq!(
        fails(&format!("{HEAD}{first}\n{ok}")).1,
        ParseErrorKind::DuplicateRow { gpu: 0 }
    );
    let (line, kind, _) = fails(&format!("{HEAD}{ok}mlx5_0\tPIX\tPIX\tSYS\n"));
    assert_eq!(line, Some(5));
    assert_eq!(
        kind,
        ParseErrorKind::UnknownRow {
            label: "mlx5_0".into()
        }
    );

    // Header problems.
    let (_, kind, msg) =
        fails("\tGPU0\tGPU2\tCPU Affinity\nGPU0\t X \tSYS\t0\nGPU2\tSYS\t X \t0\n");
    assert!(
        matches!(kind, ParseErrorKind::GpuColumns { .. }),
        "{kind:?}"
    );
    assert!(msg.contains("GPU0..GPU<n-1>"), "{msg}");
    let (_, kind, _) = fails("\tGPU0\tCPU Affinity\tPower\nGPU0\t X \t0-3\n");
    assert_eq!(
        kind,
        ParseErrorKind::UnknownColumn {
            name: "Power".into()
        }
    );
    let (_, kind, _) = fails(&format!(
        "{HEAD}{}",
        ok.replace("\t16-31\t1", "\t16-31\tone")
    ));
    assert_eq!(
        kind,
        ParseErrorKind::BadNuma {
            gpu: 2,
            value: "one".into()
        }
    );
}

#[test]
fn spaces_tabs_and_na_values() {
    let text = "        GPU0    GPU1    CPU Affinity    NUMA Affinity   GPU NUMA ID\n\
                GPU0     X      PHB     N/A             N/A             N/A\n\
                GPU1    PHB      X      0-63            0-1             N/A\n\n\
                Legend:\n\n  X    = Self\n";
    let t = parse_topo_matrix(text).unwrap();
    assert_eq!(t.gpus()[0].cpu_affinity, None);
    assert_eq!(t.gpus()[0].numa_node, None);
    assert_eq!(t.gpus()[1].cpu_affinity.as_deref(), Some("0-63"));
    assert_eq!(t.gpus()[1].numa_node, None, "0-1 names no single node");
    assert_eq!(t.link(0, 1).unwrap().pcie, Some(PcieLevel::HostBridge));
}
