//! The fleet: which workers there are and what is known of them, feeding every decision.
//! `registry.rs` (open it first) holds the routing view, an immutable `PoolSnapshot` swapped
//! atomically, and each worker's runtime counters and breaker; `membership.rs` applies the
//! one stream of changes (`Add | Drain | SetEnabled | Remove`) from the three sources: static
//! flags (`app/server.rs`), the `/workers` API (`workers_api.rs`) and Kubernetes
//! (`discovery/`). Facts come from health checks (`health.rs`), load polling (`load.rs`: where
//! a worker's load comes from), the gateway's own token counts (`token_load.rs`) and engine KV
//! events (`kv_sub/`); `own_addr.rs` refuses a worker that is this gateway.
//!
//! May use `clients` (to ask workers), `observe` and the leaves; never `exec`, `admit`, `edge`
//! or `app`.

pub mod discovery;
pub mod gauges;
pub mod health;
pub mod kv_sub;
pub mod load;
pub mod membership;
pub mod own_addr;
pub mod registry;
pub mod token_load;
pub mod workers_api;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use pdgate_core::breaker::{BreakerState, Judgement, Outcome};
use pdgate_core::radix::RadixTree;
use pdgate_core::GatewayConfig;

use crate::clients::grpc::GrpcClient;
use crate::clients::upstream::Upstream;
use crate::observe::log_limit::LogLimiter;
use crate::observe::metrics::Metrics;
use load::{stale_after_ms, GatewayLoads};
use registry::{Registry, Runtime};

/// What the fleet's tasks (health checks, load polling, discovery, KV subscriptions) and the
/// `/workers` API share, and what a request's decision reads of the workers: one per gateway.
pub struct Fleet {
    pub config: Arc<GatewayConfig>,
    pub registry: Registry,
    /// The HTTP client health checks and load polling ask workers over.
    pub upstream: Upstream,
    /// The gRPC workers' client (`grpc://`), asked by health and load polling too.
    pub grpc: Arc<GrpcClient>,
    /// What each worker that publishes KV events holds (kv_sub); cache_aware reads it.
    pub kv_view: kv_sub::KvView,
    /// A cache_aware pool may route on `kv_view` (`--cache-source` events or auto).
    pub routes_on_events: bool,
    /// Recent prompts per worker, for cache-aware policies (keys are worker URLs, so one tree
    /// serves every pool). Locked only around a decision and its insert, never across an await.
    pub tree: Mutex<RadixTree>,
    /// Whether any configured policy reads `tree` (set from the policies by `app`).
    pub uses_tree: bool,
    /// This gateway's listener, for refusing workers that are this gateway.
    pub own: own_addr::OwnListener,
    pub metrics: Arc<Metrics>,
    pub log: Arc<LogLimiter>,
}

