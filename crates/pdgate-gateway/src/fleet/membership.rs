//! Membership changes as one stream: the static flags, the `/workers` API and Kubernetes
//! discovery all express what they want as a [`Change`], and [`apply`] is the one place that
//! makes it happen on the registry (including the drain that precedes a removal).

use std::sync::Arc;
use std::time::Duration;

use pdgate_core::WorkerSpec;

use crate::fleet::registry::{Entry, RegistryError, Source};
use crate::fleet::Fleet;

/// How often a draining worker is checked for its last in-flight request.
const DRAIN_POLL: Duration = Duration::from_millis(50);

/// One change of the worker set.
#[derive(Clone, Debug)]
pub enum Change {
    /// A new worker from `source` (boxed: a spec is far larger than the other changes).
    Add(Box<WorkerSpec>, Source),
    /// No new requests to the worker (by id or URL); it is removed once its in-flight requests
    /// finished, at the latest after the request timeout (then they are cut).
    Drain(String),
    /// Take the worker (by id or URL) out of routing, or back in, without removing it.
    SetEnabled(String, bool),
    /// Remove the worker (by id) now, whatever is in flight on it.
    Remove(String),
}

/// Applies one change; returns the worker's entry as it is after the change.
pub fn apply(state: &Arc<Fleet>, change: Change) -> Result<Entry, RegistryError> {
    match change {
        // A registered Mooncake engine id seeds the worker's runtime record (registry.rs).
        Change::Add(spec, source) => {
            let entry = state.registry.add(*spec, source)?;
            if let Some(endpoint) = &entry.spec.kv_events {
                state.kv_view.watch(&entry.spec.url, endpoint, entry.spec.kv_events_replay.as_deref());
            } else if state.routes_on_events && entry.spec.url.starts_with("grpc://") {
                // a gRPC worker's events come over its own connection (SubscribeKvEvents)
                state.kv_view.watch_grpc(&entry.spec.url, state.grpc.clone());
            }
            Ok(entry)
        }
        Change::Drain(key) => drain(state, &key),
        Change::SetEnabled(key, enabled) => state.registry.set_enabled(&key, enabled),
        Change::Remove(id) => {
            let entry = state.registry.get(&id).ok_or_else(|| RegistryError::NotFound(id.clone()))?;
            state.registry.finish_drain(&entry.id, true);
            state.forget_worker(&entry.spec.url);
            Ok(entry)
        }
    }
}

fn drain(state: &Arc<Fleet>, key: &str) -> Result<Entry, RegistryError> {
    let entry = state.registry.start_drain(key)?;
    let state = state.clone();
    let (id, url) = (entry.id.clone(), entry.spec.url.clone());
    tokio::spawn(async move {
        let deadline = tokio::time::Instant::now() + state.request_timeout();
        loop {
            if state.registry.finish_drain(&id, false) {
                state.forget_worker(&url);
                tracing::info!(id = %id, "drained worker removed");
                return;
            }
            if tokio::time::Instant::now() >= deadline {
                tracing::info!(id = %id, "drain timed out: removing the worker with requests still in flight");
                let _ = apply(&state, Change::Remove(id));
                return;
            }
            tokio::time::sleep(DRAIN_POLL).await;
        }
    });
    Ok(entry)
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use pdgate_core::breaker::BreakerConfig;
    use pdgate_core::radix::RadixTree;
    use pdgate_core::{GatewayConfig, KvConnector, PairingMode, SnapshotOptions, WorkerRole, WorkerSpec};

    use super::{apply, Change};
    use crate::clients::grpc::GrpcClient;
    use crate::clients::upstream::Upstream;
    use crate::fleet::kv_sub::{KvView, SubTimings};
    use crate::fleet::own_addr::OwnListener;
    use crate::fleet::registry::{Registry, Source};
    use crate::fleet::Fleet;

    const URL: &str = "grpc://127.0.0.1:1";

    /// A fleet alone, as the gateway builds it (app/state.rs), with no listener.
    fn fleet() -> Arc<Fleet> {
        let config = GatewayConfig::default();
        let options = SnapshotOptions { default_connector: KvConnector::Bootstrap, pairing_mode: PairingMode::Lenient };
        Arc::new(Fleet {
            registry: Registry::new(Vec::new(), options, BreakerConfig::default()),
            upstream: Upstream::from_config(&config).unwrap(),
            grpc: Arc::new(GrpcClient::new()),
            kv_view: KvView::new(1, config.kv_index_max_blocks, SubTimings::default()),
            routes_on_events: false,
            tree: Mutex::new(RadixTree::new()),
            uses_tree: false,
            own: OwnListener::new(std::net::SocketAddr::from(([0, 0, 0, 0], 0))),
            metrics: Arc::default(),
            log: Arc::default(),
            config: Arc::new(config),
        })
    }

    /// A removed gRPC worker's cached connection is dropped (apply → Fleet::forget_worker).
    #[tokio::test]
    async fn removing_a_worker_drops_its_connection_and_only_its_own() {
        let state = fleet();
        let entry = apply(&state, Change::Add(Box::new(WorkerSpec::new(URL, WorkerRole::Regular).unwrap()), Source::Api)).unwrap();
        let other = "grpc://127.0.0.1:2";
        state.grpc.cache_unconnected(URL);
        state.grpc.cache_unconnected(other);
        assert!(state.grpc.has_connection(URL));
        apply(&state, Change::Remove(entry.id)).unwrap();
        assert!(!state.grpc.has_connection(URL), "the removed worker's channel is still cached");
        assert!(state.grpc.has_connection(other));
    }
}
