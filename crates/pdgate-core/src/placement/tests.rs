use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;

fn worked() -> CostModel {
    CostModel::new(CostPriors::default())
}

/// The design's worked example: a 6,000-token prompt against a 600 ms TTFT budget, outputs of
/// 200 tokens, TPOT SLO 50 ms.
fn input(remote: Option<RemotePath>, local: Option<LocalPath>) -> PlacementInput {
    PlacementInput { prompt_tokens: 6000, output_tokens: 200, waited_ms: 0.0, remote, local, slo_ttft_ms: 600.0, slo_tpot_ms: 50.0, slack: 1.0 }
}

fn close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol
}

#[test]
fn worked_example_predictions() {
    let m = worked();
    let p = predict(&m, &input(Some(RemotePath::default()), None));
    assert!(close(p.prefill_ms, 230.0, 1e-9), "{p:?}");
    assert!(close(p.transfer_ms, 95.2, 0.1), "{p:?}");
    assert!(close(p.remote_ttft_ms.unwrap(), 370.2, 0.1), "{p:?}");
}

#[test]
fn worked_example_goes_remote_at_low_load() {
    // Eight decodes run on the colocated target: a 230 ms prefill there stalls each of them.
    let busy_local = LocalPath { queue_ms: 0.0, batch: 8, cached_tokens: 0 };
    let d = decide(&worked(), PlacementMode::Conditional, &input(Some(RemotePath::default()), Some(busy_local)));
    assert_eq!((d.placement, d.reason), (Placement::Disaggregated, "local_stall_breaks_tpot"), "{d:?}");
    assert!(d.predicted.local_tpot_ms.unwrap() > 50.0);
}

#[test]
fn worked_example_goes_colocated_when_decodes_are_saturated() {
    let m = worked();
    // No decode has room: the wait is one request of this size finishing (400 steps).
    let saturated = RemotePath { prefill_queue_ms: 0.0, decode_wait_ms: 400.0 * m.decode_step_ms(1), decode_batch: 32 };
    let idle_local = LocalPath::default();
    let d = decide(&m, PlacementMode::Conditional, &input(Some(saturated), Some(idle_local)));
    assert_eq!((d.placement, d.reason), (Placement::Colocated, "decode_saturated"), "{d:?}");
}

#[test]
fn worked_example_is_rejected_when_nothing_meets_the_slo() {
    let m = worked();
    let queued = RemotePath { prefill_queue_ms: m.queued_prefill_ms(20_000, 4), ..RemotePath::default() };
    let local = LocalPath { queue_ms: 1000.0, ..LocalPath::default() };
    let d = decide(&m, PlacementMode::Conditional, &input(Some(queued), Some(local)));
    assert_eq!((d.placement, d.reason), (Placement::Reject, "predicted_ttft_over_budget"), "{d:?}");
    // With slack 2 the budget is 1,200 ms: the lower TTFT is served, missing the SLO.
    let d = decide(&m, PlacementMode::Conditional, &PlacementInput { slack: 2.0, ..input(Some(queued), Some(local)) });
    assert_eq!((d.placement, d.reason), (Placement::Disaggregated, "slo_missed_remote_lower"), "{d:?}");
    // Slack 0 never rejects.
    let d = decide(&m, PlacementMode::Disaggregated, &PlacementInput { slack: 0.0, ..input(Some(queued), None) });
    assert_eq!(d.placement, Placement::Disaggregated);
}

#[test]
fn every_reason_is_listed() {
    let m = worked();
    let remotes =
        [None, Some(RemotePath::default()), Some(RemotePath { decode_wait_ms: 5000.0, ..Default::default() }), Some(RemotePath { prefill_queue_ms: 700.0, ..Default::default() })];
    let locals = [None, Some(LocalPath::default()), Some(LocalPath { batch: 30, ..Default::default() }), Some(LocalPath { cached_tokens: 5900, batch: 1, ..Default::default() })];
    for mode in [PlacementMode::Disaggregated, PlacementMode::Colocated, PlacementMode::Conditional] {
        for r in remotes {
            for l in locals {
                for slack in [0.0, 1.0, 3.0] {
                    let d = decide(&m, mode, &PlacementInput { slack, ..input(r, l) });
                    assert!(REASONS.contains(&d.reason), "{}", d.reason);
                }
            }
        }
    }
}

