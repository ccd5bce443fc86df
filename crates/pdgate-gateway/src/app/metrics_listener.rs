//! `--prometheus-port`: `/metrics` on a listener of its own, as SMG serves it, so a scraper
//! (or a NetworkPolicy) can reach the metrics without reaching the API. The main port keeps
//! `/metrics` too.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::routing::get;
use axum::Router;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::app::server::StartError;
use crate::app::state::AppState;

/// Binds `--prometheus-host:--prometheus-port` and serves `/metrics` there until shutdown.
/// Returns the bound address (the port is a free one for 0).
pub async fn spawn(state: &Arc<AppState>, mut shutdown: watch::Receiver<bool>) -> Result<Option<SocketAddr>, StartError> {
    let Some(port) = state.config.prometheus_port else { return Ok(None) };
    let bind = format!("{}:{port}", state.config.prometheus_host);
    let listener = TcpListener::bind(&bind).await.map_err(|source| StartError::Bind { addr: bind.clone(), source })?;
    let addr = listener.local_addr().map_err(|source| StartError::Bind { addr: bind, source })?;
    let app = Router::new().route("/metrics", get(crate::app::front::metrics)).with_state(state.clone());
    tokio::spawn(async move {
        let stop = async move {
            while !*shutdown.borrow() {
                if shutdown.changed().await.is_err() {
                    return;
                }
            }
        };
        if let Err(e) = axum::serve(listener, app).with_graceful_shutdown(stop).await {
            tracing::warn!(error = %e, "the --prometheus-port listener stopped");
        }
    });
    tracing::info!(%addr, "metrics listening (--prometheus-port)");
    Ok(Some(addr))
}
