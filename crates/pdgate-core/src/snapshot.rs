//! An immutable view of the whole pool: every routing decision reads one snapshot, so it never
//! sees half an update. The registry in `pdgate-gateway` rebuilds and swaps it atomically when
//! membership, health, drain or breaker state changes; nothing here changes after `build`
//! (the consistent-hash rings are computed on first use, or carried over from the previous
//! snapshot when membership did not change).
//!
//! Everything a decision needs that would cost O(fleet) is precomputed here: eligible workers
//! per role, the URL → index map, and the prefill → compatible decodes pairing index.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use crate::breaker::BreakerState;
use crate::pairing::{gap_message, PairingIndex, PairingKey, PairingMode};
use crate::policy::HashRing;
use crate::worker::{KvConnector, WorkerRole, WorkerSpec};

/// One worker as routing sees it.
#[derive(Clone, Debug)]
pub struct WorkerView {
    pub spec: Arc<WorkerSpec>,
    /// Result of active health checks (with thresholds applied).
    pub healthy: bool,
    /// Administrative switch; a disabled worker is not a failed one.
    pub enabled: bool,
    /// Being removed: in-flight requests finish, new ones go elsewhere.
    pub draining: bool,
    /// The circuit breaker's state when the snapshot was built (see `breaker`).
    pub breaker: BreakerState,
    /// Model names the worker serves, when known.
    pub models: Vec<String>,
    /// The engine's context length (`max_model_len`, `context_length`), when it reports one.
    pub context_length: Option<u64>,
    /// Unhealthy only because its active checks went unanswered (`HealthState::silent`):
    /// panic routing may still send it requests.
    pub silent: bool,
}

impl WorkerView {
    /// A healthy-or-not, enabled, not draining worker with a closed breaker.
    pub fn new(spec: Arc<WorkerSpec>, healthy: bool) -> Self {
        WorkerView { spec, healthy, enabled: true, draining: false, breaker: BreakerState::Closed, models: Vec::new(), context_length: None, silent: false }
    }

    /// Healthy, enabled, not draining, and the breaker lets requests through.
    pub fn eligible(&self) -> bool {
        self.healthy && self.enabled && !self.draining && self.breaker.allows()
    }

    /// Eligible but for health checks that went unanswered: what panic routing uses when a
    /// role has no eligible worker (the breaker, a drain and the admin switch still count).
    pub fn panic_eligible(&self) -> bool {
        !self.healthy && self.silent && self.enabled && !self.draining && self.breaker.allows()
    }
}

/// How a snapshot is built, besides its workers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SnapshotOptions {
    /// The connector of workers registered without one.
    pub default_connector: KvConnector,
    pub pairing_mode: PairingMode,
}

