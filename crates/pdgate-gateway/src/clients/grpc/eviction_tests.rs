//! A removed gRPC worker's cached connection is dropped (membership.rs → state.forget_worker).

use std::sync::Arc;

use pdgate_core::breaker::BreakerConfig;
use pdgate_core::{GatewayConfig, KvConnector, PairingMode, SnapshotOptions, WorkerRole, WorkerSpec};

use super::{GrpcClient, Wire};
use crate::app::state::AppState;
use crate::clients::upstream::Upstream;
use crate::fleet::membership::{apply, Change};
use crate::fleet::registry::{Registry, Source};

const URL: &str = "grpc://127.0.0.1:1";

fn cache(client: &GrpcClient, url: &str) {
    client.workers.lock().unwrap().insert(url.to_string(), Arc::new(Wire::unconnected(url)));
}

fn state() -> Arc<AppState> {
    let config = GatewayConfig::default();
    let options = SnapshotOptions { default_connector: KvConnector::Bootstrap, pairing_mode: PairingMode::Lenient };
    let registry = Registry::new(Vec::new(), options, BreakerConfig::default());
    let upstream = Upstream::from_config(&config).unwrap();
    Arc::new(AppState::new(config, registry, upstream))
}

#[tokio::test]
async fn removing_a_worker_drops_its_connection_and_only_its_own() {
    let state = state();
    let entry = apply(&state, Change::Add(Box::new(WorkerSpec::new(URL, WorkerRole::Regular).unwrap()), Source::Api)).unwrap();
    let other = "grpc://127.0.0.1:2";
    cache(&state.grpc, URL);
    cache(&state.grpc, other);
    assert!(state.grpc.has_connection(URL));
    apply(&state, Change::Remove(entry.id)).unwrap();
    assert!(!state.grpc.has_connection(URL), "the removed worker's channel is still cached");
    assert!(state.grpc.has_connection(other));
}

#[tokio::test]
async fn a_connection_made_across_a_removal_is_not_cached() {
    let client = GrpcClient::new();
    // What `wire()` does around its detect: read the count, connect, insert if unchanged.
    let before = client.forgets.load(std::sync::atomic::Ordering::Acquire);
    client.forget(URL);
    let after = client.forgets.load(std::sync::atomic::Ordering::Acquire);
    assert_ne!(before, after, "a forget must be visible to a connect that raced it");
    // A connect to a listener that refuses: an error, and nothing cached.
    assert!(client.wire(URL, pdgate_core::Leg::Regular).await.is_err());
    assert!(!client.has_connection(URL));
}
