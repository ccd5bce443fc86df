//! Prefill/decode attempts in the three KV protocols (PROTOCOLS.md §1-3).
//!
//! - bootstrap: mint rooms, the same body to P and D at once, relay D, drain P.
//! - nixl:      P first (one token, remote decode), its `kv_transfer_params` → D.
//! - mooncake:  mint a transfer id, learn P's engine id, P and D at once.

use std::sync::Arc;
use std::time::Duration;

use axum::response::Response;
use bytes::Bytes;
use http_body_util::BodyExt;
use pdgate_core::route::select_pair;
use pdgate_core::{ErrorKind, GatewayError, KvConnector, Leg, WorkerRole, WorkerSpec};
use pdgate_protocol::bootstrap::{self, Rooms, MAX_ROOM};
use pdgate_protocol::kv_transfer;
use pdgate_protocol::Endpoint;
use rand::Rng;
use serde_json::{Map, Value};
use tokio::time::{timeout_at, Instant};

use super::leg::{self, deadline_error, RESPONSE_LIMIT};
use super::relay::{Finish, PrefillFuture};
use super::single::relay_leg;
use super::{AttemptFailure, Ctx};
use crate::metrics::InflightGuard;
use crate::registry::Runtime;
use crate::record::{Record, Rendezvous};

/// Default port of an engine's bootstrap server when the gateway was given none.
const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;
/// Longest wait for a Mooncake bootstrap `/query`.
const QUERY_TIMEOUT: Duration = Duration::from_secs(5);

pub async fn attempt(ctx: &Ctx, failed: &[String], record: &mut Record) -> Result<Response, AttemptFailure> {
    let routing = ctx.state.registry.routing();
    let snap = &routing.snapshot;
    let exclude: Vec<usize> = failed.iter().filter_map(|u| snap.index_of(u)).collect();
    let text = ctx.routing_text();
    let (pp, dp) = (ctx.state.prefill_policy.as_ref(), ctx.state.decode_policy.as_ref());
    let chosen = ctx.decide(&routing, text.as_deref(), |input| select_pair(snap, pp, dp, input, &exclude, &mut rand::rng()));
    if let Ok((p, d)) = &chosen {
        if pp.uses_tree() {
            ctx.remember(text.as_deref(), &snap.worker(p.worker).spec.url);
        }
        if dp.uses_tree() {
            ctx.remember(text.as_deref(), &snap.worker(d.worker).spec.url);
        }
    }
    let (p, d) = chosen.inspect_err(|e| {
        if e.kind == ErrorKind::NoCompatiblePair {
            let mode = format!("{:?}", snap.pairing_mode()).to_ascii_lowercase();
            ctx.state.metrics.pairing_refusals.with_label_values(&[&mode]).inc();
        }
    })?;
    ctx.state.metrics.decisions.with_label_values(&["prefill", p.branch]).inc();
    ctx.state.metrics.decisions.with_label_values(&["decode", d.branch]).inc();
    let protocol = snap.connector_of(p.worker);
    if protocol != KvConnector::Bootstrap && ctx.req.endpoint == Endpoint::Generate {
        // vLLM workers have no SGLang-native /generate: refuse before any leg is sent.
        return Err(GatewayError::invalid(
            None,
            format!("/generate is SGLang's native API; the {} workers speak vLLM's OpenAI API: use /v1/completions or /v1/chat/completions", protocol.as_str()),
        )
        .into());
    }
    let pw = Picked { spec: snap.worker(p.worker).spec.clone(), runtime: routing.runtime[p.worker].clone() };
    let dw = Picked { spec: snap.worker(d.worker).spec.clone(), runtime: routing.runtime[d.worker].clone() };
    drop(routing);
    record.protocol = protocol.as_str();
    record.prefill = Some(pw.spec.url.clone());
    record.decode = Some(dw.spec.url.clone());
    record.policy = Some(format!("prefill:{} decode:{}", p.reason, d.reason));
    record.rendezvous = None;
    let result = match protocol {
        KvConnector::Bootstrap => run_bootstrap(ctx, &pw, &dw, record).await,
        KvConnector::Nixl => run_nixl(ctx, &pw, &dw, record).await,
        KvConnector::Mooncake => run_mooncake(ctx, &pw, &dw, record).await,
    };
    result.map_err(|error| {
        if protocol == KvConnector::Mooncake {
            ctx.state.forget_engine_id(&pw.spec.url);
        }
        let worker = match error.leg {
            Some(Leg::Prefill) => Some(pw.spec.url.clone()),
            Some(Leg::Decode) => Some(dw.spec.url.clone()),
            _ => None,
        };
        AttemptFailure { error, worker }
    })
}

