//! The placement decision: disaggregated, colocated or rejected, with its reason and the
//! predictions behind it. A pure function of the request's size, the load each path would
//! meet, the SLOs and the cost model's state.

use serde::{Deserialize, Serialize};

use super::cost_model::CostModel;

/// What `--pd-placement` asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum PlacementMode {
    /// Every request on a prefill/decode pair (pdgate's behaviour before conditional placement).
    #[default]
    Disaggregated,
    /// Every request on one worker that prefills and decodes.
    Colocated,
    /// Per request, whichever path the cost model predicts meets the SLOs better.
    Conditional,
}

impl PlacementMode {
    pub fn as_str(self) -> &'static str {
        match self {
            PlacementMode::Disaggregated => "disaggregated",
            PlacementMode::Colocated => "colocated",
            PlacementMode::Conditional => "conditional",
        }
    }
}

/// Where one request runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    Disaggregated,
    Colocated,
    /// Nothing is predicted to answer within the TTFT SLO × admission slack: answer 429 now.
    Reject,
}

impl Placement {
    pub fn as_str(self) -> &'static str {
        match self {
            Placement::Disaggregated => "disaggregated",
            Placement::Colocated => "colocated",
            Placement::Reject => "rejected",
        }
    }
}

/// The remote path as the best prefill/decode pair would meet it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RemotePath {
    /// Prefill work queued ahead on the prefill worker, ms ([`CostModel::queued_prefill_ms`]).
    pub prefill_queue_ms: f64,
    /// Wait for room on the decode worker, ms: 0 when it has room for prompt + max_tokens.
    pub decode_wait_ms: f64,
    /// Sequences running on the decode worker.
    pub decode_batch: u64,
}

/// The colocated path as its best target would meet it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LocalPath {
    /// Prefill work queued ahead on the target, ms.
    pub queue_ms: f64,
    /// Decodes running there: the ones a local prefill stalls.
    pub batch: u64,
    /// Prompt tokens already in the target's prefix cache (not prefilled again).
    pub cached_tokens: u64,
}

/// Everything the decision looks at besides the model.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlacementInput {
    pub prompt_tokens: u64,
    /// Output tokens the request may produce (max_tokens, or a default).
    pub output_tokens: u64,
    /// Time already spent in the gateway (admission queue), ms; counts against the TTFT SLO.
    pub waited_ms: f64,
    /// `None` when no prefill/decode pair is available.
    pub remote: Option<RemotePath>,
    /// `None` when no colocated target is available.
    pub local: Option<LocalPath>,
    pub slo_ttft_ms: f64,
    pub slo_tpot_ms: f64,
    /// Reject when the best predicted TTFT exceeds `slo_ttft_ms × slack`; 0 never rejects.
    /// Otherwise at least 1 (a budget below the SLO would reject requests that meet it).
    pub slack: f64,
}

/// The predictions behind a decision (ms), for the record and the simulator.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Predicted {
    pub prefill_ms: f64,
    pub transfer_ms: f64,
    pub remote_ttft_ms: Option<f64>,
    pub local_ttft_ms: Option<f64>,
    /// TPOT of the target's running decodes with this prefill stalling them.
    pub local_tpot_ms: Option<f64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Decision {
    pub placement: Placement,
    /// A short label from a fixed set (a metric label): see [`REASONS`].
    pub reason: &'static str,
    pub predicted: Predicted,
}

/// Every reason a decision can give.
pub const REASONS: &[&str] = &[
    "placement_disaggregated",
    "placement_colocated",
    "remote_ttft_lower",
    "local_ttft_lower",
    "remote_less_utilised",
    "local_less_utilised",
    "cached_prefix_local",
    "local_stall_breaks_tpot",
    "local_misses_ttft",
    "no_colocated_target",
    "decode_saturated",
    "remote_misses_ttft",
    "no_pd_pair",
    "slo_missed_remote_lower",
    "slo_missed_local_lower",
    "predicted_ttft_over_budget",
];

/// When both paths meet the SLOs, the lower TTFT wins unless the other path's utilisation (see
/// [`path_utilisation`]) is lower by more than this share of the SLOs. Below it the paths count
/// as equally loaded, and the one without a transfer keeps short prompts; above it load spreads
/// to the idler path before the busier one is near its SLO (where prediction error breaks it).
pub const TIE_BREAK_MARGIN: f64 = 0.1;

