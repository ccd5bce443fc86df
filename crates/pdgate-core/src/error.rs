//! The one error type of the request path. It knows where it came from, which PD leg failed and
//! whether a retry on another worker is safe. It is rendered to HTTP in exactly one place
//! (`pdgate-gateway`'s `error_response`), from `status()`, `code()` and `error_type()`.

use std::fmt;

/// Who caused the failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    Client,
    Worker,
    Gateway,
}

/// Which leg of a request a worker failure belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Leg {
    Regular,
    Prefill,
    Decode,
    /// EPD: a call to an encode worker for a request's images.
    Encode,
}

impl Leg {
    pub fn as_str(self) -> &'static str {
        match self {
            Leg::Regular => "worker",
            Leg::Prefill => "prefill",
            Leg::Decode => "decode",
            Leg::Encode => "encode",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// The client's request is malformed (400). `param` names the field when known.
    InvalidRequest {
        param: Option<String>,
    },
    PayloadTooLarge,
    NotFound,
    MethodNotAllowed,
    /// The resource exists already (e.g. a worker URL registered twice).
    Conflict,
    /// No credentials where the endpoint needs them.
    Unauthorized,
    /// Credentials given, but wrong.
    Forbidden,
    /// No eligible worker in a pool (503).
    NoWorkers,
    /// Prefills and decodes exist but no pair can work together (503).
    NoCompatiblePair,
    /// Could not connect to the worker, or it closed the connection before answering.
    WorkerUnreachable,
    /// The worker answered with a non-success status; `body` is its error body, if any.
    WorkerStatus {
        status: u16,
        body: Option<String>,
    },
    /// The worker's answer was broken (bad JSON, cut stream, missing PD fields).
    WorkerProtocol,
    /// The worker's answer is not what the request asked for: not JSON of the endpoint's shape,
    /// not SSE for a stream, an unasked-for content encoding, or over a size limit. Checked
    /// before any byte is relayed; after commit (an SSE event too long) it ends the stream.
    BadWorkerResponse,
    /// A stream ended without its terminating `data: [DONE]` event.
    StreamTruncated,
    /// The request's deadline passed with no answer from the leg's worker (no response head,
    /// no stream data): evidence against the worker.
    Timeout,
    /// The request's deadline passed while the worker was still answering (response head
    /// received, body or tokens arriving): the request was long, the worker is not to blame.
    TimeoutWhileAnswering,
    /// A bug or an impossible state in the gateway.
    Internal,
    /// The client did not send its request body in time (408).
    ClientTimeout,
    /// The request came back to this gateway, or crossed too many gateways (508).
    LoopDetected,
    /// The worker API is closed: no `--admin-api-key` and no `--admin-api-open` (403).
    AdminApiClosed,
    /// The gateway is shutting down gracefully: new requests are refused (503) while those in
    /// flight finish.
    ShuttingDown,
    /// `--max-concurrent-requests` are running and the queue is full (429).
    Overloaded,
    /// The request waited `--queue-timeout-secs` in the admission queue (408).
    QueueTimeout,
    /// Early rejection: no path is predicted to give the first token within the TTFT
    /// objective times `--admission-slack` (429, code `overloaded`).
    PredictedOverload,
}

/// Every `reason()` a retry may have: `pdgate_retries_total{reason}` exists for each from the
/// start, so alerts need no first retry.
pub const RETRY_REASONS: [&str; 8] = ["unreachable", "status", "protocol", "bad_response", "truncated", "timeout", "no_workers", "other"];

/// Every `code()` a failed worker leg can have (`pdgate_worker_errors_total{leg, code}`).
pub fn worker_error_codes(leg: Leg) -> [String; 6] {
    let l = leg.as_str();
    [format!("{l}_unavailable"), format!("{l}_error"), format!("{l}_bad_response"), "bad_worker_response".into(), format!("{l}_stream_truncated"), format!("{l}_timeout")]
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GatewayError {
    pub kind: ErrorKind,
    pub source: Source,
    pub leg: Option<Leg>,
    pub message: String,
    /// The request never reached the worker (the connection was refused or could not be
    /// made): a plain retry, never a worker that died while answering.
    pub not_sent: bool,
}

impl GatewayError {
    fn new(kind: ErrorKind, source: Source, message: impl Into<String>) -> Self {
        GatewayError { kind, source, leg: None, message: message.into(), not_sent: false }
    }

    pub fn invalid(param: Option<&str>, message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidRequest { param: param.map(str::to_string) }, Source::Client, message)
    }
    pub fn payload_too_large(limit: usize) -> Self {
        Self::new(ErrorKind::PayloadTooLarge, Source::Client, format!("request body is larger than {limit} bytes"))
    }
    pub fn not_found(path: &str) -> Self {
        Self::new(ErrorKind::NotFound, Source::Client, format!("no route for {path}"))
    }
    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        Self::new(ErrorKind::MethodNotAllowed, Source::Client, format!("method {method} is not allowed on {path}"))
    }
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Conflict, Source::Client, message)
    }
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unauthorized, Source::Client, message)
    }
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Forbidden, Source::Client, message)
    }
    /// A named resource (a worker, say) that does not exist.
    pub fn missing(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::NotFound, Source::Client, message)
    }
    pub fn no_workers(what: &str) -> Self {
        Self::new(ErrorKind::NoWorkers, Source::Gateway, format!("no healthy {what} worker available"))
    }
    pub fn no_compatible_pair(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::NoCompatiblePair, Source::Gateway, message)
    }
    pub fn unreachable(leg: Leg, message: impl Into<String>) -> Self {
        Self::new(ErrorKind::WorkerUnreachable, Source::Worker, message).on(leg)
    }
    pub fn worker_status(leg: Leg, status: u16, body: Option<String>) -> Self {
        let message = format!("{} worker answered HTTP {status}", leg.as_str());
        Self::new(ErrorKind::WorkerStatus { status, body }, Source::Worker, message).on(leg)
    }
    pub fn protocol(leg: Leg, message: impl Into<String>) -> Self {
        Self::new(ErrorKind::WorkerProtocol, Source::Worker, message).on(leg)
    }
    pub fn timeout(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Timeout, Source::Gateway, message)
    }
    /// The deadline passed while `leg`'s worker was still sending its answer.
    pub fn timeout_while_answering(leg: Leg, message: impl Into<String>) -> Self {
        Self::new(ErrorKind::TimeoutWhileAnswering, Source::Gateway, message).on(leg)
    }
    pub fn bad_worker_response(leg: Leg, message: impl Into<String>) -> Self {
        Self::new(ErrorKind::BadWorkerResponse, Source::Worker, message).on(leg)
    }
    pub fn stream_truncated(leg: Leg) -> Self {
        let message = format!("{} worker ended its stream without data: [DONE]; the answer is incomplete", leg.as_str());
        Self::new(ErrorKind::StreamTruncated, Source::Worker, message).on(leg)
    }
    pub fn shutting_down() -> Self {
        Self::new(ErrorKind::ShuttingDown, Source::Gateway, "the gateway is shutting down and takes no new requests; retry on another replica")
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Internal, Source::Gateway, message)
    }
    pub fn client_timeout(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::ClientTimeout, Source::Client, message)
    }
    pub fn loop_detected(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::LoopDetected, Source::Gateway, message)
    }
    pub fn admin_api_closed(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::AdminApiClosed, Source::Client, message)
    }
    pub fn overloaded(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Overloaded, Source::Gateway, message)
    }
    pub fn predicted_overload(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::PredictedOverload, Source::Gateway, message)
    }
    pub fn queue_timeout(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::QueueTimeout, Source::Gateway, message)
    }

    /// The worker could not be reached at all: nothing of the request was sent.
    pub fn not_sent(mut self) -> Self {
        self.not_sent = true;
        self
    }

    /// Attach the leg the error happened on.
    pub fn on(mut self, leg: Leg) -> Self {
        self.leg = Some(leg);
        self
    }

    /// Whether trying again on another worker/pair may succeed and cannot do harm.
    /// A worker's 4xx (other than 408/429) is the client's fault: the same body fails anywhere.
    pub fn retryable(&self) -> bool {
        match &self.kind {
            ErrorKind::WorkerUnreachable | ErrorKind::WorkerProtocol | ErrorKind::BadWorkerResponse | ErrorKind::StreamTruncated => true,
            // An encode leg's timeout is its own (`--encode-timeout-secs`), shorter than the
            // request's: another encode worker may answer (the retry still needs time left).
            ErrorKind::Timeout => self.leg == Some(Leg::Encode),
            // 508: the worker is a gateway that saw the request loop; another try loops again.
            ErrorKind::WorkerStatus { status: 508, .. } => false,
            ErrorKind::WorkerStatus { status, .. } => *status >= 500 || *status == 408 || *status == 429,
            _ => false,
        }
    }

    /// Whether a decode's failure says that its KV source failed: a 5xx whose error code is
    /// the reference engine's `kv_transfer_failed` or `kv_transfer_timeout` (docs/engine.md),
    /// or whose message says the transfer failed (SGLang's decode aborts with status 500 and
    /// "Decode transfer failed for request rank=..." when its KV receiver fails:
    /// `DecodeTransferQueue.pop_transferred`, `python/sglang/srt/disaggregation/decode.py`). In
    /// concurrent PD that source is the prefill leg, so the failure may be
    /// the prefill's (or, EPD, an encode worker's): the transaction asks the prefill leg's own
    /// outcome before it blames the decode.
    pub fn kv_source_failed(&self) -> bool {
        let ErrorKind::WorkerStatus { status, body: Some(body) } = &self.kind else { return false };
        if self.leg != Some(Leg::Decode) || *status < 500 {
            return false;
        }
        let Ok(v) = serde_json::from_str::<serde_json::Value>(body) else { return false };
        let err = v.get("error").unwrap_or(&v);
        let code = err.get("code").and_then(serde_json::Value::as_str);
        let message = err.get("message").and_then(serde_json::Value::as_str).unwrap_or_default();
        matches!(code, Some("kv_transfer_failed" | "kv_transfer_timeout")) || message.to_ascii_lowercase().contains("transfer failed")
    }

    /// HTTP status for the client.
    pub fn status(&self) -> u16 {
        match &self.kind {
            ErrorKind::InvalidRequest { .. } => 400,
            ErrorKind::PayloadTooLarge => 413,
            ErrorKind::NotFound => 404,
            ErrorKind::MethodNotAllowed => 405,
            ErrorKind::Conflict => 409,
            ErrorKind::Unauthorized => 401,
            ErrorKind::Forbidden => 403,
            ErrorKind::NoWorkers | ErrorKind::NoCompatiblePair => 503,
            ErrorKind::WorkerUnreachable => 503,
            // A worker's client error is the client's: pass its status through.
            ErrorKind::WorkerStatus { status, .. } if (400..500).contains(status) => *status,
            // A loop seen further down the chain is a loop of this request too.
            ErrorKind::WorkerStatus { status: 508, .. } => 508,
            ErrorKind::WorkerStatus { .. } | ErrorKind::WorkerProtocol => 502,
            ErrorKind::BadWorkerResponse | ErrorKind::StreamTruncated => 502,
            ErrorKind::Timeout | ErrorKind::TimeoutWhileAnswering => 504,
            ErrorKind::Internal => 500,
            ErrorKind::ClientTimeout => 408,
            ErrorKind::LoopDetected => 508,
            ErrorKind::AdminApiClosed => 403,
            ErrorKind::ShuttingDown => 503,
            ErrorKind::Overloaded | ErrorKind::PredictedOverload => 429,
            ErrorKind::QueueTimeout => 408,
        }
    }

    /// Stable machine-readable code, e.g. `prefill_unavailable`.
    pub fn code(&self) -> String {
        let leg = self.leg.map(Leg::as_str).unwrap_or("worker");
        match &self.kind {
            ErrorKind::InvalidRequest { .. } => "invalid_request".into(),
            ErrorKind::PayloadTooLarge => "payload_too_large".into(),
            ErrorKind::NotFound => "not_found".into(),
            ErrorKind::MethodNotAllowed => "method_not_allowed".into(),
            ErrorKind::Conflict => "conflict".into(),
            ErrorKind::Unauthorized => "missing_api_key".into(),
            ErrorKind::Forbidden => "invalid_api_key".into(),
            ErrorKind::NoWorkers => "no_available_workers".into(),
            ErrorKind::NoCompatiblePair => "no_compatible_pd_pair".into(),
            ErrorKind::WorkerUnreachable => format!("{leg}_unavailable"),
            ErrorKind::WorkerStatus { status: 508, .. } => "loop_detected".into(),
            ErrorKind::WorkerStatus { .. } => format!("{leg}_error"),
            ErrorKind::WorkerProtocol => format!("{leg}_bad_response"),
            ErrorKind::BadWorkerResponse => "bad_worker_response".into(),
            ErrorKind::StreamTruncated => format!("{leg}_stream_truncated"),
            ErrorKind::Timeout | ErrorKind::TimeoutWhileAnswering => match self.leg {
                Some(l) => format!("{}_timeout", l.as_str()),
                None => "request_timeout".into(),
            },
            ErrorKind::Internal => "internal_error".into(),
            ErrorKind::ClientTimeout => "body_read_timeout".into(),
            ErrorKind::LoopDetected => "loop_detected".into(),
            ErrorKind::AdminApiClosed => "admin_api_closed".into(),
            ErrorKind::ShuttingDown => "shutting_down".into(),
            ErrorKind::Overloaded => "too_many_requests".into(),
            ErrorKind::PredictedOverload => "overloaded".into(),
            ErrorKind::QueueTimeout => "queue_timeout".into(),
        }
    }

    /// OpenAI error `type`.
    pub fn error_type(&self) -> &'static str {
        match self.source {
            Source::Client => match self.kind {
                ErrorKind::Unauthorized | ErrorKind::Forbidden | ErrorKind::AdminApiClosed => "authentication_error",
                _ => "invalid_request_error",
            },
            Source::Worker => "upstream_error",
            Source::Gateway => match self.kind {
                ErrorKind::Timeout | ErrorKind::TimeoutWhileAnswering | ErrorKind::QueueTimeout => "timeout_error",
                ErrorKind::Overloaded | ErrorKind::PredictedOverload => "rate_limit_error",
                ErrorKind::Internal => "internal_error",
                ErrorKind::LoopDetected => "loop_detected_error",
                _ => "service_unavailable_error",
            },
        }
    }

    pub fn param(&self) -> Option<&str> {
        match &self.kind {
            ErrorKind::InvalidRequest { param } => param.as_deref(),
            _ => None,
        }
    }

    /// The gateway turned the request away before any worker served it (no worker, admission,
    /// early rejection, shutdown): the answers that carry `x-pdgate-dropped-reason` and
    /// `Retry-After`, so a client or a load balancer in front can tell "come back" from "broken".
    pub fn is_refusal(&self) -> bool {
        matches!(
            self.kind,
            ErrorKind::NoWorkers | ErrorKind::NoCompatiblePair | ErrorKind::ShuttingDown | ErrorKind::Overloaded | ErrorKind::PredictedOverload | ErrorKind::QueueTimeout
        )
    }

    /// Short reason label for metrics (`retries_total{reason}`).
    pub fn reason(&self) -> &'static str {
        match &self.kind {
            ErrorKind::WorkerUnreachable => "unreachable",
            ErrorKind::WorkerStatus { .. } => "status",
            ErrorKind::WorkerProtocol => "protocol",
            ErrorKind::BadWorkerResponse => "bad_response",
            ErrorKind::StreamTruncated => "truncated",
            ErrorKind::Timeout | ErrorKind::TimeoutWhileAnswering => "timeout",
            ErrorKind::NoWorkers | ErrorKind::NoCompatiblePair => "no_workers",
            _ => "other",
        }
    }
}

