//! API keys: `--api-key` guards the client endpoints, `--admin-api-key` (and the `admin` keys
//! of SMG's `--control-plane-api-keys`) the worker API. Both as `Authorization: Bearer KEY`. Missing → 401, wrong → 403. Health, readiness and metrics stay
//! open for probes and scrapers.
//!
//! The worker API is closed without `--admin-api-key` (403 `admin_api_closed`), unless
//! `--admin-api-open` opens it for development. `--api-key` never opens or guards it.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::Response;
use pdgate_core::{GatewayConfig, GatewayError};

use crate::render::error_response;

fn check(req: &Request, key: Option<&str>) -> Result<(), GatewayError> {
    let Some(key) = key.filter(|k| !k.is_empty()) else { return Ok(()) };
    check_any(req, &[key])
}

/// Passes when the request's bearer key is one of `keys` (compared in constant time each).
fn check_any(req: &Request, keys: &[&str]) -> Result<(), GatewayError> {
    let bearer = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
    // Anthropic's SDKs send the key as `x-api-key` (the Messages API, app/messages.rs).
    let given = bearer.or_else(|| req.headers().get("x-api-key").and_then(|v| v.to_str().ok()));
    match given {
        None => Err(GatewayError::unauthorized("this endpoint needs an API key: Authorization: Bearer KEY")),
        // Every key is compared, so the time taken does not say which one matched.
        Some(g) if keys.iter().fold(false, |found, k| constant_time_eq(g.trim().as_bytes(), k.as_bytes()) | found) => Ok(()),
        Some(_) => Err(GatewayError::forbidden("the API key is not valid for this endpoint")),
    }
}

/// Compares without an early exit, so the time taken does not reveal how much of a key matched.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

pub async fn client_key(State(config): State<Arc<GatewayConfig>>, req: Request, next: Next) -> Response {
    match check(&req, config.api_key.as_deref()) {
        Ok(()) => next.run(req).await,
        Err(e) => error_response(&e),
    }
}

/// How the worker API is guarded, as `/readiness` reports it.
pub fn admin_api_mode(config: &GatewayConfig) -> &'static str {
    if !config.admin_keys().is_empty() {
        "key"
    } else if config.admin_api_open {
        "open"
    } else {
        "closed"
    }
}

pub async fn admin_key(State(config): State<Arc<GatewayConfig>>, req: Request, next: Next) -> Response {
    let checked = match admin_api_mode(&config) {
        "key" => {
            let keys = config.admin_keys();
            check_any(&req, &keys.iter().map(String::as_str).collect::<Vec<_>>())
        }
        "open" => Ok(()),
        _ => Err(GatewayError::admin_api_closed(
            "the worker API (/workers) is closed: start the gateway with --admin-api-key KEY and send Authorization: Bearer KEY \
             (or, for development only, --admin-api-open)",
        )),
    };
    match checked {
        Ok(()) => next.run(req).await,
        Err(e) => error_response(&e),
    }
}
