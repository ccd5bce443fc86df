//! Choosing workers for one request: a regular worker, or a compatible prefill/decode pair.
//!
//! Candidate lists stay in ascending index order (policies rely on it), and nothing here
//! allocates unless workers are excluded.

use rand::RngCore;

use crate::error::GatewayError;
use crate::policy::{Policy, RouteInput, Selection};
use crate::snapshot::PoolSnapshot;
use crate::worker::WorkerRole;

/// Candidates minus `exclude` (workers that already failed this request), unless that would
/// leave none: then a failed worker is better than no worker.
fn without<'a>(candidates: &'a [usize], exclude: &[usize], buf: &'a mut Vec<usize>) -> &'a [usize] {
    if exclude.is_empty() || !candidates.iter().any(|c| exclude.contains(c)) {
        return candidates;
    }
    buf.clear();
    buf.extend(candidates.iter().copied().filter(|c| !exclude.contains(c)));
    if buf.is_empty() {
        candidates
    } else {
        buf
    }
}

pub fn select_regular(snap: &PoolSnapshot, policy: &dyn Policy, input: &RouteInput<'_>, exclude: &[usize], rng: &mut dyn RngCore) -> Result<Selection, GatewayError> {
    let mut buf = Vec::new();
    let candidates = without(snap.eligible(WorkerRole::Regular), exclude, &mut buf);
    policy.select(snap, candidates, input, rng).ok_or_else(|| GatewayError::no_workers("regular"))
}