/// A chosen worker: its spec and live counters.
struct Picked {
    spec: Arc<WorkerSpec>,
    runtime: Arc<Runtime>,
}

/// Accounting for the pair. The prefill counts as in flight until the decode is done, not just
/// until its own answer: with NIXL the decode pulls the KV from it afterwards, with Mooncake it
/// pushes after answering, so draining it earlier would cut a transfer.
fn finish(ctx: &Ctx, protocol: KvConnector, prefill: &Picked, decode: &Picked) -> Finish {
    Finish {
        state: ctx.state.clone(),
        route: ctx.route,
        protocol: protocol.as_str(),
        started: ctx.started,
        recompute_counted: false,
        guards: vec![
            InflightGuard::new(&ctx.state.metrics, &decode.runtime, &decode.spec.url, WorkerRole::Decode.as_str()),
            InflightGuard::new(&ctx.state.metrics, &prefill.runtime, &prefill.spec.url, WorkerRole::Prefill.as_str()),
        ],
    }
}

fn to_bytes(body: &Map<String, Value>) -> Result<Bytes, GatewayError> {
    serde_json::to_vec(body).map(Bytes::from).map_err(|e| GatewayError::internal(format!("cannot encode request: {e}")))
}

/// The prefill leg as an owned future: reads P's whole answer, timed and counted.
fn spawn_prefill(ctx: &Ctx, prefill: &Picked, body: Bytes, protocol: KvConnector) -> PrefillFuture {
    let state = ctx.state.clone();
    let url = prefill.spec.url.clone();
    let path = ctx.req.endpoint.path();
    let rid = ctx.request_id.clone();
    let deadline = ctx.deadline;
    Box::pin(async move {
        let t = std::time::Instant::now();
        let out = leg::send_and_read(&state.upstream, &url, path, body, &rid, Leg::Prefill, deadline).await;
        state.metrics.leg_duration.with_label_values(&["prefill", protocol.as_str()]).observe(t.elapsed().as_secs_f64());
        out
    })
}

fn mint_rooms(batch_items: Option<usize>) -> Rooms {
    let mut rng = rand::rng();
    match batch_items {
        None => Rooms::Single(rng.random_range(0..=MAX_ROOM)),
        Some(n) => Rooms::Batch((0..n).map(|_| rng.random_range(0..=MAX_ROOM)).collect()),
    }
}

async fn run_bootstrap(ctx: &Ctx, p: &Picked, d: &Picked, record: &mut Record) -> Result<Response, GatewayError> {
    // batch_items is bounded by --max-batch-size in the parser: at most that many rooms.
    let rooms = mint_rooms(ctx.req.batch_items);
    let mut body = ctx.req.body.clone();
    bootstrap::inject(&mut body, &p.spec.host, p.spec.bootstrap_port, &rooms);
    record.rendezvous = Some(Rendezvous::Rooms(rooms));
    let bytes = to_bytes(&body)?;
    let prefill = spawn_prefill(ctx, p, bytes.clone(), KvConnector::Bootstrap);
    let merge = ctx.req.wants_input_logprobs;
    relay_leg(ctx, &d.spec.url, Leg::Decode, bytes, Some(prefill), merge, finish(ctx, KvConnector::Bootstrap, p, d)).await
}