#[test]
fn a_cached_prefix_favours_local() {
    let m = worked();
    // Two decodes run locally; without its cache the local prefill would be slower than remote.
    let cached = LocalPath { queue_ms: 200.0, batch: 2, cached_tokens: 5500 };
    let d = decide(&m, PlacementMode::Conditional, &input(Some(RemotePath::default()), Some(cached)));
    assert_eq!((d.placement, d.reason), (Placement::Colocated, "cached_prefix_local"), "{d:?}");
    let uncached = LocalPath { cached_tokens: 0, ..cached };
    let d = decide(&m, PlacementMode::Conditional, &input(Some(RemotePath::default()), Some(uncached)));
    assert_eq!(d.placement, Placement::Disaggregated, "{d:?}");
}

#[test]
fn short_prompts_stay_local_and_long_ones_go_remote_beside_running_decodes() {
    let m = worked();
    let local = Some(LocalPath { batch: 4, ..LocalPath::default() });
    let short = decide(&m, PlacementMode::Conditional, &PlacementInput { prompt_tokens: 200, ..input(Some(RemotePath::default()), local) });
    assert_eq!(short.placement, Placement::Colocated, "{short:?}");
    let long = decide(&m, PlacementMode::Conditional, &PlacementInput { prompt_tokens: 10_000, ..input(Some(RemotePath::default()), local) });
    assert_eq!(long.placement, Placement::Disaggregated, "{long:?}");
}

#[test]
fn fixed_modes_keep_their_placement_unless_over_budget() {
    let m = worked();
    let both = input(Some(RemotePath::default()), Some(LocalPath::default()));
    assert_eq!(decide(&m, PlacementMode::Disaggregated, &both).reason, "placement_disaggregated");
    assert_eq!(decide(&m, PlacementMode::Colocated, &both).placement, Placement::Colocated);
    let late = PlacementInput { waited_ms: 500.0, ..both };
    assert_eq!(decide(&m, PlacementMode::Disaggregated, &late).placement, Placement::Reject, "time already waited counts");
}

#[test]
fn prefill_fit_converges_on_noisy_observations() {
    // Truth: 50 + 0.08·tokens, 5 % multiplicative noise; the prior is the worked example's.
    let mut m = worked();
    let mut rng = StdRng::seed_from_u64(7);
    for _ in 0..2000 {
        let tokens = rng.random_range(100..16_000u64);
        let noise = 1.0 + rng.random_range(-0.05..0.05);
        m.observe_prefill(tokens, (50.0 + 0.08 * tokens as f64) * noise);
    }
    let f = m.fitted();
    assert!(close(f.prefill_ms_per_token, 0.08, 0.004), "{f:?}");
    assert!(close(f.prefill_base_ms, 50.0, 25.0), "{f:?}");
    assert!(close(m.prefill_ms(6000), 530.0, 15.0), "{}", m.prefill_ms(6000));
    assert_eq!(f.prefill_observations, 2000);
}

#[test]
fn transfer_and_decode_fits_converge() {
    let mut m = worked();
    let mut rng = StdRng::seed_from_u64(11);
    // Truth: 5 ms setup + 10 GiB/s; decode step 30 ms.
    for _ in 0..1000 {
        let bytes = rng.random_range(1u64 << 20..4u64 << 30);
        let ms = 5.0 + bytes as f64 / (10.0 * GIB) * 1000.0;
        m.observe_transfer(bytes, ms * (1.0 + rng.random_range(-0.03..0.03)));
        m.observe_decode_step(30.0 + rng.random_range(-3.0..3.0));
    }
    let f = m.fitted();
    assert!(close(f.link_gib_per_s, 10.0, 0.5), "{f:?}");
    assert!(close(f.link_setup_ms, 5.0, 5.0), "{f:?}");
    assert!(close(f.decode_step_ms, 30.0, 1.5), "{f:?}");
}

#[test]
fn the_prior_holds_until_observations_outweigh_it_and_bad_samples_are_ignored() {
    let mut m = worked();
    m.observe_prefill(6000, f64::NAN);
    m.observe_prefill(6000, -1.0);
    assert_eq!(m.fitted().prefill_observations, 0);
    assert!(close(m.prefill_ms(6000), 230.0, 1e-9));
    // One slow sample moves the fit, but less than halfway: the prior outweighs it.
    m.observe_prefill(6000, 2300.0);
    let after = m.prefill_ms(6000);
    assert!(after > 230.0 && after < (230.0 + 2300.0) / 2.0, "{after}");
    // Observations all of one size still leave a usable slope (the prior's floor).
    let mut m = worked();
    for _ in 0..5000 {
        m.observe_prefill(1000, 55.0);
    }
    assert!(close(m.prefill_ms(1000), 55.0, 0.5) && m.fitted().prefill_ms_per_token > 0.0, "{:?}", m.fitted());
}

