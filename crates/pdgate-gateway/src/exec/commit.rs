//! Send → commit → relay for the relayed leg (the decode, or the only worker), over any
//! [`WorkerClient`], while watching the prefill leg when one runs at the same time.
//!
//! The commit point is the first byte of the answer that the client will get: before it, an
//! error is the attempt's (and may be retried on another pair); after it, the relay owns the
//! leg. The answer is checked before any byte of it is relayed (workers are not trusted): JSON
//! of the route's shape, or SSE for a stream, within the size limits.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use pdgate_core::breaker::Outcome;
use pdgate_core::{ErrorKind, GatewayError, Leg};
use pdgate_protocol::answer::{check_json, check_sse_start, BadAnswer};
use pdgate_protocol::logprobs::PrefillLogprobs;
use pdgate_protocol::sse::SseScanner;
use tokio::time::{timeout_at, Instant};
use tracing::Instrument;

use super::accounting::{usage_of, StreamTally};
use super::relay::{drain_prefill, wait_prefill, Finish, PrefillLeg, Relayed, Rewriter, StreamRelay};
use super::resume::Resumer;
use super::spans::{self, RelayTrace};
use super::Ctx;
use crate::clients::client::{AbortGuard, LegEvent, LegEvents, LegRequest, WorkerClient};
use crate::clients::leg::{self, answering_deadline_error, deadline_error};

/// What the relay does to the answer, from the plan.
pub struct RelayPlan {
    pub leg: Leg,
    pub url: String,
    pub merge_logprobs: bool,
    pub scan_usage: bool,
    /// The relayed worker, to learn from its first chunk whether it sends token ids
    /// ([`UsageAsk::UnlessIds`](super::accounting::UsageAsk)).
    pub learn_ids: Option<Arc<crate::fleet::registry::Runtime>>,
}

/// Whether an error means the leg already ended at its worker (it failed or answered badly
/// by itself), so there is nothing left there to abort. A deadline or a refused answer is the
/// gateway giving the leg up: the engine may still be working on it.
fn ended_at_worker(e: &GatewayError, leg: Leg) -> bool {
    e.leg == Some(leg) && matches!(e.kind, ErrorKind::WorkerUnreachable | ErrorKind::WorkerStatus { .. } | ErrorKind::WorkerProtocol | ErrorKind::StreamTruncated)
}

/// The prefill leg (when one runs concurrently) and its finished answer, if it finished.
pub struct Watched {
    pub leg: Option<PrefillLeg>,
    /// The prefill's answer, kept only when `keep_answer`.
    pub answer: Option<Bytes>,
    /// The prefill's input logprobs are merged into the answer, so its body is read at the
    /// commit. Otherwise it is dropped as it comes: held until the decode's first data, a
    /// one-frame answer kept its connection's 8 KiB read buffer alive (docs/performance.md).
    pub keep_answer: bool,
    /// Concurrent legs: a prefill still silent when the decode, having answered its head, is
    /// silent at the deadline is the leg to blame (the decode waits for its KV).
    pub blame_silent_prefill: bool,
    /// Releases what the prefill holds for the decode (NIXL blocks) unless the decode commits:
    /// after its first byte it has pulled them.
    pub release: Option<AbortGuard>,
}

impl Watched {
    fn answered(&mut self, answer: Bytes) {
        self.leg = None;
        if self.keep_answer {
            self.answer = Some(answer);
        }
    }

    /// The relayed leg committed: the decode has what the prefill held for it.
    fn committed(&mut self) {
        if let Some(g) = self.release.as_mut() {
            g.disarm();
        }
    }
}

/// How long a decode that says its KV source failed waits for the prefill leg, still running,
/// to end on its own (`settle_kv_source`). The prefill tells the decode first and answers its
/// own failure right after, so this is slack for a loaded machine, not a transfer's time.
pub const KV_SOURCE_GRACE: Duration = Duration::from_secs(5);