impl fmt::Display for GatewayError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for GatewayError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_client_errors_pass_through_and_are_final() {
        let e = GatewayError::worker_status(Leg::Decode, 400, None);
        assert_eq!(e.status(), 400);
        assert!(!e.retryable());
        assert_eq!(e.code(), "decode_error");
    }

    #[test]
    fn worker_failures_are_retryable_and_name_the_leg() {
        let e = GatewayError::worker_status(Leg::Prefill, 500, None);
        assert_eq!((e.status(), e.retryable()), (502, true));
        assert_eq!(e.code(), "prefill_error");
        let u = GatewayError::unreachable(Leg::Decode, "refused");
        assert_eq!((u.status(), u.code().as_str()), (503, "decode_unavailable"));
        assert!(GatewayError::worker_status(Leg::Regular, 429, None).retryable());
    }

    #[test]
    fn client_and_deadline_errors_are_not_retried() {
        assert!(!GatewayError::invalid(Some("prompt"), "missing").retryable());
        let t = GatewayError::timeout("deadline").on(Leg::Prefill);
        assert_eq!((t.status(), t.code().as_str(), t.retryable()), (504, "prefill_timeout", false));
        assert_eq!(GatewayError::no_compatible_pair("x").code(), "no_compatible_pd_pair");
        let a = GatewayError::timeout_while_answering(Leg::Decode, "long");
        assert_eq!((a.status(), a.code().as_str(), a.retryable()), (504, "decode_timeout", false));
        // an encode leg's own timeout (--encode-timeout-secs) may be retried on another encode worker
        let e = GatewayError::timeout("no answer").on(Leg::Encode);
        assert_eq!((e.status(), e.code().as_str(), e.retryable()), (504, "encode_timeout", true));
    }

    #[test]
    fn broken_worker_answers_are_the_workers_and_retryable() {
        let b = GatewayError::bad_worker_response(Leg::Regular, "worker answered HTML");
        assert_eq!((b.status(), b.code().as_str(), b.retryable(), b.source), (502, "bad_worker_response", true, Source::Worker));
        assert_eq!(b.error_type(), "upstream_error");
        let t = GatewayError::stream_truncated(Leg::Decode);
        assert_eq!((t.status(), t.code().as_str()), (502, "decode_stream_truncated"));
        assert!(t.message.starts_with("decode worker"), "{}", t.message);
        assert_eq!(GatewayError::stream_truncated(Leg::Regular).code(), "worker_stream_truncated");
    }

    #[test]
    fn a_decode_that_lost_its_kv_source_is_told_apart() {
        let decode = |status, body: &str| GatewayError::worker_status(Leg::Decode, status, Some(body.to_string()));
        let reference = r#"{"error": {"message": "KV source failed: encode worker: room 7 holds image 00", "type": "server_error", "code": "kv_transfer_failed", "param": null}}"#;
        assert!(decode(500, reference).kv_source_failed());
        assert!(decode(500, r#"{"error": {"message": "timed out after 300s waiting for the source's KV", "code": "kv_transfer_timeout"}}"#).kv_source_failed());
        assert!(decode(500, r#"{"error": {"message": "Decode transfer failed for request rank=0 rid=x", "code": 500}}"#).kv_source_failed());
        // the decode's own failures, a 4xx, another leg, no body: not about the KV source
        assert!(!decode(500, r#"{"error": {"message": "internal error: boom", "code": "internal"}}"#).kv_source_failed());
        assert!(!decode(503, r#"{"error": {"message": "no KV memory for 3 pages within 300s", "code": "kv_cache_full"}}"#).kv_source_failed());
        assert!(!decode(400, reference).kv_source_failed());
        assert!(!decode(500, "KV source failed (not JSON)").kv_source_failed());
        assert!(!GatewayError::worker_status(Leg::Prefill, 500, Some(reference.to_string())).kv_source_failed());
        assert!(!GatewayError::worker_status(Leg::Decode, 500, None).kv_source_failed());
    }

    #[test]
    fn edge_errors_have_their_statuses_and_a_loop_is_final() {
        assert_eq!(GatewayError::client_timeout("slow body").status(), 408);
        assert_eq!(GatewayError::loop_detected("loop").code(), "loop_detected");
        assert_eq!(GatewayError::admin_api_closed("closed").status(), 403);
        let looped = GatewayError::worker_status(Leg::Regular, 508, None);
        assert_eq!((looped.status(), looped.code().as_str(), looped.retryable()), (508, "loop_detected", false));
    }

    #[test]
    fn admission_errors_are_429_and_408_and_final() {
        let full = GatewayError::overloaded("queue full");
        assert_eq!((full.status(), full.code().as_str(), full.error_type(), full.retryable()), (429, "too_many_requests", "rate_limit_error", false));
        let waited = GatewayError::queue_timeout("waited");
        assert_eq!((waited.status(), waited.code().as_str(), waited.error_type()), (408, "queue_timeout", "timeout_error"));
    }

    #[test]
    fn the_label_lists_cover_what_errors_say() {
        let errors = [
            GatewayError::unreachable(Leg::Decode, "x"),
            GatewayError::worker_status(Leg::Decode, 500, None),
            GatewayError::protocol(Leg::Decode, "x"),
            GatewayError::bad_worker_response(Leg::Decode, "x"),
            GatewayError::stream_truncated(Leg::Decode),
            GatewayError::timeout("x").on(Leg::Decode),
            GatewayError::no_workers("decode"),
        ];
        for e in &errors {
            assert!(RETRY_REASONS.contains(&e.reason()), "{}", e.reason());
            if e.leg.is_some() {
                assert!(worker_error_codes(Leg::Decode).contains(&e.code()), "{}", e.code());
            }
        }
    }
}
