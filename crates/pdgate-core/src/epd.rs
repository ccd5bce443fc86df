//! EPD's decisions (docs/protocols.md §8): which encode worker gets each image, what it is
//! sent, and what the prefill is told. Two styles, by the PD connector:
//!
//! - **TokenSpeed** (bootstrap, as SMG drives TokenSpeed workers): per image a 63-bit room is
//!   minted from the injected rng; the encode worker gets `POST /encode` with the image and the
//!   room, and the prefill's body gets `encode_bootstrap_info` naming the encode worker's
//!   bootstrap server and the room per `item_index`. Sent together with the PD legs.
//! - **vLLM** (NIXL, Mooncake; vLLM's disaggregated encoder): per image the encoder gets a chat
//!   completion of that image alone (`max_tokens` 1, not streamed), and answers once it stored
//!   the embedding where the prefill's encoder-cache connector finds it; its answer's
//!   `ec_transfer_params` go to the prefill ([`add_ec_params`]). Sent before the PD legs.
//!
//! Either way the encode policy picks the worker (consistent hashing keys it by the image's
//! content hash, so a repeated image meets the same worker's embedding cache) and the decode's
//! body is unchanged. Pure: no IO, randomness as an argument.

use rand::{Rng, RngCore};

use pdgate_protocol::bootstrap::MAX_ROOM;
use pdgate_protocol::media::{self, EncodeItem};

use crate::error::GatewayError;
use crate::plan::{LegBody, Mode, PdPlan};
use crate::policy::{Policy, RouteInput, Selection};
use crate::snapshot::PoolSnapshot;
use crate::worker::{KvConnector, WorkerRole, DEFAULT_BOOTSTRAP_PORT};

/// One image of the request, as the gateway found it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Image {
    /// The `data:image/...;base64,` URL, sent to the encode worker as it came.
    pub url: String,
    /// SHA-256 (hex) of the image's bytes, as the reference engine names it (SMG: BLAKE3).
    pub content_hash: String,
}

/// How encode workers are driven: by the PD connector (see the module's doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EncodeStyle {
    /// `POST /encode` with a room, sent with the PD legs (bootstrap).
    TokenSpeed,
    /// `POST /v1/chat/completions` of the image alone, answered before the PD legs are sent
    /// (NIXL, Mooncake).
    Vllm,
}

impl EncodeStyle {
    /// The style the plan's PD connector implies, or none outside PD.
    pub fn of(mode: Mode) -> Option<EncodeStyle> {
        match mode {
            Mode::Pd(KvConnector::Bootstrap) => Some(EncodeStyle::TokenSpeed),
            Mode::Pd(KvConnector::Nixl | KvConnector::Mooncake) => Some(EncodeStyle::Vllm),
            Mode::Regular => None,
        }
    }

    /// The path the encode leg is sent to.
    pub fn path(self) -> &'static str {
        match self {
            EncodeStyle::TokenSpeed => "/encode",
            EncodeStyle::Vllm => "/v1/chat/completions",
        }
    }
}

/// The call to one encode worker for one image.
#[derive(Clone, Debug, PartialEq)]
pub struct EncodeLeg {
    /// Index into the snapshot the decision was made on.
    pub worker: usize,
    pub url: String,
    /// The image's place among the prompt's images (`item_index`).
    pub item_index: usize,
    pub style: EncodeStyle,
    /// TokenSpeed: the room the embedding waits under. vLLM: none (the embedding is found by
    /// the engine's hash of the image).
    pub room: Option<u64>,
    /// The engine's id for the call: TokenSpeed's `req_id` (what `/abort_request` matches), or
    /// the `X-Request-Id` of a vLLM call.
    pub call_id: String,
    /// `POST /encode` body, or the image's own chat completion.
    pub body: serde_json::Map<String, serde_json::Value>,
}

/// Picks the encode worker for one image among the eligible encode workers not in `exclude`
/// (unless that leaves none). `sequence` drives round robin; the content hash is the
/// consistent-hashing key.
pub fn select_encoder(snap: &PoolSnapshot, policy: &dyn Policy, image: &Image, sequence: u64, exclude: &[usize], rng: &mut dyn RngCore) -> Result<Selection, GatewayError> {
    let all = snap.eligible(WorkerRole::Encode);
    let kept: Vec<usize> = all.iter().copied().filter(|w| !exclude.contains(w)).collect();
    let candidates = if kept.is_empty() { all } else { &kept };
    let input = RouteInput { key: Some(&image.content_hash), sequence, ..RouteInput::default() };
    policy.select(snap, candidates, &input, rng).ok_or_else(|| GatewayError::no_workers("encode"))
}

