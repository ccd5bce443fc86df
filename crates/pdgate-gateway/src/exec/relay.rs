//! Relaying the decode's (or the only worker's) answer to the client.
//!
//! A streamed answer is relayed by a small state machine: first chunk (already read, it was the
//! commit point) → chunks as they come → end. While it runs it also watches the prefill leg
//! (SGLang bootstrap and Mooncake send both legs at once) and drains it to the end. Once bytes
//! went out, failures end the stream with an SSE error event naming the leg; nothing is
//! retried. Every chunk passes an [`SseScanner`]: an event over `--max-sse-event-bytes` ends the
//! stream, and so does an end without `data: [DONE]` (a truncated answer is not a success).
//! The relayed worker's breaker hears the stream's real outcome when it ends.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use axum::body::Body;
use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use pdgate_core::breaker::Outcome;
use pdgate_core::{GatewayError, Leg};
use pdgate_protocol::logprobs::{merge_into, PrefillLogprobs};
use pdgate_protocol::openai::error_event;
use pdgate_protocol::sse::{frame, SseDecoder, SseScanner};
use pdgate_protocol::usage::{cache_report, CacheReport};
use serde_json::Value;
use tokio::time::{timeout_at, Instant};

use crate::metrics::InflightGuard;
use crate::state::AppState;

/// The prefill leg still running: resolves to its whole answer.
pub type PrefillFuture = Pin<Box<dyn Future<Output = Result<Bytes, GatewayError>> + Send>>;

/// Waits for the prefill if one is pending, else never resolves (for `select!`).
pub async fn wait_prefill(p: &mut Option<PrefillFuture>) -> Result<Bytes, GatewayError> {
    match p {
        Some(f) => f.await,
        None => std::future::pending().await,
    }
}

/// Keeps reading a prefill answer nobody needs any more, so the engine sees its response
/// consumed (closing early can abort its KV transfer), bounded by the request deadline.
pub fn drain_prefill(p: Option<PrefillFuture>, deadline: Instant) {
    if let Some(f) = p {
        tokio::spawn(async move {
            match timeout_at(deadline, f).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => tracing::warn!(error = %e, "prefill leg failed after the decode answered"),
                Err(_) => tracing::warn!("prefill leg still open at the request deadline; dropped"),
            }
        });
    }
}

/// What to do to each answer on its way out, and what to learn from it.
pub struct Rewriter {
    decoder: SseDecoder,
    /// Prefill input logprobs to merge (SGLang `/generate` with `return_logprob`).
    logprobs: Option<PrefillLogprobs>,
    /// Read usage to detect a decode that recomputed the prompt (PD modes).
    scan_usage: bool,
    pub cache: Option<CacheReport>,
}

impl Rewriter {
    pub fn new(logprobs: Option<PrefillLogprobs>, scan_usage: bool) -> Option<Self> {
        (logprobs.is_some() || scan_usage).then(|| Rewriter { decoder: SseDecoder::new(), logprobs, scan_usage, cache: None })
    }

    fn observe(&mut self, v: &Value) {
        if self.scan_usage {
            if let Some(r) = cache_report(v) {
                self.cache = Some(r);
            }
        }
    }

    /// A whole JSON answer (`v` parsed from `bytes`): merge, observe, and re-serialise only if
    /// something changed.
    pub fn process_json(&mut self, mut v: Value, bytes: Bytes) -> Bytes {
        self.observe(&v);
        match &self.logprobs {
            Some(lp) if merge_into(&mut v, lp) => serde_json::to_vec(&v).map(Bytes::from).unwrap_or(bytes),
            _ => bytes,
        }
    }

    /// One chunk of an SSE stream.
    pub fn process_sse(&mut self, chunk: Bytes) -> Bytes {
        let events = self.decoder.feed(&chunk);
        if self.logprobs.is_none() {
            for ev in events.iter().filter(|e| !e.is_done()) {
                if let Ok(v) = serde_json::from_str::<Value>(&ev.data) {
                    self.observe(&v);
                }
            }
            return chunk;
        }
        let mut out = String::new();
        for ev in events {
            if ev.is_done() {
                out.push_str(&frame(&ev.data));
                continue;
            }
            match serde_json::from_str::<Value>(&ev.data) {
                Ok(mut v) => {
                    self.observe(&v);
                    if let Some(lp) = &self.logprobs {
                        merge_into(&mut v, lp);
                    }
                    out.push_str(&frame(&v.to_string()));
                }
                Err(_) => out.push_str(&frame(&ev.data)),
            }
        }
        Bytes::from(out)
    }