/// How close a path, with this request on it, comes to the objectives: the larger of its TTFT
/// over the TTFT SLO and the worst TPOT on its target over the TPOT SLO. Remote: the decode
/// worker's step with this request added. Local: the running decodes' TPOT with this prefill
/// stalling them ([`local_stall_tpot_ms`]), or the step with this request added if larger.
/// `None` when the path is not available.
pub fn path_utilisation(m: &CostModel, input: &PlacementInput, p: &Predicted) -> (Option<f64>, Option<f64>) {
    let waited = input.waited_ms.max(0.0);
    let of = |ttft: f64, tpot: f64| ((ttft + waited) / input.slo_ttft_ms).max(tpot / input.slo_tpot_ms);
    let remote = input.remote.zip(p.remote_ttft_ms).map(|(r, t)| of(t, m.decode_step_ms(r.decode_batch + 1)));
    let local = input.local.zip(p.local_ttft_ms).map(|(l, t)| of(t, m.decode_step_ms(l.batch + 1).max(p.local_tpot_ms.unwrap_or(0.0))));
    (remote, local)
}

/// The early-rejection slack for a request of `priority` (higher is more important, 0 the
/// default): below 0 a request is shed as soon as it is predicted to miss the TTFT SLO (slack
/// 1), at 0 it gets `slack`, above 0 twice `slack`; so as load rises the lowest priority is shed
/// first. A slack of 0 (rejection off) stays 0.
pub fn priority_slack(slack: f64, priority: i64) -> f64 {
    if slack <= 0.0 {
        return 0.0;
    }
    match priority.cmp(&0) {
        std::cmp::Ordering::Less => 1.0,
        std::cmp::Ordering::Equal => slack,
        std::cmp::Ordering::Greater => slack * 2.0,
    }
}

/// Remote TTFT: prefill queue + prefill + the transfer the prefill does not hide + wait for
/// decode room + one decode step in the decode's batch.
pub fn remote_ttft_ms(m: &CostModel, tokens: u64, r: &RemotePath) -> f64 {
    r.prefill_queue_ms + m.prefill_ms(tokens) + m.exposed_transfer_ms(tokens) + r.decode_wait_ms + m.decode_step_ms(r.decode_batch + 1)
}

/// Local TTFT: queue + prefill of the uncached part, each prefill chunk riding in one step
/// with the running decodes.
pub fn local_ttft_ms(m: &CostModel, tokens: u64, l: &LocalPath) -> f64 {
    let fresh = tokens.saturating_sub(l.cached_tokens);
    l.queue_ms + m.prefill_ms(fresh) + m.prefill_chunks(fresh) as f64 * m.decode_step_ms(l.batch)
}

/// TPOT of the local target's running decodes if this prefill runs there. The prefill (and the
/// work queued before it) delays each of them once; in steady state each of the n running
/// decodes also shares its life with about n such arrivals, so the delay is counted n times,
/// spread over an output of this request's length.
pub fn local_stall_tpot_ms(m: &CostModel, tokens: u64, output_tokens: u64, l: &LocalPath) -> f64 {
    let stall = (l.queue_ms + m.prefill_ms(tokens.saturating_sub(l.cached_tokens))) * l.batch.max(1) as f64;
    m.decode_step_ms(l.batch) + stall / output_tokens.max(1) as f64
}

/// The predictions for both paths.
pub fn predict(m: &CostModel, input: &PlacementInput) -> Predicted {
    let t = input.prompt_tokens;
    Predicted {
        prefill_ms: m.prefill_ms(t),
        transfer_ms: m.exposed_transfer_ms(t),
        remote_ttft_ms: input.remote.map(|r| remote_ttft_ms(m, t, &r)),
        local_ttft_ms: input.local.map(|l| local_ttft_ms(m, t, &l)),
        local_tpot_ms: input.local.filter(|l| l.batch > 0).map(|l| local_stall_tpot_ms(m, t, input.output_tokens, &l)),
    }
}

