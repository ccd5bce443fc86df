//! The worker registry: the mutable list of workers (from static flags, the `/workers` API or
//! discovery) with their health and runtime counters, and the immutable routing view that
//! requests read. Every membership or health change rebuilds the view and swaps it in
//! atomically; requests never see half an update.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use arc_swap::ArcSwap;

pub use crate::clients::engine_info::EngineInfo;
use pdgate_core::breaker::{Breaker, BreakerConfig, BreakerState, Judgement, Outcome};
use pdgate_core::{HealthState, KvLayout, PairingKey, PairingMode, PoolSnapshot, Probe, SnapshotOptions, WorkerRole, WorkerSpec, WorkerView};

/// Where a worker came from. Discovery only ever removes what discovery added.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Source {
    Static,
    Api,
    Discovery,
}

impl Source {
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Static => "static",
            Source::Api => "api",
            Source::Discovery => "discovery",
        }
    }
}

/// Live per-worker counters, shared by the routing view and the requests using the worker.
#[derive(Debug, Default)]
pub struct Runtime {
    /// Requests this gateway has in flight on the worker, until nothing is owed to it any more
    /// (a prefill's count lasts until its decode is done): what draining waits for. Routing
    /// reads `tokens` instead (token_load.rs).
    pub inflight: AtomicU64,
    /// Work queued on the worker in requests, prompt tokens and KV tokens, and the engine's
    /// last token report (routing load).
    pub tokens: crate::fleet::token_load::TokenLoad,
    /// Which load endpoint answered last (load.rs), tried first at the next poll.
    pub load_source: std::sync::atomic::AtomicU8,
    /// Engine-reported load (running + waiting requests), or -1 when unknown.
    pub polled_load: AtomicI64,
    /// When `polled_load` was read, as milliseconds since the registry started.
    pub polled_at_ms: AtomicU64,
    /// The worker's circuit breaker. Its own lock, so that recording a request's outcome
    /// neither scans the registry nor waits on the registry lock.
    pub breaker: Mutex<Breaker>,
    /// The health probe asked by no-answer timeouts ([`Judgement::Probe`]): `None` when none is
    /// in flight, `Some(n)` while one is, with the `n` timeouts that take its verdict. At most
    /// one probe per worker, however many requests of a burst time out (`Fleet::ask_worker`).
    pub probe: Mutex<Option<u32>>,
    /// Mooncake prefill: the engine id in use, seeded from the registration (`kv_engine_id`)
    /// or learned from its bootstrap `/query`; cleared when a transfer with it failed.
    pub engine_id: Mutex<Option<String>>,
    /// The last reason the worker failed a health check or a request leg, with when (Unix
    /// seconds), for `GET /workers`.
    pub last_error: Mutex<Option<(String, u64)>>,
    /// Whether the engine's OpenAI streams carry token ids when asked (`return_token_ids`),
    /// learned from its streams: 0 unknown, 1 yes, 2 no. A stream whose ids the gateway tracks
    /// counts its tokens from them, so the engine need not be asked for the usage event
    /// (`exec/accounting.rs`, [`UsageAsk`](crate::exec::accounting::UsageAsk)).
    pub token_ids: std::sync::atomic::AtomicU8,
    /// When a data-path request to the worker last succeeded (an answer, or a stream's tokens
    /// flowing), as milliseconds since the registry started, plus one (0: never). The passive
    /// health signal: an unanswered health check does not count against a worker serving
    /// requests (health.rs). Not the breaker's own `last_success`: that one is kept only with
    /// the breaker on, under its lock, and a flowing stream updates this one as it goes.
    pub served_at_ms: AtomicU64,
}

impl Runtime {
    /// The engine is known to send token ids when asked.
    pub fn gives_token_ids(&self) -> bool {
        self.token_ids.load(std::sync::atomic::Ordering::Relaxed) == 1
    }

    /// What a stream of this engine showed: its prompt's token ids came, or not.
    pub fn learn_token_ids(&self, gave: bool) {
        self.token_ids.store(if gave { 1 } else { 2 }, std::sync::atomic::Ordering::Relaxed);
    }

