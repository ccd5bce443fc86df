//! Choosing workers for one request: a regular worker, or a compatible prefill/decode pair.

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

pub fn select_regular(
    snap: &PoolSnapshot,
    policy: &dyn Policy,
    input: &RouteInput<'_>,
    exclude: &[usize],
    rng: &mut dyn RngCore,
) -> Result<Selection, GatewayError> {
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
    let prefill = prefill_policy
        .select(snap, prefills, input, rng)
        .ok_or_else(|| GatewayError::no_compatible_pair(snap.pairing_gap()))?;
    let mut buf2 = Vec::new();
    let decodes = without(snap.compatible_decodes(prefill.worker), exclude, &mut buf2);
    let decode = decode_policy
        .select(snap, decodes, input, rng)
        .ok_or_else(|| GatewayError::no_compatible_pair(snap.pairing_gap()))?;
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
        WorkerView { spec: Arc::new(spec), healthy, enabled: true, models: vec![] }
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
        for seq in 0..20 {
            let (p, d) = select_pair(&snap, &RandomPolicy, &RoundRobinPolicy, &RouteInput { text: None, sequence: seq }, &[], &mut rng).unwrap();
            assert_eq!((p.worker, d.worker), (1, 2), "the nixl prefill has no nixl decode");
        }
    }

    #[test]
    fn no_pair_names_the_mismatch() {
        let snap = PoolSnapshot::build(
            vec![
                view("http://p1:1", WorkerRole::Prefill, Some(KvConnector::Nixl), true),
                view("http://d1:1", WorkerRole::Decode, Some(KvConnector::Mooncake), true),
            ],
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
        let snap = PoolSnapshot::build(
            vec![view("http://p1:1", WorkerRole::Prefill, None, true), view("http://d1:1", WorkerRole::Decode, None, false)],
            KvConnector::Bootstrap,
        );
        let mut rng = StdRng::seed_from_u64(3);
        let err = select_pair(&snap, &RandomPolicy, &RandomPolicy, &RouteInput::default(), &[], &mut rng).unwrap_err();
        assert_eq!((err.code().as_str(), err.status()), ("no_available_workers", 503));
        assert!(err.message.contains("decode"));
    }

    #[test]
    fn retries_avoid_workers_that_failed_when_others_exist() {
        let snap = PoolSnapshot::build(
            vec![view("http://r1:1", WorkerRole::Regular, None, true), view("http://r2:1", WorkerRole::Regular, None, true)],
            KvConnector::Bootstrap,
        );
        let mut rng = StdRng::seed_from_u64(9);
        for seq in 0..10 {
            let s = select_regular(&snap, &RoundRobinPolicy, &RouteInput { text: None, sequence: seq }, &[0], &mut rng).unwrap();
            assert_eq!(s.worker, 1);
        }
        // Everything failed once: still pick something rather than nothing.
        assert!(select_regular(&snap, &RoundRobinPolicy, &RouteInput::default(), &[0, 1], &mut rng).is_ok());
    }
}