    /// Bytes held back at the end of a rewritten stream.
    fn flush(&mut self) -> Option<Bytes> {
        self.logprobs.as_ref()?;
        self.decoder.finish().map(|ev| Bytes::from(frame(&ev.data)))
    }
}

/// Accounting done when a response finishes or the client goes away.
pub struct Finish {
    pub state: Arc<AppState>,
    pub route: &'static str,
    pub protocol: &'static str,
    pub started: std::time::Instant,
    /// The request was already counted as a silent recompute (e.g. the prefill returned no
    /// `kv_transfer_params`): the decode's own report must not count it a second time.
    pub recompute_counted: bool,
    /// Held for their `Drop`: in-flight counts end with the response.
    #[allow(dead_code)]
    pub guards: Vec<InflightGuard>,
}

impl Finish {
    pub fn done(self, cache: Option<CacheReport>) {
        let m = &self.state.metrics;
        m.duration.with_label_values(&[self.route]).observe(self.started.elapsed().as_secs_f64());
        if self.protocol != "regular" && !self.recompute_counted {
            if let Some(r) = cache.filter(recomputed) {
                tracing::warn!(protocol = self.protocol, prompt = r.prompt_tokens, cached = r.cached_tokens, "decode recomputed the prompt: KV did not (fully) move");
                m.silent_recompute.with_label_values(&[self.protocol, "decode_reported"]).inc();
            }
        }
    }
}

/// The decode recomputed more than the one last prompt token vLLM decodes always recompute.
pub fn recomputed(r: &CacheReport) -> bool {
    r.prompt_tokens > 1 && r.cached_tokens + 1 < r.prompt_tokens
}

/// Marks a streamed response whose worker outcome is recorded when the stream ends, not at
/// commit (the attempt loop must not count it a success early).
#[derive(Clone, Debug)]
pub struct OutcomeAtEnd(pub String);

/// The leg being relayed: which one, its worker, and the scanner watching its bytes.
pub struct Relayed {
    pub leg: Leg,
    pub worker: String,
    /// Has seen the first chunk already.
    pub scanner: SseScanner,
}

pub struct StreamRelay {
    first: Option<Bytes>,
    body: Incoming,
    deadline: Instant,
    prefill: Option<PrefillFuture>,
    rewriter: Option<Rewriter>,
    finish: Option<Finish>,
    relayed: Relayed,
    done: bool,
}

impl StreamRelay {
    pub fn new(first: Bytes, body: Incoming, deadline: Instant, prefill: Option<PrefillFuture>, rewriter: Option<Rewriter>, finish: Finish, relayed: Relayed) -> Self {
        StreamRelay { first: Some(first), body, deadline, prefill, rewriter, finish: Some(finish), relayed, done: false }
    }

    pub fn into_body(self) -> Body {
        let stream = futures_util::stream::unfold(self, |mut relay| async move { relay.next_chunk().await.map(|chunk| (Ok::<Bytes, Infallible>(chunk), relay)) });
        Body::from_stream(stream)
    }

    fn process(&mut self, chunk: Bytes) -> Bytes {
        match self.rewriter.as_mut() {
            Some(r) => r.process_sse(chunk),
            None => chunk,
        }
    }

    fn end(&mut self) -> Option<Bytes> {
        self.done = true;
        drain_prefill(self.prefill.take(), self.deadline);
        let tail = self.rewriter.as_mut().and_then(Rewriter::flush);
        if let Some(f) = self.finish.take() {
            f.done(self.rewriter.as_ref().and_then(|r| r.cache));
        }
        tail
    }

    /// Tells the relayed worker's breaker how the stream went.
    fn record(&self, outcome: Outcome) {
        if let Some(f) = &self.finish {
            f.state.record_outcome(&self.relayed.worker, outcome);
        }
    }

