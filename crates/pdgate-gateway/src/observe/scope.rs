//! A request's id and outgoing `via`, for code that runs without the request's context: the
//! upstream client (which adds the hop header) and the relay's stream warnings (which run
//! while hyper polls the response body, after the handler returned). Set by `intake::admit_with`
//! around the execution, and by `conn`'s body wrapper around each poll of the body.

use std::future::Future;
use std::sync::Arc;

use axum::http::HeaderValue;

use crate::observe::tracing_export::ClientTrace;

pub struct RequestScope {
    pub request_id: String,
    /// The `via` value for upstream requests: the incoming one plus this gateway's entry.
    pub via: HeaderValue,
    /// The request's log span (its ids), entered wherever the scope is.
    pub span: tracing::Span,
    /// The client's W3C trace context, passed on to the workers as it came when the gateway
    /// does not trace itself (with `--enable-trace` the legs' spans are sent instead).
    pub client_trace: Option<ClientTrace>,
}

tokio::task_local! {
    static CURRENT: Arc<RequestScope>;
}

/// Runs `fut` with `scope` as the current request scope.
pub async fn run<F: Future>(scope: Arc<RequestScope>, fut: F) -> F::Output {
    use tracing::Instrument;
    let span = scope.span.clone();
    CURRENT.scope(scope, fut.instrument(span)).await
}

/// Runs `f` (one poll) with `scope` as the current request scope.
pub fn sync<R>(scope: &Arc<RequestScope>, f: impl FnOnce() -> R) -> R {
    let _entered = scope.span.enter();
    CURRENT.sync_scope(scope.clone(), f)
}

/// The `via` value to send upstream, when inside a request.
pub fn via() -> Option<HeaderValue> {
    CURRENT.try_with(|s| s.via.clone()).ok()
}

/// The current request's id, when inside a request.
pub fn request_id() -> Option<String> {
    CURRENT.try_with(|s| s.request_id.clone()).ok()
}

/// The trace headers for a request to a worker (see [`crate::observe::tracing_export::worker_headers`]).
pub fn worker_trace_headers() -> Option<(HeaderValue, Option<HeaderValue>)> {
    CURRENT.try_with(|s| crate::observe::tracing_export::worker_headers(s.client_trace.as_ref())).ok().flatten()
}