/// The encode legs of a PD plan, one per image (`encoders[i]` is image `i`'s encode worker).
/// TokenSpeed: a room per image, the `POST /encode` bodies, and the prefill's body with
/// `encode_bootstrap_info`. vLLM: each image's chat completion; the prefill's body is completed
/// from the answers ([`add_ec_params`]). The decode's body is left as it is.
pub fn attach(plan: &mut PdPlan, snap: &PoolSnapshot, images: &[Image], encoders: &[usize], rng: &mut dyn RngCore) -> Result<Vec<EncodeLeg>, GatewayError> {
    let Some(style) = EncodeStyle::of(plan.mode) else { return Err(GatewayError::internal("EPD needs a PD plan")) };
    let Some(prefill) = plan.prefill.as_ref() else { return Err(GatewayError::internal("an EPD plan needs a prefill leg")) };
    if snap.worker(prefill.worker).spec.is_grpc() {
        return Err(GatewayError::invalid(Some("messages"), "images need an http:// prefill worker: EPD over gRPC prefill workers is not built yet"));
    }
    match style {
        EncodeStyle::TokenSpeed => attach_tokenspeed(plan, snap, images, encoders, rng),
        EncodeStyle::Vllm => vllm_legs(plan, snap, images, encoders),
    }
}

fn attach_tokenspeed(plan: &mut PdPlan, snap: &PoolSnapshot, images: &[Image], encoders: &[usize], rng: &mut dyn RngCore) -> Result<Vec<EncodeLeg>, GatewayError> {
    let request_id = plan.request_id.clone();
    let Some(prefill) = plan.prefill.as_mut() else { return Err(GatewayError::internal("an EPD plan needs a prefill leg")) };
    let mut legs = Vec::with_capacity(images.len());
    let mut items = Vec::with_capacity(images.len());
    for (i, (image, &w)) in images.iter().zip(encoders).enumerate() {
        let spec = &snap.worker(w).spec;
        let room = rng.random_range(0..=MAX_ROOM);
        let port = spec.bootstrap_port.unwrap_or(DEFAULT_BOOTSTRAP_PORT);
        items.push(EncodeItem { item_index: i, bootstrap_host: spec.host.clone(), bootstrap_port: port, bootstrap_room: room });
        let call_id = format!("encode-{request_id}-{i}");
        let body = media::encode_body(&call_id, &image.url, room);
        legs.push(EncodeLeg { worker: w, url: spec.url.clone(), item_index: i, style: EncodeStyle::TokenSpeed, room: Some(room), call_id, body });
    }
    // The prefill's own body: the decode's (or, for a stream, the whole-answer copy) plus where
    // each embedding waits.
    let mut body = match (&prefill.body, &plan.relayed.body) {
        (LegBody::Json(b), _) | (LegBody::SameAsRelayed, LegBody::Json(b)) => b.clone(),
        (other, _) => return Err(GatewayError::internal(format!("an EPD prefill cannot carry encode_bootstrap_info in {other:?}"))),
    };
    body.insert("encode_bootstrap_info".into(), media::encode_bootstrap_info(&items));
    prefill.body = LegBody::Json(body);
    Ok(legs)
}

/// vLLM: each image alone in a chat completion of one token, not streamed, under the request's
/// model, as vLLM's EPD proxy primes its encoders (docs/protocols.md §8). Its call id is the
/// attempt's with the image's index, so two images on one encoder never share an id.
fn vllm_legs(plan: &PdPlan, snap: &PoolSnapshot, images: &[Image], encoders: &[usize]) -> Result<Vec<EncodeLeg>, GatewayError> {
    let model = match plan.prefill.as_ref().map(|p| &p.body) {
        Some(LegBody::Json(b)) => b.get("model").cloned(),
        _ => None,
    };
    let legs = images
        .iter()
        .zip(encoders)
        .enumerate()
        .map(|(i, (image, &w))| EncodeLeg {
            worker: w,
            url: snap.worker(w).spec.url.clone(),
            item_index: i,
            style: EncodeStyle::Vllm,
            room: None,
            call_id: format!("{}-encode-{i}", plan.request_id),
            body: media::vllm_encode_body(model.as_ref(), &image.url),
        })
        .collect();
    Ok(legs)
}

