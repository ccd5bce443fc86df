//! The handles each stage is given, built once per gateway. A stage is handed only its own
//! (the routes pass `Exec` to the transaction, `Fleet` to the worker API, `Admit` to the
//! admission layer, the config to the key checks), so each can be read and tested without the
//! whole gateway; `AppState` itself is read only by the routes in `app`.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pdgate_core::policy::{make_policy_with, PolicyOptions};
use pdgate_core::radix::RadixTree;
use pdgate_core::retry::RetryPolicy;
use pdgate_core::retry_budget::{RetryBudget, RetryBudgetConfig};
use pdgate_core::GatewayConfig;
use pdgate_protocol::Limits;
use pdgate_tokenizer::ModelTokenizer;

use crate::admit::admission::{Admission, Admit};
use crate::clients::grpc::GrpcClient;
use crate::clients::http_client::HttpClient;
use crate::clients::scheme_client::SchemeClient;
use crate::clients::upstream::Upstream;
use crate::edge::hops::Hops;
use crate::exec::placement::Placer;
use crate::exec::policy_rng::PolicyRng;
use crate::exec::Exec;
use crate::fleet::kv_sub::{KvView, SubTimings};
use crate::fleet::own_addr::OwnListener;
use crate::fleet::registry::Registry;
use crate::fleet::Fleet;
use crate::observe::goodput::Goodput;
use crate::observe::log_limit::LogLimiter;
use crate::observe::metrics::Metrics;
use crate::observe::request_log::RequestLog;

pub struct AppState {
    pub config: Arc<GatewayConfig>,
    /// The workers and what is known of them (fleet/).
    pub fleet: Arc<Fleet>,
    /// What a request's transaction uses (exec/).
    pub exec: Arc<Exec>,
    /// `--max-concurrent-requests` and its queue (admit/); `None` without a limit.
    pub admission: Option<Arc<Admit>>,
    /// Loop detection at the edge (edge/hops.rs).
    pub hops: Hops,
    pub metrics: Arc<Metrics>,
    /// The goodput window and the `--request-log` writer (observe/goodput.rs).
    pub goodput: Arc<Goodput>,
    /// The request bounds (`--max-n`, `--max-batch-size`, ...), as the parser takes them.
    pub limits: Limits,
    /// Set by a graceful shutdown: readiness is 503 and new requests are refused with 503.
    pub draining: AtomicBool,
}

impl AppState {
    /// `upstream` is built from the same config by the caller (`Upstream::from_config`), which
    /// can fail on a bad worker CA bundle. Fails only when `--request-log` cannot be opened.
    pub fn new(config: GatewayConfig, registry: Registry, upstream: Upstream, own: OwnListener, tokenizer: Option<Arc<ModelTokenizer>>) -> std::io::Result<Self> {
        let config = Arc::new(config);
        let metrics = Arc::new(Metrics::new());
        metrics.prime(&config);
        let request_log = match &config.request_log {
            Some(path) => Some(RequestLog::open(path, metrics.slo.log_dropped.clone())?),
            None => None,
        };
        let goodput = Arc::new(Goodput::new(&config, request_log));
        let log = Arc::new(LogLimiter::default());
        let grpc = Arc::new(GrpcClient::new());
        if let Some(t) = &tokenizer {
            grpc.set_tokenizer(t.clone());
        }
        let options = PolicyOptions::from_config(&config);
        let (regular_policy, prefill_policy, decode_policy) = (
            make_policy_with(config.policy, &options),
            make_policy_with(config.effective_prefill_policy(), &options),
            make_policy_with(config.effective_decode_policy(), &options),
        );
        let encode_policy = make_policy_with(config.encode_policy.policy_name(), &options);
        let fleet = Arc::new(Fleet {
            registry,
            upstream: upstream.clone(),
            grpc: grpc.clone(),
            kv_view: KvView::new(rand::random(), config.kv_index_max_blocks, SubTimings::default()),
            routes_on_events: crate::prompt_ids::routes_on_events(&config),
            tree: Mutex::new(RadixTree::new()),
            uses_tree: regular_policy.uses_tree() || prefill_policy.uses_tree() || decode_policy.uses_tree(),
            own,
            metrics: metrics.clone(),
            log: log.clone(),
            config: config.clone(),
        });
        let placer = Arc::new(Placer::from_config(&config));
        if config.pd_disaggregation {
            placer.prime_metrics(&metrics.placement);
        }
        let exec = Arc::new(Exec {
            client: Arc::new(SchemeClient::new(HttpClient::new(upstream), grpc)),
            fleet: fleet.clone(),
            regular_policy,
            prefill_policy,
            decode_policy,
            encode_policy,
            retry: RetryPolicy::from_config(&config),
            retry_budget: Mutex::new(RetryBudget::new(RetryBudgetConfig::from_config(&config))),
            sequence: AtomicU64::new(0),
            policy_rng: PolicyRng::new(config.seed),
            placer,
            tokenizer,
            metrics: metrics.clone(),
            goodput: goodput.clone(),
            log,
            config: config.clone(),
        });
        let admission = Admission::from_config(&config).map(|admission| Arc::new(Admit { admission, config: config.clone(), metrics: metrics.clone(), goodput: goodput.clone() }));
        Ok(AppState { limits: config.limits(), fleet, exec, admission, hops: Hops::new(), metrics, goodput, draining: AtomicBool::new(false), config })
    }

    /// Whether a graceful shutdown has begun.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    pub fn request_timeout(&self) -> Duration {
        Duration::from_secs(self.config.request_timeout_secs)
    }
}
