//! The request's phase spans, for `--enable-trace` (see `tracing_export.rs`):
//!
//! ```text
//! request (front.rs: ids, route, model, status)
//!  ├─ admit
//!  ├─ attempt 1 (attempt, request_id; error.type when it failed)
//!  │   ├─ select (mode, policy, prefill, decode | worker)
//!  │   ├─ prefill (worker)          ← the prefill worker gets this span as `traceparent`
//!  │   └─ decode | regular (worker) ← the relayed worker gets this span as `traceparent`
//!  │       └─ relay (bytes, chunks)
//!  ├─ attempt 2 ...                  (a retry, on another pair)
//!  └─ finish (http.response.status_code, error.type)
//! ```
//!
//! Without `--enable-trace` these callsites are disabled: each macro returns a disabled span
//! after one cached check, and recording on it does nothing.

use axum::response::Response;
use pdgate_core::{GatewayError, Leg};
use tracing::field::Empty;
use tracing::Span;

use crate::observe::tracing_export::{enabled, record_error, TARGET};
use crate::render::ErrorCode;

/// The admission phase.
pub fn admit() -> Span {
    tracing::info_span!(target: TARGET, "admit", error.type = Empty, otel.status_code = Empty)
}

/// One attempt (the first, or a retry) with the request id its legs rendezvous on.
pub fn attempt(number: u32, request_id: &str) -> Span {
    tracing::info_span!(target: TARGET, "attempt", attempt = number, request_id, error.type = Empty, otel.status_code = Empty)
}

/// The selection phase; its choice is recorded by [`selected`].
pub fn select() -> Span {
    tracing::info_span!(target: TARGET, "select", mode = Empty, policy = Empty, prefill = Empty, decode = Empty, worker = Empty, error.type = Empty, otel.status_code = Empty)
}

/// Records the selection's outcome: the mode, the policies' reasons and the chosen workers.
pub fn selected(span: &Span, mode: &str, policy: &str, prefill: Option<&str>, relayed: &str) {
    if span.is_disabled() {
        return;
    }
    span.record("mode", mode);
    span.record("policy", policy);
    match prefill {
        Some(p) => {
            span.record("prefill", p);
            span.record("decode", relayed);
        }
        None => {
            span.record("worker", relayed);
        }
    }
}

/// A leg to `worker`, named after its role (a client span: the worker's own span is its child).
pub fn leg(leg: Leg, worker: &str) -> Span {
    match leg {
        Leg::Prefill => tracing::info_span!(target: TARGET, "prefill", otel.kind = "client", worker, error.type = Empty, otel.status_code = Empty),
        Leg::Decode => tracing::info_span!(target: TARGET, "decode", otel.kind = "client", worker, error.type = Empty, otel.status_code = Empty),
        Leg::Regular => tracing::info_span!(target: TARGET, "regular", otel.kind = "client", worker, error.type = Empty, otel.status_code = Empty),
        Leg::Encode => tracing::info_span!(target: TARGET, "encode", otel.kind = "client", worker, error.type = Empty, otel.status_code = Empty),
    }
}

/// Marks a phase's span failed with `err`.
pub fn failed(span: &Span, err: &GatewayError) {
    if !span.is_disabled() {
        record_error(span, &err.code());
    }
}

/// The relay of the answer after commit: counts what went to the client, recorded when it
/// ends (the stream's end, or the client going away).
pub struct RelayTrace {
    span: Span,
    bytes: u64,
    chunks: u64,
    ended: bool,
}

impl RelayTrace {
    /// Starts the relay span under the current span (the relayed leg's).
    pub fn start() -> Self {
        let span = tracing::info_span!(target: TARGET, "relay", bytes = Empty, chunks = Empty, outcome = Empty, error.type = Empty, otel.status_code = Empty);
        RelayTrace { span, bytes: 0, chunks: 0, ended: false }
    }

    /// Bytes that went to the client.
    pub fn sent(&mut self, len: usize) {
        self.bytes += len as u64;
        self.chunks += 1;
    }

    /// The relay ended by itself: completely, or with `err` (an error event after commit).
    pub fn ended(&mut self, err: Option<&GatewayError>) {
        self.ended = true;
        if let Some(e) = err {
            failed(&self.span, e);
        }
    }
}

impl Drop for RelayTrace {
    fn drop(&mut self) {
        if self.span.is_disabled() {
            return;
        }
        self.span.record("bytes", self.bytes);
        self.span.record("chunks", self.chunks);
        // Not ended by itself: the client went away (the legs were given up).
        self.span.record("outcome", if self.ended { "done" } else { "client_gone" });
    }
}

/// The finish phase of `response`; records the status (and the error code of an error
/// response) on it and on the request span (the current one).
pub fn finish(response: &Response) -> Span {
    let status = response.status().as_u16();
    let span = tracing::info_span!(target: TARGET, "finish", http.response.status_code = status, error.type = Empty, otel.status_code = Empty);
    if !enabled() {
        return span;
    }
    let request = Span::current();
    request.record("http.response.status_code", status);
    if let Some(ErrorCode(code)) = response.extensions().get::<ErrorCode>() {
        span.record("error.type", code.as_str());
        request.record("error.type", code.as_str());
    }
    // A server span fails on 5xx only; a 4xx is the client's error.
    if status >= 500 {
        span.record("otel.status_code", "ERROR");
        request.record("otel.status_code", "ERROR");
    }
    span
}
