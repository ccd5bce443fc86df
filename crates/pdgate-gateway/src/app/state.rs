//! Everything a request handler shares: config, registry, client, metrics, policies.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use std::sync::Arc;

use pdgate_core::breaker::{BreakerState, Judgement, Outcome};
use pdgate_core::policy::{make_policy_with, PolicyOptions};
use pdgate_core::radix::RadixTree;
use pdgate_core::retry::RetryPolicy;
use pdgate_core::retry_budget::{RetryBudget, RetryBudgetConfig};
use pdgate_core::{GatewayConfig, Policy};
use pdgate_protocol::Limits;

use crate::clients::client::WorkerClient;
use crate::clients::http_client::HttpClient;
use crate::clients::scheme_client::SchemeClient;
use crate::clients::upstream::Upstream;
use crate::fleet::load::{stale_after_ms, GatewayLoads};
use crate::fleet::registry::{Registry, Runtime};
use crate::observe::metrics::Metrics;

pub struct AppState {
    pub config: GatewayConfig,
    pub registry: Registry,
    pub upstream: Upstream,
    /// The worker client the transaction runs its legs over (HTTP over `upstream`, or gRPC).
    pub client: Arc<dyn WorkerClient>,
    /// The gRPC workers' client (`grpc://`), also asked by health and load polling.
    pub grpc: Arc<crate::clients::grpc::GrpcClient>,
    pub metrics: Metrics,
    pub regular_policy: Box<dyn Policy>,
    pub prefill_policy: Box<dyn Policy>,
    pub decode_policy: Box<dyn Policy>,
    pub retry: RetryPolicy,
    /// Retries across all requests stay within this budget (see `pdgate_core::retry_budget`).
    retry_budget: Mutex<RetryBudget>,
    /// Set by a graceful shutdown: readiness is 503 and new requests are refused with 503.
    pub draining: std::sync::atomic::AtomicBool,
    /// The request bounds (`--max-n`, `--max-batch-size`, ...), as the parser takes them.
    pub limits: Limits,
    sequence: AtomicU64,
    /// Recent prompts per worker, for cache-aware policies (keys are worker URLs, so one tree
    /// serves every pool). Locked only around a decision and its insert, never across an await.
    pub tree: Mutex<RadixTree>,
    /// The client edge: hop token, own listener, log limiter (src/edge).
    pub edge: crate::edge::Edge,
    /// `--max-concurrent-requests` and its queue; `None` without a limit.
    pub admission: Option<crate::admit::admission::Admission>,
    /// What each worker that publishes KV events holds (kv_sub); cache_aware reads it.
    pub kv_view: crate::fleet::kv_sub::KvView,
    /// The routing rng (`--seed`, policy_rng.rs).
    pub policy_rng: crate::exec::policy_rng::PolicyRng,
    /// A cache_aware pool may route on `kv_view` (`--cache-source` events or auto).
    pub routes_on_events: bool,
    /// `--model-path` / `--tokenizer-path`'s tokenizer, loaded at start-up (prompt_ids.rs).
    pub tokenizer: Option<Arc<pdgate_tokenizer::ModelTokenizer>>,
    /// `--pd-placement`, early rejection and the cost model (exec/placement.rs).
    pub placer: crate::exec::placement::Placer,
    /// The goodput window and the `--request-log` writer (goodput.rs).
    pub goodput: crate::observe::goodput::Goodput,
}

