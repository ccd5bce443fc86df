//! The worker API (SMG-compatible, docs/protocols.md §4): add, list, inspect, enable/disable and
//! drain-then-remove workers at runtime. One of the three sources of membership changes
//! (`membership.rs`), with the static flags and Kubernetes discovery; the body is parsed by the
//! one registration parser of pdgate-core.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use pdgate_core::{GatewayError, WorkerRegistration, WorkerRole, WorkerSpec};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::fleet::health::{check_and_record, engine_info};
use crate::fleet::membership::{self, Change};
use crate::fleet::registry::{Entry, RegistryError, Source};
use crate::fleet::Fleet;
use crate::render::error_response;

pub fn routes() -> Router<Arc<Fleet>> {
    Router::new().route("/workers", get(list).post(add)).route("/workers/{id}", get(one).delete(remove).put(update))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct UpdateWorker {
    enabled: bool,
}

fn parse<T: for<'de> Deserialize<'de>>(body: &Bytes) -> Result<T, GatewayError> {
    serde_json::from_slice(body).map_err(|e| GatewayError::invalid(None, format!("invalid worker request: {e}")))
}

pub fn worker_json(state: &Fleet, e: &Entry) -> Value {
    let connector = e.spec.connector(state.config.kv_connector);
    let polled = e.runtime.polled_load.load(Ordering::Relaxed);
    json!({
        "id": e.id,
        "url": e.spec.url,
        "worker_type": e.spec.role.as_str(),
        "bootstrap_port": e.spec.bootstrap_port,
        "kv_connector": connector.as_str(),
        "kv_engine_id": e.spec.kv_engine_id,
        "kv_events": e.spec.kv_events,
        "kv_events_replay": e.spec.kv_events_replay,
        "labels": e.spec.labels,
        "source": e.source.as_str(),
        "healthy": e.health.healthy,
        "enabled": e.enabled,
        "draining": e.draining,
        "inflight": e.runtime.inflight.load(Ordering::Relaxed),
        "load": if polled >= 0 { json!(polled) } else { Value::Null },
        "queued_requests": e.runtime.tokens.queued_requests.load(Ordering::Relaxed),
        "prompt_tokens": e.runtime.tokens.prompt_tokens.load(Ordering::Relaxed),
        "kv_tokens": e.runtime.tokens.kv_tokens.load(Ordering::Relaxed),
        "models": e.info.models,
        "disaggregation_mode": e.info.mode,
        "pd_pairing": state.registry.pairing_key(e),
        "pd_pairing_mode": state.registry.pairing_mode(),
        "breaker": e.runtime.breaker().state(std::time::Instant::now(), state.registry.breaker_config()).as_str(),
        "last_error": e.runtime.last_error().map(|(reason, at)| json!({"reason": reason, "at": at})),
    })
}

async fn list(State(state): State<Arc<Fleet>>) -> Response {
    let workers: Vec<Value> = state.registry.list().iter().map(|e| worker_json(&state, e)).collect();
    Json(json!({"workers": workers, "total": workers.len()})).into_response()
}

fn not_found(id: &str) -> Response {
    error_response(&GatewayError::missing(format!("no worker with id or URL {id:?}")))
}

async fn one(State(state): State<Arc<Fleet>>, Path(id): Path<String>) -> Response {
    match state.registry.get(&id) {
        Some(e) => Json(worker_json(&state, &e)).into_response(),
        None => not_found(&id),
    }
}

/// The body of `POST /workers`, checked by the one registration parser (pdgate-core).
fn build_spec(state: &Fleet, body: &Bytes) -> Result<WorkerSpec, GatewayError> {
    let reg = parse::<WorkerRegistration>(body)?;
    let spec = reg.into_spec(state.config.pd_disaggregation).map_err(|e| GatewayError::invalid(Some(e.param), e.message))?;
    if spec.role == WorkerRole::Encode && !state.config.epd_disaggregation {
        return Err(GatewayError::invalid(Some("worker_type"), "encode workers need a gateway started with --epd-disaggregation"));
    }
    Ok(spec)
}

async fn add(State(state): State<Arc<Fleet>>, body: Bytes) -> Response {
    let result = async {
        let spec = build_spec(&state, &body)?;
        if state.own.is_me(&spec.url).await {
            state.metrics.edge.loops.with_label_values(&["registration"]).inc();
            return Err(GatewayError::invalid(Some("url"), state.own.refusal(&spec.url)));
        }
        // What the engine says about itself must not contradict the registration.
        let info = engine_info(&state, &spec.url).await;
        if let Some(mode) = info.mode.as_deref() {
            let expected = match spec.role {
                WorkerRole::Prefill => "prefill",
                WorkerRole::Decode => "decode",
                // An encode worker (`--encoder-only`) generates nothing and reports no PD mode.
                WorkerRole::Regular | WorkerRole::Encode => "null",
            };
            if mode != expected {
                return Err(GatewayError::invalid(Some("worker_type"), format!("{} reports disaggregation_mode {mode:?} but was added as {}", spec.url, spec.role.as_str())));
            }
        }
        let entry = membership::apply(&state, Change::Add(Box::new(spec), Source::Api)).map_err(|e| match e {
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

async fn remove(State(state): State<Arc<Fleet>>, Path(id): Path<String>) -> Response {
    match membership::apply(&state, Change::Drain(id.clone())) {
        Ok(e) => (StatusCode::ACCEPTED, Json(json!({"id": e.id, "url": e.spec.url, "status": "draining"}))).into_response(),
        Err(_) => not_found(&id),
    }
}

async fn update(State(state): State<Arc<Fleet>>, Path(id): Path<String>, body: Bytes) -> Response {
    let req = match parse::<UpdateWorker>(&body) {
        Ok(r) => r,
        Err(e) => return error_response(&e),
    };
    match membership::apply(&state, Change::SetEnabled(id.clone(), req.enabled)) {
        Ok(e) => Json(worker_json(&state, &e)).into_response(),
        Err(_) => not_found(&id),
    }
}
