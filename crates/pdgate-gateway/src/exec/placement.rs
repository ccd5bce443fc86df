//! The placement adapter: turns the routing view into the core decision's input, runs
//! `pdgate_core::placement::decide`, and keeps the online cost model the decision reads.
//!
//! - before the first attempt of a PD-mode request: disaggregated, colocated (a Regular plan on
//!   the regular pool) or rejected early (429 `overloaded`, `Retry-After`,
//!   `x-pdgate-dropped-reason`);
//! - after a failure before commit: retry on a pair, recompute colocated, or fail, by the
//!   remaining deadline (`recover`);
//! - observations: prefill legs (prompt tokens, ms) from the transaction; KV transfers from
//!   the engines' cumulative counters in their load reports (load.rs,
//!   [`Placer::observe_transfer_totals`]); decode steps from the accounting's TPOT
//!   ([`Placer::observe_decode_step`]).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use axum::http::HeaderValue;
use axum::response::Response;
use pdgate_core::placement::{
    decide, local_ttft_ms, priority_slack, recover, CostModel, Decision, FailureInput, Fitted, LocalPath, Placement, PlacementInput, PlacementMode, Recovery, RemotePath, REASONS,
};
use pdgate_core::policy::{LoadView, SCAN_LIMIT};
use pdgate_core::slo::SloTargets;
use pdgate_core::{GatewayConfig, GatewayError, PoolSnapshot, WorkerRole};
use pdgate_protocol::engine_load::TransferTotals;

use super::Ctx;
use crate::observe::record::Record;
use crate::render::{error_response, DROPPED_HEADER};

/// Output tokens assumed for a request that does not bound them (no `max_tokens`).
pub const DEFAULT_OUTPUT_TOKENS: u64 = 256;

/// The placement settings and the cost model, shared by all requests.
pub struct Placer {
    pub mode: PlacementMode,
    slack: f64,
    /// Locked only to observe or to decide (microseconds), never across an await.
    model: Mutex<CostModel>,
    /// Each worker's last cumulative transfer counters (a few bytes per worker URL ever seen).
    transfers: Mutex<HashMap<String, TransferTotals>>,
}

impl Placer {
    pub fn from_config(c: &GatewayConfig) -> Self {
        Placer { mode: c.pd_placement, slack: c.admission_slack, model: Mutex::new(CostModel::new(c.cost_priors())), transfers: Mutex::new(HashMap::new()) }
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

    /// A KV transfer of `bytes` took `ms`.
    pub fn observe_transfer(&self, bytes: u64, ms: f64) {
        self.model().observe_transfer(bytes, ms);
    }

    /// A worker's cumulative transfer counters from its load report (load.rs): the mean
    /// transfer since its previous report (its first: since the engine started) is one
    /// observation. Returns whether there was one.
    pub fn observe_transfer_totals(&self, worker: &str, now: TransferTotals) -> bool {
        let before = {
            let mut last = self.transfers.lock().unwrap_or_else(|p| p.into_inner());
            last.insert(worker.to_string(), now).unwrap_or_default()
        };
        match now.mean_since(&before) {
            Some((bytes, ms)) => {
                self.observe_transfer(bytes.round() as u64, ms);
                true
            }
            None => false,
        }
    }

    /// A finished disaggregated stream's TPOT, ms, from the latency accounting (accounting.rs).
    pub fn observe_decode_step(&self, tpot_ms: f64) {
        self.model().observe_decode_step(tpot_ms);
    }

    pub fn fitted(&self) -> Fitted {
        self.model().fitted()
    }

    /// Every reason at 0 for the configured mode's placements, so rates work from the start.
    pub fn prime_metrics(&self, m: &crate::observe::placement_metrics::PlacementMetrics) {
        for reason in REASONS {
            for placement in ["disaggregated", "colocated", "rejected"] {
                m.total.with_label_values(&[placement, reason]);
            }
        }
        m.publish(&self.fitted());
    }
}

/// The load of one request's candidate paths, as the decision reads it.
#[derive(Clone, Copy, Debug)]
pub struct Sizes {
    pub prompt_tokens: u64,
    pub output_tokens: u64,
    pub waited_ms: f64,
}

/// Which paths the decision needs: `disaggregated` reads only the remote one, `colocated`
/// only the local one (the other is never chosen, so it is not scanned).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Paths {
    pub remote: bool,
    pub local: bool,
}

