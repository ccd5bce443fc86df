//! Membership changes as one stream: the static flags, the `/workers` API and Kubernetes
//! discovery all express what they want as a [`Change`], and [`apply`] is the one place that
//! makes it happen on the registry (including the drain that precedes a removal).

use std::sync::Arc;
use std::time::Duration;

use pdgate_core::WorkerSpec;

use crate::app::state::AppState;
use crate::fleet::registry::{Entry, RegistryError, Source};

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
pub fn apply(state: &Arc<AppState>, change: Change) -> Result<Entry, RegistryError> {
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

fn drain(state: &Arc<AppState>, key: &str) -> Result<Entry, RegistryError> {
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
