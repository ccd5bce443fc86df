//! EPD (docs/protocols.md §8): a request's images, and its encode legs.
//!
//! At admission the chat body's `image_url` parts are found, in prompt order. Only `data:`
//! URLs are taken: a remote one was fetched into a `data:` URL before (`media_fetch.rs`, hosts in
//! `--allowed-media-domains`), and any other is a 400 before any leg is sent.
//! Each image is named by SHA-256 of its bytes, the name the reference engine gives it (SMG
//! uses BLAKE3 of the same bytes); `--encode-policy consistent_hashing` hashes on that name.
//!
//! Per attempt, `decide` picks an encode worker per image and core's `epd::attach` makes the
//! legs; `send` starts one call per image. Two styles, by the PD connector (core `epd`):
//! - TokenSpeed (bootstrap): `POST /encode` with a room; the prefill leg awaits the calls
//!   together with its own call (`transaction::send_prefill`), so a failed encode call fails
//!   the prefill leg and the attempt: the decode is aborted as for any failed leg, the prefill
//!   too (its call is dropped unfinished).
//! - vLLM (NIXL, Mooncake): the image's chat completion; the attempt awaits every answer before
//!   any PD leg is sent ([`before_pd`]), and their `ec_transfer_params` go to the prefill. An
//!   encoder that answers without them stored nothing a prefill can find: the prefill will
//!   encode the image itself, which is counted (`pdgate_epd_unstored_images_total`).
//!
//! Either way the retry loop may try again on another encode worker, before any byte reached
//! the client, within the request's deadline.
//!
//! Faults (docs/architecture.md, "EPD"): an encode worker that does not answer within
//! `--encode-timeout-secs` fails its leg (`encode_timeout`, retried); one that answers
//! anything but `"accepted": true` JSON (vLLM: a JSON object) too (`encode_bad_response`); a
//! prefill that refuses an embedding names the image (`param: "encode_bootstrap_info.items[K]"`),
//! and the failure is that image's encode worker's ([`blame`]). Each TokenSpeed encode call
//! holds an abort guard until the prefill has answered (by then it took the embeddings): an
//! attempt abandoned earlier (a failed leg, a client gone) tells the encode worker
//! `POST /abort_request {"rid": req_id}`, so no embedding waits there for a prefill that will
//! never come. A vLLM encoder aborts a call whose connection closes, and holds nothing after
//! its answer.

use std::sync::{Arc, OnceLock};

use base64::Engine as _;
use bytes::Bytes;
use futures_util::future::try_join_all;
use pdgate_core::breaker::Outcome;
use pdgate_core::epd::{self, EncodeLeg, EncodeStyle, Image};
use pdgate_core::plan::{AbortStyle, PdPlan};
use pdgate_core::ErrorKind;
use pdgate_core::{GatewayError, Leg, PoolSnapshot};
use pdgate_protocol::media;
use pdgate_protocol::Endpoint;
use serde_json::{Map, Value};
use tracing::Instrument;

use super::{spans, Ctx};
use crate::clients::client::{AbortGuard, LegFuture, LegRequest, WorkerClient};
use crate::fleet::gauges::InflightGuard;
use crate::fleet::registry::{Routing, Runtime};

/// The request's images, or none outside `--epd-disaggregation` and for other routes than
/// chat. A remote URL, a non-image or bad base64 is the client's 400.
pub fn find_images(ctx: &Ctx) -> Result<Arc<[Image]>, GatewayError> {
    if !ctx.state.config.epd_disaggregation || ctx.req.endpoint != Endpoint::ChatCompletions {
        return Ok(Arc::from([]));
    }
    let urls = media::image_urls(&ctx.req.body);
    if !urls.is_empty() && ctx.req.batch_items.is_some() {
        return Err(GatewayError::invalid(Some("n"), "a request with images takes n=1 under --epd-disaggregation"));
    }
    let invalid = |m: String| GatewayError::invalid(Some("messages"), m);
    let mut images = Vec::with_capacity(urls.len());
    for (i, url) in urls.into_iter().enumerate() {
        let b64 = media::data_url_base64(url, i).map_err(|e| invalid(e.to_string()))?;
        let bytes = base64::engine::general_purpose::STANDARD.decode(b64).map_err(|e| invalid(format!("image {i}: the data URL is not valid base64: {e}")))?;
        let digest = ring::digest::digest(&ring::digest::SHA256, &bytes);
        let content_hash = digest.as_ref().iter().map(|b| format!("{b:02x}")).collect();
        images.push(Image { url: url.unwrap_or_default().to_string(), content_hash });
    }
    Ok(images.into())
}