/// Runs `fut` while watching the prefill leg: a prefill failure ends `fut` (which drops the
/// decode connection) and becomes the result; a prefill success is kept. When both end at once
/// (the deadline, with neither leg answering: in SGLang bootstrap each waits for the other) the
/// relayed leg's result wins, so the blame is not a coin toss. Except when the relayed leg's
/// failure says its KV source failed while the prefill still runs: then the prefill's outcome
/// decides (`settle_kv_source`), and `abort` (the relayed leg's) is disarmed if the prefill is
/// blamed, since that leg ended at its worker.
async fn race<T>(w: &mut Watched, deadline: Instant, abort: &mut Option<AbortGuard>, fut: impl Future<Output = Result<T, GatewayError>>) -> Result<T, GatewayError> {
    tokio::pin!(fut);
    loop {
        let prefill = tokio::select! {
            biased;
            r = &mut fut => return match r {
                Err(e) if e.kv_source_failed() && w.leg.is_some() => Err(settle_kv_source(w, e, deadline, abort).await),
                r => r,
            },
            pr = wait_prefill(&mut w.leg) => pr,
        };
        match prefill {
            Ok(answer) => w.answered(answer),
            Err(e) => {
                w.leg = None;
                return Err(e);
            }
        }
    }
}

/// The decode failed because its KV source failed, and the prefill leg (that source) has not
/// ended yet: in SGLang bootstrap the prefill tells the decode before it answers its own
/// failure, so the decode's 500 is often heard first. The prefill's outcome, within
/// [`KV_SOURCE_GRACE`] and the deadline, says whose failure it was: a failed prefill leg (an
/// encode worker whose embedding it could not take, a prefill that died) is the attempt's
/// error, so that side is blamed and the retry avoids it; a prefill that answered, or is still
/// silent at the end of the grace, leaves the failure with the decode, as before.
async fn settle_kv_source(w: &mut Watched, decode: GatewayError, deadline: Instant, abort: &mut Option<AbortGuard>) -> GatewayError {
    let Some(leg) = w.leg.as_mut() else { return decode };
    let by = deadline.min(Instant::now() + KV_SOURCE_GRACE);
    match timeout_at(by, &mut leg.answer).await {
        Ok(Err(prefill)) => {
            tracing::debug!(decode = %decode, prefill = %prefill, "the decode's KV source failed: the prefill leg failed too, and is blamed");
            w.leg = None;
            if let Some(guard) = abort.as_mut() {
                guard.disarm();
            }
            prefill
        }
        Ok(Ok(answer)) => {
            w.answered(answer);
            decode
        }
        Err(_) => decode,
    }
}

/// The first non-empty chunk of a stream: the commit point. A head without data says nothing
/// of the worker's progress (engines send it at once), so the deadline here is a no-answer
/// timeout.
async fn first_data(events: &mut LegEvents, leg: Leg, deadline: Instant) -> Result<Bytes, GatewayError> {
    loop {
        let event = timeout_at(deadline, events.next()).await.map_err(|_| deadline_error(leg))?;
        match event {
            None => return Err(GatewayError::protocol(leg, format!("{} worker ended its stream without data", leg.as_str()))),
            Some(LegEvent::Error(e)) => return Err(e),
            Some(LegEvent::Chunk(data)) if !data.is_empty() => return Ok(data),
            Some(LegEvent::Chunk(_)) => {}
        }
    }
}

/// A whole answer from its events, within `limit` bytes; a deadline here is one the worker met
/// while answering (its head came).
async fn collect(mut events: LegEvents, limit: usize, leg: Leg, deadline: Instant) -> Result<Bytes, GatewayError> {
    let read = async {
        let mut first: Option<Bytes> = None;
        let mut buf = BytesMut::new();
        while let Some(event) = events.next().await {
            let data = match event {
                LegEvent::Chunk(d) => d,
                LegEvent::Error(e) => return Err(e),
            };
            let have = first.as_ref().map_or(buf.len(), Bytes::len);
            if have + data.len() > limit {
                return Err(GatewayError::bad_worker_response(leg, format!("{} answer exceeds {limit} bytes", leg::whose(leg))));
            }
            // A body in one chunk (the usual small answer) is passed on without a copy.
            match first.take() {
                None if buf.is_empty() => first = Some(data),
                None => buf.extend_from_slice(&data),
                Some(f) => {
                    buf.extend_from_slice(&f);
                    buf.extend_from_slice(&data);
                }
            }
        }
        Ok(first.unwrap_or_else(|| buf.freeze()))
    };
    timeout_at(deadline, read).await.map_err(|_| answering_deadline_error(leg))?
}

