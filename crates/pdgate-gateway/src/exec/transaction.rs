//! The request as one transaction, for every mode and over any [`WorkerClient`]:
//!
//! ```text
//!  admit ─► select ─► prepare ─► send ─► commit ─► relay ─► finish
//!   │        │ plan     │ bodies    │ legs    │ first byte    │ record, headers, metrics
//!   │        │ (core)   │ engine id │ P ∥ D   │ for the client│
//!   ▼        ▼          ▼           ▼ P → D   ▼               ▼
//!   400   error before commit ──► retry? (error, attempts, deadline) on a fresh pair
//! ```
//!
//! `select` picks the worker(s) and builds the attempt's [`PdPlan`] in core (legs, order,
//! rendezvous, bodies); `prepare` turns it into bytes (and learns a Mooncake prefill's engine
//! id); `send` starts the prefill leg (concurrent or first, by the plan); `commit` and `relay`
//! live in `commit.rs` and `relay.rs`. Retries happen only before commit. Every leg's worker
//! hears its outcome when the leg really ends; a leg the gateway gives up is aborted.

use std::sync::Arc;

use axum::http::HeaderValue;
use axum::response::Response;
use bytes::Bytes;
use pdgate_core::breaker::Outcome;
use pdgate_core::placement::Placement;
use pdgate_core::plan::{self, LegBody, LegPlan, Mode, Order, PdPlan};
use pdgate_core::route::{select_pair, select_regular};
use pdgate_core::{ErrorKind, GatewayError, KvConnector, Leg, WorkerRole};
use serde_json::{Map, Value};
use tokio::time::Instant;
use tracing::Instrument;

use super::accounting::{ask_for_usage_in, placement_of, Account, Ending, Usage, UsageAsk, Who};
use super::commit::{relay_leg, Committed, RelayPlan, Watched};
use super::encode::{self, Encodes};
use super::placement;
use super::relay::{Finish, PrefillLeg};
use super::resume::{Continuing, Resumer};
use super::{spans, AttemptFailure, Ctx};
use crate::clients::client::{AbortGuard, LegFuture, LegRequest, WorkerClient};
use crate::fleet::gauges::InflightGuard;
use crate::fleet::registry::Runtime;
use crate::fleet::token_load::TokenGuard;
use crate::observe::record::{Record, ROUTE_HEADER};
use crate::render::error_response;

