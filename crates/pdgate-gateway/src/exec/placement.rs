//! The placement adapter: turns the routing view into the core decision's input, runs
//! `pdgate_core::placement::decide`, and keeps the online cost model the decision reads.
//!
//! - before the first attempt of a PD-mode request: disaggregated, colocated (a Regular plan on
//!   the regular pool) or rejected early (429 `overloaded`, `Retry-After`,
//!   `x-pdgate-dropped-reason`);
//! - after a failure before commit: retry on a pair, recompute colocated, or fail, by the
//!   remaining deadline (`recover`);
//! - observations: prefill legs (prompt tokens, ms) from the transaction; KV transfers and
//!   decode steps through [`Placer::observe_transfer`] and [`Placer::observe_decode_step`].

use std::sync::Mutex;
use std::time::Duration;

use axum::http::HeaderValue;
use axum::response::Response;
use pdgate_core::placement::{decide, recover, CostModel, Decision, FailureInput, Fitted, LocalPath, Placement, PlacementInput, PlacementMode, Recovery, RemotePath, REASONS};
use pdgate_core::policy::{LoadView, SCAN_LIMIT};
use pdgate_core::{GatewayConfig, GatewayError, PoolSnapshot, WorkerRole};
use prometheus::{GaugeVec, IntCounterVec, Opts, Registry};

use super::Ctx;
use crate::record::Record;
use crate::render::error_response;

/// Output tokens assumed for a request that does not bound them (no `max_tokens`).
pub const DEFAULT_OUTPUT_TOKENS: u64 = 256;
/// The header a rejected request carries, naming why.
pub const DROPPED_HEADER: &str = "x-pdgate-dropped-reason";

/// The placement settings and the cost model, shared by all requests.
pub struct Placer {
    pub mode: PlacementMode,
    slack: f64,
    slo_ttft_ms: f64,
    slo_tpot_ms: f64,
    /// Locked only to observe or to decide (microseconds), never across an await.
    model: Mutex<CostModel>,
}

impl Placer {
    pub fn from_config(c: &GatewayConfig) -> Self {
        Placer { mode: c.pd_placement, slack: c.admission_slack, slo_ttft_ms: c.slo_ttft_ms, slo_tpot_ms: c.slo_tpot_ms, model: Mutex::new(CostModel::new(c.cost_priors())) }
    }

    /// Whether a PD-mode request needs a decision at all (default settings with early
    /// rejection off skip it: today's behaviour, at no cost).
    pub fn engaged(&self) -> bool {
        self.mode != PlacementMode::Disaggregated || self.slack > 0.0
    }

    fn model(&self) -> std::sync::MutexGuard<'_, CostModel> {
        self.model.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A prefill leg of `tokens` prompt tokens answered after `ms` (its queue at the engine
    /// included; for SGLang bootstrap the KV transfer too, since that leg answers after it).
    pub fn observe_prefill(&self, tokens: u64, ms: f64) {
        self.model().observe_prefill(tokens, ms);
    }

    /// A KV transfer of `bytes` took `ms`. Not fed yet: the engines' transfer reports are not
    /// read by the gateway (see docs/placement.md); the prior stands until they are.
    #[allow(dead_code)]
    pub fn observe_transfer(&self, bytes: u64, ms: f64) {
        self.model().observe_transfer(bytes, ms);
    }

    /// Hook for the latency accounting: a finished request's TPOT, ms. Not connected yet: the
    /// per-request TPOT is measured by the goodput accounting, which calls this once merged.
    #[allow(dead_code)]
    pub fn observe_decode_step(&self, tpot_ms: f64) {
        self.model().observe_decode_step(tpot_ms);
    }

    pub fn fitted(&self) -> Fitted {
        self.model().fitted()
    }
}

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

