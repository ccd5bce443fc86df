//! Relaying one worker's answer (the regular mode, and the decode leg of every PD mode).

use axum::body::Body;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use pdgate_core::route::select_regular;
use pdgate_core::{ErrorKind, GatewayError, Leg, WorkerRole};
use pdgate_protocol::answer::{check_json, check_sse_start, BadAnswer};
use pdgate_protocol::logprobs::PrefillLogprobs;
use pdgate_protocol::sse::SseScanner;
use std::future::Future;
use tokio::time::{timeout_at, Instant};

use super::leg::{self, deadline_error};
use super::relay::{drain_prefill, wait_prefill, Finish, OutcomeAtEnd, PrefillFuture, Relayed, Rewriter, StreamRelay};
use super::{AttemptFailure, Ctx};
use crate::metrics::InflightGuard;
use crate::record::Record;

pub async fn regular_attempt(ctx: &Ctx, failed: &[String], record: &mut Record) -> Result<Response, AttemptFailure> {
    let routing = ctx.state.registry.routing();
    let snap = &routing.snapshot;
    let mut exclude: Vec<usize> = failed.iter().filter_map(|u| snap.index_of(u)).collect();
    let text = ctx.routing_text();
    let policy = ctx.state.regular_policy.as_ref();
    let choice = loop {
        let choice = ctx.decide(&routing, text.as_deref(), |input| select_regular(snap, policy, input, &exclude, &mut rand::rng()))?;
        match super::admit_all(ctx, snap, &[choice.worker]) {
            None => break choice,
            Some(refused) if !exclude.contains(&refused) => exclude.push(refused),
            Some(_) => return Err(GatewayError::no_workers("regular (the only candidates are half-open, their one probe in flight)").into()),
        }
    };
    if policy.uses_tree() {
        ctx.remember(text.as_deref(), &snap.worker(choice.worker).spec.url);
    }
    ctx.state.metrics.decisions.with_label_values(&["regular", choice.branch]).inc();
    let url = snap.worker(choice.worker).spec.url.clone();
    let runtime = routing.runtime[choice.worker].clone();
    drop(routing);
    record.protocol = "regular";
    record.worker = Some(url.clone());
    record.policy = Some(choice.reason.to_string());
    let finish = Finish {
        state: ctx.state.clone(),
        route: ctx.route,
        protocol: "regular",
        started: ctx.started,
        recompute_counted: false,
        guards: vec![InflightGuard::new(&ctx.state.metrics, &runtime, &url, WorkerRole::Regular.as_str())],
    };
    // The received bytes unless the parser removed gateway-owned fields (see `Ctx::forward_body`).
    let body = ctx.forward_body().map_err(|error| AttemptFailure { error, worker: None })?;
    relay_leg(ctx, &url, Leg::Regular, body, None, false, finish).await.map_err(|error| AttemptFailure { error, worker: Some(url) })
}

/// Runs `fut` while watching the prefill leg: a prefill failure aborts `fut` (which drops the
/// decode connection) and becomes the result; a prefill success is kept in `p_out`. When both
/// end at once (the deadline, with neither leg answering: in SGLang bootstrap each waits for
/// the other) the relayed leg's result wins, so the blame is not a coin toss.
async fn race<T>(p: &mut Option<PrefillFuture>, p_out: &mut Option<Bytes>, fut: impl Future<Output = Result<T, GatewayError>>) -> Result<T, GatewayError> {
    tokio::pin!(fut);
    loop {
        let prefill = tokio::select! {
            biased;
            r = &mut fut => return r,
            pr = wait_prefill(p) => pr,
        };
        *p = None;
        *p_out = Some(prefill?);
    }
}

/// The first non-empty data frame of a stream: the commit point. A head without data says
/// nothing of the worker's progress (engines send it at once), so the deadline here is a
/// plain no-answer timeout.
async fn first_data(body: &mut Incoming, leg: Leg, deadline: Instant) -> Result<Bytes, GatewayError> {
    loop {
        match timeout_at(deadline, body.frame()).await.map_err(|_| deadline_error(leg))? {
            None => return Err(GatewayError::protocol(leg, format!("{} worker ended its stream without data", leg.as_str()))),
            Some(Err(e)) => return Err(GatewayError::unreachable(leg, format!("{} worker's stream broke off: {e}", leg.as_str()))),
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    if !data.is_empty() {
                        return Ok(data);
                    }
                }
            }
        }
    }
}