/// The prefill policy chooses among prefills that have a compatible decode; the decode policy
/// among that prefill's compatible decodes.
pub fn select_pair(
    snap: &PoolSnapshot,
    prefill_policy: &dyn Policy,
    decode_policy: &dyn Policy,
    input: &RouteInput<'_>,
    exclude: &[usize],
    rng: &mut dyn RngCore,
) -> Result<(Selection, Selection), GatewayError> {
    if snap.eligible(WorkerRole::Prefill).is_empty() {
        return Err(GatewayError::no_workers("prefill"));
    }
    if snap.eligible(WorkerRole::Decode).is_empty() {
        return Err(GatewayError::no_workers("decode"));
    }
    let mut buf = Vec::new();
    let prefills = without(snap.pairable_prefills(), exclude, &mut buf);
    let prefill = prefill_policy.select(snap, prefills, input, rng).ok_or_else(|| GatewayError::no_compatible_pair(snap.pairing_gap()))?;
    let mut buf2 = Vec::new();
    let decodes = without(snap.compatible_decodes(prefill.worker), exclude, &mut buf2);
    let decode = decode_policy.select(snap, decodes, input, rng).ok_or_else(|| GatewayError::no_compatible_pair(snap.pairing_gap()))?;
    Ok((prefill, decode))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{RandomPolicy, RoundRobinPolicy};
    use crate::snapshot::WorkerView;
    use crate::worker::{KvConnector, WorkerSpec};
    use rand::{rngs::StdRng, SeedableRng};
    use std::sync::Arc;

    fn view(url: &str, role: WorkerRole, conn: Option<KvConnector>, healthy: bool) -> WorkerView {
        let mut spec = WorkerSpec::new(url, role).unwrap();
        spec.kv_connector = conn;
        WorkerView::new(Arc::new(spec), healthy)
    }

    fn seq(sequence: u64) -> RouteInput<'static> {
        RouteInput { sequence, ..RouteInput::default() }
    }

    #[test]
    fn pair_respects_connector_compatibility() {
        let snap = PoolSnapshot::build(
            vec![
                view("http://p1:1", WorkerRole::Prefill, Some(KvConnector::Nixl), true),
                view("http://p2:1", WorkerRole::Prefill, None, true),
                view("http://d1:1", WorkerRole::Decode, None, true),
            ],
            KvConnector::Bootstrap,
        );
        let mut rng = StdRng::seed_from_u64(3);
        for n in 0..20 {
            let (p, d) = select_pair(&snap, &RandomPolicy, &RoundRobinPolicy, &seq(n), &[], &mut rng).unwrap();
            assert_eq!((p.worker, d.worker), (1, 2), "the nixl prefill has no nixl decode");
        }
    }

    #[test]
    fn no_pair_names_the_mismatch() {
        let snap = PoolSnapshot::build(
            vec![view("http://p1:1", WorkerRole::Prefill, Some(KvConnector::Nixl), true), view("http://d1:1", WorkerRole::Decode, Some(KvConnector::Mooncake), true)],
            KvConnector::Bootstrap,
        );
        let mut rng = StdRng::seed_from_u64(3);
        let err = select_pair(&snap, &RandomPolicy, &RandomPolicy, &RouteInput::default(), &[], &mut rng).unwrap_err();
        assert_eq!(err.code(), "no_compatible_pd_pair");
        assert!(err.message.contains("nixl") && err.message.contains("mooncake"), "{}", err.message);
        assert!(!snap.pd_ready());
    }

    #[test]
    fn unhealthy_workers_are_not_chosen_and_missing_roles_say_which() {
        let snap = PoolSnapshot::build(vec![view("http://p1:1", WorkerRole::Prefill, None, true), view("http://d1:1", WorkerRole::Decode, None, false)], KvConnector::Bootstrap);
        let mut rng = StdRng::seed_from_u64(3);
        let err = select_pair(&snap, &RandomPolicy, &RandomPolicy, &RouteInput::default(), &[], &mut rng).unwrap_err();
        assert_eq!((err.code().as_str(), err.status()), ("no_available_workers", 503));
        assert!(err.message.contains("decode"));
    }

    #[test]
    fn retries_avoid_workers_that_failed_when_others_exist() {
        let snap = PoolSnapshot::build(vec![view("http://r1:1", WorkerRole::Regular, None, true), view("http://r2:1", WorkerRole::Regular, None, true)], KvConnector::Bootstrap);
        let mut rng = StdRng::seed_from_u64(9);
        for n in 0..10 {
            let s = select_regular(&snap, &RoundRobinPolicy, &seq(n), &[0], &mut rng).unwrap();
            assert_eq!(s.worker, 1);
        }
        // Everything failed once: still pick something rather than nothing.
        assert!(select_regular(&snap, &RoundRobinPolicy, &RouteInput::default(), &[0, 1], &mut rng).is_ok());
    }

    #[test]
    fn an_open_breaker_on_a_prefill_makes_the_pair_ineligible() {
        use crate::breaker::BreakerState;
        let mut p = view("http://p1:1", WorkerRole::Prefill, None, true);
        p.breaker = BreakerState::Open;
        let snap = PoolSnapshot::build(vec![p, view("http://d1:1", WorkerRole::Decode, None, true)], KvConnector::Bootstrap);
        let mut rng = StdRng::seed_from_u64(3);
        let err = select_pair(&snap, &RandomPolicy, &RandomPolicy, &RouteInput::default(), &[], &mut rng).unwrap_err();
        assert_eq!(err.code(), "no_available_workers");
        assert!(!snap.pd_ready(), "readiness reflects the open breaker");
    }

    #[test]
    fn draining_and_half_open_workers() {
        use crate::breaker::BreakerState;
        let mut a = view("http://r1:1", WorkerRole::Regular, None, true);
        a.draining = true;
        let mut b = view("http://r2:1", WorkerRole::Regular, None, true);
        b.breaker = BreakerState::HalfOpen;
        let snap = PoolSnapshot::build(vec![a, b], KvConnector::Bootstrap);
        assert_eq!(snap.eligible(WorkerRole::Regular), &[1], "draining is out, half-open is in");
    }

    #[test]
    fn strict_pairing_refuses_unknown_layouts_and_says_so() {
        use crate::pairing::PairingMode;
        use crate::snapshot::SnapshotOptions;
        let mut p = WorkerSpec::new("http://p1:1", WorkerRole::Prefill).unwrap();
        p.runtime = Some("sglang".into());
        p.kv_layout.page_size = Some(16);
        let mut d = WorkerSpec::new("http://d1:1", WorkerRole::Decode).unwrap();
        d.runtime = Some("SGLang".into());
        let views = || vec![WorkerView::new(Arc::new(p.clone()), true), WorkerView::new(Arc::new(d.clone()), true)];
        let build = |mode| PoolSnapshot::build_with(views(), SnapshotOptions { pairing_mode: mode, ..Default::default() }, None);
        assert!(build(PairingMode::Lenient).pd_ready(), "runtime names compare case-insensitively; unknown page size is fine");
        let strict = build(PairingMode::Strict);
        assert!(!strict.pd_ready());
        let mut rng = StdRng::seed_from_u64(3);
        let err = select_pair(&strict, &RandomPolicy, &RandomPolicy, &RouteInput::default(), &[], &mut rng).unwrap_err();
        assert_eq!(err.code(), "no_compatible_pd_pair");
        assert!(err.message.contains("KV layout page_size unknown"), "{}", err.message);
    }
}
