//! The request as a transaction: select → prepare legs → relay → finish, with retries on a
//! fresh worker/pair only before any byte reached the client, all under one deadline.
//!
//! ```text
//!   attempt n:  select (snapshot, policy)  →  legs (regular | bootstrap | nixl | mooncake)
//!                  │ error before commit         │ first byte ready = commit
//!                  ▼                             ▼
//!              retry? (error, n, deadline)    relay to client (errors → SSE error event)
//! ```

pub mod leg;
mod pd;
pub mod relay;
mod single;

use std::sync::Arc;

use axum::http::HeaderValue;
use axum::response::Response;
use bytes::Bytes;
use pdgate_core::breaker::Outcome;
use pdgate_core::{GatewayError, RouteInput};
use pdgate_protocol::ParsedRequest;
use tokio::time::Instant;

use crate::record::{Record, ROUTE_HEADER};
use crate::registry::Routing;
use crate::render::error_response;
use crate::state::AppState;

/// One client request on its way through the gateway.
pub struct Ctx {
    pub state: Arc<AppState>,
    pub req: ParsedRequest,
    /// The client's body as received; forwarded unchanged where no rewrite is needed.
    pub raw: Bytes,
    /// The id of the current attempt, sent to the workers as `X-Request-Id` (the id the legs
    /// rendezvous on): minted by the gateway, fresh for every attempt (see `request_id`).
    pub request_id: String,
    /// The client's own `X-Request-Id`, validated; for the logs and `x-client-request-id`.
    pub client_request_id: Option<String>,
    /// Affinity key for consistent hashing: `x-session-id` header, else the body's `user`.
    pub session_key: Option<String>,
    pub deadline: Instant,
    pub started: std::time::Instant,
    pub route: &'static str,
}

impl Ctx {
    /// The client's body for a leg that forwards it as it came: the received bytes, unless the
    /// parser removed gateway-owned fields (rare: then the cleaned body is encoded).
    pub fn forward_body(&self) -> Result<Bytes, GatewayError> {
        if !self.req.rewritten {
            return Ok(self.raw.clone());
        }
        serde_json::to_vec(&self.req.body).map(Bytes::from).map_err(|e| GatewayError::internal(format!("cannot encode request: {e}")))
    }

    /// The prompt text, only when a policy reads it (copying it for the others would be waste).
    pub fn routing_text(&self) -> Option<String> {
        if self.state.uses_tree() {
            self.req.routing_text()
        } else {
            None
        }
    }

