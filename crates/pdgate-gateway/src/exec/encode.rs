//! EPD (docs/protocols.md §8): a request's images, and its encode legs.
//!
//! At admission the chat body's `image_url` parts are found, in prompt order. Only `data:`
//! URLs are taken: a remote one is a 400 before any leg is sent (the gateway fetches nothing).
//! Each image is named by SHA-256 of its bytes, the name the reference engine gives it (SMG
//! uses BLAKE3 of the same bytes); `--encode-policy consistent_hashing` hashes on that name.
//!
//! Per attempt, `decide` picks an encode worker per image and core's `epd::attach` mints the
//! rooms and the bodies; `send` starts one `POST /encode` per image, and the prefill leg awaits
//! them together with its own call (`transaction::send_prefill`). So a failed encode call
//! fails the prefill leg and the attempt: the decode is aborted as for any failed leg, the
//! prefill too (its call is dropped unfinished), and the retry loop may try again on another
//! encode worker, before any byte reached the client, within the request's deadline.

use std::sync::{Arc, OnceLock};

use base64::Engine as _;
use bytes::Bytes;
use futures_util::future::try_join_all;
use pdgate_core::breaker::Outcome;
use pdgate_core::epd::{self, EncodeLeg, Image};
use pdgate_core::plan::PdPlan;
use pdgate_core::{GatewayError, Leg};
use pdgate_protocol::media;
use pdgate_protocol::Endpoint;
use serde_json::Value;
use tracing::Instrument;

use super::{spans, Ctx};
use crate::clients::client::{LegFuture, LegRequest, WorkerClient};
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
}

/// Select, for an EPD attempt with images: an encode worker per image by `--encode-policy`
/// (never one that failed this request while another is left), then the rooms and bodies
/// (core), which also give the prefill its `encode_bootstrap_info`.
pub fn decide(ctx: &Ctx, routing: &Routing, plan: &mut PdPlan, exclude: &[usize]) -> Result<Encodes, GatewayError> {
    let snap = &routing.snapshot;
    let policy = ctx.state.encode_policy.as_ref();
    let mut workers = Vec::with_capacity(ctx.images.len());
    for image in ctx.images.iter() {
        let sequence = ctx.state.next_sequence();
        let pick = ctx.state.policy_rng.with(|rng| epd::select_encoder(snap, policy, image, sequence, exclude, rng))?;
        ctx.state.metrics.decisions.with_label_values(&["encode", pick.branch]).inc();
        workers.push(pick.worker);
    }
    // the rooms: never from the seeded routing rng (replicas with one seed must not share rooms)
    let legs = epd::attach(plan, snap, &ctx.images, &workers, &mut rand::rng())?;
    let runtimes = legs.iter().map(|l| routing.runtime[l.worker].clone()).collect();
    Ok(Encodes { legs, runtimes })
}

/// Send: every encode leg at once, as one future that ends when each worker accepted its
/// image, or with the first failure (the other calls are dropped). The worker that failed is
/// put in `failed` for the attempt's blame; a success is heard by its breaker here.
pub fn send(ctx: &Ctx, client: &Arc<dyn WorkerClient>, encodes: Encodes, failed: Arc<OnceLock<String>>) -> Result<LegFuture<()>, GatewayError> {
    let limit = ctx.state.fleet.upstream.limits.max_response_bytes;
    let mut calls = Vec::with_capacity(encodes.legs.len());
    for (leg, rt) in encodes.legs.into_iter().zip(encodes.runtimes) {
        let body = serde_json::to_vec(&leg.body).map(Bytes::from).map_err(|e| GatewayError::internal(format!("cannot encode the /encode body: {e}")))?;
        let req = LegRequest {
            url: leg.url.clone(),
            path: "/encode",
            body,
            request_id: ctx.request_id.clone(),
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
        calls.push(
            async move {
                let t = std::time::Instant::now();
                let out = call.await.and_then(|answer| accepted(&answer));
                drop(inflight);
                state.metrics.leg_duration.with_label_values(&["encode", "bootstrap"]).observe(t.elapsed().as_secs_f64());
                match &out {
                    Ok(()) => state.fleet.record_outcome(&url, Outcome::Success),
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
    Ok(Box::pin(async move { try_join_all(calls).await.map(|_| ()) }))
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