    /// Every reason at 0 for the configured mode's placements, so rates work from the start.
    pub fn prime(&self, placer: &Placer) {
        for reason in REASONS {
            for placement in ["disaggregated", "colocated", "rejected"] {
                self.total.with_label_values(&[placement, reason]);
            }
        }
        self.publish(&placer.fitted());
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

/// The load of one request's candidate paths, as the decision reads it.
#[derive(Clone, Copy, Debug)]
pub struct Sizes {
    pub prompt_tokens: u64,
    pub output_tokens: u64,
    pub waited_ms: f64,
}

/// The decision's input from the snapshot and the load view: the best prefill by queued
/// prompt work, the best decode with room for prompt + output (fewest running), the best
/// colocated target by queued work then running decodes. At most [`SCAN_LIMIT`] of each.
pub fn input_for(m: &CostModel, snap: &PoolSnapshot, loads: &dyn LoadView, s: Sizes, slo: (f64, f64), slack: f64) -> PlacementInput {
    let queue_ms = |w: usize| m.queued_prefill_ms(loads.prompt_tokens(w), u64::from(loads.prompt_tokens(w) > 0));
    let prefill_queue_ms = snap.pairable_prefills().iter().take(SCAN_LIMIT).map(|&w| queue_ms(w)).min_by(f64::total_cmp);
    let need = s.prompt_tokens.saturating_add(s.output_tokens);
    let decodes = snap.eligible(WorkerRole::Decode).iter().take(SCAN_LIMIT);
    let (mut roomy, mut any): (Option<u64>, Option<u64>) = (None, None);
    for &w in decodes {
        let running = loads.running(w);
        any = Some(any.map_or(running, |r| r.min(running)));
        if loads.free_kv_tokens(w).is_none_or(|free| free >= need) {
            roomy = Some(roomy.map_or(running, |r| r.min(running)));
        }
    }
    let remote = match (prefill_queue_ms, roomy, any) {
        (Some(q), Some(batch), _) => Some(RemotePath { prefill_queue_ms: q, decode_wait_ms: 0.0, decode_batch: batch }),
        // No decode has room: wait for one request of this size to finish somewhere.
        (Some(q), None, Some(batch)) => Some(RemotePath { prefill_queue_ms: q, decode_wait_ms: m.decode_step_ms(batch.max(1)) * s.output_tokens as f64, decode_batch: batch }),
        _ => None,
    };
    let local = snap
        .eligible(WorkerRole::Regular)
        .iter()
        .take(SCAN_LIMIT)
        .map(|&w| LocalPath { queue_ms: queue_ms(w), batch: loads.running(w), cached_tokens: 0 })
        .min_by(|a, b| a.queue_ms.total_cmp(&b.queue_ms).then(a.batch.cmp(&b.batch)));
    PlacementInput { prompt_tokens: s.prompt_tokens, output_tokens: s.output_tokens, waited_ms: s.waited_ms, remote, local, slo_ttft_ms: slo.0, slo_tpot_ms: slo.1, slack }
}

fn sizes(ctx: &Ctx) -> Sizes {
    Sizes {
        prompt_tokens: ctx.req.prompt_tokens,
        output_tokens: ctx.req.max_tokens.map_or(DEFAULT_OUTPUT_TOKENS, |(n, _)| n),
        waited_ms: ctx.started.elapsed().as_secs_f64() * 1000.0,
    }
}

/// The placement of a PD-mode request's first attempt, counted; `None` when placement is not
/// engaged (every request disaggregated, nothing predicted).
pub fn place(ctx: &Ctx) -> Option<Decision> {
    let placer = &ctx.state.placer;
    if !ctx.state.config.pd_disaggregation || !placer.engaged() {
        return None;
    }
    let routing = ctx.state.registry.routing();
    let loads = ctx.state.loads(&routing.runtime);
    let decision = {
        let model = placer.model();
        let input = input_for(&model, &routing.snapshot, &loads, sizes(ctx), (placer.slo_ttft_ms, placer.slo_tpot_ms), placer.slack);
        decide(&model, placer.mode, &input)
    };
    ctx.state.metrics.placement.total.with_label_values(&[decision.placement.as_str(), decision.reason]).inc();
    Some(decision)
}

/// The place phase of a request: the first attempt's placement (recorded in the header under
/// `colocated` and `conditional`, and for every rejection), then, for a disaggregated request,
/// the wait for decode KV room (`kv_room`). `Err` is the response to answer at once.
pub async fn place_request(ctx: &Ctx, record: &mut Record) -> Result<Option<Placement>, Response> {
    let decision = place(ctx);
    if let Some(d) = &decision {
        if ctx.state.placer.mode != PlacementMode::Disaggregated || d.placement == Placement::Reject {
            record.placement = Some((d.placement.as_str(), d.reason));
        }
        if d.placement == Placement::Reject {
            return Err(rejection(d));
        }
    }
    let placed = decision.map(|d| d.placement);
    if ctx.state.config.pd_disaggregation && placed != Some(Placement::Colocated) {
        super::kv_room::admit(ctx).await.map_err(|err| error_response(&err))?;
    }
    Ok(placed)
}

/// The early rejection's answer: 429 `overloaded`, `Retry-After` (the predicted TTFT in
/// whole seconds, at least 1) and the reason header.
pub fn rejection(d: &Decision) -> Response {
    let best = [d.predicted.remote_ttft_ms, d.predicted.local_ttft_ms].into_iter().flatten().fold(f64::INFINITY, f64::min);
    let msg = if best.is_finite() {
        format!("overloaded: predicted time to first token {best:.0} ms exceeds the TTFT objective times --admission-slack")
    } else {
        "overloaded: no path is predicted to meet the TTFT objective".to_string()
    };
    let mut resp = error_response(&GatewayError::predicted_overload(msg));
    let retry_after = if best.is_finite() { Duration::from_secs_f64((best / 1000.0).ceil().clamp(1.0, 3600.0)).as_secs() } else { 1 };
    let h = resp.headers_mut();
    h.insert(axum::http::header::RETRY_AFTER, HeaderValue::from(retry_after));
    h.insert(DROPPED_HEADER, HeaderValue::from_static(d.reason));
    resp
}

/// After a failure before commit that the retry policy would retry: retry on a pair,
/// recompute colocated, or fail, by the time left and the predicted TTFT of each (computed on
/// the current view). `None` when placement is not engaged (the retry policy alone decides).
pub fn recovery(ctx: &Ctx, left: Duration) -> Option<(Recovery, &'static str)> {
    let placer = &ctx.state.placer;
    if !ctx.state.config.pd_disaggregation || !placer.engaged() {
        return None;
    }
    let routing = ctx.state.registry.routing();
    let loads = ctx.state.loads(&routing.runtime);
    let p = {
        let model = placer.model();
        let input = input_for(&model, &routing.snapshot, &loads, sizes(ctx), (placer.slo_ttft_ms, placer.slo_tpot_ms), placer.slack);
        pdgate_core::placement::predict(&model, &input)
    };
    let colocated_ttft_ms = p.local_ttft_ms.filter(|_| placer.mode != PlacementMode::Disaggregated);
    let retry_ttft_ms = p.remote_ttft_ms.filter(|_| placer.mode != PlacementMode::Colocated);
    let choice = recover(&FailureInput { remaining_ms: left.as_secs_f64() * 1000.0, may_retry: true, retry_ttft_ms, colocated_ttft_ms });
    ctx.state.metrics.placement.recovery.with_label_values(&[choice.0.as_str(), choice.1]).inc();
    Some(choice)
}

/// The placement an attempt runs under after `recovery` chose.
pub fn after_recovery(r: Recovery) -> Option<Placement> {
    match r {
        Recovery::RetryPair => Some(Placement::Disaggregated),
        Recovery::RecomputeColocated => Some(Placement::Colocated),
        Recovery::Fail => None,
    }
}
