//! The client-facing HTTP surface: OpenAI and SGLang routes, health, readiness, models, metrics.
//! Handlers only admit (loop check, size limit and body-read timeout, validation) and hand over
//! to `exec`.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{middleware, Json, Router};
use pdgate_core::{GatewayError, WorkerRole};
use pdgate_protocol::{parse_request, Endpoint};
use serde_json::json;
use tokio::time::Instant;

use crate::app::state::AppState;
use crate::edge::auth;
use crate::exec::{execute, Ctx};
use crate::fleet::workers_api;
use crate::observe::scope::{self, RequestScope};
use crate::render::error_response;
use crate::request_id;

pub fn router(state: Arc<AppState>) -> Router {
    let responses = crate::app::responses::Responses::new(state.clone());
    let mut inference = Router::new().route("/v1/completions", post(completions)).route("/v1/chat/completions", post(chat_completions)).route("/generate", post(generate));
    inference = inference.merge(responses.create_route());
    if let Some(admit) = &state.admission {
        inference = inference.route_layer(middleware::from_fn_with_state(admit.clone(), crate::admit::admission::limit));
    }
    // Layers added later run first: the key check comes before admission.
    let mut client = inference.route("/v1/models", get(models)).merge(responses.stored_routes());
    // Without a key the check would pass every request: skip the middleware and its boxing.
    if state.config.api_key.as_deref().is_some_and(|k| !k.is_empty()) {
        client = client.route_layer(middleware::from_fn_with_state(state.config.clone(), auth::client_key));
    }
    let admin = workers_api::routes().route_layer(middleware::from_fn_with_state(state.config.clone(), auth::admin_key)).with_state(state.fleet.clone());
    Router::new()
        .merge(client)
        .merge(admin)
        .route("/health", get(liveness))
        .route("/liveness", get(liveness))
        .route("/readiness", get(readiness))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
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

fn client_error(state: &AppState, route: &'static str, err: &GatewayError, started: std::time::Instant) -> Response {
    let resp = error_response(err);
    state.metrics.requests.with_label_values(&[route, resp.status().as_str()]).inc();
    crate::observe::access_log::refused(route, resp.status().as_u16(), &err.code(), started);
    resp
}

/// Admission: not a loop, body within the limit and in time, valid JSON of the right shape,
/// then execution.
async fn admit(state: Arc<AppState>, endpoint: Endpoint, req: Request) -> Response {
    admit_with(state, endpoint, endpoint.path(), req, |raw| std::future::ready(Ok(raw))).await
}

/// [`admit`] for a route that translates its body into `endpoint`'s (`/v1/responses` into chat
/// completions): `prepare` turns the body read into the body parsed and executed, and `route`
/// names the client's route in metrics, logs and the request log.
pub(crate) async fn admit_with<F, Fut>(state: Arc<AppState>, endpoint: Endpoint, route: &'static str, req: Request, prepare: F) -> Response
where
    F: FnOnce(axum::body::Bytes) -> Fut,
    Fut: std::future::Future<Output = Result<axum::body::Bytes, GatewayError>>,
{
    // The whole request, not the HeaderMap extractor: that one clones every header.
    let (parts, body) = req.into_parts();
    let headers = parts.headers;
    let started = std::time::Instant::now();
    let arrival_unix_s = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
    if state.is_draining() {
        // Graceful shutdown: refuse at once, and close the connection so the client's next
        // request goes to another replica.
        let mut resp = client_error(&state, route, &GatewayError::shutting_down(), started);
        resp.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
        return resp;
    }
    // Reading the body counts against the request's deadline.
    let deadline = Instant::now() + state.request_timeout();
    let via = match state.hops.outgoing(&headers) {
        Ok(v) => v,
        Err((err, kind)) => {
            state.metrics.edge.loops.with_label_values(&[kind]).inc();
            return client_error(&state, route, &err, started);
        }
    };
    let limit = state.config.max_payload_size;
    let declared = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > limit) {
        return client_error(&state, route, &GatewayError::payload_too_large(limit), started);
    }
    // One timer for the whole body, not one per frame.
    let body_timeout = Duration::from_secs(state.config.body_read_timeout_secs);
    let raw = match tokio::time::timeout_at(deadline.min(Instant::now() + body_timeout), axum::body::to_bytes(body, limit)).await {
        Err(_) => return body_timeout_response(&state, route, body_timeout.min(state.request_timeout()), started),
        Ok(Ok(b)) => b,
        Ok(Err(e)) => {
            let too_large = std::error::Error::source(&e).is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
            let err = if too_large { GatewayError::payload_too_large(limit) } else { GatewayError::invalid(None, format!("could not read the request body: {e}")) };
            return client_error(&state, route, &err, started);
        }
    };
    let raw = match prepare(raw).await {
        Ok(b) => b,
        Err(err) => return client_error(&state, route, &err, started),
    };
    let req = match parse_request(endpoint, &raw, &state.limits) {
        Ok(r) => r,
        Err(e) => return client_error(&state, route, &GatewayError::invalid(e.param.as_deref(), e.message), started),
    };
    let slo = match state.config.slo_targets().with_headers(|name| headers.get(name).map(|v| v.as_bytes())) {
        Ok(t) => t,
        Err(e) => return client_error(&state, route, &GatewayError::invalid(Some(e.header), e.message), started),
    };
    let priority = match crate::admit::admission::request_priority(&headers, &req.body) {
        Ok(p) => p,
        Err(err) => return client_error(&state, route, &err, started),
    };
    // The client's id only after validation; the legs get a minted one (see `request_id`).
    let client_request_id = request_id::client_id(&headers, &state.config.request_id_headers);
    let request_id = request_id::mint(client_request_id.as_deref());
    let session_key = headers.get("x-session-id").and_then(|v| v.to_str().ok()).map(str::to_string).or_else(|| req.body.get("user").and_then(|u| u.as_str()).map(str::to_string));
    // Every log line of the request (warnings of its legs and of its stream included) carries
    // its ids through this span.
    let span = tracing::info_span!(
        target: crate::observe::tracing_export::REQUEST_TARGET,
        "request",
        request_id = %request_id,
        client_request_id = client_request_id.as_deref().unwrap_or("-"),
        route,
        // Recorded only when tracing (tracing_export.rs), so logs stay as they were without it.
        otel.kind = tracing::field::Empty,
        model = tracing::field::Empty,
        http.response.status_code = tracing::field::Empty,
        error.type = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    );
    let mut client_trace = crate::observe::tracing_export::ClientTrace::from_headers(&headers);
    if crate::observe::tracing_export::enabled() {
        span.record("otel.kind", "server");
        if let Some(model) = req.model.as_deref() {
            span.record("model", model);
        }
        if let Some(client) = client_trace.take() {
            client.adopt(&span);
        }
    }
    let scope = Arc::new(RequestScope { request_id: request_id.clone(), via, span, client_trace });
    let mut resp = scope::run(
        scope.clone(),
        execute(Ctx {
            state: state.exec.clone(),
            req,
            raw,
            request_id,
            client_request_id,
            session_key,
            deadline,
            started,
            arrival_unix_s,
            route,
            slo,
            priority,
            usage: Default::default(),
            prompt_ids: Default::default(),
            ids_to_ledger: false,
            prompt_memo: Default::default(),
        }),
    )
    .await;
    // For the body wrapper in edge/conn.rs: the relay's stream warnings name the request.
    resp.extensions_mut().insert(scope);
    resp
}

/// 408 for a body that did not arrive in time; the connection is closed after it, since the
/// rest of the body may still come.
fn body_timeout_response(state: &AppState, route: &'static str, limit: Duration, started: std::time::Instant) -> Response {
    state.metrics.edge.client_timeouts.with_label_values(&["body"]).inc();
    let err = GatewayError::client_timeout(format!("the request body was not complete within {} s", limit.as_secs()));
    let mut resp = client_error(state, route, &err, started);
    resp.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
    resp
}

async fn liveness() -> Response {
    Json(json!({"status": "ok"})).into_response()
}

/// Ready when a request could be served now: PD mode needs a healthy prefill with a compatible
/// healthy decode; regular mode a healthy worker.
async fn readiness(State(state): State<Arc<AppState>>) -> Response {
    let routing = state.fleet.registry.routing();
    let snap = &routing.snapshot;
    let (ready, detail) = if state.config.pd_disaggregation {
        let p = snap.eligible(WorkerRole::Prefill).len();
        let d = snap.eligible(WorkerRole::Decode).len();
        (snap.pd_ready(), json!({"healthy_prefill": p, "healthy_decode": d, "pairable_prefill": snap.pairable_prefills().len()}))
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
