//! The gateway's view of what every worker's KV cache holds, fed by the engines' KV events
//! (docs/kv-events.md): one subscription task per worker that registered a `kv_events`
//! endpoint (ZMQ, `subscriber.rs`) and per gRPC worker (`SubscribeKvEvents`, `grpc_sub.rs`),
//! all applying to one [`KvIndex`] behind a mutex held for one batch or one match.
//!
//! Every gateway replica subscribes to the same publishers, so all replicas hold the same view
//! without talking to each other.

pub mod grpc_sub;
pub mod subscriber;
#[cfg(test)]
mod tests;
pub mod zmtp;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use pdgate_core::kv_events::DecodedBatch;
use pdgate_core::kv_index::{IndexStats, KvIndex, SeqCheck, WorkerSlot};
use pdgate_core::{CachedBlocks, PoolSnapshot};
use tokio::task::JoinHandle;

pub use subscriber::SubTimings;

/// Counters the index does not keep itself.
#[derive(Debug, Default)]
pub struct SubMetrics {
    /// Successful connections to a publisher (each one resets that worker's view).
    pub connects: AtomicU64,
    /// Replay requests (gap fills and catch-ups after a connect).
    pub replays: AtomicU64,
    /// Connections whose catch-up is done (the replay socket's buffer applied, or none to
    /// ask): from then on the worker's view is as current as its events.
    pub catch_ups: AtomicU64,
    /// Replays that did not fill their range (no answer, or the buffer no longer had it).
    pub replay_failures: AtomicU64,
    /// Messages that were not `(topic, 8-byte seq, payload)`.
    pub bad_messages: AtomicU64,
}

struct Sub {
    slot: WorkerSlot,
    source: Source,
    task: JoinHandle<()>,
}

/// Where a worker's events come from.
#[derive(PartialEq, Eq)]
enum Source {
    /// A registered ZMQ publisher (and its replay socket).
    Zmq(String, Option<String>),
    /// The gRPC worker's own `SubscribeKvEvents` stream.
    Grpc,
}

/// The index and the counters, shared with the subscription tasks.
pub struct KvShared {
    index: Mutex<KvIndex>,
    pub metrics: SubMetrics,
    /// gRPC workers whose stream is open: only these count as publishing (a gRPC worker that
    /// does not offer `SubscribeKvEvents`, or cannot be reached, is matched on the text tree
    /// under `--cache-source auto`).
    grpc_live: Mutex<HashSet<WorkerSlot>>,
}

impl KvShared {
    /// The index, for one short operation. A panic inside one leaves it usable (no operation
    /// awaits or calls out while holding it), so a poisoned lock is taken over.
    pub fn lock(&self) -> MutexGuard<'_, KvIndex> {
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn apply(&self, slot: WorkerSlot, seq: u64, batch: &DecodedBatch) -> SeqCheck {
        self.lock().apply(slot, seq, batch)
    }

    /// A gRPC worker's stream opened (true) or ended (false).
    pub fn set_grpc_live(&self, slot: WorkerSlot, live: bool) {
        let mut set = self.grpc_live.lock().unwrap_or_else(|p| p.into_inner());
        if live {
            set.insert(slot);
        } else {
            set.remove(&slot);
        }
    }

    fn grpc_live(&self, slot: WorkerSlot) -> bool {
        self.grpc_live.lock().unwrap_or_else(|p| p.into_inner()).contains(&slot)
    }
}

/// The shared index and the subscriptions feeding it; dropping it ends them.
pub struct KvView {
    shared: Arc<KvShared>,
    subs: Mutex<Subs>,
    timings: SubTimings,
}

/// The subscriptions by worker URL, and each index slot's URL: a match maps its holders back to
/// workers one lookup per holder, not one per subscription (a 1,000-worker fleet).
#[derive(Default)]
struct Subs {
    by_url: HashMap<String, Sub>,
    url_of_slot: Vec<Option<String>>,
    /// How many are ZMQ publishers (always publishing, unlike a gRPC stream that may be shut).
    zmq: usize,
}