impl Fleet {
    /// The load view policies read, over the workers of one routing view.
    pub fn loads<'a>(&self, runtime: &'a [Arc<Runtime>]) -> GatewayLoads<'a> {
        GatewayLoads { runtime, now_ms: self.registry.now_ms(), stale_after_ms: stale_after_ms(self) }
    }

    /// Feeds a request outcome to the worker's circuit breaker; when it opens, schedules the
    /// rebuild that lets half-open probes through after the cool-down.
    ///
    /// A no-answer timeout that the record cannot judge (the worker answered nobody since the
    /// request was sent: a long non-streamed request, or a hung worker) is not recorded at once:
    /// the worker is asked ([`Fleet::ask_worker`]) and its health check's answer decides.
    pub fn record_outcome(self: &Arc<Self>, url: &str, outcome: Outcome) {
        let outcome = match outcome {
            Outcome::NoAnswerSince(_) => match self.registry.judge(url, outcome) {
                Some((Judgement::Record(o), _)) => o,
                Some((Judgement::Probe, runtime)) => {
                    self.ask_worker(url, &runtime);
                    return;
                }
                None => return,
            },
            o => o,
        };
        let changed = self.registry.record_outcome(url, outcome);
        if let Some(s) = changed {
            self.metrics.breaker_state.with_label_values(&[url]).set(i64::from(s.as_gauge()));
        }
        if changed == Some(BreakerState::Open) {
            tracing::warn!(worker = url, "circuit breaker opened");
            let state = self.clone();
            let url = url.to_string();
            let cooldown = self.registry.breaker_config().cooldown;
            tokio::spawn(async move {
                tokio::time::sleep(cooldown).await;
                state.registry.refresh();
                state.metrics.breaker_state.with_label_values(&[&url]).set(i64::from(BreakerState::HalfOpen.as_gauge()));
            });
        }
    }

    /// Asks the worker's breaker to admit one request ([`Registry::admit`]); false when it
    /// must go elsewhere. A request admitted as the half-open probe schedules the refresh that
    /// frees the probe slot if its outcome never comes.
    pub fn admit(self: &Arc<Self>, url: &str) -> bool {
        match self.registry.admit(url) {
            registry::Admission::Pass => true,
            registry::Admission::Refused => false,
            registry::Admission::Probe => {
                tracing::info!(worker = url, "circuit breaker half-open: one probe request let through");
                let state = self.clone();
                let timeout = self.registry.breaker_config().probe_timeout;
                tokio::spawn(async move {
                    tokio::time::sleep(timeout).await;
                    state.registry.refresh();
                });
                true
            }
        }
    }

    /// One health probe of a silent worker (the active check's `--health-check-endpoint`
    /// within `--health-check-timeout-secs`), spawned off the request path so the client's 504
    /// is not delayed. Coalesced: while a probe of the worker is in flight, further no-answer
    /// timeouts start none and wait for its verdict, which each of them then records (a
    /// failed probe after a burst of N timeouts is N failures, so a hung worker opens its
    /// breaker in one burst, as before; a healthy answer leaves all N neutral).
    fn ask_worker(self: &Arc<Self>, url: &str, runtime: &Arc<Runtime>) {
        {
            let mut waiting = runtime.probe.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(n) = waiting.as_mut() {
                *n = n.saturating_add(1);
                return;
            }
            *waiting = Some(1);
        }
        let (state, runtime, url) = (self.clone(), runtime.clone(), url.to_string());
        tokio::spawn(async move {
            let healthy = health::probe(&state, &url).await;
            let waiting = runtime.probe.lock().unwrap_or_else(|p| p.into_inner()).take().unwrap_or(0);
            tracing::debug!(worker = %url, healthy, timeouts = waiting, "probed a worker silent past the deadline");
            let outcome = Outcome::of_probe(healthy);
            for _ in 0..waiting {
                state.record_outcome(&url, outcome);
            }
        });
    }

    /// Notes why a worker failed a request leg, for `/workers`' `last_error`.
    pub fn note_worker_error(&self, url: &str, err: &pdgate_core::GatewayError) {
        let routing = self.registry.routing();
        if let Some(i) = routing.snapshot.index_of(url) {
            routing.runtime[i].note_error(format!("request: {} ({})", err.message, err.code()));
        }
    }

    /// Records that `text` went to `url` (for the policies that asked), keeping the tree bounded.
    pub fn remember(&self, tree: &mut RadixTree, text: &str, url: &str) {
        tree.insert(text, url, self.registry.now_ms());
        tree.evict(self.config.max_tree_size);
    }

    /// Forgets a removed worker's cached prefixes, and a gRPC worker's cached connection.
    pub fn forget_worker(&self, url: &str) {
        self.kv_view.unwatch(url);
        self.grpc.forget(url);
        if self.uses_tree {
            self.tree.lock().unwrap_or_else(|p| p.into_inner()).remove_tenant(url);
        }
    }

    pub fn request_timeout(&self) -> Duration {
        Duration::from_secs(self.config.request_timeout_secs)
    }

    /// A Mooncake prefill's engine id, stored once: in the worker's runtime record (seeded from
    /// its registration, else learned from `/query`).
    pub fn cached_engine_id(&self, prefill_url: &str) -> Option<String> {
        self.with_engine_id(prefill_url, |id| id.clone()).flatten()
    }

    pub fn store_engine_id(&self, prefill_url: &str, id: String) {
        self.with_engine_id(prefill_url, |slot| *slot = Some(id));
    }

    /// Forget a prefill's engine id (it may have restarted with a new one).
    pub fn forget_engine_id(&self, prefill_url: &str) {
        self.with_engine_id(prefill_url, |slot| *slot = None);
    }

    fn with_engine_id<T>(&self, prefill_url: &str, f: impl FnOnce(&mut Option<String>) -> T) -> Option<T> {
        let routing = self.registry.routing();
        let runtime = &routing.runtime[routing.snapshot.index_of(prefill_url)?];
        let mut slot = runtime.engine_id.lock().unwrap_or_else(|p| p.into_inner());
        Some(f(&mut slot))
    }
}