impl AppState {
    /// `upstream` is built from the same config by the caller (`Upstream::from_config`), which
    /// can fail on a bad worker CA bundle; nothing here can.
    /// `--request-log` is opened by the caller ([`AppState::open_request_log`]), since opening
    /// a file can fail.
    pub fn new(config: GatewayConfig, registry: Registry, upstream: Upstream) -> Self {
        let grpc = Arc::new(crate::clients::grpc::GrpcClient::new());
        AppState {
            goodput: crate::observe::goodput::Goodput::new(&config, None),
            client: Arc::new(SchemeClient::new(HttpClient::new(upstream.clone()), grpc.clone())),
            grpc,
            upstream,
            placer: crate::exec::placement::Placer::from_config(&config),
            metrics: {
                let m = Metrics::new();
                m.prime(&config);
                m
            },
            admission: crate::admit::admission::Admission::from_config(&config),
            tokenizer: None,
            routes_on_events: crate::prompt_ids::routes_on_events(&config),
            regular_policy: make_policy_with(config.policy, &PolicyOptions::from_config(&config)),
            prefill_policy: make_policy_with(config.effective_prefill_policy(), &PolicyOptions::from_config(&config)),
            decode_policy: make_policy_with(config.effective_decode_policy(), &PolicyOptions::from_config(&config)),
            retry: RetryPolicy::from_config(&config),
            limits: config.limits(),
            retry_budget: Mutex::new(RetryBudget::new(RetryBudgetConfig::from_config(&config))),
            draining: std::sync::atomic::AtomicBool::new(false),
            sequence: AtomicU64::new(0),
            tree: Mutex::new(RadixTree::new()),
            edge: crate::edge::Edge::new(),
            policy_rng: crate::exec::policy_rng::PolicyRng::new(config.seed),
            kv_view: crate::fleet::kv_sub::KvView::new(rand::random(), config.kv_index_max_blocks, crate::fleet::kv_sub::SubTimings::default()),
            registry,
            config,
        }
        .primed()
    }

    fn primed(self) -> Self {
        if self.config.pd_disaggregation {
            self.placer.prime_metrics(&self.metrics.placement);
        }
        self
    }

    /// Opens `--request-log` (when set) and starts its writer.
    pub fn open_request_log(&mut self) -> std::io::Result<()> {
        if let Some(path) = &self.config.request_log {
            let log = crate::observe::request_log::RequestLog::open(path, self.metrics.slo.log_dropped.clone())?;
            self.goodput = crate::observe::goodput::Goodput::new(&self.config, Some(log));
        }
        Ok(())
    }

    /// The load view policies read, over the workers of one routing view.
    pub fn loads<'a>(&self, runtime: &'a [Arc<Runtime>]) -> GatewayLoads<'a> {
        GatewayLoads { runtime, now_ms: self.registry.now_ms(), stale_after_ms: stale_after_ms(self) }
    }

    /// Feeds a request outcome to the worker's circuit breaker; when it opens, schedules the
    /// rebuild that lets half-open probes through after the cool-down.
    ///
    /// A no-answer timeout that the record cannot judge (the worker answered nobody since the
    /// request was sent: a long non-streamed request, or a hung worker) is not recorded at once:
    /// the worker is asked ([`AppState::ask_worker`]) and its health check's answer decides.
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
            crate::fleet::registry::Admission::Pass => true,
            crate::fleet::registry::Admission::Refused => false,
            crate::fleet::registry::Admission::Probe => {
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
            let healthy = crate::fleet::health::probe(&state, &url).await;
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

    /// Whether any configured policy reads the radix tree.
    pub fn uses_tree(&self) -> bool {
        self.regular_policy.uses_tree() || self.prefill_policy.uses_tree() || self.decode_policy.uses_tree()
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
        if self.uses_tree() {
            self.tree.lock().unwrap_or_else(|p| p.into_inner()).remove_tenant(url);
        }
    }

    /// A request's first attempt: it earns its share of retries for everyone.
    pub fn retry_budget_deposit(&self) {
        self.retry_budget.lock().unwrap_or_else(|p| p.into_inner()).deposit(tokio::time::Instant::now().into_std());
    }

    /// Whether the shared budget allows one more retry now (and spends it if so).
    pub fn retry_budget_withdraw(&self) -> bool {
        self.retry_budget.lock().unwrap_or_else(|p| p.into_inner()).try_withdraw(tokio::time::Instant::now().into_std())
    }

    /// Whether a graceful shutdown has begun.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// One step of the round-robin sequence.
    pub fn next_sequence(&self) -> u64 {
        self.sequence.fetch_add(1, Ordering::Relaxed)
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