/// Runs the request to its response: admit, then attempts until one commits or the error is
/// final, then finish.
pub async fn execute(mut ctx: Ctx) -> Response {
    let mut record = Record::default();
    let admit_span = spans::admit();
    if let Err(err) = admit_span.in_scope(|| admit(&ctx)) {
        spans::failed(&admit_span, &err);
        return finish(&ctx, error_response(&err), &record, Some(&err));
    }
    drop(admit_span);
    // EPD: the images, before anything reaches a worker: remote ones fetched from the listed
    // hosts (--allowed-media-domains), any other remote URL the client's 400.
    if let Err(err) = super::media_fetch::inline_remote_images(&mut ctx).await {
        return finish(&ctx, error_response(&err), &record, Some(&err));
    }
    ctx.images = match encode::find_images(&ctx) {
        Ok(images) => images,
        Err(err) => return finish(&ctx, error_response(&err), &record, Some(&err)),
    };
    // Learns, before the legs are built, whether this stream could be resumed (then the decode
    // is asked for token ids).
    let mut resumer = Resumer::prepare(&mut ctx, continue_stream);
    // Then how its token counts are learned: a stream whose ids are tracked need not make its
    // engine send the usage event too (PD does: the decode's cached-token report is in it).
    let tracks_ids = resumer.as_ref().is_some_and(Resumer::tracking);
    ctx.usage = super::accounting::usage_ask(&mut ctx.req, ctx.state.config.pd_disaggregation, tracks_ids);
    if ctx.req.differs() {
        tracing::debug!(request_id = %ctx.request_id, usage = ?ctx.usage, "the body sent differs from the client's (rendezvous fields removed, token ids or the stream's usage asked for)");
    }
    // Place (PD mode): disaggregated, colocated, or rejected early; then wait for decode room.
    let mut placed = match placement::place_request(&ctx, &mut record).await {
        Ok(placed) => placed,
        Err((refusal, err)) => return finish(&ctx, refusal, &record, Some(&err)),
    };
    let mut failed: Vec<String> = Vec::new();
    let mut whole_resumes = 0;
    ctx.state.retry_budget_deposit();
    let response = loop {
        record.attempts += 1;
        if record.attempts > 1 {
            // A retry is a new rendezvous: the old id may still be live on the failed pair.
            ctx.request_id = crate::request_id::mint(ctx.client_request_id.as_deref());
            tracing::Span::current().record("request_id", ctx.request_id.as_str());
        }
        let attempt_span = spans::attempt(record.attempts, &ctx.request_id);
        let failure = match attempt(&ctx, &failed, placed, &mut record).instrument(attempt_span.clone()).await {
            Ok(committed) => break committed.into_response(resumer.take().map(|r| r.bind(ctx.for_resume(), &record))),
            Err(f) => f,
        };
        let err = &failure.error;
        spans::failed(&attempt_span, err);
        if let Some(url) = &failure.worker {
            ctx.state.fleet.record_outcome(url, Outcome::of_attempt(err, ctx.started));
            ctx.state.fleet.note_worker_error(url, err);
        }
        let metrics = &ctx.state.metrics;
        if let Some(leg) = err.leg {
            metrics.leg_errors.with_label_values(&[leg.as_str(), &err.code()]).inc();
        }
        let left = ctx.deadline.saturating_duration_since(Instant::now());
        tracing::debug!(request_id = %ctx.request_id, attempt = record.attempts, error = %err, route = %record.full(), "attempt failed");
        let mut retry = ctx.state.retry.should_retry(err, record.attempts, false, left);
        // The failure policy: another pair, colocated, or fail, by the time left.
        if let Some((choice, why)) = retry.then(|| placement::recovery(&ctx, left)).flatten() {
            record.recovery = Some((choice.as_str(), why));
            placed = placement::after_recovery(choice);
            retry = placed.is_some();
            if placed == Some(Placement::Colocated) {
                record.placement = Some((Placement::Colocated.as_str(), why));
            }
        }
        // The shared budget is asked last, so only a retry that would happen spends from it.
        let refused = retry && !ctx.state.retry_budget_withdraw();
        if refused {
            metrics.retries_refused.with_label_values(&["budget"]).inc();
            tracing::debug!(request_id = %ctx.request_id, "retry refused: the shared retry budget is spent");
        }
        // A whole answer whose decode died is resumed (from the start: nothing of it reached
        // the client) even where retrying is off or over budget, up to --max-resumes.
        let resume = (!retry || refused) && super::resume::resume_whole(&ctx, err, &mut whole_resumes);
        if (!retry || refused) && !resume {
            crate::observe::log_limit::warn_request(&ctx.state.log, &ctx.state.metrics, Some(&ctx.request_id), "request failed", err, Some(&record.header_value()));
            let response = error_response(err);
            return finish(&ctx, response, &record, Some(err));
        }
        if resume {
            record.resumes += 1;
        } else {
            metrics.retries.with_label_values(&[err.reason()]).inc();
        }
        if let Some(w) = failure.worker {
            failed.push(w);
        }
        // ThreadRng is not Send: take it only for this call, never across an await.
        let backoff = ctx.state.retry.backoff(record.attempts, &mut rand::rng());
        tokio::time::sleep(backoff.min(left)).await;
    };
    finish(&ctx, response, &record, None)
}

/// Admit: a request for more tokens than the model's context length can never be served:
/// refuse it (400 naming the field) instead of letting it wait on the workers.
fn admit(ctx: &Ctx) -> Result<(), GatewayError> {
    let Some((asked, field)) = ctx.req.max_tokens else { return Ok(()) };
    let Some(limit) = ctx.state.fleet.registry.routing().snapshot.context_limit(ctx.req.model.as_deref()) else { return Ok(()) };
    if asked > limit {
        return Err(GatewayError::invalid(Some(field), format!("'{field}' is {asked}, more than the model's context length of {limit} tokens")));
    }
    Ok(())
}

/// A resumed stream's continuation (`resume.rs`): one attempt, its pair chosen as for a retry.
fn continue_stream<'a>(ctx: &'a Ctx, failed: &'a [String], record: &'a mut Record) -> Continuing<'a> {
    Box::pin(async move {
        Ok(match attempt(ctx, failed, None, record).await? {
            Committed::Stream { relay, .. } => Some(*relay),
            Committed::Whole(_) => None,
        })
    })
}

