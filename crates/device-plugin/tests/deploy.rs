//! deploy/ agrees with the code: the ConfigMap's config.toml is a valid plugin configuration,
//! and every metric the Grafana dashboard queries is one the endpoint serves.

use cuvisor_device_plugin::config::Config;
use cuvisor_device_plugin::metrics::{render, Histogram};
use std::path::Path;

fn deploy(p: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../deploy")
        .join(p);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn the_configmap_holds_a_valid_config() {
    let text = deploy("configmap.yaml");
    let block: String = text
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("config.toml: |"))
        .skip(1)
        .take_while(|l| l.is_empty() || l.starts_with("    "))
        .map(|l| format!("{}\n", l.strip_prefix("    ").unwrap_or(l)))
        .collect();
    assert!(block.contains("[health]"), "{block}");
    let cfg = Config::parse(&block).unwrap_or_else(|e| panic!("{e}\n{block}"));
    cfg.validate().unwrap();
    assert_eq!(cfg.resources.memory_unit, "1Gi");
    // The ConfigMap spells out the defaults of health and PodResources.
    assert_eq!(cfg.health, Config::default().health);
    assert_eq!(cfg.pod_resources, Config::default().pod_resources);
    // And of the ledger directories' tmpfs, which the DaemonSet's privileges and
    // Bidirectional propagation make possible.
    assert_eq!(cfg.ledger_dir, Config::default().ledger_dir);
    assert!(cfg.ledger_dir.mounts());
}

#[test]
fn the_dashboard_queries_served_metrics() {
    let dash = deploy("grafana/cuvisor-dashboard.json");
    let v: serde_json::Value = serde_json::from_str(&dash).unwrap();
    let served = render(&[], &Default::default(), &Histogram::default(), None);
    let mut n = 0;
    for p in v["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().unwrap() {
            let expr = t["expr"].as_str().unwrap();
            for word in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
                if word.starts_with("cuvisor_") {
                    let family = ["_bucket", "_sum", "_count"]
                        .iter()
                        .find_map(|s| word.strip_suffix(s))
                        .unwrap_or(word);
                    assert!(
                        served.contains(&format!("# TYPE {family} ")),
                        "the dashboard queries {word}, which is not served"
                    );
                    n += 1;
                }
            }
        }
    }
    assert!(n >= 10);
}