impl Subs {
    fn insert(&mut self, url: &str, sub: Sub) {
        let i = sub.slot as usize;
        if self.url_of_slot.len() <= i {
            self.url_of_slot.resize(i + 1, None);
        }
        self.url_of_slot[i] = Some(url.to_string());
        self.zmq += usize::from(sub.source != Source::Grpc);
        self.by_url.insert(url.to_string(), sub);
    }

    fn remove(&mut self, url: &str) -> Option<Sub> {
        let sub = self.by_url.remove(url)?;
        if let Some(u) = self.url_of_slot.get_mut(sub.slot as usize) {
            *u = None;
        }
        self.zmq -= usize::from(sub.source != Source::Grpc);
        Some(sub)
    }

    fn url_of(&self, slot: WorkerSlot) -> Option<&str> {
        self.url_of_slot.get(slot as usize)?.as_deref()
    }
}

impl KvView {
    /// `seed`: random per process in production (keys a client cannot aim at); `max_blocks`
    /// bounds the index (worker-block entries).
    pub fn new(seed: u64, max_blocks: usize, timings: SubTimings) -> KvView {
        let shared = Arc::new(KvShared { index: Mutex::new(KvIndex::new(seed, max_blocks)), metrics: SubMetrics::default(), grpc_live: Mutex::new(HashSet::new()) });
        KvView { shared, subs: Mutex::new(Subs::default()), timings }
    }

    pub fn metrics(&self) -> &SubMetrics {
        &self.shared.metrics
    }