impl Paths {
    pub const BOTH: Paths = Paths { remote: true, local: true };

    pub fn for_mode(mode: PlacementMode) -> Self {
        match mode {
            PlacementMode::Disaggregated => Paths { remote: true, local: false },
            PlacementMode::Colocated => Paths { remote: false, local: true },
            PlacementMode::Conditional => Paths::BOTH,
        }
    }
}

/// The decision's input from the snapshot and the load view: the best prefill by queued
/// prompt work, the best decode with room for prompt + output (fewest running), the colocated
/// target with the lowest predicted TTFT (its queued work, running decodes and `cached`
/// prompt tokens), then the fewest running. At most [`SCAN_LIMIT`] of each; a path not in
/// `paths` is left out.
#[allow(clippy::too_many_arguments)]
pub fn input_for(m: &CostModel, snap: &PoolSnapshot, loads: &dyn LoadView, s: Sizes, slo: SloTargets, slack: f64, paths: Paths, cached: &dyn Fn(usize) -> u64) -> PlacementInput {
    let queue_ms = |w: usize| m.queued_prefill_ms(loads.prompt_tokens(w), u64::from(loads.prompt_tokens(w) > 0));
    let remote = if paths.remote { remote_path(m, snap, loads, s, &queue_ms) } else { None };
    let local = if paths.local {
        snap.eligible(WorkerRole::Regular)
            .iter()
            .take(SCAN_LIMIT)
            .map(|&w| LocalPath { queue_ms: queue_ms(w), batch: loads.running(w), cached_tokens: cached(w).min(s.prompt_tokens) })
            .map(|l| (local_ttft_ms(m, s.prompt_tokens, &l), l))
            .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.batch.cmp(&b.1.batch)))
            .map(|(_, l)| l)
    } else {
        None
    };
    PlacementInput {
        prompt_tokens: s.prompt_tokens,
        output_tokens: s.output_tokens,
        waited_ms: s.waited_ms,
        remote,
        local,
        slo_ttft_ms: slo.ttft_ms,
        slo_tpot_ms: slo.tpot_ms,
        // Early rejection acts only on an objective someone chose, never the reporting one.
        slack: if slo.ttft_set { slack } else { 0.0 },
    }
}

fn remote_path(m: &CostModel, snap: &PoolSnapshot, loads: &dyn LoadView, s: Sizes, queue_ms: &dyn Fn(usize) -> f64) -> Option<RemotePath> {
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
    match (prefill_queue_ms, roomy, any) {
        (Some(q), Some(batch), _) => Some(RemotePath { prefill_queue_ms: q, decode_wait_ms: 0.0, decode_batch: batch }),
        // No decode has room: wait for one request of this size to finish somewhere.
        (Some(q), None, Some(batch)) => Some(RemotePath { prefill_queue_ms: q, decode_wait_ms: m.decode_step_ms(batch.max(1)) * s.output_tokens as f64, decode_batch: batch }),
        _ => None,
    }
}

fn sizes(ctx: &Ctx) -> Sizes {
    Sizes {
        prompt_tokens: ctx.req.prompt_tokens,
        output_tokens: ctx.req.max_tokens.map_or(DEFAULT_OUTPUT_TOKENS, |(n, _)| n),
        waited_ms: ctx.started.elapsed().as_secs_f64() * 1000.0,
    }
}

