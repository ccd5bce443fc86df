//! The client-facing HTTP surface: OpenAI and SGLang routes, health, readiness, models, metrics.
//! Handlers only admit (loop check, size limit and body-read timeout, validation) and hand over
//! to `exec`.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{middleware, Json, Router};
use pdgate_core::{GatewayError, WorkerRole};
use pdgate_protocol::Endpoint;
use serde_json::json;

use crate::app::intake::{admit_with, Prepared};
use crate::app::state::AppState;
use crate::edge::auth;
use crate::fleet::workers_api;
use crate::render::error_response;

pub fn router(state: Arc<AppState>) -> Router {
    let responses = crate::app::responses::Responses::new(state.clone());
    let inference = Router::new().route("/v1/completions", post(completions)).route("/v1/chat/completions", post(chat_completions)).route("/generate", post(generate));
    let inference = admitted(&state, inference.merge(responses.create_route()));
    let client = keyed(&state, inference.route("/v1/models", get(models)).merge(responses.stored_routes()));
    // The Messages routes under the same layers, then, outermost, the rewrite of their refusals
    // (key, admission, validation) into Anthropic's shape: on these routes only, so the other
    // routes pay nothing for it.
    let messages = keyed(&state, admitted(&state, crate::app::messages::routes(Router::new())));
    let messages = messages.route_layer(middleware::from_fn(crate::app::messages::anthropic_errors));
    let admin = workers_api::routes().route_layer(middleware::from_fn_with_state(state.config.clone(), auth::admin_key)).with_state(state.fleet.clone());
    Router::new()
        .merge(client)
        .merge(messages)
        .merge(admin)
        .route("/health", get(liveness))
        .route("/liveness", get(liveness))
        .route("/readiness", get(readiness))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

/// The admission limit (queue, priority) on inference routes, when configured.
fn admitted(state: &AppState, routes: Router<Arc<AppState>>) -> Router<Arc<AppState>> {
    match &state.admission {
        Some(admit) => routes.route_layer(middleware::from_fn_with_state(admit.clone(), crate::admit::admission::limit)),
        None => routes,
    }
}

/// The client key check, when a key is set. Layers added later run first: the key check comes
/// before admission. Without a key the check would pass every request: no middleware, no boxing.
fn keyed(state: &AppState, routes: Router<Arc<AppState>>) -> Router<Arc<AppState>> {
    if state.config.api_key.as_deref().is_some_and(|k| !k.is_empty()) {
        routes.route_layer(middleware::from_fn_with_state(state.config.clone(), auth::client_key))
    } else {
        routes
    }
}

async fn completions(State(s): State<Arc<AppState>>, req: Request) -> Response {
    admit(s, Endpoint::Completions, req).await
}

async fn chat_completions(State(s): State<Arc<AppState>>, req: Request) -> Response {
    admit(s, Endpoint::ChatCompletions, req).await
}

async fn generate(State(s): State<Arc<AppState>>, req: Request) -> Response {
    admit(s, Endpoint::Generate, req).await
}

/// Admission: not a loop, body within the limit and in time, valid JSON of the right shape,
/// then execution.
async fn admit(state: Arc<AppState>, endpoint: Endpoint, req: Request) -> Response {
    admit_with(state, endpoint, endpoint.path(), req, |raw| std::future::ready(Ok(Prepared::Raw(raw)))).await
}

async fn liveness() -> Response {
    Json(json!({"status": "ok"})).into_response()
}

/// Ready when a request could be served now: PD mode needs a healthy prefill with a compatible
/// healthy decode; EPD mode a healthy encode worker as well (an EPD gateway is there for its
/// image requests, and each would fail without one); regular mode a healthy worker.
async fn readiness(State(state): State<Arc<AppState>>) -> Response {
    let routing = state.fleet.registry.routing();
    let snap = &routing.snapshot;
    let (ready, detail) = if state.config.pd_disaggregation {
        let p = snap.eligible(WorkerRole::Prefill).len();
        let d = snap.eligible(WorkerRole::Decode).len();
        let mut detail = json!({"healthy_prefill": p, "healthy_decode": d, "pairable_prefill": snap.pairable_prefills().len()});
        let mut ready = snap.pd_ready();
        if state.config.epd_disaggregation {
            let e = snap.eligible(WorkerRole::Encode).len();
            detail["healthy_encode"] = json!(e);
            ready &= e > 0;
        }
        (ready, detail)
    } else {
        let r = snap.eligible(WorkerRole::Regular).len();
        (r > 0, json!({"healthy_workers": r}))
    };
    // A draining gateway is not ready, whatever its workers: load balancers must stop sending.
    let draining = state.is_draining();
    let ready = ready && !draining;
    let status = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    let word = if draining {
        "draining"
    } else if ready {
        "ready"
    } else {
        "not_ready"
    };
    let mut body = json!({"status": word, "admin_api": auth::admin_api_mode(&state.config)});
    if let (Some(b), Some(d)) = (body.as_object_mut(), detail.as_object()) {
        b.extend(d.clone());
    }
    (status, Json(body)).into_response()
}

async fn models(State(state): State<Arc<AppState>>) -> Response {
    let data: Vec<_> = state.fleet.registry.routing().snapshot.models().into_iter().map(|id| json!({"id": id, "object": "model", "created": 0, "owned_by": "pdgate"})).collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

pub(crate) async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    // Exact at scrape time, whatever changed the registry since the last periodic refresh.
    crate::fleet::discovery::refresh_worker_gauge(&state.fleet);
    crate::fleet::gauges::refresh_workers(&state.metrics, &state.fleet.registry.list(), state.fleet.registry.breaker_config());
    let routing = state.fleet.registry.routing();
    crate::fleet::gauges::refresh_token_load(&state.metrics, &routing, &state.fleet.loads(&routing.runtime));
    if let Some(a) = &state.admission {
        state.metrics.admission_waiting.set(a.admission.waiting() as i64);
    }
    state.goodput.refresh(&state.metrics.slo);
    let text = state.metrics.render() + &state.fleet.kv_view.metrics_text();
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

async fn not_found(uri: Uri) -> Response {
    error_response(&GatewayError::not_found(uri.path()))
}

async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    error_response(&GatewayError::method_not_allowed(method.as_str(), uri.path()))
}
