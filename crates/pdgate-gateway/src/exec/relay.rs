//! Relaying the decode's (or the only worker's) answer to the client.
//!
//! A streamed answer is relayed by a small state machine over the relayed leg's events: first
//! chunk (already read, it was the commit point) → chunks as they come → end. While it runs it
//! also watches the prefill leg (SGLang bootstrap and Mooncake send both legs at once) and
//! drains it to the end. Once bytes went out, failures end the stream with an SSE error event
//! naming the leg; nothing is retried. Every chunk passes an [`SseScanner`]: an event over
//! `--max-sse-event-bytes` ends the stream, and so does an end without `data: [DONE]` (a
//! truncated answer is not a success). Each leg's worker hears its real outcome when the leg
//! ends: the relayed one here, the prefill in [`PrefillLeg`]. A leg given up (the client went
//! away, the deadline) is aborted at its engine ([`AbortGuard`]).

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Body;
use bytes::Bytes;
use futures_util::{FutureExt, StreamExt};
use pdgate_core::breaker::Outcome;
use pdgate_core::{GatewayError, Leg};
use pdgate_protocol::logprobs::{merge_into, PrefillLogprobs};
use pdgate_protocol::openai::error_event;
use pdgate_protocol::resume::TokenLedger;
use pdgate_protocol::sse::{frame, SseDecoder, SseScanner};
use pdgate_protocol::usage::{cache_report, CacheReport};
use serde_json::Value;
use tokio::time::{timeout_at, Instant};

use super::accounting::{Account, Ending, StreamTally, Usage};
use super::resume::Resumer;
use super::spans::RelayTrace;
use crate::clients::client::{AbortGuard, LegEvent, LegEvents, LegFuture};
use crate::exec::Exec;
use crate::fleet::gauges::InflightGuard;

/// How long the worker's end of a body may follow its `[DONE]` event.
const TAIL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// The prefill leg still running: resolves to its whole answer. Its worker hears a success
/// when the answer is complete (the leg's real end); an error is judged by whoever receives it
/// (before commit the attempt, after it the relay), and a leg dropped unfinished is neutral.
pub struct PrefillLeg {
    pub url: String,
    /// When the leg was sent (a no-answer timeout is judged against it).
    pub sent: std::time::Instant,
    pub answer: LegFuture<Bytes>,
}

impl PrefillLeg {
    /// Records an error the prefill leg ended with, after the decode committed.
    pub fn judge_late_error(state: &Arc<Exec>, url: &str, sent: std::time::Instant, err: &GatewayError) {
        tracing::warn!(error = %err, prefill = url, "prefill leg failed after the decode answered");
        state.metrics.leg_errors.with_label_values(&[Leg::Prefill.as_str(), &err.code()]).inc();
        state.fleet.record_outcome(url, Outcome::of_attempt(err, sent));
    }
}

/// Waits for the prefill if one is pending, else never resolves (for `select!`).
pub async fn wait_prefill(p: &mut Option<PrefillLeg>) -> Result<Bytes, GatewayError> {
    match p {
        Some(f) => (&mut f.answer).await,
        None => std::future::pending().await,
    }
}