/// The smaller of two lengths where either may be unknown.
fn min_known(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

const ROLES: [WorkerRole; 4] = [WorkerRole::Regular, WorkerRole::Prefill, WorkerRole::Decode, WorkerRole::Encode];

fn role_slot(role: WorkerRole) -> usize {
    match role {
        WorkerRole::Regular => 0,
        WorkerRole::Prefill => 1,
        WorkerRole::Decode => 2,
        WorkerRole::Encode => 3,
    }
}

#[derive(Clone, Debug, Default)]
pub struct PoolSnapshot {
    workers: Vec<WorkerView>,
    options: SnapshotOptions,
    /// Indices of eligible workers per role, ascending (the silent ones under panic routing).
    eligible: [Vec<usize>; 4],
    /// Per role: no worker was eligible, so the silent ones are routed to (Envoy's panic
    /// threshold, at zero healthy): busy engines that do not answer health are not refused.
    panic: [bool; 4],
    by_url: HashMap<String, usize>,
    keys: Vec<PairingKey>,
    pairing: PairingIndex,
    /// Consistent-hash rings per role over all workers of the role, eligible or not.
    rings: [OnceLock<Arc<HashRing>>; 4],
    /// Smallest reported context length among eligible workers, per model they serve (`None`
    /// when none of them reports one).
    context_by_model: HashMap<String, Option<u64>>,
    /// Smallest reported context length among all eligible workers.
    context_any: Option<u64>,
}

impl PoolSnapshot {
    /// Lenient pairing; see [`PoolSnapshot::build_with`].
    pub fn build(workers: Vec<WorkerView>, default_connector: KvConnector) -> Self {
        Self::build_with(workers, SnapshotOptions { default_connector, ..Default::default() }, None)
    }

    /// Builds the routing view. Pass the snapshot being replaced as `previous` so its hash rings
    /// are reused when the workers of a role did not change (a health flip, a drain).
    pub fn build_with(workers: Vec<WorkerView>, options: SnapshotOptions, previous: Option<&PoolSnapshot>) -> Self {
        let mut snap = PoolSnapshot { workers, options, ..Default::default() };
        for role in ROLES {
            let slot = role_slot(role);
            let of_role = |w: &WorkerView| w.spec.role == role;
            snap.panic[slot] = !snap.workers.iter().any(|w| of_role(w) && w.eligible()) && snap.workers.iter().any(|w| of_role(w) && w.panic_eligible());
        }
        for (i, w) in snap.workers.iter().enumerate() {
            snap.by_url.insert(w.spec.url.clone(), i);
            snap.keys.push(PairingKey::of(&w.spec, options.default_connector));
            let routed = if snap.panic[role_slot(w.spec.role)] { w.panic_eligible() } else { w.eligible() };
            if routed {
                snap.eligible[role_slot(w.spec.role)].push(i);
            }
            // An encode worker generates nothing: its context length bounds no request.
            if routed && w.spec.role != WorkerRole::Encode {
                let len = w.context_length;
                snap.context_any = min_known(snap.context_any, len);
                for m in &w.models {
                    let c = snap.context_by_model.entry(m.clone()).or_insert(len);
                    *c = min_known(*c, len);
                }
            }
        }
        snap.pairing = PairingIndex::build(&snap.keys, &snap.eligible[1], &snap.eligible[2], options.pairing_mode);
        if let Some(prev) = previous {
            for role in ROLES {
                let slot = role_slot(role);
                if let Some(ring) = prev.rings[slot].get() {
                    if prev.members(role).eq(snap.members(role)) {
                        let _ = snap.rings[slot].set(ring.clone());
                    }
                }
            }
        }
        snap
    }

    /// `(index, url)` of every worker of `role`, eligible or not.
    fn members(&self, role: WorkerRole) -> impl Iterator<Item = (usize, &str)> {
        self.workers.iter().enumerate().filter(move |(_, w)| w.spec.role == role).map(|(i, w)| (i, w.spec.url.as_str()))
    }

    pub fn workers(&self) -> &[WorkerView] {
        &self.workers
    }

    pub fn worker(&self, index: usize) -> &WorkerView {
        &self.workers[index]
    }

    /// The snapshot index of the worker with this URL. O(1).
    pub fn index_of(&self, url: &str) -> Option<usize> {
        self.by_url.get(url).copied()
    }

    pub fn default_connector(&self) -> KvConnector {
        self.options.default_connector
    }

    pub fn pairing_mode(&self) -> PairingMode {
        self.options.pairing_mode
    }

    /// The connector worker `index` speaks.
    pub fn connector_of(&self, index: usize) -> KvConnector {
        self.keys[index].transport
    }

    /// Worker `index`'s pairing key (for `GET /workers`).
    pub fn pairing_key(&self, index: usize) -> &PairingKey {
        &self.keys[index]
    }

    /// Whether `role` is under panic routing: none of its workers is eligible, and its silent
    /// ones (`WorkerView::panic_eligible`) take its requests.
    pub fn in_panic(&self, role: WorkerRole) -> bool {
        self.panic[role_slot(role)]
    }

    /// URLs of `role`'s workers routed to under panic (empty when the role is not in panic).
    pub fn panic_workers(&self, role: WorkerRole) -> Vec<&str> {
        if !self.in_panic(role) {
            return Vec::new();
        }
        self.eligible(role).iter().map(|&i| self.workers[i].spec.url.as_str()).collect()
    }

    /// Eligible workers of `role`, ascending.
    pub fn eligible(&self, role: WorkerRole) -> &[usize] {
        &self.eligible[role_slot(role)]
    }

    /// Prefills that can be paired with some eligible decode. A prefill whose breaker is open
    /// is not eligible, so it is not here and no decode is dispatched for it.
    pub fn pairable_prefills(&self) -> &[usize] {
        &self.pairing.pairable_prefill
    }

    /// Eligible decodes compatible with prefill `prefill` under the pairing mode, ascending.
    pub fn compatible_decodes(&self, prefill: usize) -> &[usize] {
        self.pairing.compatible_decodes(prefill)
    }

    /// PD mode is ready when at least one prefill can be paired with a decode.
    pub fn pd_ready(&self) -> bool {
        !self.pairing.pairable_prefill.is_empty()
    }

    /// Why no pair exists, for the `no_compatible_pd_pair` message: names what differed
    /// (transport, runtime, KV layout).
    pub fn pairing_gap(&self) -> String {
        gap_message(&self.keys, self.eligible(WorkerRole::Prefill), self.eligible(WorkerRole::Decode), self.options.pairing_mode)
    }

    /// The consistent-hash ring of `role`; built on first use.
    pub fn hash_ring(&self, role: WorkerRole) -> &HashRing {
        self.rings[role_slot(role)].get_or_init(|| Arc::new(HashRing::build(self.members(role))))
    }

    /// The longest sequence every eligible worker for `model` can hold: the smallest reported
    /// context length among eligible workers serving it, or among all eligible workers when no
    /// worker lists the model (or none was named). `None` when no such worker reports one.
    pub fn context_limit(&self, model: Option<&str>) -> Option<u64> {
        match model.and_then(|m| self.context_by_model.get(m)) {
            Some(served) => *served,
            None => self.context_any,
        }
    }

    /// Models served by eligible workers, sorted and deduplicated.
    pub fn models(&self) -> Vec<String> {
        let routed = self.eligible.iter().flatten().map(|&i| &self.workers[i]);
        let mut out: Vec<String> = routed.flat_map(|w| w.models.iter().cloned()).collect();
        out.sort();
        out.dedup();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(url: &str, models: &[&str], context: Option<u64>, healthy: bool) -> WorkerView {
        let spec = Arc::new(WorkerSpec::new(url, WorkerRole::Regular).unwrap());
        WorkerView { models: models.iter().map(|m| m.to_string()).collect(), context_length: context, ..WorkerView::new(spec, healthy) }
    }

    #[test]
    fn context_limit_is_the_smallest_among_eligible_workers_of_the_model() {
        let snap = PoolSnapshot::build(
            vec![
                view("http://a:1", &["m"], Some(4096), true),
                view("http://b:1", &["m"], Some(2048), true),
                view("http://c:1", &["m"], Some(16), false),
                view("http://d:1", &["big"], Some(131072), true),
                view("http://e:1", &["silent"], None, true),
            ],
            KvConnector::Bootstrap,
        );
        assert_eq!(snap.context_limit(Some("m")), Some(2048), "the unhealthy worker does not count");
        assert_eq!(snap.context_limit(Some("big")), Some(131072));
        assert_eq!(snap.context_limit(Some("silent")), None, "its workers report nothing: no check");
        assert_eq!(snap.context_limit(Some("unknown")), Some(2048), "no worker lists it: any eligible worker");
        assert_eq!(snap.context_limit(None), Some(2048));
        assert_eq!(PoolSnapshot::default().context_limit(None), None);
    }

    fn decode(url: &str, healthy: bool, silent: bool) -> WorkerView {
        let spec = Arc::new(WorkerSpec::new(url, WorkerRole::Decode).unwrap());
        WorkerView { silent, ..WorkerView::new(spec, healthy) }
    }

    #[test]
    fn a_role_whose_workers_are_only_silent_is_routed_in_panic() {
        let build = |views| PoolSnapshot::build(views, KvConnector::Bootstrap);
        // One healthy decode: no panic, the silent one is not routed to.
        let snap = build(vec![decode("http://a:1", true, false), decode("http://b:1", false, true)]);
        assert_eq!((snap.in_panic(WorkerRole::Decode), snap.eligible(WorkerRole::Decode)), (false, &[0][..]));
        // None healthy: the silent ones take the role's requests; a worker known down does not.
        let snap = build(vec![decode("http://a:1", false, false), decode("http://b:1", false, true), decode("http://c:1", false, true)]);
        assert!(snap.in_panic(WorkerRole::Decode));
        assert_eq!(snap.eligible(WorkerRole::Decode), &[1, 2]);
        assert_eq!(snap.panic_workers(WorkerRole::Decode), ["http://b:1", "http://c:1"]);
        assert!(!snap.in_panic(WorkerRole::Prefill) && snap.panic_workers(WorkerRole::Prefill).is_empty());
        // The breaker, a drain and the admin switch still take a silent worker out.
        let mut open = decode("http://b:1", false, true);
        open.breaker = BreakerState::Open;
        let mut draining = decode("http://c:1", false, true);
        draining.draining = true;
        let mut disabled = decode("http://d:1", false, true);
        disabled.enabled = false;
        let snap = build(vec![open, draining, disabled, decode("http://e:1", false, false)]);
        assert!(!snap.in_panic(WorkerRole::Decode) && snap.eligible(WorkerRole::Decode).is_empty());
    }
}