/// Prompt tokens each regular worker already holds of this prompt, from the cache-aware
/// policy's prefix tree (kept only when a policy reads it: otherwise nothing is known and
/// every worker counts 0). The tree counts bytes of text; they become tokens in proportion.
fn cached_prefixes(ctx: &Ctx, snap: &PoolSnapshot) -> Vec<(usize, u64)> {
    let Some(text) = ctx.routing_text().filter(|t| !t.is_empty()) else { return Vec::new() };
    let tree = ctx.state.fleet.tree.lock().unwrap_or_else(|p| p.into_inner());
    let per_byte = ctx.req.prompt_tokens as f64 / text.len() as f64;
    tree.matched_by_key(&text).into_iter().filter_map(|(url, bytes)| Some((snap.index_of(url)?, (bytes as f64 * per_byte).floor() as u64))).collect()
}

/// The decision's input for this request, on the current view: its own SLOs and priority.
fn request_input(ctx: &Ctx, model: &CostModel, snap: &PoolSnapshot, loads: &dyn LoadView, paths: Paths, cached: &[(usize, u64)]) -> PlacementInput {
    let placer = &ctx.state.placer;
    let cached = |w: usize| cached.iter().find(|(i, _)| *i == w).map_or(0, |(_, n)| *n);
    input_for(model, snap, loads, sizes(ctx), ctx.slo, priority_slack(placer.slack, ctx.priority), paths, &cached)
}

/// The placement of a PD-mode request's first attempt, counted; `None` when placement is not
/// engaged (every request disaggregated, nothing predicted).
pub fn place(ctx: &Ctx) -> Option<Decision> {
    let placer = &ctx.state.placer;
    if !ctx.state.config.pd_disaggregation || !placer.engaged() {
        return None;
    }
    let routing = ctx.state.fleet.registry.routing();
    let loads = ctx.state.fleet.loads(&routing.runtime);
    let paths = Paths::for_mode(placer.mode);
    let cached = if paths.local { cached_prefixes(ctx, &routing.snapshot) } else { Vec::new() };
    let decision = {
        let model = placer.model();
        let input = request_input(ctx, &model, &routing.snapshot, &loads, paths, &cached);
        decide(&model, placer.mode, &input)
    };
    ctx.state.metrics.placement.total.with_label_values(&[decision.placement.as_str(), decision.reason]).inc();
    Some(decision)
}

/// The place phase of a request: the first attempt's placement (recorded in the header for
/// every PD-mode request: `--pd-placement disaggregated` without a decision names its mode),
/// then, for a disaggregated request, the wait for decode KV room (`kv_room`). `Err` is the
/// refusal to answer at once (and to account as failed).
pub async fn place_request(ctx: &Ctx, record: &mut Record) -> Result<Option<Placement>, (Response, GatewayError)> {
    let decision = place(ctx);
    if ctx.state.config.pd_disaggregation {
        record.placement = Some(match &decision {
            Some(d) => (d.placement.as_str(), d.reason),
            None => (Placement::Disaggregated.as_str(), "placement_disaggregated"),
        });
    }
    if let Some(d) = &decision {
        if d.placement == Placement::Reject {
            record.placed_as = Placement::Reject.as_str();
            return Err(rejection(d, &ctx.slo));
        }
    }
    let placed = decision.map(|d| d.placement);
    if ctx.state.config.pd_disaggregation && placed != Some(Placement::Colocated) {
        super::kv_room::admit(ctx).await.map_err(|err| (crate::render::refusal_response(&err, "no_kv_room"), err))?;
    }
    Ok(placed)
}

