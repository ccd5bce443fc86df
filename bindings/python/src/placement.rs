//! `PlacementModel`: pdgate-core's placement cost model and decision, for `pdgate simulate`.
//!
//! Glue only: the decision is `pdgate_core::placement::decide`, the one the gateway runs, so
//! the simulator and the gateway share it (no second copy in Python).

use pdgate_core::placement::{decide, CostModel, CostPriors, LocalPath, PlacementInput, PlacementMode, RemotePath};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// A cost model fixed at its priors (the simulator's service-time model), and the decision.
#[pyclass(module = "pdgate._core", frozen)]
pub struct PlacementModel {
    model: CostModel,
}

/// What `decide` returns: placement, reason, remote TTFT, local TTFT, local stall TPOT (ms).
type DecisionTuple = (&'static str, &'static str, Option<f64>, Option<f64>, Option<f64>);

#[pymethods]
impl PlacementModel {
    #[new]
    #[pyo3(signature = (*, prefill_base_ms=20.0, prefill_ms_per_token=0.035, decode_step_ms=45.0, decode_step_per_seq_ms=0.0, kv_bytes_per_token=327_680.0,
                        link_setup_ms=12.0, link_gib_per_s=22.0, send_chunk_tokens=0, prefill_chunk_tokens=0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        prefill_base_ms: f64,
        prefill_ms_per_token: f64,
        decode_step_ms: f64,
        decode_step_per_seq_ms: f64,
        kv_bytes_per_token: f64,
        link_setup_ms: f64,
        link_gib_per_s: f64,
        send_chunk_tokens: u64,
        prefill_chunk_tokens: u64,
    ) -> PyResult<Self> {
        let priors = CostPriors {
            prefill_base_ms,
            prefill_ms_per_token,
            decode_step_ms,
            decode_step_per_seq_ms,
            kv_bytes_per_token,
            link_setup_ms,
            link_gib_per_s,
            send_chunk_tokens,
            prefill_chunk_tokens,
            ..CostPriors::default()
        };
        priors.check().map_err(PyValueError::new_err)?;
        Ok(PlacementModel { model: CostModel::new(priors) })
    }

    /// The decision for one request. `remote` is `(prefill_queue_ms, decode_wait_ms,
    /// decode_batch)` or None (no pair); `local` is `(queue_ms, batch, cached_tokens)` or None
    /// (no colocated target); `mode` is disaggregated, colocated or conditional; `slack` 0 never
    /// rejects.
    #[pyo3(signature = (mode, prompt_tokens, output_tokens, remote, local, slo_ttft_ms, slo_tpot_ms, slack=0.0, waited_ms=0.0))]
    #[allow(clippy::too_many_arguments)]
    fn decide(
        &self,
        mode: &str,
        prompt_tokens: u64,
        output_tokens: u64,
        remote: Option<(f64, f64, u64)>,
        local: Option<(f64, u64, u64)>,
        slo_ttft_ms: f64,
        slo_tpot_ms: f64,
        slack: f64,
        waited_ms: f64,
    ) -> PyResult<DecisionTuple> {
        let mode = match mode {
            "disaggregated" => PlacementMode::Disaggregated,
            "colocated" => PlacementMode::Colocated,
            "conditional" => PlacementMode::Conditional,
            other => return Err(PyValueError::new_err(format!("mode must be disaggregated, colocated or conditional, not {other:?}"))),
        };
        let input = PlacementInput {
            prompt_tokens,
            output_tokens,
            waited_ms,
            remote: remote.map(|(prefill_queue_ms, decode_wait_ms, decode_batch)| RemotePath { prefill_queue_ms, decode_wait_ms, decode_batch }),
            local: local.map(|(queue_ms, batch, cached_tokens)| LocalPath { queue_ms, batch, cached_tokens }),
            slo_ttft_ms,
            slo_tpot_ms,
            slack,
        };
        let d = decide(&self.model, mode, &input);
        let p = d.predicted;
        Ok((d.placement.as_str(), d.reason, p.remote_ttft_ms, p.local_ttft_ms, p.local_tpot_ms))
    }

    fn prefill_ms(&self, tokens: u64) -> f64 {
        self.model.prefill_ms(tokens)
    }

    fn exposed_transfer_ms(&self, tokens: u64) -> f64 {
        self.model.exposed_transfer_ms(tokens)
    }

    fn decode_step_ms(&self, batch: u64) -> f64 {
        self.model.decode_step_ms(batch)
    }
}