/// One attempt: select → prepare → send → commit → relay. Also how a resume continues a
/// stream on a new pair (`resume.rs`).
pub(super) async fn attempt(ctx: &Ctx, failed: &[String], placed: Option<Placement>, record: &mut Record) -> Result<Committed, AttemptFailure> {
    let select_span = spans::select();
    let chosen = select_span.in_scope(|| select(ctx, failed, placed)).inspect_err(|e| spans::failed(&select_span, e))?;
    let plan = &chosen.plan;
    spans::selected(&select_span, plan.mode.as_str(), &chosen.policy, plan.prefill.as_ref().map(|p| p.url.as_str()), &plan.relayed.url);
    drop(select_span);
    record.protocol = plan.mode.as_str();
    record.placed_as = placement_of(plan.mode);
    let prefill_url = plan.prefill.as_ref().map(|p| p.url.clone());
    match plan.mode {
        Mode::Regular => record.worker = Some(plan.relayed.url.clone()),
        Mode::Pd(_) => {
            record.prefill = prefill_url.clone();
            record.decode = Some(plan.relayed.url.clone());
        }
    }
    record.policy = Some(chosen.policy.clone());
    record.rendezvous = plan.rendezvous.clone();
    record.encode.clear();
    record.images = 0;
    if let Some(e) = &chosen.encode {
        record.images = e.legs.len();
        for leg in &e.legs {
            if !record.encode.contains(&leg.url) {
                record.encode.push(leg.url.clone());
            }
        }
    }
    let relayed_url = plan.relayed.url.clone();
    let mode = plan.mode;
    let encode_failed = Arc::new(std::sync::OnceLock::new());
    run(ctx, chosen, record.attempts, record.resumes, encode_failed.clone()).await.map_err(|error| {
        if mode == Mode::Pd(KvConnector::Mooncake) {
            if let Some(p) = &prefill_url {
                ctx.state.fleet.forget_engine_id(p);
            }
        }
        let worker = match error.leg {
            Some(Leg::Prefill) => prefill_url,
            Some(Leg::Decode | Leg::Regular) => Some(relayed_url),
            Some(Leg::Encode) => encode_failed.get().cloned(),
            // A regular attempt's failures are its one worker's (as before the plan).
            None if mode == Mode::Regular => Some(relayed_url),
            None => None,
        };
        AttemptFailure { error, worker }
    })
}

/// The attempt's decision: the plan, the live counters of its workers, the policies' reasons.
struct Chosen {
    plan: PdPlan,
    prefill_runtime: Option<Arc<Runtime>>,
    relayed_runtime: Arc<Runtime>,
    policy: String,
    /// EPD: the encode legs of a request with images.
    encode: Option<Encodes>,
}

