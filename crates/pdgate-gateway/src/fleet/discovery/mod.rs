//! Kubernetes service discovery: worker pods found by label, fed to the registry as the third
//! source of worker changes (after static flags and the `/workers` API).
//!
//! One kube-rs `watcher` per role (a label selector cannot say "prefill OR decode") lists and
//! watches Pods: it resumes from the last resourceVersion (bookmarks keep it fresh), re-lists
//! after 410 Gone, and backs off when a watch drops. Its events become `state::Change`s on a
//! per-role `PodSet`; a re-list replaces the set only when complete, so pods deleted while the
//! watch was down leave too. `sync` then brings the registry to the desired set, after each event
//! and on a timer. What a pod means (`pod::verdict`) is a pure function of the Pod object.
//!
//! Annotations and labels: see `pod` and docs/kubernetes.md.

use std::sync::Arc;
use std::time::Duration;

use pdgate_core::GatewayConfig;
use tokio::sync::watch;

use crate::fleet::Fleet;

#[cfg(feature = "kubernetes")]
mod pod;
#[cfg(feature = "kubernetes")]
mod run;
#[cfg(feature = "kubernetes")]
mod state;
#[cfg(feature = "kubernetes")]
mod sync;

/// How often `pdgate_workers{source}` is refreshed when discovery is off.
const GAUGE_REFRESH: Duration = Duration::from_secs(5);

/// What discovery needs before the gateway serves: the Kubernetes client, when asked for.
pub struct Prepared {
    #[cfg(feature = "kubernetes")]
    client: Option<kube::Client>,
}

/// Checks, before anything is bound, that discovery can run: with `--service-discovery`, the
/// kube client must build (kubeconfig readable, or in-cluster credentials present). Otherwise
/// the gateway would serve with an empty pool forever while logging retries.
pub async fn prepare(config: &GatewayConfig) -> Result<Prepared, String> {
    if !config.service_discovery {
        #[cfg(feature = "kubernetes")]
        return Ok(Prepared { client: None });
        #[cfg(not(feature = "kubernetes"))]
        return Ok(Prepared {});
    }
    #[cfg(feature = "kubernetes")]
    return run::client(config).await.map(|c| Prepared { client: Some(c) }).map_err(|e| format!("service discovery: {e}"));
    #[cfg(not(feature = "kubernetes"))]
    Err("--service-discovery is set but this gateway was built without the `kubernetes` feature".into())
}

/// Starts discovery when it was prepared; runs until `shutdown` turns true.
pub fn spawn(state: &Arc<Fleet>, prepared: Prepared, shutdown: watch::Receiver<bool>) {
    #[cfg(feature = "kubernetes")]
    if let Some(client) = prepared.client {
        tokio::spawn(run::run(state.clone(), client, shutdown));
        return;
    }
    #[cfg(not(feature = "kubernetes"))]
    let Prepared {} = prepared;
    spawn_gauge_refresh(state, shutdown);
}

fn spawn_gauge_refresh(state: &Arc<Fleet>, mut shutdown: watch::Receiver<bool>) {
    let state = state.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(GAUGE_REFRESH);
        loop {
            tokio::select! {
                _ = tick.tick() => refresh_worker_gauge(&state),
                _ = shutdown.changed() => return,
            }
        }
    });
}

/// `pdgate_workers{source}`: the registry's workers by where they came from.
pub fn refresh_worker_gauge(state: &Fleet) {
    use crate::fleet::registry::Source;
    let entries = state.registry.list();
    for source in [Source::Static, Source::Api, Source::Discovery] {
        let n = entries.iter().filter(|e| e.source == source).count();
        state.metrics.workers.with_label_values(&[source.as_str()]).set(i64::try_from(n).unwrap_or(i64::MAX));
    }
}