    /// A data-path request to the worker succeeded at `now_ms` (registry milliseconds).
    pub fn note_served(&self, now_ms: u64) {
        self.served_at_ms.store(now_ms.saturating_add(1), Ordering::Relaxed);
    }

    /// Whether a data-path request succeeded within `window_ms` before `now_ms`.
    pub fn served_within(&self, now_ms: u64, window_ms: u64) -> bool {
        match self.served_at_ms.load(Ordering::Relaxed) {
            0 => false,
            at => now_ms.saturating_sub(at - 1) <= window_ms,
        }
    }

    pub fn note_error(&self, reason: String) {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = Some((reason, now));
    }

    pub fn last_error(&self) -> Option<(String, u64)> {
        self.last_error.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn breaker(&self) -> Breaker {
        self.breaker.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// The PD role an engine's reported mode names (`null`, `both` and unknown name none).
fn reported_role(mode: Option<&str>) -> Option<WorkerRole> {
    match mode? {
        "prefill" => Some(WorkerRole::Prefill),
        "decode" => Some(WorkerRole::Decode),
        _ => None,
    }
}

#[derive(Clone, Debug)]
pub struct Entry {
    pub id: String,
    pub spec: Arc<WorkerSpec>,
    pub source: Source,
    pub health: HealthState,
    pub enabled: bool,
    pub draining: bool,
    pub info: EngineInfo,
    pub runtime: Arc<Runtime>,
}

/// What routing reads: the snapshot plus the runtime counters of the same workers, by index.
pub struct Routing {
    pub snapshot: PoolSnapshot,
    pub runtime: Vec<Arc<Runtime>>,
}

#[derive(Debug, PartialEq, Eq)]
pub enum RegistryError {
    Duplicate(String),
    NotFound(String),
}

/// Where the registry reads the time: injected, so that breakers and load ages are tested on
/// a fake or paused clock. The gateway passes tokio's clock ([`tokio_clock`]).
pub type Clock = Arc<dyn Fn() -> Instant + Send + Sync>;

/// Tokio's clock as a std `Instant`: real time, or the paused test clock under
/// `tokio::time::pause`.
pub fn tokio_clock() -> Clock {
    Arc::new(|| tokio::time::Instant::now().into_std())
}

/// What the breaker says of a request about to be sent to a worker ([`Registry::admit`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Closed breaker (or breakers off, or the worker is gone): send.
    Pass,
    /// Half-open: this request is the one probe; its outcome decides.
    Probe,
    /// Half-open with a probe in flight (or open): choose another worker.
    Refused,
}

pub struct Registry {
    entries: Mutex<Vec<Entry>>,
    routing: ArcSwap<Routing>,
    options: SnapshotOptions,
    breaker_config: BreakerConfig,
    clock: Clock,
    epoch: Instant,
}

/// Whether `key` (an id or a URL, maybe with a trailing slash) names entry `e`.
fn names(e: &Entry, key: &str) -> bool {
    e.id == key || e.spec.url.eq_ignore_ascii_case(key.trim_end_matches('/'))
}

/// A short stable id derived from the URL, usable in paths (`/workers/{id}`).
pub fn worker_id(url: &str) -> String {
    // FNV-1a: stable across runs and platforms, unlike the std hasher.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in url.as_bytes() {
        h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
    }
    format!("w{:012x}", h & 0xffff_ffff_ffff)
}

impl Registry {
    pub fn new(specs: Vec<WorkerSpec>, options: SnapshotOptions, breaker_config: BreakerConfig) -> Self {
        Self::with_clock(specs, options, breaker_config, tokio_clock())
    }

    pub fn with_clock(specs: Vec<WorkerSpec>, options: SnapshotOptions, breaker_config: BreakerConfig, clock: Clock) -> Self {
        let reg = Registry {
            breaker_config,
            entries: Mutex::new(Vec::new()),
            routing: ArcSwap::from_pointee(Routing { snapshot: PoolSnapshot::default(), runtime: vec![] }),
            options,
            epoch: clock(),
            clock,
        };
        for spec in specs {
            let _ = reg.add(spec, Source::Static);
        }
        reg
    }