/// Select: the policy picks from the snapshot (never a worker that failed this request), and
/// core turns the pick into the attempt's plan. A colocated placement in PD mode runs a
/// regular plan on the regular pool.
fn select(ctx: &Ctx, failed: &[String], placed: Option<Placement>) -> Result<Chosen, GatewayError> {
    let routing = ctx.state.fleet.registry.routing();
    let snap = &routing.snapshot;
    let mut exclude: Vec<usize> = failed.iter().filter_map(|u| snap.index_of(u)).collect();
    let text = ctx.routing_text();
    let metrics = &ctx.state.metrics;
    if !ctx.state.config.pd_disaggregation || placed == Some(Placement::Colocated) {
        let policy = ctx.state.regular_policy.as_ref();
        // A half-open worker admits one probe at a time: a pick it refuses is re-made without it.
        let choice = loop {
            let choice = ctx.decide(&routing, text.as_deref(), |input| ctx.state.policy_rng.with(|rng| select_regular(snap, policy, input, &exclude, rng)))?;
            match super::admit_all(ctx, snap, &[choice.worker]) {
                None => break choice,
                Some(refused) if !exclude.contains(&refused) => exclude.push(refused),
                Some(_) => return Err(GatewayError::no_workers("regular (the only candidates are half-open, their one probe in flight)")),
            }
        };
        if policy.uses_tree() {
            ctx.remember(text.as_deref(), &snap.worker(choice.worker).spec.url);
        }
        metrics.decisions.with_label_values(&["regular", choice.branch]).inc();
        let mut plan = plan::regular(snap, &choice, &ctx.req, &ctx.request_id);
        let relayed_runtime = routing.runtime[choice.worker].clone();
        if ctx.usage == UsageAsk::UnlessIds && !relayed_runtime.gives_token_ids() {
            // Not known to send ids: its counts must come from its usage event.
            ask_for_usage_in(&mut plan.relayed.body, &ctx.req);
        }
        return Ok(Chosen { plan, prefill_runtime: None, relayed_runtime, policy: choice.reason.to_string(), encode: None });
    }
    let (pp, dp) = (ctx.state.prefill_policy.as_ref(), ctx.state.decode_policy.as_ref());
    let chosen = loop {
        let chosen = ctx.decide(&routing, text.as_deref(), |input| ctx.state.policy_rng.with(|rng| select_pair(snap, pp, dp, input, &exclude, rng)));
        let Ok((p, d)) = &chosen else { break chosen };
        match super::admit_all(ctx, snap, &[p.worker, d.worker]) {
            None => break chosen,
            Some(refused) if !exclude.contains(&refused) => exclude.push(refused),
            Some(_) => break Err(GatewayError::no_workers("prefill/decode (the only candidates are half-open, their one probe in flight)")),
        }
    };
    let (p, d) = chosen.inspect_err(|e| {
        if e.kind == ErrorKind::NoCompatiblePair {
            let mode = format!("{:?}", snap.pairing_mode()).to_ascii_lowercase();
            metrics.pairing_refusals.with_label_values(&[&mode]).inc();
        }
    })?;
    if pp.uses_tree() {
        ctx.remember(text.as_deref(), &snap.worker(p.worker).spec.url);
    }
    if dp.uses_tree() {
        ctx.remember(text.as_deref(), &snap.worker(d.worker).spec.url);
    }
    metrics.decisions.with_label_values(&["prefill", p.branch]).inc();
    metrics.decisions.with_label_values(&["decode", d.branch]).inc();
    // the room: never from the seeded routing rng (replicas with one seed must not share rooms)
    let mut plan = plan::pd(snap, &p, &d, &ctx.req, &ctx.request_id, &mut rand::rng())?;
    // EPD: an encode worker per image, and the prefill told where each embedding waits.
    let encode = if ctx.images.is_empty() {
        None
    } else {
        // Not sent without its encode workers: the pair's probe slots, if it took any, go back.
        Some(encode::decide(ctx, &routing, &mut plan, &exclude).inspect_err(|_| super::end_probes(ctx, snap, &[p.worker, d.worker]))?)
    };
    Ok(Chosen {
        plan,
        prefill_runtime: Some(routing.runtime[p.worker].clone()),
        relayed_runtime: routing.runtime[d.worker].clone(),
        policy: format!("prefill:{} decode:{}", p.reason, d.reason),
        encode,
    })
}

fn to_bytes(body: &Map<String, Value>) -> Result<Bytes, GatewayError> {
    serde_json::to_vec(body).map(Bytes::from).map_err(|e| GatewayError::internal(format!("cannot encode request: {e}")))
}

/// Prepare: the relayed leg's body as bytes, when it is known before any leg answers (NIXL's
/// decode body waits for the prefill's answer). A Mooncake decode needs the prefill's engine
/// id: from the cache, or asked of its bootstrap server.
async fn prepare_relayed(ctx: &Ctx, client: &Arc<dyn WorkerClient>, plan: &PdPlan) -> Result<Option<Bytes>, GatewayError> {
    Ok(match &plan.relayed.body {
        LegBody::Forward => Some(ctx.forward_body()?),
        LegBody::Json(body) => Some(to_bytes(body)?),
        LegBody::FromPrefillAnswer | LegBody::SameAsRelayed => None,
        LegBody::NeedsEngineId { transfer_id, bootstrap_addr } => {
            let prefill = plan.prefill.as_ref().map(|p| p.url.as_str()).unwrap_or_default();
            let engine = match ctx.state.fleet.cached_engine_id(prefill) {
                Some(id) => id,
                None => {
                    let id = client.engine_id(prefill, bootstrap_addr, ctx.deadline).await?;
                    ctx.state.fleet.store_engine_id(prefill, id.clone());
                    id
                }
            };
            Some(to_bytes(&plan::mooncake_decode(&ctx.req, transfer_id, &engine, bootstrap_addr))?)
        }
    })
}