/// Keeps reading a prefill answer nobody needs any more, so the engine sees its response
/// consumed (closing early can abort its KV transfer), bounded by the request deadline. Its
/// outcome still reaches the prefill's breaker.
pub fn drain_prefill(state: &Arc<Exec>, p: Option<PrefillLeg>, deadline: Instant) {
    if let Some(p) = p {
        let state = state.clone();
        tokio::spawn(async move {
            let err = match timeout_at(deadline, p.answer).await {
                Ok(Ok(_)) => return,
                Ok(Err(e)) => e,
                Err(_) => crate::clients::leg::deadline_error(Leg::Prefill),
            };
            PrefillLeg::judge_late_error(&state, &p.url, p.sent, &err);
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

    /// One chunk of an SSE stream. Without logprobs to merge it passes unread: a stream's cache
    /// report comes from the usage its accounting already reads ([`StreamTally`], see
    /// [`StreamRelay::cache_report`]), so no event is parsed here.
    pub fn process_sse(&mut self, chunk: Bytes) -> Bytes {
        if self.logprobs.is_none() {
            return chunk;
        }
        let events = self.decoder.feed(&chunk);
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
    pub state: Arc<Exec>,
    pub route: &'static str,
    pub protocol: &'static str,
    pub started: std::time::Instant,
    /// The decode's cached-token report is not read for a silent recompute: the request was
    /// already counted as one (the prefill returned no `kv_transfer_params`), or the decode's
    /// `cached_tokens` are the prefill's prefix-cache hits (vLLM's `remote_prefill_cached_tokens`).
    pub skip_decode_report: bool,
    /// The status the client got.
    pub status: u16,
    /// The request's latency accounting, recorded once when the response ends.
    pub account: Option<Account>,
    /// Held for their `Drop`: in-flight counts end with the response.
    #[allow(dead_code)]
    pub guards: Vec<InflightGuard>,
    /// Held for its `Drop`: the relayed worker's queued work (KV tokens) ends with the response.
    #[allow(dead_code)]
    pub tokens: Option<crate::fleet::token_load::TokenGuard>,
}

impl Finish {
    /// The response ended: `error` names how, when it did not end complete; `first_content`
    /// and `usage` are what the accounting saw of it.
    pub fn done(mut self, cache: Option<CacheReport>, error: Option<String>, first_content: Option<std::time::Instant>, usage: Usage) {
        if let Some(account) = self.account.take() {
            account.finish(&self.state, Ending { status: self.status, error, first_content, usage }, std::time::Instant::now());
        }
        let m = &self.state.metrics;
        m.duration.with_label_values(&[self.route]).observe(self.started.elapsed().as_secs_f64());
        if self.protocol != "regular" && !self.skip_decode_report {
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

/// The leg being relayed: which one, its worker, and the scanner watching its bytes.
pub struct Relayed {
    pub leg: Leg,
    pub worker: String,
    /// Has seen the first chunk already.
    pub scanner: SseScanner,
    /// Tells the engine when the gateway gives this leg up (the client went away).
    pub abort: AbortGuard,
    /// The relay's span (`--enable-trace`): bytes and chunks sent, how it ended.
    pub trace: RelayTrace,
    /// First content token, usage (read, and stripped when the gateway asked for it).
    pub tally: StreamTally,
    /// The worker's live state, told after the first chunk whether the engine sends token ids.
    pub learn_ids: Option<Arc<crate::fleet::registry::Runtime>>,
    /// The leg's token ids, when its client keeps them aside instead of in the bytes (gRPC).
    pub ledger: Option<Arc<TokenLedger>>,
}

pub struct StreamRelay {
    first: Option<Bytes>,
    events: LegEvents,
    deadline: Instant,
    /// The deadline as one timer for the whole stream: a timer per chunk cost ~1 µs a chunk.
    expiry: std::pin::Pin<Box<tokio::time::Sleep>>,
    prefill: Option<PrefillLeg>,
    rewriter: Option<Rewriter>,
    finish: Option<Finish>,
    relayed: Relayed,
    done: bool,
    /// Continues the stream on a new pair if the relayed leg dies (`resume.rs`).
    resumer: Option<Box<Resumer>>,
    /// A continuation's accounting (its workers' in-flight counts), held until the stream ends.
    held: Vec<Finish>,
    /// Why the stream ended early, for the accounting.
    error: Option<String>,
    /// Chunks since the worker was last noted serving (the passive health signal).
    since_noted: u32,
}

/// A flowing stream tells health its worker is serving every this many chunks: a long stream
/// keeps a busy worker's unanswered checks from counting, at one lookup per this many chunks.
const NOTE_SERVED_EVERY: u32 = 32;

impl StreamRelay {
    pub fn new(first: Bytes, events: LegEvents, deadline: Instant, prefill: Option<PrefillLeg>, rewriter: Option<Rewriter>, finish: Finish, relayed: Relayed) -> Self {
        let expiry = Box::pin(tokio::time::sleep_until(deadline));
        StreamRelay {
            first: Some(first),
            events,
            deadline,
            expiry,
            prefill,
            rewriter,
            finish: Some(finish),
            relayed,
            done: false,
            resumer: None,
            held: Vec::new(),
            error: None,
            since_noted: 0,
        }
    }

    pub fn with_resumer(mut self, resumer: Option<Resumer>) -> Self {
        self.resumer = resumer.map(Box::new);
        self
    }

    /// Takes over a continuation's legs: its first chunk, events, prefill, rewriter and relayed
    /// leg replace the dead ones (whose prefill is drained); its accounting is held.
    fn adopt(&mut self, mut next: StreamRelay) {
        if let Some(f) = &self.finish {
            drain_prefill(&f.state, self.prefill.take(), self.deadline);
        }
        self.first = next.first.take();
        self.events = std::mem::replace(&mut next.events, Box::pin(futures_util::stream::empty()));
        self.prefill = next.prefill.take();
        self.rewriter = next.rewriter.take();
        if let Some(mut held) = next.finish.take() {
            // One answer, one account: the continuation's workers are named in the first's.
            let cont = held.account.take();
            if let Some(account) = self.finish.as_mut().and_then(|f| f.account.as_mut()) {
                account.resumed(cont);
            }
            self.held.push(held);
        }
        // `next` leaves with the dead leg (its abort guard already disarmed).
        std::mem::swap(&mut self.relayed, &mut next.relayed);
        // The accounting is the client's view of one answer: its first content token came on the
        // dead leg, so the first leg's tally goes on (the continuation's usage is what it reads).
        std::mem::swap(&mut self.relayed.tally, &mut next.relayed.tally);
        next.done = true;
    }

    /// The relayed leg died: continue on a new pair if the resumer can, else `false`.
    async fn resumed(&mut self, err: &GatewayError) -> bool {
        self.absorb_ids();
        let Some(resumer) = self.resumer.as_mut() else { return false };
        if !Resumer::is_death(err) {
            return false;
        }
        match resumer.resume(&self.relayed.worker.clone(), err).await {
            Some(next) => {
                let generated = resumer.generated();
                self.adopt(next);
                self.relayed.tally.continued(generated);
                true
            }
            None => false,
        }
    }

    pub fn into_body(self) -> Body {
        let stream = futures_util::stream::unfold(self, |mut relay| async move {
            let chunk = relay.next_chunk().await?;
            relay.relayed.trace.sent(chunk.len());
            Some((Ok::<Bytes, Infallible>(chunk), relay))
        });
        Body::from_stream(stream)
    }

    fn process(&mut self, chunk: Bytes) -> Bytes {
        let chunk = self.relayed.tally.process(chunk, std::time::Instant::now());
        let chunk = match self.rewriter.as_mut() {
            Some(r) => r.process_sse(chunk),
            None => chunk,
        };
        let ledger = self.relayed.ledger.is_some();
        match self.resumer.as_mut() {
            Some(r) if r.reads_bytes(ledger) => r.process(chunk),
            _ => chunk,
        }
    }

    /// The resumer learns the ids a ledger kept (read when they are needed, not per chunk).
    fn absorb_ids(&mut self) {
        if let (Some(r), Some(ledger)) = (self.resumer.as_mut(), self.relayed.ledger.as_ref()) {
            r.absorb(ledger);
        }
    }

    /// After the first chunk: whether this worker sends token ids decides whether its next
    /// streams are asked for the usage event (`accounting::UsageAsk::UnlessIds`).
    fn learn_ids(&mut self) {
        if let Some(rt) = self.relayed.learn_ids.take() {
            self.absorb_ids();
            if let Some(gave) = self.resumer.as_ref().and_then(|r| r.gave_ids()) {
                rt.learn_token_ids(gave);
            }
        }
    }

    /// The answer's token counts: the engine's usage, else the ids the resumer counted, else
    /// the counted events.
    fn usage(&mut self) -> Usage {
        self.absorb_ids();
        let ids = self.resumer.as_ref().and_then(|r| r.counted());
        self.relayed.tally.usage_with(ids)
    }

    fn end(&mut self) -> Option<Bytes> {
        self.done = true;
        if let Some(f) = &self.finish {
            drain_prefill(&f.state, self.prefill.take(), self.deadline);
        }
        // Bytes the accounting held (an event without its blank line) go out as they came.
        let held = self.relayed.tally.flush().map(|b| self.process_held(b));
        let tail = self.rewriter.as_mut().and_then(Rewriter::flush);
        if let Some(f) = self.finish.take() {
            let first = self.relayed.tally.first_content;
            let usage = self.usage();
            f.done(self.cache_report(usage), self.error.take(), first, usage);
        }
        match (held, tail) {
            (Some(h), Some(t)) => Some([h, t].concat().into()),
            (h, t) => h.or(t),
        }
    }

    /// The decode's cache report: what a rewriting relay read, else the usage the accounting
    /// read (it also sees a usage chunk it strips, which the rewriter never does).
    fn cache_report(&self, usage: Usage) -> Option<CacheReport> {
        let read = self.rewriter.as_ref().filter(|r| r.scan_usage).and_then(|r| r.cache);
        read.or_else(|| Some(CacheReport { prompt_tokens: usage.prompt?, cached_tokens: usage.cached.unwrap_or(0) }))
    }

    /// Held bytes at the end pass the rewriter like any others.
    fn process_held(&mut self, held: Bytes) -> Bytes {
        match self.rewriter.as_mut() {
            Some(r) => r.process_sse(held),
            None => held,
        }
    }

    /// Tells the relayed worker's breaker how the stream went.
    fn record(&self, outcome: Outcome) {
        if let Some(f) = &self.finish {
            f.state.fleet.record_outcome(&self.relayed.worker, outcome);
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
        let holds_back = self.rewriter.as_ref().is_some_and(|r| r.logprobs.is_some()) || self.resumer.as_ref().is_some_and(|r| r.tracking()) || self.relayed.tally.holds_back();
        !holds_back && !self.relayed.scanner.at_boundary()
    }

    fn fail(&mut self, err: &GatewayError) -> Option<Bytes> {
        self.judge(err);
        self.error_event(err)
    }

    /// The relayed leg's failure reaches its worker's breaker and the error counts.
    fn judge(&self, err: &GatewayError) {
        self.record(Outcome::from_error(err));
        self.count_error(err);
    }

    /// Ends the stream with the error event.
    fn error_event(&mut self, err: &GatewayError) -> Option<Bytes> {
        if let Some(f) = &self.finish {
            let id = crate::observe::scope::request_id();
            crate::observe::log_limit::warn_request(&f.state.log, &f.state.metrics, id.as_deref(), "stream ended by an error after bytes reached the client", err, None);
        }
        self.relayed.trace.ended(Some(err));
        self.error = Some(err.code());
        // Close a half-sent event first, so the error event reads as an event of its own.
        let sep = if self.client_mid_event() { "\n\n" } else { "" };
        self.end();
        Some(Bytes::from(format!("{sep}{}", error_event(&err.message, err.error_type(), &err.code()))))
    }

    /// The worker's stream ended: a success only if it ended with `data: [DONE]`, else the
    /// truncation (counted).
    fn ended(&mut self) -> Result<Option<Bytes>, GatewayError> {
        self.relayed.abort.disarm();
        if !self.relayed.scanner.saw_done() {
            let leg = self.relayed.leg;
            if let Some(f) = &self.finish {
                f.state.metrics.streams_truncated.with_label_values(&[leg.as_str()]).inc();
            }
            return Err(GatewayError::stream_truncated(leg));
        }
        self.record(Outcome::Success);
        self.relayed.trace.ended(None);
        Ok(self.end())
    }

    /// The relayed leg died with `err`: its worker hears it, then the stream is resumed on a
    /// new pair or ends with the error event.
    async fn died(&mut self, mut err: GatewayError) -> Option<Option<Bytes>> {
        self.judge(&err);
        // Boxed: a resume runs a whole attempt, whose future would otherwise be part of every
        // stream's relay future (held, unused, between chunks by each in-flight stream).
        if Box::pin(self.resumed(&err)).await {
            return None;
        }
        // The client learns why its stream was not continued (e.g. `guided_decoding`).
        if let Some(why) = self.resumer.as_ref().and_then(|r| r.why_not()) {
            err.message = format!("{}; not resumed: {why}", err.message);
        }
        Some(self.error_event(&err))
    }

    /// Looks at the next relayed bytes; an event over the size limit ends the stream.
    fn check(&mut self, data: &Bytes) -> Result<(), GatewayError> {
        let leg = self.relayed.leg;
        self.relayed.scanner.scan(data).map_err(|e| {
            if let Some(f) = &self.finish {
                f.state.metrics.bad_worker_responses.with_label_values(&[leg.as_str(), "sse_event_too_long"]).inc();
            }
            GatewayError::bad_worker_response(leg, format!("{} stream has an SSE event longer than {} bytes", crate::clients::leg::whose(leg), e.limit))
        })
    }

    /// The prefill leg ended while the decode streams: the decode already has the KV (it
    /// produced tokens), so the stream goes on; the prefill's worker hears the outcome.
    fn prefill_ended(&mut self, result: Result<Bytes, GatewayError>) {
        let Some(p) = self.prefill.take() else { return };
        if let (Err(e), Some(f)) = (result, &self.finish) {
            PrefillLeg::judge_late_error(&f.state, &p.url, p.sent, &e);
        }
    }

    /// The relayed answer's `data: [DONE]` event is complete: nothing the worker sends after
    /// it is relayed.
    fn answer_complete(&self) -> bool {
        self.relayed.scanner.at_boundary() && self.relayed.scanner.saw_done()
    }

    /// Reads the rest of a complete answer's body (the worker's end of it, usually an empty
    /// last chunk) in a task of its own, so its connection goes back to the pool; a worker
    /// that does not end the body within [`TAIL_TIMEOUT`] loses the connection instead.
    fn drain_tail(&mut self) {
        let mut events = std::mem::replace(&mut self.events, Box::pin(futures_util::stream::empty()));
        let until = self.deadline.min(Instant::now() + TAIL_TIMEOUT);
        tokio::spawn(async move {
            let _ = timeout_at(until, async { while events.next().await.is_some() {} }).await;
        });
    }

    async fn next_chunk(&mut self) -> Option<Bytes> {
        while !self.done {
            // The first chunk of the stream, or of a continuation (already read: the commit point).
            if let Some(first) = self.first.take() {
                // The worker answered: it is serving (the passive health signal).
                if let Some(f) = &self.finish {
                    f.state.fleet.registry.note_served(&self.relayed.worker);
                }
                let out = self.process(first);
                self.learn_ids();
                if !out.is_empty() {
                    return Some(out);
                }
                continue;
            }
            let event = if self.answer_complete() {
                // The `[DONE]` event went out: if the worker's end of the body is not here yet,
                // the client's response ends now (its last event and the body's end go out in
                // one write) and the worker's end is read off the client's path.
                match self.events.next().now_or_never() {
                    Some(e) => Ok(Ok(e)),
                    None => {
                        self.drain_tail();
                        Ok(Ok(None))
                    }
                }
            } else {
                // Biased (no random pick per chunk); the deadline first, so a worker that
                // always has the next chunk ready cannot outrun it.
                tokio::select! {
                    biased;
                    () = &mut self.expiry => Ok(Err(())),
                    p = wait_prefill(&mut self.prefill) => Err(p),
                    e = self.events.next() => Ok(Ok(e)),
                }
            };
            let event = match event {
                Ok(e) => e,
                Err(p) => {
                    self.prefill_ended(p);
                    continue;
                }
            };
            let leg = self.relayed.leg;
            match event {
                // Tokens were arriving (the first chunk came): the request outlived its deadline.
                Err(_) => return self.fail(&crate::clients::leg::answering_deadline_error(leg)),
                Ok(None) => match self.ended() {
                    Ok(tail) if tail.is_some() => return tail,
                    Ok(_) => {}
                    Err(e) => {
                        if let Some(out) = self.died(e).await {
                            return out;
                        }
                    }
                },
                Ok(Some(LegEvent::Error(e))) => {
                    // The worker's own failure: nothing left at the engine to abort.
                    self.relayed.abort.disarm();
                    if let Some(out) = self.died(e).await {
                        return out;
                    }
                }
                Ok(Some(LegEvent::Chunk(data))) => {
                    if let Err(e) = self.check(&data) {
                        return self.fail(&e);
                    }
                    self.since_noted += 1;
                    if self.since_noted >= NOTE_SERVED_EVERY {
                        self.since_noted = 0;
                        if let Some(f) = &self.finish {
                            f.state.fleet.registry.note_served(&self.relayed.worker);
                        }
                    }
                    let out = self.process(data);
                    if !out.is_empty() {
                        return Some(out);
                    }
                }
            }
        }
        None
    }
}

impl Drop for StreamRelay {
    fn drop(&mut self) {
        // The client went away mid-stream: dropping the events closes the decode connection,
        // dropping the prefill closes that leg too, and the guards abort both at their engines.
        if let Some(f) = self.finish.take() {
            let first = self.relayed.tally.first_content;
            // A client that had `[DONE]` got the whole answer, even if it left before the
            // worker closed its stream.
            let error = (!self.relayed.scanner.saw_done()).then(|| "client_disconnected".to_string());
            let usage = self.usage();
            f.done(None, error, first, usage);
        }
    }
}

#[cfg(test)]
#[path = "relay_props.rs"]
mod props;
