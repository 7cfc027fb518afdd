//! The group score: the seeds' four weighted terms, made precise.
//!
//! For a group S of k GPUs (k >= 1), with P = k(k-1)/2 pairs:
//!
//! - **bandwidth** B = mean over the pairs of S of the pair bandwidth
//!   ([`super::Topology::bandwidth_gbps`], rounded to whole MB/s), divided by the best pair
//!   bandwidth anywhere on the machine. 1 for a single GPU. In 0..=1.
//! - **topology structure** T, from the NVLink graph restricted to S (two GPUs adjacent when
//!   joined by at least one NVLink, NVSwitch paths included): fully connected 1, otherwise a
//!   ring (a Hamiltonian cycle through all of S, k >= 4) 2/3, otherwise connected (a spanning
//!   tree) 1/3, otherwise (disconnected, or no NVLink at all) 0. A single GPU, or a pair joined
//!   by NVLink, is fully connected.
//! - **memory balance** M = 1 - (max - min) over S of each GPU's free-memory fraction
//!   (free / total; 1 when unknown). 1 for a single GPU.
//! - **fault-domain spread** D = (distinct fault domains in S) / min(k, fault domains on the
//!   machine). 1 when S is spread as widely as the machine allows. With the default domains (one
//!   per board, i.e. per GPU on every SXM machine) D is 1 for every group; it bites when an
//!   operator groups GPUs into domains ([`super::Topology::set_fault_domains`]).
//!
//! total = (wB·B + wT·T + wM·M + wD·D) / (wB + wT + wM + wD), in 0..=1, with the weights of
//! [`Weights`] (default 0.5 / 0.3 / 0.1 / 0.1, the seeds').
//!
//! The score depends only on the group (and the machine's current free memory), never on which
//! other GPUs are free, so scores of different requests compare (the metrics histogram relies on
//! this).

use super::objective::Policy;
use serde::{Deserialize, Serialize};

/// The `[topology]` section: which policy picks GPUs, and the weights of the four score terms
/// (the score of the `weighted` policy, and the topology score the metrics report under either
/// policy). Weights: any non-negative finite values with a positive sum; the score divides by
/// the sum. Deserializes from e.g. `{"policy": "weighted", "bandwidth": 0.6, "topology": 0.4}`
/// (missing fields take their defaults; the default policy is `allreduce`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Weights {
    pub policy: Policy,
    pub bandwidth: f64,
    pub topology: f64,
    pub balance: f64,
    pub domain: f64,
}

impl Default for Weights {
    fn default() -> Weights {
        Weights {
            policy: Policy::AllReduce,
            bandwidth: 0.5,
            topology: 0.3,
            balance: 0.1,
            domain: 0.1,
        }
    }
}

impl Weights {
    /// The seeds' weights under the `weighted` policy.
    pub fn weighted() -> Weights {
        Weights {
            policy: Policy::Weighted,
            ..Weights::default()
        }
    }

    /// Checks the weights; the reason when they are unusable.
    pub fn validate(&self) -> Result<(), String> {
        let all = [
            ("bandwidth", self.bandwidth),
            ("topology", self.topology),
            ("balance", self.balance),
            ("domain", self.domain),
        ];
        for (name, w) in all {
            if !w.is_finite() || w < 0.0 {
                return Err(format!("weight {name} = {w} must be a finite number >= 0"));
            }
        }
        if all.iter().map(|(_, w)| w).sum::<f64>() <= 0.0 {
            return Err("the weights add up to 0; at least one must be positive".into());
        }
        Ok(())
    }

    /// The weights divided by their sum, in term order (bandwidth, topology, balance, domain).
    pub(crate) fn normalised(&self) -> [f64; 4] {
        let sum = self.bandwidth + self.topology + self.balance + self.domain;
        [
            self.bandwidth / sum,
            self.topology / sum,
            self.balance / sum,
            self.domain / sum,
        ]
    }
}

/// The shape of a group's NVLink graph, best first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Structure {
    FullyConnected,
    Ring,
    Tree,
    Disconnected,
}

impl Structure {
    /// The structure term T.
    pub fn value(self) -> f64 {
        match self {
            Structure::FullyConnected => 1.0,
            Structure::Ring => 2.0 / 3.0,
            Structure::Tree => 1.0 / 3.0,
            Structure::Disconnected => 0.0,
        }
    }
}