/// What the prefill leg carries besides its body.
struct PrefillExtras {
    /// Its worker hears a success when the whole answer is in (NIXL judges after reading the
    /// params).
    judge_success: bool,
    /// Its prompt tokens, queued on its worker for routing until the leg ends.
    queued: Option<TokenGuard>,
    /// EPD: the encode legs, awaited with the prefill's own call (`encode::send`).
    encode: Option<encode::Sent>,
}

/// Send: starts the prefill leg (see [`PrefillExtras`]); a prefill dropped unfinished is
/// aborted at its engine.
fn send_prefill(ctx: &Ctx, client: &Arc<dyn WorkerClient>, leg: &LegPlan, body: Bytes, protocol: &'static str, extras: PrefillExtras) -> PrefillLeg {
    let PrefillExtras { judge_success, queued, encode } = extras;
    let req = LegRequest {
        url: leg.url.clone(),
        path: ctx.req.endpoint.path(),
        body,
        request_id: ctx.request_id.clone(),
        leg: Leg::Prefill,
        deadline: ctx.deadline,
        resumed_ids: ctx.req.resumed_ids,
        ids_to_ledger: false,
        prompts: ctx.prompt_memo.clone(),
    };
    let call = client.call(req, ctx.state.fleet.upstream.limits.max_response_bytes);
    let with_encode = encode.is_some();
    let (call, mut encode_aborts, encode_blame): (LegFuture<Bytes>, Vec<AbortGuard>, _) = match encode {
        None => (call, Vec::new(), None),
        // A failed encode call ends the leg at once, dropping the prefill's call unfinished.
        Some(encode::Sent { calls, aborts, urls, failed }) => {
            (Box::pin(async move { futures_util::future::try_join(calls, call).await.map(|(_, answer)| answer) }), aborts, Some((urls, failed)))
        }
    };
    let mut abort = AbortGuard::new(client, &leg.url, &leg.abort);
    let (state, url, tokens) = (ctx.state.clone(), leg.url.clone(), ctx.req.prompt_tokens);
    // The leg's span is current while it is sent: the worker gets it as its `traceparent`.
    let span = spans::leg(Leg::Prefill, &leg.url);
    let answer = Box::pin(
        async move {
            let t = std::time::Instant::now();
            let mut out = call.await;
            if let Err(e) = &out {
                spans::failed(&tracing::Span::current(), e);
            }
            // The leg ended at the worker, either way: nothing left to abort, and the KV was
            // handed off (or never will be): the prompt no longer loads the prefill for routing.
            // Unless an encode call failed: then the prefill's call was dropped unfinished, and
            // the armed guard aborts it at its engine.
            if !matches!(&out, Err(e) if e.leg == Some(Leg::Encode)) {
                abort.disarm();
            }
            // EPD: a prefill that answered took its embeddings: nothing waits on the encode
            // workers. Otherwise the guards, dropped armed, abort the encode calls' rooms; and
            // a prefill that refused an embedding fails on that image's encode worker.
            if out.is_ok() {
                encode_aborts.iter_mut().for_each(AbortGuard::disarm);
            }
            drop(encode_aborts);
            if let (Err(e), Some((urls, failed))) = (out.as_ref(), &encode_blame) {
                out = Err(encode::blame(e.clone(), urls, failed));
            }
            // Only a leg that had its worker to itself (and waited for no encode worker)
            // measures the prefill's service time.
            let alone = !with_encode && queued.as_ref().is_none_or(TokenGuard::alone_since_sent);
            drop(queued);
            state.metrics.leg_duration.with_label_values(&["prefill", protocol]).observe(t.elapsed().as_secs_f64());
            if out.is_ok() && alone {
                state.placer.observe_prefill(tokens, t.elapsed().as_secs_f64() * 1000.0);
                state.metrics.placement.publish(&state.placer.fitted());
            }
            if out.is_ok() && judge_success {
                state.fleet.record_outcome(&url, Outcome::Success);
            }
            out
        }
        .instrument(span),
    );
    PrefillLeg { url: leg.url.clone(), sent: std::time::Instant::now(), answer }
}