/// The encode legs of one attempt, with their workers' live counters.
pub struct Encodes {
    pub legs: Vec<EncodeLeg>,
    pub runtimes: Vec<Arc<Runtime>>,
    /// The attempt's PD protocol (the legs' metric label).
    pub protocol: &'static str,
}

impl Encodes {
    /// Whether the legs are answered before the PD legs are sent (vLLM) rather than with them.
    pub fn go_first(&self) -> bool {
        self.legs.first().is_some_and(|l| l.style == EncodeStyle::Vllm)
    }
}

/// Select, for an EPD attempt with images: an encode worker per image by `--encode-policy`
/// (never one that failed this request while another is left), each admitted by its breaker
/// as the prefill and decode are (a half-open encode worker takes one probe request at a time:
/// a pick it refuses is made again without it), then the rooms and bodies (core), which also
/// give the prefill its `encode_bootstrap_info`. On an error, the probe slots this attempt took
/// for its encode workers are given back.
pub fn decide(ctx: &Ctx, routing: &Routing, plan: &mut PdPlan, exclude: &[usize]) -> Result<Encodes, GatewayError> {
    let snap = &routing.snapshot;
    let mut admitted = Vec::new();
    let decided = pick_all(ctx, snap, exclude, &mut admitted)
        // the rooms: never from the seeded routing rng (replicas with one seed must not share rooms)
        .and_then(|workers| epd::attach(plan, snap, &ctx.images, &workers, &mut rand::rng()));
    let legs = decided.inspect_err(|_| super::end_probes(ctx, snap, &admitted))?;
    let runtimes = legs.iter().map(|l| routing.runtime[l.worker].clone()).collect();
    Ok(Encodes { legs, runtimes, protocol: plan.mode.as_str() })
}

/// Each image's encode worker, in image order. A worker is asked to admit this attempt once,
/// however many of its images it gets (they are one probe); `admitted` collects those it
/// admitted.
fn pick_all(ctx: &Ctx, snap: &PoolSnapshot, exclude: &[usize], admitted: &mut Vec<usize>) -> Result<Vec<usize>, GatewayError> {
    let policy = ctx.state.encode_policy.as_ref();
    let mut exclude = exclude.to_vec();
    let mut workers = Vec::with_capacity(ctx.images.len());
    for image in ctx.images.iter() {
        let pick = loop {
            let sequence = ctx.state.next_sequence();
            let pick = ctx.state.policy_rng.with(|rng| epd::select_encoder(snap, policy, image, sequence, &exclude, rng))?;
            if admitted.contains(&pick.worker) {
                break pick;
            }
            if ctx.state.fleet.admit(&snap.worker(pick.worker).spec.url) {
                admitted.push(pick.worker);
                break pick;
            }
            // Refused: half-open with its one probe in flight (the view predates that probe).
            if exclude.contains(&pick.worker) {
                return Err(GatewayError::no_workers("encode (the only candidates are half-open, their one probe in flight)"));
            }
            exclude.push(pick.worker);
        };
        ctx.state.metrics.decisions.with_label_values(&["encode", pick.branch]).inc();
        workers.push(pick.worker);
    }
    Ok(workers)
}

/// The encode calls of one attempt, once sent.
pub struct Sent {
    /// Ends when each worker accepted its image, or with the first failure (the other calls
    /// are dropped). vLLM: each answer's `ec_transfer_params` (TokenSpeed: none).
    pub calls: LegFuture<Vec<Option<Map<String, Value>>>>,
    /// One per call, armed until the prefill answered: dropped armed, each aborts its call's
    /// rooms on its encode worker.
    pub aborts: Vec<AbortGuard>,
    /// Each image's encode worker, by item index (for [`blame`]).
    pub urls: Vec<String>,
    /// The attempt's blame for a failed encode leg: the worker whose call failed.
    pub failed: Arc<OnceLock<String>>,
}