/// vLLM: the encoders' `ec_transfer_params`, merged (one entry per image hash; an image sent
/// twice keeps its first entry), in the prefill's body. Nothing is added when no encoder gave
/// any (vLLM's shared-storage connector finds the embeddings without them).
pub fn add_ec_params(plan: &mut PdPlan, params: serde_json::Map<String, serde_json::Value>) -> Result<(), GatewayError> {
    if params.is_empty() {
        return Ok(());
    }
    let relayed = plan.relayed.body.clone();
    let Some(prefill) = plan.prefill.as_mut() else { return Err(GatewayError::internal("an EPD plan needs a prefill leg")) };
    let mut body = match (&prefill.body, relayed) {
        (LegBody::Json(b), _) => b.clone(),
        (LegBody::SameAsRelayed, LegBody::Json(b)) => b,
        (other, _) => return Err(GatewayError::internal(format!("an EPD prefill cannot carry ec_transfer_params in {other:?}"))),
    };
    body.insert("ec_transfer_params".into(), serde_json::Value::Object(params));
    prefill.body = LegBody::Json(body);
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::policy::{make_policy, Selection};
    use crate::snapshot::WorkerView;
    use crate::worker::WorkerSpec;
    use crate::PolicyName;
    use pdgate_protocol::{parse_request, Endpoint, Limits};
    use rand::{rngs::StdRng, SeedableRng};
    use serde_json::{json, Value};
    use std::sync::Arc;

    fn snap() -> PoolSnapshot {
        snap_for(KvConnector::Bootstrap)
    }

    fn snap_for(connector: KvConnector) -> PoolSnapshot {
        let mut views = Vec::new();
        for (url, role, port) in [
            ("http://p:1", WorkerRole::Prefill, Some(8998)),
            ("http://d:1", WorkerRole::Decode, None),
            ("http://e0:1", WorkerRole::Encode, Some(8990)),
            ("http://e1:1", WorkerRole::Encode, None),
            ("http://e2:1", WorkerRole::Encode, Some(8992)),
        ] {
            let mut spec = WorkerSpec::new(url, role).unwrap();
            spec.bootstrap_port = port;
            views.push(WorkerView::new(Arc::new(spec), true));
        }
        PoolSnapshot::build(views, connector)
    }

    fn image(hash: &str) -> Image {
        Image { url: format!("data:image/png;base64,{hash}"), content_hash: hash.into() }
    }

    #[test]
    fn consistent_hashing_sends_an_image_to_one_encoder_and_spreads_images() {
        let s = snap();
        let policy = make_policy(PolicyName::ConsistentHash);
        let mut rng = StdRng::seed_from_u64(3);
        let pick = |h: &str, seq, rng: &mut StdRng| select_encoder(&s, policy.as_ref(), &image(h), seq, &[], rng).unwrap().worker;
        let first = pick("abc", 0, &mut rng);
        assert!((2..5).contains(&first), "an encode worker");
        assert!((1..50).all(|seq| pick("abc", seq, &mut rng) == first), "the same image, the same worker");
        let used: std::collections::BTreeSet<usize> = (0..64).map(|i| pick(&format!("{i:064x}"), 0, &mut rng)).collect();
        assert_eq!(used.len(), 3, "different images spread over the encode workers");
        // A failed encoder is avoided while another is left.
        let other = select_encoder(&s, policy.as_ref(), &image("abc"), 0, &[first], &mut rng).unwrap().worker;
        assert_ne!(other, first);
    }

    #[test]
    fn round_robin_and_no_encoder() {
        let s = snap();
        let rr = make_policy(PolicyName::RoundRobin);
        let mut rng = StdRng::seed_from_u64(1);
        let picks: Vec<usize> = (0..3).map(|seq| select_encoder(&s, rr.as_ref(), &image("x"), seq, &[], &mut rng).unwrap().worker).collect();
        assert_eq!(picks, vec![2, 3, 4]);
        let none = PoolSnapshot::build(Vec::new(), KvConnector::Bootstrap);
        assert_eq!(select_encoder(&none, rr.as_ref(), &image("x"), 0, &[], &mut rng).unwrap_err().code(), "no_available_workers");
    }

    fn plan_for(stream: bool) -> (PoolSnapshot, PdPlan) {
        let s = snap();
        let body = json!({"model": "m", "stream": stream, "messages": [{"role": "user", "content": "hi"}]});
        let req = parse_request(Endpoint::ChatCompletions, serde_json::to_vec(&body).unwrap().as_slice(), &Limits::default()).unwrap();
        let mut rng = StdRng::seed_from_u64(7);
        let plan = crate::plan::pd(&s, &Selection::new(0, "t"), &Selection::new(1, "t"), &req, "rid-1", &mut rng).unwrap();
        (s, plan)
    }

    #[test]
    fn the_prefill_is_told_where_each_embedding_waits_and_the_decode_is_not() {
        for stream in [false, true] {
            let (s, mut plan) = plan_for(stream);
            let decode_before = plan.relayed.body.clone();
            let mut rng = StdRng::seed_from_u64(9);
            let legs = attach(&mut plan, &s, &[image("h0"), image("h1")], &[2, 3], &mut rng).unwrap();
            assert_eq!(plan.relayed.body, decode_before, "the decode's body is unchanged");
            let LegBody::Json(p) = &plan.prefill.as_ref().unwrap().body else { panic!("the prefill has its own body") };
            let items = p["encode_bootstrap_info"]["items"].as_array().unwrap();
            assert_eq!(items.len(), 2);
            assert_eq!(items[0]["bootstrap_host"], "e0");
            assert_eq!(items[0]["bootstrap_port"], 8990);
            assert_eq!(items[1]["bootstrap_port"], u64::from(DEFAULT_BOOTSTRAP_PORT), "no port given: the engine default");
            assert_eq!(p["stream"], Value::Bool(false), "the prefill answers whole");
            assert!(p.contains_key("bootstrap_room"), "the PD rendezvous stays");
            for (i, leg) in legs.iter().enumerate() {
                assert_eq!(items[i]["bootstrap_room"], leg.room.unwrap());
                assert_eq!(items[i]["item_index"], i);
                assert_eq!(leg.body["items"][0]["bootstrap_room"], leg.room.unwrap());
                assert_eq!((leg.style, leg.call_id.as_str()), (EncodeStyle::TokenSpeed, leg.body["req_id"].as_str().unwrap()));
                assert_eq!(leg.body["mm_items"][0], format!("data:image/png;base64,h{i}"));
                assert_eq!(leg.body["req_id"], format!("encode-rid-1-{i}"));
            }
            assert_ne!(legs[0].room, legs[1].room);
        }
    }

    fn nixl_plan(stream: bool) -> (PoolSnapshot, PdPlan) {
        let s = snap_for(KvConnector::Nixl);
        let body = json!({"model": "m", "stream": stream, "max_tokens": 9, "messages": [{"role": "user", "content": "hi"}]});
        let req = parse_request(Endpoint::ChatCompletions, serde_json::to_vec(&body).unwrap().as_slice(), &Limits::default()).unwrap();
        let mut rng = StdRng::seed_from_u64(7);
        let plan = crate::plan::pd(&s, &Selection::new(0, "t"), &Selection::new(1, "t"), &req, "rid-2", &mut rng).unwrap();
        (s, plan)
    }

    #[test]
    fn vllm_encoders_get_each_image_alone_and_the_prefill_their_params() {
        let (s, mut plan) = nixl_plan(true);
        let (prefill_before, decode_before) = (plan.prefill.clone(), plan.relayed.body.clone());
        let mut rng = StdRng::seed_from_u64(9);
        let legs = attach(&mut plan, &s, &[image("h0"), image("h1")], &[2, 4], &mut rng).unwrap();
        assert_eq!((plan.prefill.clone(), plan.relayed.body.clone()), (prefill_before, decode_before), "nothing changes before the answers");
        for (i, leg) in legs.iter().enumerate() {
            assert_eq!((leg.style, leg.room, leg.item_index), (EncodeStyle::Vllm, None, i));
            assert_eq!(leg.call_id, format!("rid-2-encode-{i}"));
            let want = json!({"model": "m", "max_tokens": 1, "stream": false,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": format!("data:image/png;base64,h{i}")}}]}]});
            assert_eq!(Value::Object(leg.body.clone()), want);
        }
        assert_eq!((legs[0].url.as_str(), legs[1].url.as_str()), ("http://e0:1", "http://e2:1"));
        assert_eq!(EncodeStyle::Vllm.path(), "/v1/chat/completions");

        // No params: the prefill's body is left alone.
        let before = plan.prefill.clone();
        add_ec_params(&mut plan, serde_json::Map::new()).unwrap();
        assert_eq!(plan.prefill, before);
        let params = json!({"abc": {"item_indices": [0], "metadata": {}}}).as_object().unwrap().clone();
        add_ec_params(&mut plan, params).unwrap();
        let LegBody::Json(p) = &plan.prefill.as_ref().unwrap().body else { panic!("the prefill has its own body") };
        assert_eq!(p["ec_transfer_params"], json!({"abc": {"item_indices": [0], "metadata": {}}}));
        assert_eq!(p["kv_transfer_params"]["do_remote_decode"], Value::Bool(true), "the NIXL prefill stays one");
    }

    #[test]
    fn the_style_follows_the_connector() {
        assert_eq!(EncodeStyle::of(Mode::Pd(KvConnector::Bootstrap)), Some(EncodeStyle::TokenSpeed));
        assert_eq!(EncodeStyle::of(Mode::Pd(KvConnector::Mooncake)), Some(EncodeStyle::Vllm));
        assert_eq!(EncodeStyle::of(Mode::Regular), None);
    }
}
