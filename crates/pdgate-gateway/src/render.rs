//! The one place where a `GatewayError` becomes an HTTP response.

use axum::body::Body;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use pdgate_core::{ErrorKind, GatewayError};
use pdgate_protocol::openai::error_body;
use serde_json::Value;

/// Why the gateway refused a request (its error code, or a finer cause such as `queue_full`,
/// `shed`, `no_kv_room` or the early rejection's reason): on every refusal.
pub const DROPPED_HEADER: &str = "x-pdgate-dropped-reason";

/// The `Retry-After` of a refusal or a 429/503 that does not predict its own: one second,
/// soon enough to find a freed slot, late enough not to spin.
const DEFAULT_RETRY_AFTER_SECS: u32 = 1;

/// The error code of an error response, kept on it for the finish span (exec/spans.rs).
#[derive(Clone, Debug)]
pub struct ErrorCode(pub String);

pub fn error_response(err: &GatewayError) -> Response {
    let status = StatusCode::from_u16(err.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let body = match &err.kind {
        // A worker's own OpenAI-style client error is the most precise message: pass it on.
        // 508 too: a peer gateway's loop verdict names the loop.
        ErrorKind::WorkerStatus { status: s, body: Some(text) } if (400..500).contains(s) || *s == 508 => match serde_json::from_str::<Value>(text) {
            Ok(v) if v.get("error").is_some() => v,
            _ => error_body(&format!("{}: {}", err.message, truncate(text)), err.error_type(), &err.code(), None),
        },
        ErrorKind::WorkerStatus { body: Some(text), .. } => error_body(&format!("{}: {}", err.message, truncate(text)), err.error_type(), &err.code(), None),
        _ => error_body(&err.message, err.error_type(), &err.code(), err.param()),
    };
    let mut resp = Response::new(Body::from(body.to_string()));
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    let refusal = err.is_refusal();
    if refusal {
        if let Ok(v) = HeaderValue::from_str(&err.code()) {
            h.insert(DROPPED_HEADER, v);
        }
    }
    if refusal || matches!(status.as_u16(), 429 | 503) {
        h.insert(header::RETRY_AFTER, HeaderValue::from(DEFAULT_RETRY_AFTER_SECS));
    }
    resp.extensions_mut().insert(ErrorCode(err.code()));
    resp
}

/// `error_response` with a finer refusal cause than the error code in `x-pdgate-dropped-reason`.
pub fn refusal_response(err: &GatewayError, cause: &'static str) -> Response {
    let mut resp = error_response(err);
    resp.headers_mut().insert(DROPPED_HEADER, HeaderValue::from_static(cause));
    resp
}

fn truncate(s: &str) -> &str {
    match s.char_indices().nth(500) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}
