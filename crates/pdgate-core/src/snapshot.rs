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
}

impl WorkerView {
    /// A healthy-or-not, enabled, not draining worker with a closed breaker.
    pub fn new(spec: Arc<WorkerSpec>, healthy: bool) -> Self {
        WorkerView { spec, healthy, enabled: true, draining: false, breaker: BreakerState::Closed, models: Vec::new(), context_length: None }
    }

    /// Healthy, enabled, not draining, and the breaker lets requests through.
    pub fn eligible(&self) -> bool {
        self.healthy && self.enabled && !self.draining && self.breaker.allows()
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

const ROLES: [WorkerRole; 3] = [WorkerRole::Regular, WorkerRole::Prefill, WorkerRole::Decode];

fn role_slot(role: WorkerRole) -> usize {
    match role {
        WorkerRole::Regular => 0,
        WorkerRole::Prefill => 1,
        WorkerRole::Decode => 2,
    }
}

#[derive(Clone, Debug, Default)]
pub struct PoolSnapshot {
    workers: Vec<WorkerView>,
    options: SnapshotOptions,
    /// Indices of eligible workers per role, ascending.
    eligible: [Vec<usize>; 3],
    by_url: HashMap<String, usize>,
    keys: Vec<PairingKey>,
    pairing: PairingIndex,
    /// Consistent-hash rings per role over all workers of the role, eligible or not.
    rings: [OnceLock<Arc<HashRing>>; 3],
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
        for (i, w) in snap.workers.iter().enumerate() {
            snap.by_url.insert(w.spec.url.clone(), i);
            snap.keys.push(PairingKey::of(&w.spec, options.default_connector));
            if w.eligible() {
                snap.eligible[role_slot(w.spec.role)].push(i);
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
        let mut out: Vec<String> = self.workers.iter().filter(|w| w.eligible()).flat_map(|w| w.models.iter().cloned()).collect();
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
}
