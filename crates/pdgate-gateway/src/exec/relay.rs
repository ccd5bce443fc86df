//! Relaying the decode's (or the only worker's) answer to the client.
//!
//! A streamed answer is relayed by a small state machine: first chunk (already read, it was the
//! commit point) → chunks as they come → end. While it runs it also watches the prefill leg
//! (SGLang bootstrap and Mooncake send both legs at once) and drains it to the end. Once bytes
//! went out, failures end the stream with an SSE error event; nothing is retried.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use axum::body::Body;
use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use pdgate_core::{GatewayError, Leg};
use pdgate_protocol::logprobs::{merge_into, PrefillLogprobs};
use pdgate_protocol::openai::error_event;
use pdgate_protocol::sse::{frame, SseDecoder};
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

    /// A whole JSON answer: merge, observe, and re-serialise only if something changed.
    pub fn process_json(&mut self, bytes: Bytes) -> Bytes {
        let Ok(mut v) = serde_json::from_slice::<Value>(&bytes) else { return bytes };
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

pub struct StreamRelay {
    first: Option<Bytes>,
    body: Incoming,
    deadline: Instant,
    prefill: Option<PrefillFuture>,
    rewriter: Option<Rewriter>,
    finish: Option<Finish>,
    done: bool,
}

impl StreamRelay {
    pub fn new(first: Bytes, body: Incoming, deadline: Instant, prefill: Option<PrefillFuture>, rewriter: Option<Rewriter>, finish: Finish) -> Self {
        StreamRelay { first: Some(first), body, deadline, prefill, rewriter, finish: Some(finish), done: false }
    }

    pub fn into_body(self) -> Body {
        let stream = futures_util::stream::unfold(self, |mut relay| async move {
            relay.next_chunk().await.map(|chunk| (Ok::<Bytes, Infallible>(chunk), relay))
        });
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

    fn fail(&mut self, err: &GatewayError) -> Option<Bytes> {
        if let Some(f) = &self.finish {
            let id = crate::edge::scope::request_id();
            crate::edge::log_limit::warn_request(&f.state, id.as_deref(), "stream ended by an error after bytes reached the client", err, None);
        }
        self.end();
        Some(Bytes::from(error_event(&err.message, err.error_type(), &err.code())))
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
            match frame {
                Err(_) => return self.fail(&super::leg::deadline_error(Leg::Decode)),
                Ok(None) => {
                    let tail = self.end();
                    if tail.is_some() {
                        return tail;
                    }
                }
                Ok(Some(Err(e))) => {
                    return self.fail(&GatewayError::unreachable(Leg::Decode, format!("worker stream broke off: {e}")));
                }
                Ok(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data() {
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
