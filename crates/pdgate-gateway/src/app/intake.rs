//! A translated or plain inference request's way in: the body read within its limit and time,
//! translated when the route asks (`prepare`), validated, and handed to `exec`. `front.rs`'s
//! routes and the routes that translate another API (`messages.rs`, `responses/`) all admit here.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::Response;
use pdgate_core::GatewayError;
use pdgate_protocol::{parse_object, parse_request, Endpoint};
use serde_json::{Map, Value};
use tokio::time::Instant;

use crate::app::state::AppState;
use crate::exec::{execute, Ctx};
use crate::observe::scope::{self, RequestScope};
use crate::render::error_response;
use crate::request_id;

pub(crate) fn client_error(state: &AppState, route: &'static str, err: &GatewayError, started: std::time::Instant) -> Response {
    let resp = error_response(err);
    state.metrics.requests.with_label_values(&[route, resp.status().as_str()]).inc();
    crate::observe::access_log::refused(route, resp.status().as_u16(), &err.code(), started);
    resp
}

/// What a route's `prepare` step hands to [`admit_with`].
pub(crate) enum Prepared {
    /// The client's body, to be parsed as `endpoint`'s (the plain routes).
    Raw(Bytes),
    /// A translated route's body, built as a value: parsed as is (not read again from `raw`);
    /// `raw` is the same body written out, which the legs forward.
    Built { raw: Bytes, body: Map<String, Value> },
}

impl Prepared {
    /// A built body, written out once.
    pub(crate) fn built(body: Map<String, Value>) -> Result<Self, GatewayError> {
        // Sized for a usual body at once (`to_vec` starts small and regrows).
        let mut raw = Vec::with_capacity(512);
        serde_json::to_writer(&mut raw, &body).map_err(|e| GatewayError::invalid(None, format!("could not encode the request: {e}")))?;
        Ok(Prepared::Built { raw: Bytes::from(raw), body })
    }
}

/// Admits a request on `route`, run as `endpoint`'s: `prepare` turns the body read into the one
/// parsed and executed (the plain routes hand it on; `/v1/messages` and `/v1/responses`
/// translate it into chat completions), and `route` names the client's route in metrics, logs
/// and the request log.
pub(crate) async fn admit_with<F, Fut>(state: Arc<AppState>, endpoint: Endpoint, route: &'static str, req: Request, prepare: F) -> Response
where
    F: FnOnce(axum::body::Bytes) -> Fut,
    Fut: std::future::Future<Output = Result<Prepared, GatewayError>>,
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
    let raw = match read_body(&state, route, &headers, body, deadline, started).await {
        Ok(b) => b,
        Err(resp) => return resp,
    };
    let (raw, parsed) = match prepare(raw).await {
        Ok(Prepared::Raw(raw)) => {
            let parsed = parse_request(endpoint, &raw, &state.limits);
            (raw, parsed)
        }
        Ok(Prepared::Built { raw, body }) => (raw, parse_object(endpoint, body, &state.limits)),
        Err(err) => return client_error(&state, route, &err, started),
    };
    let req = match parsed {
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
    // Boxed: the transaction's future is ~14 KB; held inline, it made every route handler's
    // future that size, and axum's route boxing (tower's MapFuture::call) copies that future
    // twice per request: a fifth of a non-streamed request's instructions (docs/performance.md,
    // issue 28 item 6).
    let mut resp = scope::run(
        scope.clone(),
        Box::pin(execute(Ctx {
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
            images: Arc::from([]),
        })),
    )
    .await;
    // For the body wrapper in edge/conn.rs: the relay's stream warnings name the request.
    resp.extensions_mut().insert(scope);
    resp
}

/// The body, whole within `--max-payload-size` (a declared length over it is refused before
/// reading) and in time: one timer, `--body-read-timeout-secs` or the request's `deadline`,
/// whichever comes first. The refusal, counted under `route`, otherwise.
pub(crate) async fn read_body(state: &AppState, route: &'static str, headers: &HeaderMap, body: Body, deadline: Instant, started: std::time::Instant) -> Result<Bytes, Response> {
    let limit = state.config.max_payload_size;
    let declared = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(client_error(state, route, &GatewayError::payload_too_large(limit), started));
    }
    // One timer for the whole body, not one per frame.
    let body_timeout = Duration::from_secs(state.config.body_read_timeout_secs);
    match tokio::time::timeout_at(deadline.min(Instant::now() + body_timeout), axum::body::to_bytes(body, limit)).await {
        Err(_) => Err(body_timeout_response(state, route, body_timeout.min(state.request_timeout()), started)),
        Ok(Ok(b)) => Ok(b),
        Ok(Err(e)) => {
            let too_large = std::error::Error::source(&e).is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
            let err = if too_large { GatewayError::payload_too_large(limit) } else { GatewayError::invalid(None, format!("could not read the request body: {e}")) };
            Err(client_error(state, route, &err, started))
        }
    }
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