/// The early rejection's answer: 429 `overloaded`, `Retry-After` (the predicted TTFT in
/// whole seconds, at least 1) and the reason header; and its error, for the accounting.
pub fn rejection(d: &Decision, slo: &SloTargets) -> (Response, GatewayError) {
    let best = [d.predicted.remote_ttft_ms, d.predicted.local_ttft_ms].into_iter().flatten().fold(f64::INFINITY, f64::min);
    let msg = if best.is_finite() {
        format!(
            "overloaded: predicted time to first token {best:.0} ms exceeds the TTFT objective ({:.0} ms, from --slo-ttft-ms or x-slo-ttft-ms) times --admission-slack",
            slo.ttft_ms
        )
    } else {
        "overloaded: no path is predicted to meet the TTFT objective".to_string()
    };
    let err = GatewayError::predicted_overload(msg);
    let mut resp = error_response(&err);
    let retry_after = if best.is_finite() { Duration::from_secs_f64((best / 1000.0).ceil().clamp(1.0, 3600.0)).as_secs() } else { 1 };
    let h = resp.headers_mut();
    h.insert(axum::http::header::RETRY_AFTER, HeaderValue::from(retry_after));
    h.insert(DROPPED_HEADER, HeaderValue::from_static(d.reason));
    (resp, err)
}