/// Prefill input logprobs for the merge: from the finished prefill, or by waiting for it.
async fn prefill_logprobs(p: &mut Option<PrefillFuture>, p_out: &mut Option<Bytes>, deadline: Instant) -> Result<PrefillLogprobs, GatewayError> {
    if p_out.is_none() {
        if let Some(f) = p.take() {
            *p_out = Some(timeout_at(deadline, f).await.map_err(|_| deadline_error(Leg::Prefill))??);
        }
    }
    Ok(p_out.as_deref().map(PrefillLogprobs::from_prefill_body).unwrap_or_default())
}

/// Sends `body` to `url` and relays the answer; with `prefill` set, watches that leg too.
/// `merge_logprobs`: put the prefill's input logprobs into the answer (SGLang bootstrap).
/// The answer is checked before any byte of it is relayed (workers are not trusted): JSON of
/// the route's shape, or SSE for a stream, in no content encoding, within the size limits.
pub async fn relay_leg(ctx: &Ctx, url: &str, leg: Leg, body: Bytes, mut prefill: Option<PrefillFuture>, merge_logprobs: bool, finish: Finish) -> Result<Response, GatewayError> {
    let deadline = ctx.deadline;
    let limits = ctx.state.upstream.limits;
    let mut p_out = None;
    let resp = race(&mut prefill, &mut p_out, leg::send(&ctx.state.upstream, url, ctx.req.endpoint.path(), body, &ctx.request_id, leg, deadline)).await?;
    leg::check_head_encoding(&resp, leg).inspect_err(|_| count_bad(ctx, leg, "content_encoding"))?;
    let status = resp.status();
    let content_type = resp.headers().get(header::CONTENT_TYPE).cloned();
    let scan_usage = leg == Leg::Decode;
    let mut body = resp.into_body();
    if ctx.req.stream {
        let first = race(&mut prefill, &mut p_out, first_data(&mut body, leg, deadline)).await?;
        check_sse_start(content_type.as_ref().map(|v| v.to_str().unwrap_or("(not text)")), &first).map_err(|b| refuse(ctx, leg, b))?;
        let mut scanner = SseScanner::new(limits.max_sse_event_bytes);
        scanner.scan(&first).map_err(|e| refuse(ctx, leg, BadAnswer { reason: "sse_event_too_long", message: format!("SSE event is longer than {} bytes", e.limit) }))?;
        let logprobs = if merge_logprobs { Some(prefill_logprobs(&mut prefill, &mut p_out, deadline).await?) } else { None };
        observe_ttfb(ctx);
        let relayed = Relayed { leg, worker: url.to_string(), scanner };
        let relay = StreamRelay::new(first, body, deadline, prefill, Rewriter::new(logprobs, scan_usage), finish, relayed);
        let ct = content_type.unwrap_or_else(|| HeaderValue::from_static("text/event-stream"));
        let mut resp = build(status, ct, relay.into_body());
        // The stream's own end tells whether the worker did its job: the breaker hears it then.
        resp.extensions_mut().insert(OutcomeAtEnd(url.to_string()));
        return Ok(resp);
    }
    let bytes = race(&mut prefill, &mut p_out, leg::read_limited(body, limits.max_response_bytes, leg, deadline)).await.inspect_err(|e| {
        if e.kind == ErrorKind::BadWorkerResponse {
            count_bad(ctx, leg, "too_large");
        }
    })?;
    let answer = check_json(ctx.req.endpoint, &bytes).map_err(|b| refuse(ctx, leg, b))?;
    let logprobs = if merge_logprobs { Some(prefill_logprobs(&mut prefill, &mut p_out, deadline).await?) } else { None };
    drain_prefill(prefill, deadline);
    observe_ttfb(ctx);
    let mut rewriter = Rewriter::new(logprobs, scan_usage);
    let out = match rewriter.as_mut() {
        Some(r) => r.process_json(answer, bytes),
        None => bytes,
    };
    finish.done(rewriter.and_then(|r| r.cache));
    let ct = content_type.unwrap_or_else(|| HeaderValue::from_static("application/json"));
    Ok(build(status, ct, Body::from(out)))
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
