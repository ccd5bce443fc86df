//! Properties of the placement cost model and decision.

use pdgate_core::placement::{decide, local_ttft_ms, remote_ttft_ms, CostModel, CostPriors, LocalPath, Placement, PlacementInput, PlacementMode, RemotePath, REASONS};
use proptest::prelude::*;

fn model(observations: &[(u64, f64)]) -> CostModel {
    let mut m = CostModel::new(CostPriors { send_chunk_tokens: 0, ..CostPriors::default() });
    for &(t, ms) in observations {
        m.observe_prefill(t, ms);
        m.observe_transfer(t * 1000, ms / 10.0);
    }
    m
}

fn observations() -> impl Strategy<Value = Vec<(u64, f64)>> {
    prop::collection::vec((0u64..50_000, 0.0f64..10_000.0), 0..40)
}

proptest! {
    #[test]
    fn more_tokens_never_predict_less(obs in observations(), a in 0u64..100_000, extra in 0u64..100_000) {
        let m = model(&obs);
        let b = a + extra;
        prop_assert!(m.prefill_ms(b) >= m.prefill_ms(a));
        prop_assert!(m.send_ms(b) >= m.send_ms(a));
        prop_assert!(m.exposed_transfer_ms(b) >= m.exposed_transfer_ms(a) - 1e-9);
        prop_assert!(remote_ttft_ms(&m, b, &RemotePath::default()) >= remote_ttft_ms(&m, a, &RemotePath::default()));
        prop_assert!(local_ttft_ms(&m, b, &LocalPath::default()) >= local_ttft_ms(&m, a, &LocalPath::default()));
        let f = m.fitted();
        prop_assert!(f.prefill_base_ms >= 0.0 && f.prefill_ms_per_token >= 0.0 && f.link_setup_ms >= 0.0 && f.link_gib_per_s > 0.0);
    }

    #[test]
    fn more_load_never_predicts_less(obs in observations(), tokens in 0u64..50_000, q in 0.0f64..5000.0, dq in 0.0f64..5000.0, batch in 0u64..64, db in 0u64..64) {
        let m = model(&obs);
        let r = RemotePath { prefill_queue_ms: q, decode_wait_ms: q, decode_batch: batch };
        let r2 = RemotePath { prefill_queue_ms: q + dq, decode_wait_ms: q + dq, decode_batch: batch + db };
        prop_assert!(remote_ttft_ms(&m, tokens, &r2) >= remote_ttft_ms(&m, tokens, &r));
        let l = LocalPath { queue_ms: q, batch, cached_tokens: 0 };
        let l2 = LocalPath { queue_ms: q + dq, batch: batch + db, cached_tokens: 0 };
        prop_assert!(local_ttft_ms(&m, tokens, &l2) >= local_ttft_ms(&m, tokens, &l));
        // A longer cached prefix never predicts a slower local prefill.
        let cached = LocalPath { cached_tokens: tokens / 2, ..l };
        prop_assert!(local_ttft_ms(&m, tokens, &cached) <= local_ttft_ms(&m, tokens, &l));
    }

    #[test]
    fn decisions_are_total_and_reasoned(
        obs in observations(), tokens in 0u64..100_000, out in 0u64..4096, waited in 0.0f64..3000.0,
        remote in prop::option::of((0.0f64..3000.0, 0.0f64..3000.0, 0u64..64)),
        local in prop::option::of((0.0f64..3000.0, 0u64..64, 0u64..100_000)),
        slo_ttft in 1.0f64..5000.0, slo_tpot in 1.0f64..200.0, slack in prop_oneof![Just(0.0f64), 1.0f64..4.0], mode in 0usize..3,
    ) {
        let m = model(&obs);
        let input = PlacementInput {
            prompt_tokens: tokens, output_tokens: out, waited_ms: waited,
            remote: remote.map(|(q, w, b)| RemotePath { prefill_queue_ms: q, decode_wait_ms: w, decode_batch: b }),
            local: local.map(|(q, b, c)| LocalPath { queue_ms: q, batch: b, cached_tokens: c }),
            slo_ttft_ms: slo_ttft, slo_tpot_ms: slo_tpot, slack,
        };
        let mode = [PlacementMode::Disaggregated, PlacementMode::Colocated, PlacementMode::Conditional][mode];
        let d = decide(&m, mode, &input);
        prop_assert!(REASONS.contains(&d.reason));
        // Never rejected while some available path fits the budget; never with slack 0.
        let best = [d.predicted.remote_ttft_ms.filter(|_| mode != PlacementMode::Colocated), d.predicted.local_ttft_ms.filter(|_| mode != PlacementMode::Disaggregated)]
            .into_iter().flatten().fold(f64::INFINITY, f64::min);
        if d.placement == Placement::Reject {
            prop_assert!(slack > 0.0 && best + waited > slo_ttft * slack);
        } else if slack > 0.0 && best.is_finite() {
            prop_assert!(best + waited <= slo_ttft * slack || mode != PlacementMode::Conditional);
        }
        // A conditional decision never picks a path that is not there.
        if mode == PlacementMode::Conditional {
            match d.placement {
                Placement::Colocated => prop_assert!(input.local.is_some()),
                Placement::Disaggregated => prop_assert!(input.remote.is_some() || input.local.is_none()),
                Placement::Reject => {}
            }
        }
    }
}