/// Runs a chosen plan: prepare, send the legs in the plan's order, commit and relay.
async fn run(ctx: &Ctx, chosen: Chosen, attempts: u32, resumes: u32, encode_failed: Arc<std::sync::OnceLock<String>>) -> Result<Committed, GatewayError> {
    let client = ctx.state.client.clone();
    let Chosen { mut plan, prefill_runtime, relayed_runtime, encode, .. } = chosen;
    let protocol = plan.mode.as_str();
    // EPD, vLLM style: every image stored at its encoder before any PD leg is sent.
    let encode = match encode {
        Some(e) if e.go_first() => {
            encode::before_pd(ctx, &client, e, &mut plan, encode_failed.clone()).await?;
            None
        }
        other => other,
    };
    let relayed_body = prepare_relayed(ctx, &client, &plan).await?;
    let learn_ids = (ctx.usage == UsageAsk::UnlessIds).then(|| relayed_runtime.clone());
    let (mut finish, prefill_queued) = accounting(ctx, &plan, prefill_runtime, relayed_runtime, attempts, resumes);
    let mut watched = Watched { leg: None, answer: None, keep_answer: plan.merge_input_logprobs, blame_silent_prefill: plan.order == Order::Concurrent, release: None };
    let body = match (plan.order, &plan.prefill, relayed_body) {
        (Order::PrefillFirst, Some(p), _) => {
            let extras = PrefillExtras { judge_success: false, queued: prefill_queued, encode: None };
            let sent = send_prefill(ctx, &client, p, prefill_body(p, None)?, protocol, extras);
            let answer = sent.answer.await?;
            let body = nixl_decode_body(ctx, &p.url, &answer, &mut finish)?;
            ctx.state.fleet.record_outcome(&p.url, Outcome::Success);
            watched.release = plan.release_prefill.as_ref().map(|how| AbortGuard::new(&client, &p.url, how));
            body
        }
        (_, Some(p), Some(body)) => {
            // EPD: the encode calls go out with the prefill and decode legs, as SMG sends them.
            let encode = encode.map(|e| encode::send(ctx, &client, e, encode_failed)).transpose()?;
            let extras = PrefillExtras { judge_success: true, queued: prefill_queued, encode };
            watched.leg = Some(send_prefill(ctx, &client, p, prefill_body(p, Some(&body))?, protocol, extras));
            body
        }
        (_, None, Some(body)) => body,
        (_, _, None) => return Err(GatewayError::internal("the plan's relayed body is unknown before its legs run")),
    };
    let relay = RelayPlan { leg: plan.relayed.leg, url: plan.relayed.url.clone(), merge_logprobs: plan.merge_input_logprobs, scan_usage: plan.scan_usage, learn_ids };
    let abort = AbortGuard::new(&client, &plan.relayed.url, &plan.relayed.abort);
    relay_leg(ctx, &client, relay, body, watched, finish, abort).await
}

/// The prefill leg's bytes: its own body, or the relayed leg's (SGLang bootstrap).
fn prefill_body(p: &LegPlan, relayed: Option<&Bytes>) -> Result<Bytes, GatewayError> {
    match (&p.body, relayed) {
        (LegBody::SameAsRelayed, Some(b)) => Ok(b.clone()),
        (LegBody::Json(body), _) => to_bytes(body),
        (other, _) => Err(GatewayError::internal(format!("the plan gives the prefill an unsendable body: {other:?}"))),
    }
}

/// NIXL: the decode's body from the prefill's answer; a prefill that gave no (complete)
/// params means a decode that recomputes the prompt, counted here once.
fn nixl_decode_body(ctx: &Ctx, prefill: &str, answer: &Bytes, finish: &mut Finish) -> Result<Bytes, GatewayError> {
    let answer: Value = serde_json::from_slice(answer).map_err(|e| GatewayError::protocol(Leg::Prefill, format!("prefill answer is not JSON: {e}")))?;
    let decided = plan::nixl_decode(&ctx.req, &answer);
    if let Some(reason) = decided.recompute {
        tracing::warn!(missing = ?decided.missing, prefill, reason, "prefill returned no complete kv_transfer_params; decode will recompute the prompt");
        ctx.state.metrics.silent_recompute.with_label_values(&["nixl", reason]).inc();
        finish.skip_decode_report = true;
    }
    // vLLM relays the prefill's own cache hits to the decode's usage (docs/protocols.md, "NIXL").
    finish.skip_decode_report |= decided.decode_reports_prefill_cache;
    to_bytes(&decided.body)
}

