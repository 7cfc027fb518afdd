//! The simulated GPU: machine model, shared cross-process state, device address space.
//!
//! Both simulated libraries (`libcuda.so.1` in crates/sim/cuda and `libnvidia-ml.so.1` in
//! crates/sim/nvml) and the CLI's fault-injection verbs build on this crate. It exports no C
//! symbols itself.

pub mod arena;
pub mod model;
pub mod state;

use std::sync::OnceLock;

/// The machine model, its interconnect and its mapped shared state, as one process sees them.
pub struct Sim {
    pub model: model::Model,
    /// `model.fabric()`, built once: what copies are timed over and peer answers come from.
    pub fabric: cuvisor_fabric::Fabric,
    pub shared: state::Shared,
}

impl Sim {
    /// Loads the model from `CUVISOR_SIM` and attaches to its shared state.
    pub fn from_env() -> Result<Sim, String> {
        let model = model::Model::from_env()?;
        let shared = state::Shared::attach(&model)?;
        Ok(Sim {
            fabric: model.fabric(),
            model,
            shared,
        })
    }

    /// The process-wide instance, made on first use. An error is remembered and repeated.
    pub fn global() -> Result<&'static Sim, &'static str> {
        static SIM: OnceLock<Result<Sim, String>> = OnceLock::new();
        SIM.get_or_init(Sim::from_env)
            .as_ref()
            .map_err(|e| e.as_str())
    }
}