/// After a failure before commit that the retry policy would retry: retry on a pair,
/// recompute colocated, or fail, by the time left and the predicted TTFT of each (computed on
/// the current view). `None` when placement is not engaged (the retry policy alone decides).
pub fn recovery(ctx: &Ctx, left: Duration) -> Option<(Recovery, &'static str)> {
    let placer = &ctx.state.placer;
    if !ctx.state.config.pd_disaggregation || !placer.engaged() {
        return None;
    }
    let routing = ctx.state.fleet.registry.routing();
    let loads = ctx.state.fleet.loads(&routing.runtime);
    let paths = Paths::for_mode(placer.mode);
    let cached = if paths.local { cached_prefixes(ctx, &routing.snapshot) } else { Vec::new() };
    let p = {
        let model = placer.model();
        let input = request_input(ctx, &model, &routing.snapshot, &loads, paths, &cached);
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use pdgate_core::placement::{CostPriors, GIB};
    use pdgate_core::{KvConnector, WorkerSpec, WorkerView};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::*;

    /// Queued prompt tokens and running decodes per worker.
    struct View(Vec<(u64, u64)>);

    impl LoadView for View {
        fn load(&self, w: usize) -> u64 {
            self.0[w].1
        }
        fn prompt_tokens(&self, w: usize) -> u64 {
            self.0[w].0
        }
        fn running(&self, w: usize) -> u64 {
            self.0[w].1
        }
    }

    fn pool() -> PoolSnapshot {
        let roles = [("http://p:1", WorkerRole::Prefill), ("http://d:1", WorkerRole::Decode), ("http://c1:1", WorkerRole::Regular), ("http://c2:1", WorkerRole::Regular)];
        let views = roles.iter().map(|(u, r)| WorkerView::new(Arc::new(WorkerSpec::new(u, *r).unwrap()), true)).collect();
        PoolSnapshot::build(views, KvConnector::Bootstrap)
    }

    const SLO: SloTargets = SloTargets::set(600.0, 50.0);
    const SIZES: Sizes = Sizes { prompt_tokens: 6000, output_tokens: 200, waited_ms: 0.0 };

    #[test]
    fn a_cached_prefix_picks_its_worker_and_favours_local() {
        let m = CostModel::new(CostPriors::default());
        let snap = pool();
        // c1 has 5,000 tokens queued; c2 none, but c1 holds 5,900 of the prompt's tokens.
        let view = View(vec![(0, 0), (0, 0), (5000, 0), (0, 0)]);
        let none = |_: usize| 0;
        let input = input_for(&m, &snap, &view, SIZES, SLO, 1.0, Paths::BOTH, &none);
        assert_eq!(input.local.map(|l| l.cached_tokens), Some(0), "without a cache the idle c2 is the target");
        let c1 = |w: usize| if w == 2 { 5900 } else { 0 };
        let input = input_for(&m, &snap, &view, SIZES, SLO, 1.0, Paths::BOTH, &c1);
        assert_eq!(input.local.map(|l| l.cached_tokens), Some(5900), "c1's prefix outweighs its queue");
        let d = decide(&m, PlacementMode::Conditional, &input);
        assert_eq!((d.placement, d.reason), (Placement::Colocated, "cached_prefix_local"), "{d:?}");
    }

    #[test]
    fn the_reporting_objective_never_rejects() {
        let m = CostModel::new(CostPriors::default());
        let snap = pool();
        // A prefill queue far past any budget: rejected against a chosen 600 ms objective,
        // served against the reporting one (nobody set an objective).
        let view = View(vec![(2_000_000, 0), (0, 0), (0, 0), (0, 0)]);
        let none = |_: usize| 0;
        let chosen = input_for(&m, &snap, &view, SIZES, SLO, 2.0, Paths::for_mode(PlacementMode::Disaggregated), &none);
        assert_eq!(decide(&m, PlacementMode::Disaggregated, &chosen).placement, Placement::Reject);
        let reporting = SloTargets::reporting();
        for mode in [PlacementMode::Disaggregated, PlacementMode::Conditional] {
            let input = input_for(&m, &snap, &view, SIZES, reporting, 2.0, Paths::for_mode(mode), &none);
            assert_eq!(input.slack, 0.0);
            assert_ne!(decide(&m, mode, &input).placement, Placement::Reject, "{mode:?}");
        }
    }

    #[test]
    fn a_fixed_mode_scans_only_its_own_path_and_decides_the_same() {
        let m = CostModel::new(CostPriors::default());
        let snap = pool();
        let view = View(vec![(20_000, 0), (0, 4), (0, 8), (0, 8)]);
        let none = |_: usize| 0;
        for mode in [PlacementMode::Disaggregated, PlacementMode::Colocated] {
            for slack in [0.0, 1.0, 2.0] {
                let both = input_for(&m, &snap, &view, SIZES, SLO, slack, Paths::BOTH, &none);
                let own = input_for(&m, &snap, &view, SIZES, SLO, slack, Paths::for_mode(mode), &none);
                assert!(own.remote.is_none() || own.local.is_none());
                let (a, b) = (decide(&m, mode, &both), decide(&m, mode, &own));
                assert_eq!((a.placement, a.reason), (b.placement, b.reason), "{mode:?} slack {slack}");
            }
        }
    }

    /// The engines' cumulative transfer counters, polled, fit setup + bytes / bandwidth: two
    /// decode workers on a 5 ms + 10 GiB/s link, transfers of 1-200 MiB with 5 % noise,
    /// a few per poll; the fit starts from the 12 ms + 22 GiB/s prior.
    #[test]
    fn polled_transfer_totals_fit_the_link() {
        let placer = Placer::from_config(&GatewayConfig::default());
        let mut rng = StdRng::seed_from_u64(7);
        let mut totals = [TransferTotals::default(); 2];
        for (w, t) in totals.iter().enumerate() {
            assert!(!placer.observe_transfer_totals(&format!("http://d{w}:1"), *t), "no transfer yet");
        }
        for poll in 0..400 {
            let w = poll % 2;
            for _ in 0..rng.random_range(1..4) {
                let bytes = rng.random_range(1.0..200.0) * 1024.0 * 1024.0;
                let ms = (5.0 + bytes / (10.0 * GIB) * 1000.0) * (1.0 + rng.random_range(-0.05..0.05));
                totals[w].count += 1;
                totals[w].bytes += bytes as u64;
                totals[w].micros += (ms * 1000.0) as u64;
            }
            assert!(placer.observe_transfer_totals(&format!("http://d{w}:1"), totals[w]));
        }
        // A poll with no new transfer, and a restarted engine's counters, observe nothing.
        assert!(!placer.observe_transfer_totals("http://d0:1", totals[0]));
        assert!(!placer.observe_transfer_totals("http://d0:1", TransferTotals::default()));
        let f = placer.fitted();
        assert!((f.link_setup_ms - 5.0).abs() < 1.0, "{f:?}");
        assert!((f.link_gib_per_s - 10.0).abs() < 0.5, "{f:?}");
        assert_eq!(f.transfer_observations, 400);
    }
}