/// Send: every encode leg at once, each bounded by `--encode-timeout-secs` within the
/// request's deadline. The worker that failed is put in `failed` for the attempt's blame; a
/// success is heard by its breaker here.
pub fn send(ctx: &Ctx, client: &Arc<dyn WorkerClient>, encodes: Encodes, failed: Arc<OnceLock<String>>) -> Result<Sent, GatewayError> {
    let limit = ctx.state.fleet.upstream.limits.max_response_bytes;
    let own = std::time::Duration::from_secs(ctx.state.config.encode_timeout_secs);
    let by = ctx.deadline.min(tokio::time::Instant::now() + own);
    let mut calls = Vec::with_capacity(encodes.legs.len());
    let mut aborts = Vec::with_capacity(encodes.legs.len());
    let mut urls = Vec::with_capacity(encodes.legs.len());
    let protocol = encodes.protocol;
    for (leg, rt) in encodes.legs.into_iter().zip(encodes.runtimes) {
        let body = serde_json::to_vec(&leg.body).map(Bytes::from).map_err(|e| GatewayError::internal(format!("cannot encode the encode leg's body: {e}")))?;
        let (style, request_id) = match leg.style {
            // TokenSpeed: the abort names the call's req_id; the header is the attempt's.
            EncodeStyle::TokenSpeed => (AbortStyle::AbortRequest { rid: leg.call_id.clone() }, ctx.request_id.clone()),
            // vLLM: its own request id per call; a closed connection is its abort.
            EncodeStyle::Vllm => (AbortStyle::CloseConnection, leg.call_id.clone()),
        };
        aborts.push(AbortGuard::new(client, &leg.url, &style));
        urls.push(leg.url.clone());
        let req = LegRequest {
            url: leg.url.clone(),
            path: leg.style.path(),
            body,
            request_id,
            leg: Leg::Encode,
            deadline: ctx.deadline,
            resumed_ids: 0,
            ids_to_ledger: false,
            prompts: ctx.prompt_memo.clone(),
        };
        let call = client.call(req, limit);
        let (state, failed, url) = (ctx.state.clone(), failed.clone(), leg.url);
        let inflight = InflightGuard::new(&state.metrics, &rt, &url, "encode");
        let span = spans::leg(Leg::Encode, &url);
        let secs = own.as_secs();
        let style = leg.style;
        calls.push(
            async move {
                let t = std::time::Instant::now();
                let answer = tokio::time::timeout_at(by, call).await.unwrap_or_else(|_| {
                    Err(GatewayError::timeout(format!("the encode worker did not accept the image within {secs}s (--encode-timeout-secs) or the request's deadline"))
                        .on(Leg::Encode))
                });
                let out = answer.and_then(|answer| match style {
                    EncodeStyle::TokenSpeed => accepted(&answer).map(|()| None),
                    EncodeStyle::Vllm => ec_params(&answer),
                });
                drop(inflight);
                state.metrics.leg_duration.with_label_values(&["encode", protocol]).observe(t.elapsed().as_secs_f64());
                match &out {
                    Ok(_) => state.fleet.record_outcome(&url, Outcome::Success),
                    Err(e) => {
                        spans::failed(&tracing::Span::current(), e);
                        let _ = failed.set(url);
                    }
                }
                out
            }
            .instrument(span),
        );
    }
    let calls: LegFuture<Vec<Option<Map<String, Value>>>> = Box::pin(try_join_all(calls));
    Ok(Sent { calls, aborts, urls, failed })
}

/// vLLM: sends the encode legs and waits for every answer, before any PD leg is sent (vLLM's
/// proxy order: the prefill's connector looks for the embeddings when it schedules the
/// prompt). Their `ec_transfer_params` go into the prefill's body. An encoder that gave none
/// is counted (the prefill will encode that image itself).
pub async fn before_pd(ctx: &Ctx, client: &Arc<dyn WorkerClient>, encodes: Encodes, plan: &mut PdPlan, failed: Arc<OnceLock<String>>) -> Result<(), GatewayError> {
    let protocol = encodes.protocol;
    let sent = send(ctx, client, encodes, failed)?;
    let answers = sent.calls.await?;
    let mut merged = Map::new();
    for (params, url) in answers.into_iter().zip(&sent.urls) {
        match params {
            Some(p) => p.into_iter().for_each(|(hash, entry)| {
                merged.entry(hash).or_insert(entry);
            }),
            None => {
                tracing::warn!(encoder = %url, "the encoder answered without ec_transfer_params: the prefill will encode the image itself");
                ctx.state.metrics.unstored_images.with_label_values(&[protocol]).inc();
            }
        }
    }
    epd::add_ec_params(plan, merged)
}

/// A prefill that failed because an embedding did not reach it (the reference engine's 5xx
/// with `param: "encode_bootstrap_info.items[K]"`: the encode worker offered a wrong one, or
/// none): the failure is image K's encode worker's, not the prefill's. Returns the error to
/// fail the attempt with, on the encode leg, with that worker in `failed`; any other error
/// is returned as it is.
pub fn blame(err: GatewayError, urls: &[String], failed: &OnceLock<String>) -> GatewayError {
    let item = match (&err.leg, &err.kind) {
        (Some(Leg::Prefill), ErrorKind::WorkerStatus { status, body: Some(body) }) if *status >= 500 => refused_item(body),
        _ => None,
    };
    let Some(url) = item.and_then(|k| urls.get(k)) else { return err };
    let _ = failed.set(url.clone());
    let why = match &err.kind {
        ErrorKind::WorkerStatus { body: Some(body), .. } => body.chars().take(300).collect::<String>(),
        _ => String::new(),
    };
    GatewayError::protocol(Leg::Encode, format!("the prefill could not take the embedding of encode worker {url}: {why}"))
}