    fn lock(&self) -> MutexGuard<'_, KvIndex> {
        self.shared.lock()
    }

    /// Subscribe to a worker's publisher (idempotent; new endpoints restart it from empty).
    pub fn watch(&self, worker_url: &str, endpoint: &str, replay: Option<&str>) {
        let source = Source::Zmq(endpoint.to_string(), replay.map(str::to_string));
        let (shared, timings) = (Arc::clone(&self.shared), self.timings);
        let (endpoint, replay) = (endpoint.to_string(), replay.map(str::to_string));
        self.start(worker_url, source, move |slot| tokio::spawn(subscriber::run(shared, slot, endpoint, replay, timings)));
    }

    /// Subscribe to a gRPC worker's `SubscribeKvEvents` (idempotent). A worker that does not
    /// offer it ends its task; it then never counts as publishing.
    pub fn watch_grpc(&self, worker_url: &str, grpc: Arc<crate::clients::grpc::GrpcClient>) {
        let (shared, timings, url) = (Arc::clone(&self.shared), self.timings, worker_url.to_string());
        self.start(worker_url, Source::Grpc, move |slot| tokio::spawn(grpc_sub::run(shared, slot, url, grpc, timings)));
    }

    fn start(&self, worker_url: &str, source: Source, spawn: impl FnOnce(WorkerSlot) -> JoinHandle<()>) {
        let mut subs = self.subs.lock().unwrap_or_else(|p| p.into_inner());
        if subs.by_url.get(worker_url).is_some_and(|s| s.source == source) {
            return;
        }
        if let Some(old) = subs.remove(worker_url) {
            self.drop_sub(old);
        }
        let slot = self.lock().add_worker();
        let task = spawn(slot);
        subs.insert(worker_url, Sub { slot, source, task });
    }

    /// End a worker's subscription and drop its view.
    pub fn unwatch(&self, worker_url: &str) {
        let old = self.subs.lock().unwrap_or_else(|p| p.into_inner()).remove(worker_url);
        if let Some(old) = old {
            self.drop_sub(old);
        }
    }

    fn drop_sub(&self, sub: Sub) {
        sub.task.abort();
        self.shared.set_grpc_live(sub.slot, false);
        self.lock().remove_worker(sub.slot);
    }

    /// Whether this sub's events reach the index (a registered publisher always counts: its
    /// view is what is known of it; a gRPC worker while its stream is open).
    fn publishes(&self, sub: &Sub) -> bool {
        sub.source != Source::Grpc || self.shared.grpc_live(sub.slot)
    }

    /// Whether this worker publishes KV events to us (it registered an endpoint, or its gRPC
    /// stream is open).
    pub fn is_watched(&self, worker_url: &str) -> bool {
        self.subs.lock().unwrap_or_else(|p| p.into_inner()).by_url.get(worker_url).is_some_and(|s| self.publishes(s))
    }

    /// For each watched worker holding a prefix of `tokens`: its URL and how many leading
    /// tokens it holds.
    pub fn matches(&self, tokens: &[u32]) -> HashMap<String, usize> {
        let by_slot = self.lock().match_tokens(tokens);
        let subs = self.subs.lock().unwrap_or_else(|p| p.into_inner());
        by_slot.into_iter().filter_map(|(slot, n)| Some((subs.url_of(slot)?.to_string(), n))).collect()
    }

    /// Whether any worker publishes KV events to us. Asked per request: O(1), not a scan of
    /// the subscriptions (a fleet of gRPC workers whose streams are shut would scan them all).
    pub fn any_watched(&self) -> bool {
        self.subs.lock().unwrap_or_else(|p| p.into_inner()).zmq > 0 || !self.shared.grpc_live.lock().unwrap_or_else(|p| p.into_inner()).is_empty()
    }

    /// For each worker of `snap` holding a prefix of `tokens`: `(snapshot index, leading tokens
    /// it holds)`, ascending by index (what cache_aware reads as `RouteInput::kv`); and the gRPC
    /// workers whose stream is open, by snapshot index, ascending (`KvMatch::subscribed`).
    pub fn held_in(&self, snap: &PoolSnapshot, tokens: &[u32]) -> (Vec<(usize, usize)>, Vec<usize>) {
        let by_slot = self.lock().match_tokens(tokens);
        let live: Vec<WorkerSlot> = self.shared.grpc_live.lock().unwrap_or_else(|p| p.into_inner()).iter().copied().collect();
        let subs = self.subs.lock().unwrap_or_else(|p| p.into_inner());
        // One URL lookup per holder and per open gRPC stream, not per subscription.
        let index_of = |slot: WorkerSlot| snap.index_of(subs.url_of(slot)?);
        let mut held: Vec<(usize, usize)> = by_slot.into_iter().filter_map(|(slot, n)| Some((index_of(slot)?, n))).collect();
        let mut subscribed: Vec<usize> = live.into_iter().filter_map(index_of).collect();
        held.sort_unstable();
        subscribed.sort_unstable();
        (held, subscribed)
    }

    /// Applies a batch to a watched worker's view as its subscription would; `None` when the
    /// worker is not watched. For benches (tests in this crate reach the index directly).
    #[doc(hidden)]
    pub fn apply_to(&self, worker_url: &str, seq: u64, batch: &DecodedBatch) -> Option<SeqCheck> {
        Some(self.shared.apply(self.slot_of(worker_url)?, seq, batch))
    }

    /// Blocks a worker's view holds; `None` when the worker is not watched.
    pub fn worker_blocks(&self, worker_url: &str) -> Option<usize> {
        let slot = self.slot_of(worker_url)?;
        Some(self.lock().worker_blocks(slot))
    }

    /// The index slot of a watched worker (the subscriptions' lock is released on return).
    fn slot_of(&self, worker_url: &str) -> Option<WorkerSlot> {
        self.subs.lock().unwrap_or_else(|p| p.into_inner()).by_url.get(worker_url).map(|s| s.slot)
    }

    /// The index's counters and its size in bytes (estimate, O(workers) to compute), for
    /// metrics.
    pub fn stats(&self) -> (IndexStats, usize) {
        let index = self.lock();
        (index.stats(), index.memory_bytes())
    }

    /// The index's bound on worker-block entries (`--kv-index-max-blocks`).
    pub fn max_blocks(&self) -> usize {
        self.lock().max_blocks()
    }
}

