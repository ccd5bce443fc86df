//! Starting and stopping a gateway: bind, refuse workers that are the gateway itself, spawn
//! health checks, serve (edge/conn.rs: timeouts, connection cap, panics, TCP_NODELAY).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use pdgate_core::breaker::BreakerConfig;
use pdgate_core::{ConfigError, GatewayConfig, SnapshotOptions};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::app::front;
use crate::app::state::AppState;
use crate::clients::upstream::Upstream;
use crate::edge::conn::{self, Limits};
use crate::edge::threads::ConnThreads;
use crate::fleet::membership::{self, Change};
use crate::fleet::own_addr::OwnListener;
use crate::fleet::registry::{Registry, Source};
use crate::fleet::{health, load};

/// How often a graceful shutdown looks whether the requests in flight have ended.
const DRAIN_POLL: Duration = Duration::from_millis(20);
/// After the grace period, how long connections get to close before they are cut.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: String, source: std::io::Error },
    #[error("{0}")]
    Discovery(String),
    /// The worker client cannot be built (`--worker-ca-cert`, `--worker-api-key`).
    #[error("{0}")]
    Upstream(String),
    /// `--request-log` cannot be opened for appending.
    #[error("cannot open the request log {path}: {source}")]
    RequestLog { path: String, source: std::io::Error },
    /// `--model-path` / `--tokenizer-path` cannot be loaded.
    #[error("{0}")]
    Tokenizer(String),
    /// `--connection-threads`: a thread or its event loop cannot be created.
    #[error("cannot start {n} connection threads: {source}")]
    Threads { n: usize, source: std::io::Error },
}

pub struct RunningGateway {
    addr: SocketAddr,
    /// The `--prometheus-port` listener's address, when there is one.
    metrics_addr: Option<SocketAddr>,
    shutdown: watch::Sender<bool>,
    task: JoinHandle<()>,
    state: Arc<AppState>,
}

impl RunningGateway {
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Where `--prometheus-port` serves `/metrics`, when it is set.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// Graceful shutdown: readiness turns 503 and new requests are refused with 503 at once;
    /// requests in flight (streams included) get `--shutdown-grace-period-secs` to finish; then
    /// the listener closes, connections close after their responses, health checks stop.
    /// Whatever is still running after the grace period is cut. With `--enable-trace`, the
    /// spans still queued are exported last (a flush bounded to a few seconds).
    pub async fn shutdown(self) {
        let grace = Duration::from_secs(self.state.config.shutdown_grace_period_secs);
        let deadline = tokio::time::Instant::now() + grace;
        self.state.draining.store(true, std::sync::atomic::Ordering::Release);
        let in_flight = &self.state.metrics.edge.requests_in_flight;
        tracing::info!(in_flight = in_flight.get(), grace_secs = grace.as_secs(), "shutting down: not ready, refusing new requests, letting requests in flight finish");
        while in_flight.get() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(DRAIN_POLL).await;
        }
        if in_flight.get() > 0 {
            tracing::warn!(in_flight = in_flight.get(), "shutdown grace period over: cutting the requests still in flight");
        }
        let _ = self.shutdown.send(true);
        let abort = self.task.abort_handle();
        let left = deadline.saturating_duration_since(tokio::time::Instant::now()).max(CLOSE_TIMEOUT);
        if tokio::time::timeout(left, self.task).await.is_err() {
            abort.abort();
        }
        // The spans of the last requests go out before the process may end (bounded).
        crate::observe::tracing_export::flush().await;
    }

    /// Whether a graceful shutdown has begun.
    pub fn is_draining(&self) -> bool {
        self.state.is_draining()
    }

    /// Whether the server task has ended (it only does after `shutdown` or a fatal error).
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }
}

