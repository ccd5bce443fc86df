//! EPD's decisions (docs/protocols.md §8): which encode worker gets each image, the room its
//! embedding waits under, and what the prefill is told, as SMG drives TokenSpeed workers.
//!
//! Per image: the encode policy picks an encode worker (consistent hashing keys it by the
//! image's content hash, so a repeated image meets the same worker's embedding cache); a
//! 63-bit room is minted from the injected rng; the encode worker gets `POST /encode` with the
//! image and the room, and the prefill's body gets `encode_bootstrap_info` naming the encode
//! worker's bootstrap server and the room per `item_index`. The decode's body is unchanged.
//! Pure: no IO, randomness as an argument.

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

/// The call to one encode worker for one image.
#[derive(Clone, Debug, PartialEq)]
pub struct EncodeLeg {
    /// Index into the snapshot the decision was made on.
    pub worker: usize,
    pub url: String,
    /// The image's place among the prompt's images (`item_index`).
    pub item_index: usize,
    pub room: u64,
    /// `POST /encode` body.
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

/// Adds the encode legs to a bootstrap plan: a room per image, the `POST /encode` bodies, and
/// the prefill's body with `encode_bootstrap_info` (the decode's is left as it is).
/// `encoders[i]` is image `i`'s encode worker.
pub fn attach(plan: &mut PdPlan, snap: &PoolSnapshot, images: &[Image], encoders: &[usize], rng: &mut dyn RngCore) -> Result<Vec<EncodeLeg>, GatewayError> {
    if plan.mode != Mode::Pd(KvConnector::Bootstrap) {
        return Err(GatewayError::internal(format!("EPD runs over the bootstrap connector, not {}", plan.mode.as_str())));
    }
    let request_id = plan.request_id.clone();
    let Some(prefill) = plan.prefill.as_mut() else { return Err(GatewayError::internal("an EPD plan needs a prefill leg")) };
    if snap.worker(prefill.worker).spec.is_grpc() {
        return Err(GatewayError::invalid(Some("messages"), "images need an http:// prefill worker: EPD over gRPC prefill workers is not built yet"));
    }
    let mut legs = Vec::with_capacity(images.len());
    let mut items = Vec::with_capacity(images.len());
    for (i, (image, &w)) in images.iter().zip(encoders).enumerate() {
        let spec = &snap.worker(w).spec;
        let room = rng.random_range(0..=MAX_ROOM);
        let port = spec.bootstrap_port.unwrap_or(DEFAULT_BOOTSTRAP_PORT);
        items.push(EncodeItem { item_index: i, bootstrap_host: spec.host.clone(), bootstrap_port: port, bootstrap_room: room });
        let body = media::encode_body(&format!("encode-{request_id}-{i}"), &image.url, room);
        legs.push(EncodeLeg { worker: w, url: spec.url.clone(), item_index: i, room, body });
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
        PoolSnapshot::build(views, KvConnector::Bootstrap)
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
                assert_eq!(items[i]["bootstrap_room"], leg.room);
                assert_eq!(items[i]["item_index"], i);
                assert_eq!(leg.body["items"][0]["bootstrap_room"], leg.room);
                assert_eq!(leg.body["mm_items"][0], format!("data:image/png;base64,h{i}"));
                assert_eq!(leg.body["req_id"], format!("encode-rid-1-{i}"));
            }
            assert_ne!(legs[0].room, legs[1].room);
        }
    }
}