    /// The current routing view; cheap (one atomic load).
    pub fn routing(&self) -> Arc<Routing> {
        self.routing.load_full()
    }

    pub fn now_ms(&self) -> u64 {
        self.now().saturating_duration_since(self.epoch).as_millis() as u64
    }

    /// The registry's clock.
    pub fn now(&self) -> Instant {
        (self.clock)()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Entry>> {
        // Edits under this lock are single assignments, so a poisoned lock is still consistent.
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn rebuild(&self, entries: &[Entry]) {
        let now = self.now();
        let cfg = &self.breaker_config;
        let views = entries
            .iter()
            .map(|e| WorkerView {
                spec: e.spec.clone(),
                healthy: e.health.healthy,
                silent: e.health.silent(),
                enabled: e.enabled,
                draining: e.draining,
                breaker: {
                    // A half-open worker whose one probe is in flight takes no other request:
                    // routing reads it as open until the probe's outcome (or its timeout).
                    let b = e.runtime.breaker();
                    match b.state(now, cfg) {
                        BreakerState::HalfOpen if b.probing(now, cfg) => BreakerState::Open,
                        s => s,
                    }
                },
                models: e.info.models.clone(),
                context_length: e.info.context_length,
            })
            .collect();
        let runtime = entries.iter().map(|e| e.runtime.clone()).collect();
        let previous = self.routing.load();
        let snapshot = PoolSnapshot::build_with(views, self.options, Some(&previous.snapshot));
        self.routing.store(Arc::new(Routing { snapshot, runtime }));
    }

    /// Edits the entries under the lock and republishes the routing view.
    fn edit<T>(&self, f: impl FnOnce(&mut Vec<Entry>) -> T) -> T {
        let mut entries = self.lock();
        let out = f(&mut entries);
        self.rebuild(&entries);
        out
    }

    /// Adds a worker (in the gateway, through `membership::apply`: the one entry point of
    /// membership changes).
    pub fn add(&self, spec: WorkerSpec, source: Source) -> Result<Entry, RegistryError> {
        self.edit(|entries| {
            if let Some(e) = entries.iter().find(|e| e.spec.url == spec.url) {
                return Err(RegistryError::Duplicate(e.id.clone()));
            }
            let engine_id = Mutex::new(spec.kv_engine_id.clone());
            let entry = Entry {
                id: worker_id(&spec.url),
                spec: Arc::new(spec),
                source,
                health: HealthState::default(),
                enabled: true,
                draining: false,
                info: EngineInfo::default(),
                runtime: Arc::new(Runtime { polled_load: AtomicI64::new(-1), engine_id, ..Default::default() }),
            };
            entries.push(entry.clone());
            Ok(entry)
        })
    }

    /// Finds a worker by id or URL.
    pub fn get(&self, key: &str) -> Option<Entry> {
        self.lock().iter().find(|e| names(e, key)).cloned()
    }

    pub fn list(&self) -> Vec<Entry> {
        self.lock().clone()
    }

    /// Stops new requests to the worker; `finish_drain` removes it once its in-flight count is 0.
    pub fn start_drain(&self, key: &str) -> Result<Entry, RegistryError> {
        self.edit(|entries| {
            let e = entries.iter_mut().find(|e| names(e, key)).ok_or_else(|| RegistryError::NotFound(key.into()))?;
            e.draining = true;
            Ok(e.clone())
        })
    }

    /// Removes a draining worker if nothing is in flight on it; true when it is gone.
    pub fn finish_drain(&self, id: &str, force: bool) -> bool {
        let mut entries = self.lock();
        let Some(pos) = entries.iter().position(|e| e.id == id) else { return true };
        if !force && entries[pos].runtime.inflight.load(Ordering::SeqCst) > 0 {
            return false;
        }
        entries.remove(pos);
        self.rebuild(&entries);
        true
    }

    pub fn set_enabled(&self, key: &str, enabled: bool) -> Result<Entry, RegistryError> {
        self.edit(|entries| {
            let e = entries.iter_mut().find(|e| names(e, key)).ok_or_else(|| RegistryError::NotFound(key.into()))?;
            e.enabled = enabled;
            Ok(e.clone())
        })
    }

    /// Records a health check result; returns the new health when it changed.
    pub fn observe_health(&self, id: &str, probe: Probe, failure_threshold: u32, success_threshold: u32) -> Option<bool> {
        let mut entries = self.lock();
        let entry = entries.iter_mut().find(|e| e.id == id)?;
        let was_silent = entry.health.silent();
        if !entry.health.observe(probe, failure_threshold, success_threshold) {
            // Still unhealthy, but an answered failure ends its silence: out of panic routing.
            if was_silent != entry.health.silent() {
                self.rebuild(&entries);
            }
            return None;
        }
        let healthy = entry.health.healthy;
        self.rebuild(&entries);
        Some(healthy)
    }

    /// Records what the engine says about itself; its runtime, connector, reported role and KV
    /// layout become part of the worker's pairing key (facts given at registration win over
    /// what the engine reports; the gateway-wide `--kv-connector` is only the default for
    /// workers whose engine names none).
    pub fn set_info(&self, id: &str, info: EngineInfo) {
        self.edit(|entries| {
            if let Some(e) = entries.iter_mut().find(|e| e.id == id) {
                let mut spec = (*e.spec).clone();
                spec.runtime = spec.runtime.take().or_else(|| info.runtime.clone());
                spec.kv_connector = spec.kv_connector.or(info.kv_connector);
                spec.reported_role = spec.reported_role.or_else(|| reported_role(info.mode.as_deref()));
                let l = &mut spec.kv_layout;
                l.page_size = l.page_size.or(info.kv_layout.page_size);
                l.kv_dtype = l.kv_dtype.take().or_else(|| info.kv_layout.kv_dtype.clone());
                l.tp_size = l.tp_size.or(info.kv_layout.tp_size);
                l.attention_backend = l.attention_backend.take().or_else(|| info.kv_layout.attention_backend.clone());
                e.spec = Arc::new(spec);
                e.info = info;
            }
        });
    }

    /// Fills the unknown parts of a worker's runtime and KV layout from its load scrape (vLLM's
    /// `cache_config_info`: vLLM has no `/server_info`). Registration and `/server_info` facts
    /// win; the view is rebuilt only when something was learned.
    pub fn learn_pairing(&self, id: &str, runtime: Option<&str>, layout: &KvLayout) {
        let mut entries = self.lock();
        let Some(e) = entries.iter_mut().find(|e| e.id == id) else { return };
        let l = &e.spec.kv_layout;
        let learns =
            (e.spec.runtime.is_none() && runtime.is_some()) || (l.page_size.is_none() && layout.page_size.is_some()) || (l.kv_dtype.is_none() && layout.kv_dtype.is_some());
        if !learns {
            return;
        }
        let mut spec = (*e.spec).clone();
        spec.runtime = spec.runtime.take().or_else(|| runtime.map(str::to_string));
        spec.kv_layout.page_size = spec.kv_layout.page_size.or(layout.page_size);
        spec.kv_layout.kv_dtype = spec.kv_layout.kv_dtype.take().or_else(|| layout.kv_dtype.clone());
        e.spec = Arc::new(spec);
        self.rebuild(&entries);
    }

    /// The worker's pairing key as routing sees it.
    pub fn pairing_key(&self, e: &Entry) -> PairingKey {
        PairingKey::of(&e.spec, self.options.default_connector)
    }

    pub fn pairing_mode(&self) -> PairingMode {
        self.options.pairing_mode
    }

    /// Feeds one request outcome to a worker's breaker. Returns the new state when it changed
    /// (the routing view is then rebuilt), so the caller can schedule the half-open rebuild.
    /// A success is also the passive health signal ([`Runtime::note_served`]), breaker or not.
    pub fn record_outcome(&self, url: &str, outcome: Outcome) -> Option<BreakerState> {
        if outcome == Outcome::Neutral {
            // No verdict, but a probe that ended this way gives its slot to the next request.
            if self.breaker_config.enabled {
                self.end_probe(url);
            }
            return None;
        }
        // O(1) through the routing view: this runs once per request and leg.
        let routing = self.routing();
        let runtime = &routing.runtime[routing.snapshot.index_of(url)?];
        if outcome == Outcome::Success {
            runtime.note_served(self.now_ms());
        }
        if !self.breaker_config.enabled {
            return None;
        }
        let mut breaker = runtime.breaker.lock().unwrap_or_else(|p| p.into_inner());
        let was_probing = breaker.probing(self.now(), &self.breaker_config);
        let changed = breaker.record(outcome, self.now(), &self.breaker_config);
        drop(breaker);
        if changed.is_some() || was_probing {
            let entries = self.lock();
            self.rebuild(&entries);
        }
        changed
    }

    /// The passive health signal for a stream still flowing from the worker at `url` (its end
    /// is an outcome: [`Registry::record_outcome`]). O(1) through the routing view.
    pub fn note_served(&self, url: &str) {
        let routing = self.routing();
        if let Some(rt) = routing.snapshot.index_of(url).and_then(|i| routing.runtime.get(i)) {
            rt.note_served(self.now_ms());
        }
    }

    /// Admits one request to the worker at `url` through its breaker ([`Breaker::try_admit`]).
    /// A request that becomes a half-open probe takes the worker out of the routing view until
    /// the probe's outcome is recorded (or `probe_timeout` passes: the caller schedules a
    /// [`Registry::refresh`] then).
    pub fn admit(&self, url: &str) -> Admission {
        if !self.breaker_config.enabled {
            return Admission::Pass;
        }
        let routing = self.routing();
        let Some(i) = routing.snapshot.index_of(url) else { return Admission::Pass };
        let now = self.now();
        let mut breaker = routing.runtime[i].breaker.lock().unwrap_or_else(|p| p.into_inner());
        if !breaker.try_admit(now, &self.breaker_config) {
            return Admission::Refused;
        }
        let probe = breaker.state(now, &self.breaker_config) == BreakerState::HalfOpen;
        drop(breaker);
        if !probe {
            return Admission::Pass;
        }
        let entries = self.lock();
        self.rebuild(&entries);
        Admission::Probe
    }

    /// Frees a worker's probe slot without a verdict (the probe was not sent after all, or
    /// ended neutral); the worker is routed to again.
    pub fn end_probe(&self, url: &str) {
        let routing = self.routing();
        let Some(i) = routing.snapshot.index_of(url) else { return };
        let ended = routing.runtime[i].breaker.lock().unwrap_or_else(|p| p.into_inner()).end_probe();
        if ended {
            let entries = self.lock();
            self.rebuild(&entries);
        }
    }

    /// What a worker's breaker record says of `outcome` ([`Breaker::judge`]), with the worker's
    /// runtime (for a probe). `None` when breakers are off or the worker is not routed to.
    pub fn judge(&self, url: &str, outcome: Outcome) -> Option<(Judgement, Arc<Runtime>)> {
        if !self.breaker_config.enabled {
            return None;
        }
        let routing = self.routing();
        let runtime = routing.runtime[routing.snapshot.index_of(url)?].clone();
        let judgement = runtime.breaker().judge(outcome);
        Some((judgement, runtime))
    }

    pub fn breaker_config(&self) -> &BreakerConfig {
        &self.breaker_config
    }

    /// Republishes the view, e.g. when an open breaker's cool-down has passed.
    pub fn refresh(&self) {
        let entries = self.lock();
        self.rebuild(&entries);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use pdgate_core::{KvConnector, WorkerRole};
    use std::time::Duration;

    fn opts() -> SnapshotOptions {
        SnapshotOptions { default_connector: KvConnector::Bootstrap, pairing_mode: PairingMode::Lenient }
    }

    fn spec(url: &str, role: WorkerRole) -> WorkerSpec {
        WorkerSpec::new(url, role).unwrap()
    }

    #[test]
    fn ids_are_stable_and_distinct() {
        assert_eq!(worker_id("http://a:1"), worker_id("http://a:1"));
        assert_ne!(worker_id("http://a:1"), worker_id("http://a:2"));
    }

    #[test]
    fn duplicates_are_refused_and_drain_waits_for_inflight() {
        let reg = Registry::new(vec![spec("http://a:1", WorkerRole::Regular)], opts(), BreakerConfig::default());
        assert!(matches!(reg.add(spec("http://a:1", WorkerRole::Regular), Source::Api), Err(RegistryError::Duplicate(_))));
        let e = reg.get("http://a:1").unwrap();
        reg.observe_health(&e.id, Probe::Ok, 1, 1);
        assert_eq!(reg.routing().snapshot.eligible(WorkerRole::Regular).len(), 1);
        e.runtime.inflight.fetch_add(1, Ordering::SeqCst);
        reg.start_drain(&e.id).unwrap();
        assert!(reg.routing().snapshot.eligible(WorkerRole::Regular).is_empty(), "draining takes no new requests");
        assert!(!reg.finish_drain(&e.id, false), "still in flight");
        e.runtime.inflight.fetch_sub(1, Ordering::SeqCst);
        assert!(reg.finish_drain(&e.id, false));
        assert!(reg.get(&e.id).is_none());
    }

    /// A clock the test moves by hand.
    fn fake_clock() -> (Clock, Arc<Mutex<Instant>>) {
        let now = Arc::new(Mutex::new(Instant::now()));
        let read = now.clone();
        (Arc::new(move || *read.lock().unwrap()), now)
    }

    fn advance(now: &Mutex<Instant>, by: Duration) {
        let mut t = now.lock().unwrap();
        *t += by;
    }

    fn breaker_cfg() -> BreakerConfig {
        BreakerConfig {
            enabled: true,
            failure_threshold: 2,
            success_threshold: 2,
            cooldown: Duration::from_secs(30),
            probe_timeout: Duration::from_secs(10),
            window: Duration::from_secs(120),
        }
    }

    #[test]
    fn an_open_breaker_takes_the_worker_out_until_its_cooldown() {
        let (clock, now) = fake_clock();
        let reg = Registry::with_clock(vec![spec("http://a:1", WorkerRole::Regular)], opts(), breaker_cfg(), clock);
        let e = reg.get("http://a:1").unwrap();
        reg.observe_health(&e.id, Probe::Ok, 1, 1);
        assert_eq!(reg.record_outcome("http://a:1", Outcome::Failure), None);
        assert_eq!(reg.record_outcome("http://a:1", Outcome::Neutral), None, "429s count as neither");
        assert_eq!(reg.record_outcome("http://a:1", Outcome::Failure), Some(BreakerState::Open));
        assert!(reg.routing().snapshot.eligible(WorkerRole::Regular).is_empty());
        assert_eq!(reg.admit("http://a:1"), Admission::Refused);
        advance(&now, Duration::from_secs(30));
        reg.refresh();
        assert_eq!(reg.routing().snapshot.eligible(WorkerRole::Regular).len(), 1, "half-open lets a probe through");
    }

    #[test]
    fn half_open_lets_one_probe_through_and_hides_the_worker_meanwhile() {
        let (clock, now) = fake_clock();
        let urls = ["http://a:1", "http://b:1"];
        let reg = Registry::with_clock(urls.iter().map(|u| spec(u, WorkerRole::Regular)).collect(), opts(), breaker_cfg(), clock);
        for e in reg.list() {
            reg.observe_health(&e.id, Probe::Ok, 1, 1);
        }
        reg.record_outcome(urls[0], Outcome::Failure);
        reg.record_outcome(urls[0], Outcome::Failure);
        advance(&now, Duration::from_secs(30));
        reg.refresh();
        let eligible = |reg: &Registry| reg.routing().snapshot.eligible(WorkerRole::Regular).len();
        assert_eq!(eligible(&reg), 2);
        assert_eq!(reg.admit(urls[0]), Admission::Probe);
        assert_eq!(eligible(&reg), 1, "the probing worker left the routing view");
        for _ in 0..5 {
            assert_eq!(reg.admit(urls[0]), Admission::Refused, "a decision made on the old view is refused");
            assert_eq!(reg.admit(urls[1]), Admission::Pass);
        }
        // The probe succeeds: the slot is free for the next probe; a second success closes.
        assert_eq!(reg.record_outcome(urls[0], Outcome::Success), Some(BreakerState::HalfOpen));
        assert_eq!(eligible(&reg), 2);
        assert_eq!(reg.admit(urls[0]), Admission::Probe);
        // A neutral outcome (the client went away) frees the slot without a verdict.
        assert_eq!(reg.record_outcome(urls[0], Outcome::Neutral), None);
        assert_eq!(eligible(&reg), 2);
        assert_eq!(reg.admit(urls[0]), Admission::Probe);
        // A probe that never reports frees its slot after probe_timeout (at the refresh).
        advance(&now, Duration::from_secs(10));
        reg.refresh();
        assert_eq!(eligible(&reg), 2);
        assert_eq!(reg.admit(urls[0]), Admission::Probe);
        assert_eq!(reg.record_outcome(urls[0], Outcome::Success), Some(BreakerState::Closed));
        assert_eq!(reg.admit(urls[0]), Admission::Pass);
        assert_eq!(reg.admit(urls[0]), Admission::Pass);
    }

    #[test]
    fn health_changes_republish_the_view() {
        let reg = Registry::new(vec![spec("http://p:1", WorkerRole::Prefill), spec("http://d:1", WorkerRole::Decode)], opts(), BreakerConfig::default());
        assert!(!reg.routing().snapshot.pd_ready());
        for e in reg.list() {
            assert_eq!(reg.observe_health(&e.id, Probe::Ok, 3, 2), Some(true));
        }
        assert!(reg.routing().snapshot.pd_ready());
    }

    #[test]
    fn scraped_kv_keys_fill_only_unknown_parts() {
        let mut p = spec("http://p:1", WorkerRole::Prefill);
        p.kv_layout.kv_dtype = Some("fp8_e5m2".into());
        let reg = Registry::new(vec![p], opts(), BreakerConfig::default());
        let id = reg.list()[0].id.clone();
        let scraped = KvLayout { page_size: Some(16), kv_dtype: Some("auto".into()), ..KvLayout::default() };
        reg.learn_pairing(&id, Some("vllm"), &scraped);
        let e = reg.get(&id).unwrap();
        assert_eq!((e.spec.runtime.as_deref(), e.spec.kv_layout.page_size), (Some("vllm"), Some(16)));
        assert_eq!(e.spec.kv_layout.kv_dtype.as_deref(), Some("fp8_e5m2"), "a registered fact wins");
    }

    /// A gRPC worker's GetServerInfo names its connector, role and attention backend: they become
    /// its pairing key (over the gateway-wide default connector); a registered connector wins.
    #[test]
    fn engine_info_gives_the_connector_role_and_backend_of_the_pairing_key() {
        let p = spec("grpc://p:1", WorkerRole::Prefill);
        let mut d = spec("grpc://d:1", WorkerRole::Decode);
        d.kv_connector = Some(KvConnector::Nixl);
        let reg = Registry::new(vec![p, d], opts(), BreakerConfig::default());
        let layout = KvLayout { page_size: Some(16), attention_backend: Some("flash".into()), ..KvLayout::default() };
        for (e, mode) in reg.list().into_iter().zip(["prefill", "decode"]) {
            let info = EngineInfo { mode: Some(mode.into()), kv_connector: Some(KvConnector::Mooncake), kv_layout: layout.clone(), ..EngineInfo::default() };
            reg.set_info(&e.id, info);
        }
        let keys: Vec<PairingKey> = reg.list().iter().map(|e| reg.pairing_key(e)).collect();
        assert_eq!((keys[0].transport, keys[0].reported_role), (KvConnector::Mooncake, Some(WorkerRole::Prefill)));
        assert_eq!(keys[0].kv_layout.attention_backend.as_deref(), Some("flash"));
        assert_eq!((keys[1].transport, keys[1].reported_role), (KvConnector::Nixl, Some(WorkerRole::Decode)), "the registration's connector wins");
        assert_eq!(reported_role(Some("null")), None);
        assert_eq!(reported_role(None), None);
    }
}