async fn run_nixl(ctx: &Ctx, p: &Picked, d: &Picked, record: &mut Record) -> Result<Response, GatewayError> {
    record.rendezvous = Some(Rendezvous::RequestId(ctx.request_id.clone()));
    let p_body = to_bytes(&kv_transfer::nixl_prefill_body(&ctx.req.body))?;
    let accounting = finish(ctx, KvConnector::Nixl, p, d);
    let answer = spawn_prefill(ctx, p, p_body, KvConnector::Nixl).await?;
    let answer: Value = serde_json::from_slice(&answer)
        .map_err(|e| GatewayError::protocol(Leg::Prefill, format!("prefill answer is not JSON: {e}")))?;
    let metrics = &ctx.state.metrics;
    let (d_body, counted) = match kv_transfer::returned_params(&answer) {
        Some(params) => {
            let missing = kv_transfer::nixl_missing_fields(params);
            if !missing.is_empty() {
                tracing::warn!(?missing, prefill = %p.spec.url, "prefill returned incomplete kv_transfer_params; decode will recompute");
                metrics.silent_recompute.with_label_values(&["nixl", "incomplete_params"]).inc();
            }
            (kv_transfer::nixl_decode_body(&ctx.req.body, params.clone()), !missing.is_empty())
        }
        None => {
            tracing::warn!(prefill = %p.spec.url, "prefill returned no kv_transfer_params; decode will recompute the prompt");
            metrics.silent_recompute.with_label_values(&["nixl", "no_params"]).inc();
            // Never the client's own params: with none from the prefill, the decode gets none.
            (kv_transfer::nixl_decode_without_params(&ctx.req.body), true)
        }
    };
    let finish = Finish { recompute_counted: counted, ..accounting };
    relay_leg(ctx, &d.spec.url, Leg::Decode, to_bytes(&d_body)?, None, false, finish).await
}

fn bootstrap_base(p: &WorkerSpec) -> String {
    let port = p.bootstrap_port.unwrap_or(DEFAULT_BOOTSTRAP_PORT);
    if p.host.contains(':') {
        format!("http://[{}]:{port}", p.host)
    } else {
        format!("http://{}:{port}", p.host)
    }
}

/// P's Mooncake engine id, from the cache or its bootstrap server's `GET /query`.
async fn engine_id(ctx: &Ctx, p: &WorkerSpec) -> Result<String, GatewayError> {
    if let Some(id) = ctx.state.cached_engine_id(&p.url) {
        return Ok(id);
    }
    let url = format!("{}/query", bootstrap_base(p));
    let deadline = ctx.deadline.min(Instant::now() + QUERY_TIMEOUT);
    // The bootstrap server speaks plain HTTP (engines serve it without TLS): the worker key
    // goes there only when the worker itself is plain HTTP, never in clear past a TLS worker.
    let query = ctx.state.upstream.get_keyed(&url, Leg::Prefill, !p.is_tls());
    let resp = timeout_at(deadline, query).await.map_err(|_| deadline_error(Leg::Prefill))??;
    if !resp.status().is_success() {
        return Err(GatewayError::unreachable(Leg::Prefill, format!("{url} answered HTTP {}", resp.status().as_u16())));
    }
    let body = timeout_at(deadline, resp.into_body().collect()).await.map_err(|_| deadline_error(Leg::Prefill))?;
    let body = body.map_err(|e| GatewayError::unreachable(Leg::Prefill, format!("{url}: {e}")))?.to_bytes();
    if body.len() > RESPONSE_LIMIT {
        return Err(GatewayError::protocol(Leg::Prefill, format!("{url}: answer too large")));
    }
    let v: Value = serde_json::from_slice(&body).map_err(|e| GatewayError::protocol(Leg::Prefill, format!("{url}: not JSON: {e}")))?;
    let id = kv_transfer::mooncake_engine_id(&v).ok_or_else(|| GatewayError::protocol(Leg::Prefill, format!("{url}: no engine_id in {v}")))?;
    ctx.state.store_engine_id(&p.url, id.clone());
    Ok(id)
}

async fn run_mooncake(ctx: &Ctx, p: &Picked, d: &Picked, record: &mut Record) -> Result<Response, GatewayError> {
    let engine = engine_id(ctx, &p.spec).await?;
    let transfer_id = kv_transfer::mooncake_transfer_id(&uuid::Builder::from_random_bytes(rand::random()).into_uuid().to_string());
    let p_body = to_bytes(&kv_transfer::mooncake_prefill_body(&ctx.req.body, &transfer_id))?;
    let d_body = to_bytes(&kv_transfer::mooncake_decode_body(&ctx.req.body, &transfer_id, &engine, &bootstrap_base(&p.spec)))?;
    record.rendezvous = Some(Rendezvous::TransferId(transfer_id));
    let prefill = spawn_prefill(ctx, p, p_body, KvConnector::Mooncake);
    relay_leg(ctx, &d.spec.url, Leg::Decode, d_body, Some(prefill), false, finish(ctx, KvConnector::Mooncake, p, d)).await
}