    /// A failure after commit is a failed leg like one before (`pdgate_worker_errors_total`).
    fn count_error(&self, err: &GatewayError) {
        if let (Some(f), Some(leg)) = (&self.finish, err.leg) {
            f.state.metrics.leg_errors.with_label_values(&[leg.as_str(), &err.code()]).inc();
        }
    }

    /// Whether the client has part of an event: a rewriting relay holds partial events back,
    /// a pass-through one has sent whatever the worker sent.
    fn client_mid_event(&self) -> bool {
        let holds_back = self.rewriter.as_ref().is_some_and(|r| r.logprobs.is_some());
        !holds_back && !self.relayed.scanner.at_boundary()
    }

    fn fail(&mut self, err: &GatewayError) -> Option<Bytes> {
        if let Some(f) = &self.finish {
            let id = crate::edge::scope::request_id();
            crate::edge::log_limit::warn_request(&f.state, id.as_deref(), "stream ended by an error after bytes reached the client", err, None);
        }
        self.record(Outcome::from_error(err));
        self.count_error(err);
        // Close a half-sent event first, so the error event reads as an event of its own.
        let sep = if self.client_mid_event() { "\n\n" } else { "" };
        self.end();
        Some(Bytes::from(format!("{sep}{}", error_event(&err.message, err.error_type(), &err.code()))))
    }

    /// The worker's stream ended: a success only if it ended with `data: [DONE]`.
    fn ended(&mut self) -> Option<Bytes> {
        if !self.relayed.scanner.saw_done() {
            let leg = self.relayed.leg;
            if let Some(f) = &self.finish {
                f.state.metrics.streams_truncated.with_label_values(&[leg.as_str()]).inc();
            }
            return self.fail(&GatewayError::stream_truncated(leg));
        }
        self.record(Outcome::Success);
        self.end()
    }

    /// Looks at the next relayed bytes; an event over the size limit ends the stream.
    fn check(&mut self, data: &Bytes) -> Result<(), GatewayError> {
        let leg = self.relayed.leg;
        self.relayed.scanner.scan(data).map_err(|e| {
            if let Some(f) = &self.finish {
                f.state.metrics.bad_worker_responses.with_label_values(&[leg.as_str(), "sse_event_too_long"]).inc();
            }
            GatewayError::bad_worker_response(leg, format!("{} stream has an SSE event longer than {} bytes", super::leg::whose(leg), e.limit))
        })
    }

    async fn next_chunk(&mut self) -> Option<Bytes> {
        if let Some(first) = self.first.take() {
            return Some(self.process(first));
        }
        while !self.done {
            let frame = tokio::select! {
                p = wait_prefill(&mut self.prefill) => {
                    self.prefill = None;
                    if let Err(e) = p {
                        // The decode already has the KV (it produced tokens); log, keep going.
                        tracing::warn!(error = %e, "prefill leg failed after the decode started streaming");
                    }
                    continue;
                }
                f = timeout_at(self.deadline, self.body.frame()) => f,
            };
            let leg = self.relayed.leg;
            match frame {
                // Tokens were arriving (the first chunk came): the request outlived its deadline.
                Err(_) => return self.fail(&super::leg::answering_deadline_error(leg)),
                Ok(None) => {
                    let tail = self.ended();
                    if tail.is_some() {
                        return tail;
                    }
                }
                Ok(Some(Err(e))) => {
                    return self.fail(&GatewayError::unreachable(leg, format!("{} stream broke off: {e}", super::leg::whose(leg))));
                }
                Ok(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data() {
                        if let Err(e) = self.check(&data) {
                            return self.fail(&e);
                        }
                        let out = self.process(data);
                        if !out.is_empty() {
                            return Some(out);
                        }
                    }
                }
            }
        }
        None
    }
}

impl Drop for StreamRelay {
    fn drop(&mut self) {
        // The client went away mid-stream: dropping `body` closes the decode connection, and
        // dropping the prefill future closes that leg too.
        if let Some(f) = self.finish.take() {
            f.done(None);
        }
    }
}

#[cfg(test)]
#[path = "relay_props.rs"]
mod props;