#[test]
fn chunked_sends_hide_most_of_the_transfer() {
    // Issue 14's variant: 2,000-token sends while the prefill runs; ttft_chunked ~ 315 ms.
    let m = CostModel::new(CostPriors { send_chunk_tokens: 2000, ..CostPriors::default() });
    let ttft = remote_ttft_ms(&m, 6000, &RemotePath::default());
    assert!(close(ttft, 314.7, 0.2), "{ttft}");
}

#[test]
fn failure_policy_by_remaining_deadline() {
    let f = |remaining_ms, retry, colocated| recover(&FailureInput { remaining_ms, may_retry: true, retry_ttft_ms: retry, colocated_ttft_ms: colocated });
    assert_eq!(f(1000.0, Some(370.0), Some(500.0)).0, Recovery::RetryPair);
    assert_eq!(f(1000.0, Some(370.0), Some(230.0)), (Recovery::RecomputeColocated, "colocated_cheaper"));
    assert_eq!(f(300.0, Some(370.0), Some(230.0)), (Recovery::RecomputeColocated, "only_colocated_fits_deadline"));
    assert_eq!(f(200.0, Some(370.0), Some(230.0)), (Recovery::Fail, "deadline_too_short"));
    assert_eq!(f(200.0, None, None), (Recovery::Fail, "no_alternative"));
    assert_eq!(f(1000.0, Some(370.0), None).0, Recovery::RetryPair);
    let no = recover(&FailureInput { remaining_ms: 1e9, may_retry: false, retry_ttft_ms: Some(1.0), colocated_ttft_ms: Some(1.0) });
    assert_eq!(no, (Recovery::Fail, "not_retryable"));
}

#[test]
fn priors_are_checked() {
    assert!(CostPriors::default().check().is_ok());
    assert!(CostPriors { link_gib_per_s: 0.0, ..CostPriors::default() }.check().is_err());
    assert!(CostPriors { forgetting: 1.5, ..CostPriors::default() }.check().is_err());
    assert!(CostPriors { prefill_ms_per_token: f64::NAN, ..CostPriors::default() }.check().is_err());
}

/// Issue 13: under early rejection the lowest priority is shed first. A remote TTFT of about
/// 900 ms against a 600 ms SLO with slack 2 (budget 1,200 ms): a low-priority request is shed,
/// the default one served; at about 1,500 ms only a high-priority one is still served.
#[test]
fn lowest_priority_is_shed_first() {
    let m = worked();
    let at = |queue_ms: f64, priority: i64| {
        let r = RemotePath { prefill_queue_ms: queue_ms, ..RemotePath::default() };
        decide(&m, PlacementMode::Disaggregated, &PlacementInput { slack: priority_slack(2.0, priority), ..input(Some(r), None) }).placement
    };
    let over_slo = 900.0 - 370.2;
    assert_eq!([at(over_slo, -1), at(over_slo, 0), at(over_slo, 1)], [Placement::Reject, Placement::Disaggregated, Placement::Disaggregated]);
    let over_budget = 1500.0 - 370.2;
    assert_eq!([at(over_budget, -1), at(over_budget, 0), at(over_budget, 1)], [Placement::Reject, Placement::Reject, Placement::Disaggregated]);
    assert_eq!(priority_slack(0.0, 5), 0.0, "rejection off stays off");
}

/// The utilisation tie-break, by hand: a 2,000-token prompt (90 ms prefill, 39.7 ms transfer),
/// 50 output tokens, SLOs 600 ms / 100 ms, the remote pair idle (its step 45 ms: 0.45 of the
/// TPOT SLO).
fn tie_input(local_batch: u64) -> PlacementInput {
    let local = LocalPath { batch: local_batch, ..LocalPath::default() };
    PlacementInput { prompt_tokens: 2000, output_tokens: 50, slo_tpot_ms: 100.0, ..input(Some(RemotePath::default()), Some(local)) }
}

