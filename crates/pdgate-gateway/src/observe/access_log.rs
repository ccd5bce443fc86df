//! The access log: one line per client request on the inference routes, at info level under
//! the target `pdgate::access` (turn it off with `--log-level info,pdgate::access=off`).
//! Each line has the request id (the last attempt's, as the response's `x-request-id`), the
//! client's own id, the route, the workers that served it, the attempts, the resumes of a
//! whole answer (a stream's come after this line: see the request log), the status and the
//! latency until the response head (a stream goes on after it).

use std::time::Instant;

use crate::observe::record::Record;

pub const TARGET: &str = "pdgate::access";

/// The metric label of a path: the route itself for the inference routes, else `other` (an
/// unknown path must not create a series per path).
pub fn route_label(path: &str) -> &'static str {
    match path {
        "/v1/completions" => "/v1/completions",
        "/v1/chat/completions" => "/v1/chat/completions",
        "/generate" => "/generate",
        "/v1/responses" => "/v1/responses",
        "/v1/messages" => "/v1/messages",
        "/v1/messages/count_tokens" => "/v1/messages/count_tokens",
        _ => "other",
    }
}

/// A request that reached execution: routed (or failed) with a decision record.
pub fn served(request_id: &str, client_request_id: Option<&str>, route: &str, record: &Record, status: u16, started: Instant) {
    let dash = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
    tracing::info!(
        target: TARGET,
        request_id,
        client_request_id = client_request_id.unwrap_or("-"),
        route,
        protocol = record.protocol,
        worker = %dash(&record.worker),
        prefill = %dash(&record.prefill),
        decode = %dash(&record.decode),
        attempts = record.attempts,
        resumes = record.resumes,
        status,
        latency_ms = started.elapsed().as_secs_f64() * 1000.0,
        "request"
    );
}

/// A request answered before execution: refused by admission or by validation.
pub fn refused(route: &str, status: u16, code: &str, started: Instant) {
    tracing::info!(
        target: TARGET,
        request_id = "-",
        route,
        status,
        code,
        latency_ms = started.elapsed().as_secs_f64() * 1000.0,
        "request refused"
    );
}
