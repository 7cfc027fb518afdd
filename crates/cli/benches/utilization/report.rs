//! What the bench reads from one job's `cuvisor sim job --json` object.

use serde_json::Value;

/// One finished job.
#[derive(Clone, Debug, Default)]
pub struct JobReport {
    pub steps: u64,
    /// nccl-tests' bus bandwidth of the job's all-reduces, GB/s: measured, modelled.
    pub busbw: (f64, f64),
    /// The seeds' communication efficiency, GB/s: measured, modelled.
    pub efficiency: (f64, f64),
    /// The seeds' topology loss rate, 0..=1: measured, modelled.
    pub loss: (f64, f64),
    /// Steps whose all-reduce the host issued later than it could start: these measured the
    /// host (issuing the copies' driver calls) as well as the links.
    pub host_bound_steps: u64,
}

/// The number at the first of `paths` (dot-separated keys) that the object has.
fn number(v: &Value, paths: &[&str]) -> Option<f64> {
    paths.iter().find_map(|p| {
        p.split('.')
            .try_fold(v, |v, key| v.get(key))
            .and_then(Value::as_f64)
    })
}

impl JobReport {
    /// Parses the job's JSON (its whole stdout); the reason when a field is missing.
    pub fn parse(text: &str) -> Result<JobReport, String> {
        let v: Value = serde_json::from_str(text.trim())
            .map_err(|e| format!("the job's output is not one JSON object: {e}"))?;
        let need = |what: &str, paths: &[&str]| {
            number(&v, paths).ok_or_else(|| format!("the job's JSON has no {what} ({paths:?})"))
        };
        let pair = |what: &str, measured: &[&str], model: &[&str]| -> Result<(f64, f64), String> {
            Ok((need(what, measured)?, need(what, model)?))
        };
        Ok(JobReport {
            steps: need("step count", &["steps"])? as u64,
            busbw: pair(
                "bus bandwidth",
                &["measured.busbw_gbps"],
                &["model.busbw_gbps"],
            )?,
            efficiency: pair(
                "communication efficiency",
                &["measured.efficiency_gbps"],
                &["model.efficiency_gbps"],
            )?,
            loss: pair(
                "topology loss",
                &["measured.topology_loss"],
                &["model.topology_loss"],
            )?,
            host_bound_steps: need("host-bound step count", &["host_bound_steps"])? as u64,
        })
    }
}
