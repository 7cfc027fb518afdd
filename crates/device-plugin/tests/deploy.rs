//! deploy/ agrees with the code: deploy/config.toml (the ConfigMap's content) is a valid plugin
//! configuration, and every metric the Grafana dashboard queries is one the endpoint serves.
//! (The manifests themselves are rendered and checked by scripts/check-deploy.sh, in .ci/run.)

use cuvisor_device_plugin::config::Config;
use cuvisor_device_plugin::metrics::{render, TopologyFigures};
use std::path::Path;

fn deploy(p: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../deploy")
        .join(p);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn the_deployed_config_is_valid() {
    // deploy/kustomization.yaml makes the ConfigMap from this file (configMapGenerator).
    let text = deploy("config.toml");
    let cfg = Config::parse(&text).unwrap_or_else(|e| panic!("deploy/config.toml: {e}\n{text}"));
    cfg.validate().unwrap();
    assert_eq!(cfg.resources.memory_unit, "1Gi");
    // It spells out the defaults of health and PodResources.
    assert_eq!(cfg.health, Config::default().health);
    assert_eq!(cfg.pod_resources, Config::default().pod_resources);
    // And of the ledger directories' tmpfs, which the DaemonSet's privileges and
    // Bidirectional propagation (on <state_root>/allocations) make possible.
    assert_eq!(cfg.ledger_dir, Config::default().ledger_dir);
    assert!(cfg.ledger_dir.mounts());
    // The library Allocate mounts lives under the state root, which the DaemonSet mounts from
    // the node.
    assert!(
        cfg.host.library.starts_with(&cfg.state_root),
        "{:?}",
        cfg.host.library
    );
}

#[test]
fn the_unprivileged_component_only_turns_the_ledger_tmpfs_off() {
    // components/unprivileged replaces the ConfigMap with its own config.toml: the base's, with
    // `[ledger_dir] mount = "none"` (no privilege, no Bidirectional propagation: no tmpfs). Any
    // other difference would be drift between the two files.
    let base = deploy("config.toml");
    let comp = deploy("components/unprivileged/config.toml");
    let (b, c): (Vec<_>, Vec<_>) = (base.lines().collect(), comp.lines().collect());
    assert_eq!(
        b.len(),
        c.len(),
        "the two config.toml files differ in length"
    );
    let diff: Vec<_> = b.iter().zip(&c).filter(|(x, y)| x != y).collect();
    assert_eq!(diff, [(&"mount = \"tmpfs\"", &"mount = \"none\"")]);
    let cfg = Config::parse(&comp).unwrap_or_else(|e| panic!("unprivileged config.toml: {e}"));
    assert!(!cfg.ledger_dir.mounts());
}

/// The metric families `text` names (`cuvisor_...`, histogram suffixes dropped), each checked
/// to be served; how many names there were.
fn check_served(text: &str, what: &str) -> usize {
    let served = render(&[], &Default::default(), &TopologyFigures::default(), None);
    let mut n = 0;
    for word in text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
        if word.starts_with("cuvisor_") {
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| word.strip_suffix(s))
                .unwrap_or(word);
            assert!(
                served.contains(&format!("# TYPE {family} ")),
                "{what} queries {word}, which is not served"
            );
            n += 1;
        }
    }
    n
}

/// docs/metrics.md's PromQL and alert rule name only metrics the endpoint serves.
#[test]
fn the_documented_promql_queries_served_metrics() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/metrics.md");
    let doc = std::fs::read_to_string(&path).unwrap();
    let mut n = 0;
    let mut block: Option<String> = None;
    for line in doc.lines() {
        match (&mut block, line.trim_start()) {
            (None, l) if l == "```promql" || l == "```yaml" => block = Some(String::new()),
            (Some(b), "```") => {
                n += check_served(b, "docs/metrics.md");
                block = None;
            }
            (Some(b), l) => {
                b.push_str(l);
                b.push('\n');
            }
            _ => {}
        }
    }
    assert!(n >= 10, "{n} metric names in docs/metrics.md's queries");
}

#[test]
fn the_dashboard_queries_served_metrics() {
    let dash = deploy("grafana/cuvisor-dashboard.json");
    let v: serde_json::Value = serde_json::from_str(&dash).unwrap();
    let mut n = 0;
    let mut exprs = Vec::new();
    for p in v["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().unwrap() {
            let expr = t["expr"].as_str().unwrap();
            n += check_served(expr, "the dashboard");
            exprs.push(expr.to_string());
        }
    }
    assert!(n >= 10);
    // The topology loss has its panels: per allocation over time, and the histogram's
    // quantiles.
    for want in [
        "cuvisor_allocation_topology_loss_ratio",
        "histogram_quantile(0.9, sum by (le) (rate(cuvisor_allocation_topology_loss_bucket[1h])))",
        "cuvisor_allocation_comm_efficiency_bytes_per_second",
    ] {
        assert!(exprs.iter().any(|e| e == want), "no panel queries {want}");
    }
}
