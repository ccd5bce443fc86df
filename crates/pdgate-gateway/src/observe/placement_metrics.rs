//! The placement decision's series: `pdgate_placement_total{placement,reason}`,
//! `pdgate_placement_recovery_total{choice,reason}` and the cost model's fitted parameters.
//! Primed by the decision's owner (`exec/placement.rs`, `Placer::prime_metrics`).

use pdgate_core::placement::Fitted;
use prometheus::{GaugeVec, IntCounterVec, Opts, Registry};

/// `pdgate_placement_total{placement,reason}`, `pdgate_placement_recovery_total{choice,reason}`
/// and the fitted parameters as `pdgate_placement_model{param}`.
pub struct PlacementMetrics {
    pub total: IntCounterVec,
    pub recovery: IntCounterVec,
    pub model: GaugeVec,
}

impl PlacementMetrics {
    pub fn new(r: &Registry) -> Self {
        let reg = |c: Box<dyn prometheus::core::Collector>, name: &str| r.register(c).unwrap_or_else(|e| panic!("metric {name}: {e}"));
        let total = IntCounterVec::new(Opts::new("pdgate_placement_total", "PD-mode placement decisions by placement and reason"), &["placement", "reason"])
            .unwrap_or_else(|e| panic!("metric pdgate_placement_total: {e}"));
        reg(Box::new(total.clone()), "pdgate_placement_total");
        let recovery = IntCounterVec::new(Opts::new("pdgate_placement_recovery_total", "Failures before commit by the recovery chosen and why"), &["choice", "reason"])
            .unwrap_or_else(|e| panic!("metric pdgate_placement_recovery_total: {e}"));
        reg(Box::new(recovery.clone()), "pdgate_placement_recovery_total");
        let model = GaugeVec::new(Opts::new("pdgate_placement_model", "The placement cost model's fitted parameters"), &["param"])
            .unwrap_or_else(|e| panic!("metric pdgate_placement_model: {e}"));
        reg(Box::new(model.clone()), "pdgate_placement_model");
        PlacementMetrics { total, recovery, model }
    }

    pub fn publish(&self, f: &Fitted) {
        for (param, v) in [
            ("prefill_base_ms", f.prefill_base_ms),
            ("prefill_ms_per_token", f.prefill_ms_per_token),
            ("link_setup_ms", f.link_setup_ms),
            ("link_gib_per_s", f.link_gib_per_s),
            ("decode_step_ms", f.decode_step_ms),
            ("prefill_observations", f.prefill_observations as f64),
            ("transfer_observations", f.transfer_observations as f64),
            ("decode_observations", f.decode_observations as f64),
        ] {
            self.model.with_label_values(&[param]).set(v);
        }
    }
}