impl KvView {
    /// The KV event metrics in the Prometheus text format, appended to `/metrics` (empty while
    /// no worker publishes events).
    pub fn metrics_text(&self) -> String {
        use std::fmt::Write;
        let watched = self.subs.lock().unwrap_or_else(|p| p.into_inner()).by_url.values().filter(|s| self.publishes(s)).count();
        if watched == 0 {
            return String::new();
        }
        let (st, bytes) = self.stats();
        let max_blocks = self.max_blocks();
        let m = self.metrics();
        let rows: [(&str, &str, &str, u64); 18] = [
            ("pdgate_kv_events_subscriptions", "gauge", "Workers whose KV events this gateway subscribes to", watched as u64),
            ("pdgate_kv_index_blocks", "gauge", "Worker-block entries in the KV event index", st.blocks as u64),
            ("pdgate_kv_index_max_blocks", "gauge", "Bound on worker-block entries in the KV event index (--kv-index-max-blocks)", max_blocks as u64),
            ("pdgate_kv_index_keys", "gauge", "Distinct prefixes (content keys) in the KV event index", st.keys as u64),
            ("pdgate_kv_index_bytes", "gauge", "Estimated heap of the KV event index", bytes as u64),
            ("pdgate_kv_events_blocks_stored_total", "counter", "Blocks stored by applied KV events", st.stored),
            ("pdgate_kv_events_blocks_removed_total", "counter", "Blocks removed by applied KV events", st.removed),
            ("pdgate_kv_events_orphans_total", "counter", "Stored blocks whose parent the view did not know", st.orphans),
            ("pdgate_kv_index_evictions_total", "counter", "Worker-block entries evicted to stay within --kv-index-max-blocks", st.evicted),
            ("pdgate_kv_events_over_capacity_total", "counter", "Stored blocks ignored because --kv-index-max-blocks is 0", st.over_capacity),
            ("pdgate_kv_events_undecodable_total", "counter", "KV events (or whole payloads) that could not be decoded", st.undecodable),
            ("pdgate_kv_events_gaps_total", "counter", "Sequence gaps seen in a worker's KV event stream", st.gaps),
            ("pdgate_kv_events_resets_total", "counter", "Worker views reset (connect, unfilled gap)", st.resets),
            ("pdgate_kv_events_connects_total", "counter", "Connections made to KV event publishers", m.connects.load(Ordering::Relaxed)),
            ("pdgate_kv_events_replays_total", "counter", "Replay requests sent to KV event replay sockets", m.replays.load(Ordering::Relaxed)),
            (
                "pdgate_kv_events_caught_up_total",
                "counter",
                "Connections to KV event publishers whose catch-up from the replay socket is done",
                m.catch_ups.load(Ordering::Relaxed),
            ),
            ("pdgate_kv_events_replay_failures_total", "counter", "Replays that did not fill their range", m.replay_failures.load(Ordering::Relaxed)),
            ("pdgate_kv_events_bad_messages_total", "counter", "Messages that were not (topic, seq, payload)", m.bad_messages.load(Ordering::Relaxed)),
        ];
        let mut out = String::new();
        for (name, kind, help, value) in rows {
            let _ = write!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}\n");
        }
        out
    }
}

impl Drop for KvView {
    fn drop(&mut self) {
        for (_, sub) in self.subs.get_mut().unwrap_or_else(|p| p.into_inner()).by_url.drain() {
            sub.task.abort();
        }
    }
}

/// The block counts of one snapshot's workers, read from the index when a policy asks (only
/// on a cache miss, for at most the scan's candidates).
pub struct SnapshotBlocks<'a> {
    pub view: &'a KvView,
    pub snap: &'a PoolSnapshot,
}

impl CachedBlocks for SnapshotBlocks<'_> {
    fn cached_blocks(&self, worker: usize) -> Option<usize> {
        self.view.worker_blocks(&self.snap.worker(worker).spec.url)
    }
}
