//! Starting and stopping a gateway: bind, spawn health checks, serve with TCP_NODELAY.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::serve::ListenerExt;
use pdgate_core::breaker::BreakerConfig;
use pdgate_core::{ConfigError, GatewayConfig, SnapshotOptions};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::registry::Registry;
use crate::state::AppState;
use crate::{front, health, load};

/// How long `shutdown` lets in-flight requests finish before cutting them.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: String, source: std::io::Error },
    #[error("{0}")]
    Discovery(String),
}

pub struct RunningGateway {
    addr: SocketAddr,
    shutdown: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl RunningGateway {
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, lets in-flight requests finish (bounded), stops health checks.
    pub async fn shutdown(self) {
        let _ = self.shutdown.send(true);
        let abort = self.task.abort_handle();
        if tokio::time::timeout(DRAIN_TIMEOUT, self.task).await.is_err() {
            abort.abort();
        }
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
    let discovery = crate::discovery::prepare(&config).await.map_err(StartError::Discovery)?;
    let bind = format!("{}:{}", config.host, config.port);
    let listener = TcpListener::bind(&bind).await.map_err(|source| StartError::Bind { addr: bind.clone(), source })?;
    let addr = listener.local_addr().map_err(|source| StartError::Bind { addr: bind, source })?;
    let options = SnapshotOptions { default_connector: config.kv_connector, pairing_mode: config.pd_pairing_mode };
    let registry = Registry::new(workers, options, BreakerConfig::from_config(&config));
    let state = Arc::new(AppState::new(config, registry));
    let (tx, rx) = watch::channel(false);
    health::spawn_supervisor(&state, rx.clone());
    load::spawn_poller(&state, rx.clone());
    crate::discovery::spawn(&state, discovery, rx.clone());
    let app = front::router(state);
    // A peer gateway without TCP_NODELAY loses 40 ms per streamed response to Nagle + delayed ACK.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let mut stop = rx;
    let task = tokio::spawn(async move {
        let signal = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        if let Err(e) = axum::serve(listener, app).with_graceful_shutdown(signal).await {
            tracing::error!(error = %e, "server stopped");
        }
    });
    tracing::info!(%addr, "pdgate listening");
    Ok(RunningGateway { addr, shutdown: tx, task })
}