#[test]
fn both_paths_meet_and_the_busier_local_target_loses_by_more_than_the_margin() {
    let m = worked();
    // Eight decodes locally: the stall makes their TPOT 45 + 90·8/50 = 59.4 ms, 0.594 of the SLO,
    // against the remote step's 0.45: 0.144 apart, over the 0.1 margin, though local's TTFT
    // (135 ms) is lower than remote's (174.7 ms).
    let d = decide(&m, PlacementMode::Conditional, &tie_input(8));
    let (ur, ul) = path_utilisation(&m, &tie_input(8), &d.predicted);
    assert!(close(ur.unwrap(), 0.45, 1e-9) && close(ul.unwrap(), 0.594, 1e-9), "{ur:?} {ul:?}");
    assert!(d.predicted.local_ttft_ms.unwrap() < d.predicted.remote_ttft_ms.unwrap(), "{d:?}");
    assert_eq!((d.placement, d.reason), (Placement::Disaggregated, "remote_less_utilised"), "{d:?}");
    // Four decodes: 52.2 ms, 0.522 against 0.45, within the margin: the lower TTFT keeps it local.
    let d = decide(&m, PlacementMode::Conditional, &tie_input(4));
    assert_eq!((d.placement, d.reason), (Placement::Colocated, "local_ttft_lower"), "{d:?}");
}

#[test]
fn both_paths_meet_and_the_busier_decode_worker_loses_by_more_than_the_margin() {
    // Each running sequence adds 2 ms to a step: 20 on the remote decode make its step 87 ms
    // (0.87 of the TPOT SLO); the local target is idle but has 200 ms of prefill queued, so its
    // TTFT (290 ms, 0.483) is higher than remote's (216.7 ms).
    let m = CostModel::new(CostPriors { decode_step_per_seq_ms: 2.0, ..CostPriors::default() });
    let busy_decode = RemotePath { decode_batch: 20, ..RemotePath::default() };
    let queued_local = LocalPath { queue_ms: 200.0, ..LocalPath::default() };
    let i = PlacementInput { prompt_tokens: 2000, output_tokens: 50, slo_tpot_ms: 100.0, ..input(Some(busy_decode), Some(queued_local)) };
    let d = decide(&m, PlacementMode::Conditional, &i);
    assert!(d.predicted.remote_ttft_ms.unwrap() < d.predicted.local_ttft_ms.unwrap(), "{d:?}");
    let (ur, ul) = path_utilisation(&m, &i, &d.predicted);
    assert!(close(ur.unwrap(), 0.87, 1e-9) && close(ul.unwrap(), 290.0 / 600.0, 1e-9), "{ur:?} {ul:?}");
    assert_eq!((d.placement, d.reason), (Placement::Colocated, "local_less_utilised"), "{d:?}");
}

#[test]
fn when_both_meet_the_choice_is_never_the_busier_path_beyond_the_margin() {
    // Random loads (seeded): whenever both paths meet the SLOs, the chosen one is at most
    // TIE_BREAK_MARGIN more utilised than the other, and the reason names the rule used.
    let m = CostModel::new(CostPriors { decode_step_per_seq_ms: 0.5, ..CostPriors::default() });
    let mut rng = StdRng::seed_from_u64(14);
    let mut tie_broken = 0;
    for _ in 0..20_000 {
        let remote = RemotePath { prefill_queue_ms: rng.random_range(0.0..400.0), decode_wait_ms: 0.0, decode_batch: rng.random_range(0..32) };
        let local = LocalPath { queue_ms: rng.random_range(0.0..400.0), batch: rng.random_range(0..32), cached_tokens: 0 };
        let i = PlacementInput {
            prompt_tokens: rng.random_range(16..8000),
            output_tokens: rng.random_range(16..800),
            slo_tpot_ms: 100.0,
            slack: 0.0,
            ..input(Some(remote), Some(local))
        };
        let d = decide(&m, PlacementMode::Conditional, &i);
        let (ur, ul) = path_utilisation(&m, &i, &d.predicted);
        let (ur, ul) = (ur.unwrap(), ul.unwrap());
        match d.reason {
            "remote_less_utilised" | "local_less_utilised" => tie_broken += 1,
            "remote_ttft_lower" | "local_ttft_lower" => {}
            _ => continue, // not both meeting the SLOs
        }
        let (chosen, other) = if d.placement == Placement::Colocated { (ul, ur) } else { (ur, ul) };
        assert!(chosen <= other + TIE_BREAK_MARGIN, "{i:?} {d:?} {ur} {ul}");
    }
    assert!(tie_broken > 100, "the tie-break decided {tie_broken} of the random cases");
}