/// Decides where the request runs. See docs/placement.md for the rules, in this order: a path
/// meets the SLOs when its TTFT (plus the time already waited) is within the TTFT SLO and, for
/// the colocated path, the stall keeps the running decodes within the TPOT SLO; when both do,
/// the lower TTFT wins, unless the other path is less utilised by more than
/// [`TIE_BREAK_MARGIN`] ([`path_utilisation`]); when one does, it wins; when neither does, the
/// lower TTFT wins unless it is over the SLO × slack, which rejects.
pub fn decide(m: &CostModel, mode: PlacementMode, input: &PlacementInput) -> Decision {
    let p = predict(m, input);
    let decision = |placement, reason| Decision { placement, reason, predicted: p };
    let waited = input.waited_ms.max(0.0);
    let over_budget = |ttft: f64| input.slack > 0.0 && ttft + waited > input.slo_ttft_ms * input.slack;
    let remote = p.remote_ttft_ms;
    let local = p.local_ttft_ms;
    match mode {
        PlacementMode::Disaggregated => match remote {
            Some(t) if over_budget(t) => decision(Placement::Reject, "predicted_ttft_over_budget"),
            _ => decision(Placement::Disaggregated, "placement_disaggregated"),
        },
        PlacementMode::Colocated => match local {
            Some(t) if over_budget(t) => decision(Placement::Reject, "predicted_ttft_over_budget"),
            _ => decision(Placement::Colocated, "placement_colocated"),
        },
        PlacementMode::Conditional => conditional(m, input, p),
    }
}

fn conditional(m: &CostModel, input: &PlacementInput, p: Predicted) -> Decision {
    let decision = |placement, reason| Decision { placement, reason, predicted: p };
    let waited = input.waited_ms.max(0.0);
    let tpot_ok = p.local_tpot_ms.is_none_or(|t| t <= input.slo_tpot_ms);
    let remote_meets = p.remote_ttft_ms.is_some_and(|t| t + waited <= input.slo_ttft_ms);
    let local_meets = tpot_ok && p.local_ttft_ms.is_some_and(|t| t + waited <= input.slo_ttft_ms);
    match (p.remote_ttft_ms, p.local_ttft_ms) {
        (None, None) => decision(Placement::Disaggregated, "no_pd_pair"),
        _ if remote_meets && local_meets => {
            let (r, l) = (p.remote_ttft_ms.unwrap_or(f64::INFINITY), p.local_ttft_ms.unwrap_or(f64::INFINITY));
            // Both meet (so both exist): the utilisation tie-break before the TTFT.
            if let (Some(ur), Some(ul)) = path_utilisation(m, input, &p) {
                if r < l && ur > ul + TIE_BREAK_MARGIN {
                    return decision(Placement::Colocated, "local_less_utilised");
                }
                if l <= r && ul > ur + TIE_BREAK_MARGIN {
                    return decision(Placement::Disaggregated, "remote_less_utilised");
                }
            }
            if r < l {
                return decision(Placement::Disaggregated, "remote_ttft_lower");
            }
            // Would local have lost without its cached prefix?
            let uncached = input.local.map(|l| local_ttft_ms(m, input.prompt_tokens, &LocalPath { cached_tokens: 0, ..l }));
            let cache_decided = input.local.is_some_and(|l| l.cached_tokens > 0) && uncached.is_some_and(|u| u > r);
            decision(Placement::Colocated, if cache_decided { "cached_prefix_local" } else { "local_ttft_lower" })
        }
        _ if remote_meets => {
            let why = match p.local_ttft_ms {
                None => "no_colocated_target",
                Some(_) if !tpot_ok => "local_stall_breaks_tpot",
                Some(_) => "local_misses_ttft",
            };
            decision(Placement::Disaggregated, why)
        }
        _ if local_meets => {
            let why = match input.remote {
                None => "no_pd_pair",
                Some(r) if r.decode_wait_ms > 0.0 => "decode_saturated",
                Some(_) => "remote_misses_ttft",
            };
            decision(Placement::Colocated, why)
        }
        (remote, local) => {
            // Neither meets the SLOs. Among the paths within the budget (TTFT SLO × slack),
            // prefer one that keeps the running decodes' TPOT, then the lower TTFT.
            let within = |t: &f64| !(input.slack > 0.0 && t + waited > input.slo_ttft_ms * input.slack);
            let mut options: Vec<(bool, f64, Placement, &'static str)> = Vec::with_capacity(2);
            if let Some(r) = remote.filter(within) {
                options.push((true, r, Placement::Disaggregated, "slo_missed_remote_lower"));
            }
            if let Some(l) = local.filter(within) {
                options.push((tpot_ok, l, Placement::Colocated, "slo_missed_local_lower"));
            }
            options.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.total_cmp(&b.1)));
            match options.first() {
                Some(&(_, _, placement, reason)) => decision(placement, reason),
                None => decision(Placement::Reject, "predicted_ttft_over_budget"),
            }
        }
    }
}