/// Prefill input logprobs for the merge: from the finished prefill, or by waiting for it.
async fn prefill_logprobs(w: &mut Watched, deadline: Instant) -> Result<PrefillLogprobs, GatewayError> {
    if w.answer.is_none() {
        if let Some(p) = w.leg.take() {
            w.answer = Some(timeout_at(deadline, p.answer).await.map_err(|_| deadline_error(Leg::Prefill))??);
        }
    }
    Ok(w.answer.as_deref().map(PrefillLogprobs::from_prefill_body).unwrap_or_default())
}

/// A committed answer: a whole one, ready for the client, or a stream whose relay has its
/// first chunk (the transaction may attach a resumer before it becomes the response body).
pub enum Committed {
    Whole(Response),
    Stream { status: StatusCode, content_type: HeaderValue, relay: Box<StreamRelay> },
}

impl Committed {
    pub fn into_response(self, resumer: Option<Resumer>) -> Response {
        match self {
            Committed::Whole(r) => r,
            Committed::Stream { status, content_type, relay } => build(status, content_type, relay.with_resumer(resumer).into_body()),
        }
    }
}

/// Sends the relayed leg and relays its answer (see the module doc). `abort` tells the engine
/// when the gateway gives the leg up (the prefill failed, the deadline, the client left).
pub async fn relay_leg(
    ctx: &Ctx,
    client: &Arc<dyn WorkerClient>,
    plan: RelayPlan,
    body: Bytes,
    watched: Watched,
    finish: Finish,
    abort: AbortGuard,
) -> Result<Committed, GatewayError> {
    let leg = plan.leg;
    let mut abort = Some(abort);
    // The leg's span is current while it is sent (the worker gets it as its `traceparent`), and
    // the relay's span is its child, so it lasts until the relay ends.
    let span = spans::leg(leg, &plan.url);
    let out = commit_and_relay(ctx, client, plan, body, watched, finish, &mut abort).instrument(span.clone()).await;
    if let Err(e) = &out {
        spans::failed(&span, e);
    }
    if let (Err(e), Some(guard)) = (&out, abort.as_mut()) {
        if ended_at_worker(e, leg) {
            guard.disarm();
        }
    }
    out
}