    /// Runs one policy decision with everything a policy may read: the load view, the affinity
    /// key, the text and, when a policy reads it, the radix tree (locked for the decision only).
    pub fn decide<T>(&self, routing: &Routing, text: Option<&str>, select: impl FnOnce(&RouteInput<'_>) -> T) -> T {
        let loads = self.state.loads(&routing.runtime);
        let input = RouteInput {
            text,
            key: self.session_key.as_deref(),
            sequence: self.state.next_sequence(),
            loads: &loads,
            ..RouteInput::default()
        };
        if !self.state.uses_tree() {
            return select(&input);
        }
        let tree = self.state.tree.lock().unwrap_or_else(|p| p.into_inner());
        select(&RouteInput { tree: Some(&tree), ..input })
    }

    /// Records that the request's text went to `url`, for the cache-aware policies.
    pub fn remember(&self, text: Option<&str>, url: &str) {
        if let Some(text) = text {
            let mut tree = self.state.tree.lock().unwrap_or_else(|p| p.into_inner());
            self.state.remember(&mut tree, text, url);
        }
    }
}

/// An attempt's failure and the worker to avoid on the next attempt.
pub struct AttemptFailure {
    pub error: GatewayError,
    pub worker: Option<String>,
}

impl From<GatewayError> for AttemptFailure {
    fn from(error: GatewayError) -> Self {
        AttemptFailure { error, worker: None }
    }
}

/// A request for more tokens than the model's context length can never be served: refuse it
/// (400 naming the field) instead of letting it wait on the workers until the deadline.
fn check_context(ctx: &Ctx) -> Result<(), GatewayError> {
    let Some((asked, field)) = ctx.req.max_tokens else { return Ok(()) };
    let Some(limit) = ctx.state.registry.routing().snapshot.context_limit(ctx.req.model.as_deref()) else { return Ok(()) };
    if asked > limit {
        return Err(GatewayError::invalid(Some(field), format!("'{field}' is {asked}, more than the model's context length of {limit} tokens")));
    }
    Ok(())
}

pub async fn execute(mut ctx: Ctx) -> Response {
    let mut record = Record::default();
    if ctx.req.rewritten {
        tracing::debug!(request_id = %ctx.request_id, "removed rendezvous fields the client sent (they are the gateway's)");
    }
    if let Err(err) = check_context(&ctx) {
        return finish(&ctx, error_response(&err), &record);
    }
    let mut failed: Vec<String> = Vec::new();
    let response = loop {
        record.attempts += 1;
        if record.attempts > 1 {
            // A retry is a new rendezvous: the old id may still be live on the failed pair.
            ctx.request_id = crate::request_id::mint(ctx.client_request_id.as_deref());
            tracing::Span::current().record("request_id", ctx.request_id.as_str());
        }
        let result = if ctx.state.config.pd_disaggregation {
            pd::attempt(&ctx, &failed, &mut record).await
        } else {
            single::regular_attempt(&ctx, &failed, &mut record).await
        };
        let failure = match result {
            Ok(resp) => {
                // A stream's relayed worker is judged when the stream ends (relay.rs).
                let at_end = resp.extensions().get::<relay::OutcomeAtEnd>().map(|o| o.0.as_str());
                for url in [&record.worker, &record.prefill, &record.decode].into_iter().flatten() {
                    if at_end != Some(url.as_str()) {
                        ctx.state.record_outcome(url, Outcome::Success);
                    }
                }
                break resp;
            }
            Err(f) => f,
        };
        let err = &failure.error;
        if let Some(url) = &failure.worker {
            ctx.state.record_outcome(url, Outcome::of_attempt(err, ctx.started));
            ctx.state.note_worker_error(url, err);
        }
        let metrics = &ctx.state.metrics;
        if let Some(leg) = err.leg {
            metrics.leg_errors.with_label_values(&[leg.as_str(), &err.code()]).inc();
        }
        let left = ctx.deadline.saturating_duration_since(Instant::now());
        tracing::debug!(request_id = %ctx.request_id, attempt = record.attempts, error = %err, route = %record.full(), "attempt failed");
        if !ctx.state.retry.should_retry(err, record.attempts, false, left) {
            crate::edge::log_limit::warn_request(&ctx.state, Some(&ctx.request_id), "request failed", err, Some(&record.header_value()));
            break error_response(err);
        }
        metrics.retries.with_label_values(&[err.reason()]).inc();
        if let Some(w) = failure.worker {
            failed.push(w);
        }
        // ThreadRng is not Send: take it only for this call, never across an await.
        let backoff = ctx.state.retry.backoff(record.attempts, &mut rand::rng());
        tokio::time::sleep(backoff.min(left)).await;
    };
    finish(&ctx, response, &record)
}

fn finish(ctx: &Ctx, mut response: Response, record: &Record) -> Response {
    // The full record (every room of a batch) goes to the debug log only, formatted only when
    // that level is on; the header is bounded (see `record`).
    tracing::debug!(request_id = %ctx.request_id, client_request_id = ctx.client_request_id.as_deref().unwrap_or("-"), route = %record.full(), status = response.status().as_u16(), "routed");
    let headers = response.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&record.header_value()) {
        headers.insert(ROUTE_HEADER, v);
    }
    // Both ids are of the safe charset (validated or minted), so they are valid header values.
    if let Ok(v) = HeaderValue::from_str(&ctx.request_id) {
        headers.insert("x-request-id", v);
    }
    if let Some(v) = ctx.client_request_id.as_deref().and_then(|c| HeaderValue::from_str(c).ok()) {
        headers.insert(crate::request_id::CLIENT_ID_HEADER, v);
    }
    let status = response.status();
    crate::access_log::served(&ctx.request_id, ctx.client_request_id.as_deref(), ctx.route, record, status.as_u16(), ctx.started);
    ctx.state.metrics.requests.with_label_values(&[ctx.route, status.as_str()]).inc();
    if !status.is_success() {
        ctx.state.metrics.duration.with_label_values(&[ctx.route]).observe(ctx.started.elapsed().as_secs_f64());
    }
    response
}