/// A group's score and its parts (each term in 0..=1, before weighting).
#[derive(Clone, Debug, PartialEq)]
pub struct Score {
    /// The weighted total, 0..=1.
    pub total: f64,
    pub bandwidth: f64,
    pub structure: Structure,
    pub balance: f64,
    pub domain: f64,
    /// Mean and minimum pair bandwidth in GB/s (0 for a single GPU), for display.
    pub mean_pair_gbps: f64,
    pub min_pair_gbps: f64,
}

/// The exact ingredients of a score, computed the same way by the allocator's search and by
/// [`super::Allocator::score`], so that both get bit-identical totals for the same group.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ingredients {
    pub k: usize,
    /// Sum of the pair bandwidths in MB/s.
    pub pair_mbps: u64,
    pub structure: Structure,
    pub min_free: f64,
    pub max_free: f64,
    pub domains: u32,
}

pub(crate) struct Terms {
    pub bandwidth: f64,
    pub balance: f64,
    pub domain: f64,
    pub total: f64,
}

/// Combines ingredients into the four terms and the total. `best_pair_mbps` is the machine's
/// best pair bandwidth (>= 1), `machine_domains` its number of fault domains (>= 1).
pub(crate) fn combine(
    w: &[f64; 4],
    x: &Ingredients,
    best_pair_mbps: u64,
    machine_domains: u32,
) -> Terms {
    let pairs = (x.k * x.k.saturating_sub(1) / 2) as u64;
    let bandwidth = if pairs == 0 {
        1.0
    } else {
        x.pair_mbps as f64 / (pairs as f64 * best_pair_mbps as f64)
    };
    let balance = if x.k <= 1 {
        1.0
    } else {
        1.0 - (x.max_free - x.min_free)
    };
    let denom = (x.k as u32).min(machine_domains).max(1);
    let domain = x.domains.min(denom) as f64 / denom as f64;
    let total = w[0] * bandwidth + w[1] * x.structure.value() + w[2] * balance + w[3] * domain;
    Terms {
        bandwidth,
        balance,
        domain,
        total,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_default_validate_and_deserialize() {
        let w = Weights::default();
        assert_eq!(w.normalised(), [0.5, 0.3, 0.1, 0.1]);
        assert!(w.validate().is_ok());
        assert_eq!(w.policy, Policy::AllReduce);
        let p: Weights = serde_json::from_str(r#"{"policy": "weighted"}"#).unwrap();
        assert_eq!(p, Weights::weighted());
        assert!(serde_json::from_str::<Weights>(r#"{"policy": "rings"}"#).is_err());
        let w: Weights = serde_json::from_str(r#"{"bandwidth": 2, "topology": 2}"#).unwrap();
        let want = [2.0 / 4.2, 2.0 / 4.2, 0.1 / 4.2, 0.1 / 4.2];
        for (got, want) in w.normalised().iter().zip(want) {
            assert!((got - want).abs() < 1e-15, "{got} vs {want}");
        }
        assert!(serde_json::from_str::<Weights>(r#"{"bandwith": 1}"#)
            .unwrap_err()
            .to_string()
            .contains("unknown field"));
        let bad = Weights {
            balance: -1.0,
            ..Weights::default()
        };
        assert!(bad.validate().unwrap_err().contains("balance"));
        let zero = Weights {
            policy: Policy::Weighted,
            bandwidth: 0.0,
            topology: 0.0,
            balance: 0.0,
            domain: 0.0,
        };
        assert!(zero.validate().unwrap_err().contains("add up to 0"));
        let nan = Weights {
            topology: f64::NAN,
            ..Weights::default()
        };
        assert!(nan.validate().is_err());
    }

    #[test]
    fn combine_terms() {
        let w = Weights::default().normalised();
        let x = Ingredients {
            k: 4,
            pair_mbps: 6 * 25_000,
            structure: Structure::Ring,
            min_free: 0.5,
            max_free: 1.0,
            domains: 2,
        };
        let t = combine(&w, &x, 50_000, 8);
        assert_eq!(t.bandwidth, 0.5);
        assert_eq!(t.balance, 0.5);
        assert_eq!(t.domain, 0.5);
        let want = 0.5 * 0.5 + 0.3 * (2.0 / 3.0) + 0.1 * 0.5 + 0.1 * 0.5;
        assert!((t.total - want).abs() < 1e-15);
        let single = Ingredients {
            k: 1,
            pair_mbps: 0,
            structure: Structure::FullyConnected,
            min_free: 0.2,
            max_free: 0.2,
            domains: 1,
        };
        assert!((combine(&w, &single, 50_000, 8).total - 1.0).abs() < 1e-15);
    }
}