/// Binds and starts serving; returns once connections are being accepted.
pub async fn start(config: GatewayConfig) -> Result<RunningGateway, StartError> {
    config.validate()?;
    let workers = config.workers()?;
    let upstream = Upstream::from_config(&config).map_err(StartError::Upstream)?;
    let tokenizer = crate::prompt_ids::load(&config).map_err(StartError::Tokenizer)?;
    if let Some(note) = crate::prompt_ids::no_tokenizer_note(&config, tokenizer.is_some()) {
        tracing::warn!("{note}");
    }
    match (&tokenizer, config.tokenizer_path.as_deref().or(config.model_path.as_deref())) {
        (Some(t), Some(path)) => tracing::info!(path, chat_template = t.has_chat_template(), "tokenizer loaded (gRPC legs and prompt ids use it)"),
        _ if workers.iter().any(|w| w.is_grpc()) => {
            tracing::info!("no --model-path / --tokenizer-path: each model's tokenizer is fetched over GetTokenizer from its first gRPC worker, on first use")
        }
        _ => {}
    }
    let discovery = crate::fleet::discovery::prepare(&config).await.map_err(StartError::Discovery)?;
    let bind = format!("{}:{}", config.host, config.port);
    let listener = TcpListener::bind(&bind).await.map_err(|source| StartError::Bind { addr: bind.clone(), source })?;
    let addr = listener.local_addr().map_err(|source| StartError::Bind { addr: bind, source })?;
    let options = SnapshotOptions { default_connector: config.kv_connector, pairing_mode: config.pd_pairing_mode };
    let own = OwnListener::new(addr);
    for w in &workers {
        if own.is_me(&w.url).await {
            return Err(StartError::Config(ConfigError::Invalid(own.refusal(&w.url))));
        }
    }
    announce_admin_api(&config, addr);
    for line in pdgate_core::armed::armed_refusals(&config) {
        tracing::info!("refusals: {line}");
    }
    for line in config.warnings() {
        tracing::warn!("{line}");
    }
    let limits = Limits::from_config(&config);
    let registry = Registry::new(Vec::new(), options, BreakerConfig::from_config(&config));
    let log_path = config.request_log.clone().unwrap_or_default();
    let state = AppState::new(config, registry, upstream, own, tokenizer).map_err(|source| StartError::RequestLog { path: log_path, source })?;
    let state = Arc::new(state);
    // The static flags are the first source of membership changes (membership.rs).
    for spec in workers {
        let _ = membership::apply(&state.fleet, Change::Add(Box::new(spec), Source::Static));
    }
    let edge_metrics = state.metrics.edge.clone();
    let threads = match connection_threads(state.config.connection_threads) {
        0 => None,
        n => Some(ConnThreads::start(n, edge_metrics.clone()).map_err(|source| StartError::Threads { n, source })?),
    };
    let (tx, rx) = watch::channel(false);
    health::spawn_supervisor(&state.fleet, rx.clone());
    load::spawn_poller(&state.fleet, state.exec.clone(), rx.clone());
    crate::fleet::discovery::spawn(&state.fleet, discovery, rx.clone());
    let metrics_addr = match crate::app::metrics_listener::spawn(&state, rx.clone()).await {
        Ok(a) => a,
        Err(e) => {
            // Stop what was spawned above before reporting.
            let _ = tx.send(true);
            return Err(e);
        }
    };
    let app = front::router(state.clone());
    match &threads {
        Some(t) => tracing::info!(threads = t.len(), "client connections are served on connection threads (--connection-threads)"),
        None => tracing::info!("client connections are served on the runtime that started the gateway"),
    }
    let task = tokio::spawn(conn::serve(listener, app, limits, edge_metrics, rx, threads));
    tracing::info!(%addr, "pdgate listening");
    Ok(RunningGateway { addr, metrics_addr, shutdown: tx, task, state })
}

/// How many connection threads `--connection-threads` asks for (0 = serve on this runtime):
/// 0 means one per CPU, except inside a single-threaded runtime (a test on tokio's paused
/// clock, an embedding that chose one thread), whose wish is kept.
fn connection_threads(asked: usize) -> usize {
    match asked {
        0 if tokio::runtime::Handle::current().runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread => 0,
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    }
}

/// Says at start-up who may use the worker API: an open one is a loud warning.
fn announce_admin_api(config: &GatewayConfig, addr: SocketAddr) {
    let keyed = !config.admin_keys().is_empty();
    if keyed {
        if config.admin_api_open {
            tracing::warn!("--admin-api-open is ignored: --admin-api-key is set, so the worker API (/workers) needs that key");
        }
    } else if config.admin_api_open {
        tracing::warn!(
            %addr,
            "the worker API (/workers) is OPEN without a key (--admin-api-open): anyone who can reach this gateway can list, add and remove workers; for development only, use --admin-api-key KEY otherwise"
        );
    } else {
        tracing::info!("the worker API (/workers) is closed: start with --admin-api-key KEY to manage workers at runtime");
    }
}