/// Accounting for the attempt's workers, two counts apart (token_load.rs). In flight (drain):
/// a prefill counts until the decode is done, not just until its own answer: with NIXL the
/// decode pulls the KV from it afterwards, with Mooncake it pushes after answering. Queued
/// (routing): the prefill's prompt tokens until its leg ends (returned here, for the leg to
/// hold); the relayed worker's KV tokens (and, regular, the prompt) until the response ends.
fn accounting(ctx: &Ctx, plan: &PdPlan, prefill: Option<Arc<Runtime>>, relayed: Arc<Runtime>, attempts: u32, resumes: u32) -> (Finish, Option<TokenGuard>) {
    let m = &ctx.state.metrics;
    let role = if plan.mode == Mode::Regular { WorkerRole::Regular } else { WorkerRole::Decode };
    let mut guards = vec![InflightGuard::new(m, &relayed, &plan.relayed.url, role.as_str())];
    let relayed_prompt = if plan.mode == Mode::Regular { ctx.req.prompt_tokens } else { 0 };
    let tokens = Some(TokenGuard::new(&relayed, relayed_prompt, ctx.kv_tokens()));
    let mut prefill_queued = None;
    if let (Some(rt), Some(p)) = (prefill, &plan.prefill) {
        guards.push(InflightGuard::new(m, &rt, &p.url, WorkerRole::Prefill.as_str()));
        prefill_queued = Some(TokenGuard::new(&rt, ctx.req.prompt_tokens, 0));
    }
    let mut account = Account::new(ctx, placement_of(plan.mode), plan.mode.as_str(), || {
        let (relayed, prefill) = (Some(plan.relayed.url.clone()), plan.prefill.as_ref().map(|p| p.url.clone()));
        match plan.mode {
            Mode::Regular => Who { worker: relayed, attempts, ..Who::default() },
            Mode::Pd(_) => Who { prefill, decode: relayed, attempts, ..Who::default() },
        }
    });
    // A whole answer sent again after its decode died (`record.resumes`).
    account.resumes = resumes;
    let finish = Finish {
        state: ctx.state.clone(),
        route: ctx.route,
        protocol: plan.mode.as_str(),
        started: ctx.started,
        skip_decode_report: false,
        status: 200,
        account: Some(account),
        guards,
        tokens,
    };
    (finish, prefill_queued)
}

/// A request that ends with an error response (nothing was committed): its accounting, as
/// failed. Committed requests are accounted when their answer ends (`Finish::done`).
fn account_failure(ctx: &Ctx, record: &Record, status: u16, err: &GatewayError) {
    let placement = match record.placed_as {
        "" if ctx.state.config.pd_disaggregation => "disaggregated",
        "" => "colocated",
        p => p,
    };
    let protocol = if record.protocol.is_empty() { "none" } else { record.protocol };
    let mut account = Account::new(ctx, placement, protocol, || Who {
        worker: record.worker.clone(),
        prefill: record.prefill.clone(),
        decode: record.decode.clone(),
        attempts: record.attempts,
        ..Who::default()
    });
    account.resumes = record.resumes;
    let end = Ending { status, error: Some(err.code()), first_content: None, usage: Usage::default() };
    account.finish(&ctx.state, end, std::time::Instant::now());
}

/// Finish: the decision record (bounded header, full log line), the ids, the request metrics.
fn finish(ctx: &Ctx, mut response: Response, record: &Record, err: Option<&GatewayError>) -> Response {
    if let Some(err) = err {
        account_failure(ctx, record, response.status().as_u16(), err);
    }
    let _finish = spans::finish(&response).entered();
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
    crate::observe::access_log::served(&ctx.request_id, ctx.client_request_id.as_deref(), ctx.route, record, status.as_u16(), ctx.started);
    ctx.state.metrics.requests.with_label_values(&[ctx.route, status.as_str()]).inc();
    if !status.is_success() {
        ctx.state.metrics.duration.with_label_values(&[ctx.route]).observe(ctx.started.elapsed().as_secs_f64());
    }
    response
}