async fn commit_and_relay(
    ctx: &Ctx,
    client: &Arc<dyn WorkerClient>,
    plan: RelayPlan,
    body: Bytes,
    mut watched: Watched,
    mut finish: Finish,
    abort: &mut Option<AbortGuard>,
) -> Result<Committed, GatewayError> {
    let (deadline, leg) = (ctx.deadline, plan.leg);
    let limits = ctx.state.fleet.upstream.limits;
    let req = LegRequest {
        url: plan.url.clone(),
        path: ctx.req.endpoint.path(),
        body,
        request_id: ctx.request_id.clone(),
        leg,
        deadline,
        resumed_ids: ctx.req.resumed_ids,
        ids_to_ledger: ctx.ids_to_ledger,
        prompts: ctx.prompt_memo.clone(),
    };
    let answer = race(&mut watched, deadline, abort, client.send(req)).await.inspect_err(|e| {
        if e.kind == ErrorKind::BadWorkerResponse {
            count_bad(ctx, leg, "content_encoding");
        }
    })?;
    let (head, mut events, ledger) = (answer.head, answer.events, answer.ledger);
    finish.status = head.status.as_u16();
    if ctx.req.stream {
        let first = race(&mut watched, deadline, abort, first_data(&mut events, leg, deadline)).await.map_err(|e| {
            // The decode answered its head and then waited: for its KV, if the prefill is
            // still silent too (SGLang bootstrap, Mooncake). Name the leg that hung.
            let prefill_hung = e.kind == ErrorKind::Timeout && e.leg == Some(leg) && watched.blame_silent_prefill && watched.leg.is_some();
            if prefill_hung {
                deadline_error(Leg::Prefill)
            } else {
                e
            }
        })?;
        watched.committed();
        let ct = head.content_type.as_ref().map(|v| v.to_str().unwrap_or("(not text)"));
        check_sse_start(ct, &first).map_err(|b| refuse(ctx, leg, b))?;
        let mut scanner = SseScanner::new(limits.max_sse_event_bytes);
        scanner.scan(&first).map_err(|e| refuse(ctx, leg, BadAnswer { reason: "sse_event_too_long", message: format!("SSE event is longer than {} bytes", e.limit) }))?;
        let logprobs = if plan.merge_logprobs { Some(prefill_logprobs(&mut watched, deadline).await?) } else { None };
        observe_ttfb(ctx);
        // The first data came: a regular worker has prefilled, its prompt no longer queues.
        if let Some(tokens) = finish.tokens.as_mut() {
            tokens.prefilled();
        }
        let abort = abort.take().ok_or_else(|| GatewayError::internal("the relayed leg's abort guard is gone"))?;
        let tally = StreamTally::new(ctx.req.endpoint, ctx.usage.strips(), ctx.req.batch_items.is_some());
        let relayed = Relayed { leg, worker: plan.url, scanner, abort, trace: RelayTrace::start(), tally, learn_ids: plan.learn_ids, ledger };
        let relay = StreamRelay::new(first, events, deadline, watched.leg, Rewriter::new(logprobs, plan.scan_usage), finish, relayed);
        let content_type = head.content_type.unwrap_or_else(|| HeaderValue::from_static("text/event-stream"));
        return Ok(Committed::Stream { status: head.status, content_type, relay: Box::new(relay) });
    }
    let bytes = race(&mut watched, deadline, abort, collect(events, limits.max_response_bytes, leg, deadline)).await.inspect_err(|e| {
        if e.kind == ErrorKind::BadWorkerResponse {
            count_bad(ctx, leg, "too_large");
        }
    })?;
    watched.committed();
    let answer = check_json(ctx.req.endpoint, &bytes).map_err(|b| refuse(ctx, leg, b))?;
    if let Some(guard) = abort.as_mut() {
        guard.disarm();
    }
    let logprobs = if plan.merge_logprobs { Some(prefill_logprobs(&mut watched, deadline).await?) } else { None };
    // The relayed leg's real end: its whole answer, checked.
    ctx.state.fleet.record_outcome(&plan.url, Outcome::Success);
    drain_prefill(&ctx.state, watched.leg, deadline);
    observe_ttfb(ctx);
    let mut trace = RelayTrace::start();
    let usage = usage_of(&answer).unwrap_or_default();
    let mut rewriter = Rewriter::new(logprobs, plan.scan_usage);
    let out = match rewriter.as_mut() {
        Some(r) => r.process_json(answer, bytes),
        None => bytes,
    };
    trace.sent(out.len());
    trace.ended(None);
    finish.done(rewriter.and_then(|r| r.cache), None, None, usage);
    let ct = head.content_type.unwrap_or_else(|| HeaderValue::from_static("application/json"));
    Ok(Committed::Whole(build(head.status, ct, Body::from(out))))
}

/// Counts a refused answer (`pdgate_bad_worker_responses_total`).
fn count_bad(ctx: &Ctx, leg: Leg, reason: &str) {
    ctx.state.metrics.bad_worker_responses.with_label_values(&[leg.as_str(), reason]).inc();
}

/// A refused answer as the leg's error: 502 `bad_worker_response`, retryable, a breaker failure.
fn refuse(ctx: &Ctx, leg: Leg, bad: BadAnswer) -> GatewayError {
    count_bad(ctx, leg, bad.reason);
    GatewayError::bad_worker_response(leg, format!("{} {}", leg::whose(leg), bad.message))
}

fn observe_ttfb(ctx: &Ctx) {
    ctx.state.metrics.ttfb.with_label_values(&[ctx.route]).observe(ctx.started.elapsed().as_secs_f64());
}

fn build(status: StatusCode, content_type: HeaderValue, body: Body) -> Response {
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    resp.headers_mut().insert(header::CONTENT_TYPE, content_type);
    resp
}

#[cfg(test)]
#[path = "commit_tests.rs"]
mod tests;