/// K of an engine error body whose `error.param` is `encode_bootstrap_info.items[K]`.
fn refused_item(body: &str) -> Option<usize> {
    let v: Value = serde_json::from_str(body).ok()?;
    let param = v.get("error")?.get("param")?.as_str()?;
    param.strip_prefix("encode_bootstrap_info.items[")?.strip_suffix(']')?.parse().ok()
}

/// A vLLM encoder's answer: a chat completion (a JSON object) whose `ec_transfer_params`, an
/// object keyed by the image's hash, say the embedding is stored; none (or not an object) is
/// an encoder that stored nothing for a prefill (not an error: the prefill encodes itself).
fn ec_params(answer: &[u8]) -> Result<Option<Map<String, Value>>, GatewayError> {
    let v: Value = serde_json::from_slice(answer).map_err(|e| GatewayError::protocol(Leg::Encode, format!("the encoder's answer is not JSON: {e}")))?;
    let Value::Object(mut answer) = v else { return Err(GatewayError::protocol(Leg::Encode, "the encoder's answer is not a JSON object")) };
    Ok(match answer.remove("ec_transfer_params") {
        Some(Value::Object(p)) if !p.is_empty() => Some(p),
        _ => None,
    })
}

/// An encode worker's answer: `{"accepted": true, ...}` once the embeddings wait for the
/// prefill (docs/engine.md, "EPD"); anything else is a bad answer.
fn accepted(answer: &[u8]) -> Result<(), GatewayError> {
    let v: Value = serde_json::from_slice(answer).map_err(|e| GatewayError::protocol(Leg::Encode, format!("the encode worker's answer is not JSON: {e}")))?;
    if v.get("accepted") == Some(&Value::Bool(true)) {
        Ok(())
    } else {
        Err(GatewayError::protocol(Leg::Encode, "the encode worker did not accept the image (no \"accepted\": true)"))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_embedding_is_its_encode_workers_failure() {
        let urls = vec!["http://e0".to_string(), "http://e1".to_string()];
        let body = r#"{"error":{"message":"mismatched","type":"server_error","code":"embedding_transfer_failed","param":"encode_bootstrap_info.items[1]"}}"#;
        let failed = OnceLock::new();
        let e = blame(GatewayError::worker_status(Leg::Prefill, 500, Some(body.into())), &urls, &failed);
        assert_eq!((e.leg, e.code().as_str(), e.retryable()), (Some(Leg::Encode), "encode_bad_response", true));
        assert_eq!(failed.get().map(String::as_str), Some("http://e1"));
        // any other prefill failure stays the prefill's
        let failed = OnceLock::new();
        for other in [r#"{"error":{"param":null}}"#, r#"{"error":{"param":"encode_bootstrap_info.items[7]"}}"#, "not json"] {
            let e = blame(GatewayError::worker_status(Leg::Prefill, 500, Some(other.into())), &urls, &failed);
            assert_eq!(e.leg, Some(Leg::Prefill), "{other}");
        }
        let e = blame(GatewayError::worker_status(Leg::Prefill, 400, Some(body.into())), &urls, &failed);
        assert_eq!(e.leg, Some(Leg::Prefill));
        assert!(failed.get().is_none());
    }

    #[test]
    fn a_vllm_encoders_answer_gives_its_ec_params_or_none() {
        let stored = br#"{"choices":[{"message":{"content":""}}],"ec_transfer_params":{"ab12":{"item_indices":[0],"metadata":{}}}}"#;
        let p = ec_params(stored).unwrap().unwrap();
        assert_eq!(p.keys().collect::<Vec<_>>(), vec!["ab12"]);
        // a worker with no encoder-cache connector stored nothing: no params, not an error
        for none in [&br#"{"choices":[],"ec_transfer_params":null}"#[..], br#"{"choices":[]}"#, br#"{"ec_transfer_params":{}}"#, br#"{"ec_transfer_params":[1]}"#] {
            assert_eq!(ec_params(none).unwrap(), None);
        }
        for bad in [&b"not json"[..], b"[1,2]", b"\"x\""] {
            let e = ec_params(bad).unwrap_err();
            assert_eq!((e.leg, e.code().as_str()), (Some(Leg::Encode), "encode_bad_response"));
        }
    }
}
