//! The worker API (SMG-compatible, PROTOCOLS.md §4): add, list, inspect, enable/disable and
//! drain-then-remove workers at runtime. A second source of the same registry changes as the
//! static flags and Kubernetes discovery.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use pdgate_core::{GatewayError, KvConnector, WorkerRole, WorkerSpec};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::health::{check_and_record, engine_info};
use crate::registry::{Entry, RegistryError, Source};
use crate::render::error_response;
use crate::state::AppState;

/// How often a draining worker is checked for its last in-flight request.
const DRAIN_POLL: Duration = Duration::from_millis(50);

pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/workers", get(list).post(add))
        .route("/workers/{id}", get(one).delete(remove).put(update))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AddWorker {
    url: String,
    #[serde(default)]
    worker_type: Option<String>,
    #[serde(default)]
    bootstrap_port: Option<u16>,
    #[serde(default)]
    kv_connector: Option<String>,
    #[serde(default)]
    kv_engine_id: Option<String>,
    #[serde(default)]
    labels: BTreeMap<String, String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct UpdateWorker {
    enabled: bool,
}

fn parse<T: for<'de> Deserialize<'de>>(body: &Bytes) -> Result<T, GatewayError> {
    serde_json::from_slice(body).map_err(|e| GatewayError::invalid(None, format!("invalid worker request: {e}")))
}

pub fn worker_json(state: &AppState, e: &Entry) -> Value {
    let connector = e.spec.connector(state.config.kv_connector);
    let polled = e.runtime.polled_load.load(Ordering::Relaxed);
    json!({
        "id": e.id,
        "url": e.spec.url,
        "worker_type": e.spec.role.as_str(),
        "bootstrap_port": e.spec.bootstrap_port,
        "kv_connector": connector.as_str(),
        "kv_engine_id": e.kv_engine_id,
        "labels": e.spec.labels,
        "source": e.source.as_str(),
        "healthy": e.health.healthy,
        "enabled": e.enabled,
        "draining": e.draining,
        "inflight": e.runtime.inflight.load(Ordering::Relaxed),
        "load": if polled >= 0 { json!(polled) } else { Value::Null },
        "models": e.info.models,
        "disaggregation_mode": e.info.mode,
        "pd_pairing": state.registry.pairing_key(e),
        "pd_pairing_mode": state.registry.pairing_mode(),
        "breaker": e.runtime.breaker().state(std::time::Instant::now(), state.registry.breaker_config()).as_str(),
        "last_error": e.runtime.last_error().map(|(reason, at)| json!({"reason": reason, "at": at})),
    })
}

async fn list(State(state): State<Arc<AppState>>) -> Response {
    let workers: Vec<Value> = state.registry.list().iter().map(|e| worker_json(&state, e)).collect();
    Json(json!({"workers": workers, "total": workers.len()})).into_response()
}

fn not_found(id: &str) -> Response {
    error_response(&GatewayError::missing(format!("no worker with id or URL {id:?}")))
}

async fn one(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    match state.registry.get(&id) {
        Some(e) => Json(worker_json(&state, &e)).into_response(),
        None => not_found(&id),
    }
}

/// The role a request asks for, checked against the gateway's mode.
fn role_for(state: &AppState, worker_type: Option<&str>) -> Result<WorkerRole, GatewayError> {
    let pd = state.config.pd_disaggregation;
    let role = match worker_type.unwrap_or(if pd { "" } else { "regular" }) {
        "regular" => WorkerRole::Regular,
        "prefill" => WorkerRole::Prefill,
        "decode" => WorkerRole::Decode,
        "" => return Err(GatewayError::invalid(Some("worker_type"), "worker_type is required in PD mode: prefill or decode")),
        other => return Err(GatewayError::invalid(Some("worker_type"), format!("unknown worker_type {other:?}: regular, prefill or decode"))),
    };
    match (pd, role) {
        (true, WorkerRole::Regular) => Err(GatewayError::invalid(Some("worker_type"), "this gateway runs in PD mode: add prefill or decode workers")),
        (false, WorkerRole::Prefill | WorkerRole::Decode) => {
            Err(GatewayError::invalid(Some("worker_type"), "this gateway runs in regular mode: add regular workers"))
        }
        _ => Ok(role),
    }
}

fn build_spec(state: &AppState, req: AddWorker) -> Result<(WorkerSpec, Option<String>), GatewayError> {
    let role = role_for(state, req.worker_type.as_deref())?;
    let mut spec = WorkerSpec::new(&req.url, role).map_err(|m| GatewayError::invalid(Some("url"), m))?;
    if req.bootstrap_port.is_some() && role != WorkerRole::Prefill {
        return Err(GatewayError::invalid(Some("bootstrap_port"), "bootstrap_port is for prefill workers"));
    }
    spec.bootstrap_port = req.bootstrap_port;
    spec.kv_connector = match req.kv_connector.as_deref() {
        None => None,
        Some(name) => Some(KvConnector::from_name(name).ok_or_else(|| {
            GatewayError::invalid(Some("kv_connector"), format!("unknown kv_connector {name:?}: bootstrap, nixl or mooncake"))
        })?),
    };
    spec.labels = req.labels;
    Ok((spec, req.kv_engine_id))
}

async fn add(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let result = async {
        let (spec, engine_id) = build_spec(&state, parse::<AddWorker>(&body)?)?;
        if state.edge.own.is_me(&spec.url).await {
            state.metrics.edge.loops.with_label_values(&["registration"]).inc();
            return Err(GatewayError::invalid(Some("url"), state.edge.own.refusal(&spec.url)));
        }
        // What the engine says about itself must not contradict the registration.
        let info = engine_info(&state, &spec.url).await;
        if let Some(mode) = info.mode.as_deref() {
            let expected = match spec.role {
                WorkerRole::Prefill => "prefill",
                WorkerRole::Decode => "decode",
                WorkerRole::Regular => "null",
            };
            if mode != expected {
                return Err(GatewayError::invalid(
                    Some("worker_type"),
                    format!("{} reports disaggregation_mode {mode:?} but was added as {}", spec.url, spec.role.as_str()),
                ));
            }
        }
        if let Some(id) = &engine_id {
            state.store_engine_id(&spec.url, id.clone());
        }
        let entry = state.registry.add(spec, Source::Api, engine_id).map_err(|e| match e {
            RegistryError::Duplicate(id) => GatewayError::conflict(format!("worker already registered as {id}")),
            RegistryError::NotFound(id) => GatewayError::missing(id),
        })?;
        state.registry.set_info(&entry.id, info);
        // First health check now, so the worker serves without waiting for the next round.
        check_and_record(&state, entry.clone()).await;
        tracing::info!(worker = %entry.spec.url, id = %entry.id, "worker added through the API");
        Ok(state.registry.get(&entry.id).unwrap_or(entry))
    }
    .await;
    match result {
        Ok(e) => (StatusCode::CREATED, Json(worker_json(&state, &e))).into_response(),
        Err(err) => error_response(&err),
    }
}

/// Drains, then removes: no new requests from now on; in-flight ones finish first (bounded by
/// the request timeout, after which they are cut).
pub fn drain_and_remove(state: &Arc<AppState>, id: &str) -> Result<Entry, RegistryError> {
    let entry = state.registry.start_drain(id)?;
    let state = state.clone();
    let id = entry.id.clone();
    let url = entry.spec.url.clone();
    tokio::spawn(async move {
        let deadline = tokio::time::Instant::now() + state.request_timeout();
        while !state.registry.finish_drain(&id, tokio::time::Instant::now() >= deadline) {
            tokio::time::sleep(DRAIN_POLL).await;
        }
        state.forget_worker(&url);
        tracing::info!(id = %id, "drained worker removed");
    });
    Ok(entry)
}

async fn remove(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    match drain_and_remove(&state, &id) {
        Ok(e) => (StatusCode::ACCEPTED, Json(json!({"id": e.id, "url": e.spec.url, "status": "draining"}))).into_response(),
        Err(_) => not_found(&id),
    }
}

async fn update(State(state): State<Arc<AppState>>, Path(id): Path<String>, body: Bytes) -> Response {
    let req = match parse::<UpdateWorker>(&body) {
        Ok(r) => r,
        Err(e) => return error_response(&e),
    };
    match state.registry.set_enabled(&id, req.enabled) {
        Ok(e) => Json(worker_json(&state, &e)).into_response(),
        Err(_) => not_found(&id),
    }
}
