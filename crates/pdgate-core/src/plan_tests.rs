//! Unit tests of the plans: which legs, in what order, carrying which fields, for single
//! requests, batches and n>1, in every mode (seeded rng, no IO).

use std::sync::Arc;

use rand::rngs::StdRng;
use rand::SeedableRng;
use serde_json::{json, Value};

use pdgate_protocol::bootstrap::Rooms;
use pdgate_protocol::{parse_request, Endpoint, Limits, ParsedRequest};

use super::*;
use crate::snapshot::WorkerView;
use crate::worker::WorkerRole;

fn snapshot(connector: KvConnector, bootstrap_port: Option<u16>) -> PoolSnapshot {
    let mut p = WorkerSpec::new("http://10.0.0.1:30000", WorkerRole::Prefill).unwrap();
    p.bootstrap_port = bootstrap_port;
    let d = WorkerSpec::new("http://10.0.0.2:30001", WorkerRole::Decode).unwrap();
    let r = WorkerSpec::new("http://10.0.0.3:30002", WorkerRole::Regular).unwrap();
    PoolSnapshot::build(vec![WorkerView::new(Arc::new(p), true), WorkerView::new(Arc::new(d), true), WorkerView::new(Arc::new(r), true)], connector)
}

fn req(endpoint: Endpoint, body: Value) -> ParsedRequest {
    parse_request(endpoint, body.to_string().as_bytes(), &Limits::default()).unwrap()
}

fn plan(connector: KvConnector, r: &ParsedRequest, seed: u64) -> PdPlan {
    let snap = snapshot(connector, Some(8998));
    pd(&snap, &Selection::new(0, "t"), &Selection::new(1, "t"), r, "rid-1", &mut StdRng::seed_from_u64(seed)).unwrap()
}

fn json_body(b: &LegBody) -> &Map<String, Value> {
    match b {
        LegBody::Json(m) => m,
        other => panic!("expected a built body, got {other:?}"),
    }
}

#[test]
fn regular_forwards_the_clients_bytes_to_one_worker() {
    let snap = snapshot(KvConnector::Bootstrap, None);
    let r = req(Endpoint::Completions, json!({"prompt": "hi", "stream": true}));
    let p = regular(&snap, &Selection::new(2, "t"), &r, "rid-1");
    assert_eq!((p.mode, p.order, p.prefill.is_none()), (Mode::Regular, Order::One, true));
    assert_eq!((p.relayed.leg, p.relayed.url.as_str(), p.relayed.stream), (Leg::Regular, "http://10.0.0.3:30002", true));
    assert_eq!(p.relayed.body, LegBody::Forward);
    assert_eq!((p.rendezvous, p.scan_usage, p.merge_input_logprobs), (None, false, false));
    // A body the parser cleaned of gateway fields is sent as cleaned, never as received.
    let cleaned = req(Endpoint::Completions, json!({"prompt": "hi", "bootstrap_room": 3}));
    let p = regular(&snap, &Selection::new(2, "t"), &cleaned, "rid-1");
    assert_eq!(Value::Object(json_body(&p.relayed.body).clone()), json!({"prompt": "hi"}));
}

#[test]
fn bootstrap_sends_one_body_with_a_room_to_both_legs_at_once() {
    let r = req(Endpoint::Generate, json!({"text": "hi", "sampling_params": {"max_new_tokens": 4}, "stream": true}));
    let p = plan(KvConnector::Bootstrap, &r, 1);
    assert_eq!((p.mode, p.order), (Mode::Pd(KvConnector::Bootstrap), Order::Concurrent));
    let pre = p.prefill.as_ref().unwrap();
    assert_eq!((pre.leg, pre.url.as_str(), pre.stream), (Leg::Prefill, "http://10.0.0.1:30000", false));
    assert_eq!((p.relayed.leg, p.relayed.url.as_str(), p.relayed.stream), (Leg::Decode, "http://10.0.0.2:30001", true));
    let body = json_body(&p.relayed.body);
    // A streamed request's prefill is asked for a whole answer, otherwise the decode's body.
    let mut pre_body = json_body(&pre.body).clone();
    assert_eq!(pre_body.insert("stream".into(), json!(true)), Some(json!(false)));
    assert_eq!(&pre_body, body);
    let whole = req(Endpoint::Generate, json!({"text": "hi", "sampling_params": {"max_new_tokens": 4}}));
    assert_eq!(plan(KvConnector::Bootstrap, &whole, 1).prefill.unwrap().body, LegBody::SameAsRelayed, "not streamed: the same bytes");
    let Some(Rendezvous::Rooms(Rooms::Single(room))) = p.rendezvous else { panic!("{:?}", p.rendezvous) };
    assert_eq!((body["bootstrap_host"].clone(), body["bootstrap_port"].clone(), body["bootstrap_room"].clone()), (json!("10.0.0.1"), json!(8998), json!(room)));
    assert!(room <= MAX_ROOM);
    assert_eq!(body["rid"], json!("rid-1"), "the body's rid is the attempt's id: SGLang's abort matches on it");
    let abort = AbortStyle::AbortRequest { rid: "rid-1".into() };
    assert_eq!((&pre.abort, &p.relayed.abort), (&abort, &abort), "both legs abortable by the one rid");
    assert!(p.scan_usage && !p.merge_input_logprobs);
    assert_eq!(p.release_prefill, None, "a bootstrap prefill answers only after its transfer");
}

#[test]
fn bootstrap_batches_and_n_get_one_distinct_room_per_item() {
    for (endpoint, body, items) in [
        (Endpoint::Generate, json!({"text": ["a", "b", "c"]}), 3),
        (Endpoint::Completions, json!({"prompt": "a", "n": 4}), 4),
        (Endpoint::Completions, json!({"prompt": ["a", "b"], "n": 2}), 4),
    ] {
        let r = req(endpoint, body.clone());
        let p = plan(KvConnector::Bootstrap, &r, 7);
        let Some(Rendezvous::Rooms(Rooms::Batch(rooms))) = &p.rendezvous else { panic!("{body}: {:?}", p.rendezvous) };
        let b = json_body(&p.relayed.body);
        assert_eq!(rooms.len(), items, "{body}");
        assert_eq!(b["bootstrap_room"], json!(rooms), "{body}");
        assert_eq!(b["bootstrap_host"], json!(vec!["10.0.0.1"; items]), "{body}");
        let mut unique = rooms.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), items, "rooms are distinct: {rooms:?}");
    }
}

#[test]
fn rooms_and_transfer_ids_come_from_the_injected_rng() {
    let r = req(Endpoint::Completions, json!({"prompt": "a"}));
    assert_eq!(plan(KvConnector::Bootstrap, &r, 5).rendezvous, plan(KvConnector::Bootstrap, &r, 5).rendezvous);
    assert_ne!(plan(KvConnector::Bootstrap, &r, 5).rendezvous, plan(KvConnector::Bootstrap, &r, 6).rendezvous);
    let a = mint_transfer_id(&mut StdRng::seed_from_u64(1));
    assert_eq!(a, mint_transfer_id(&mut StdRng::seed_from_u64(1)));
    assert_ne!(a, mint_transfer_id(&mut StdRng::seed_from_u64(2)));
    // xfer-<uuid v4>: 8-4-4-4-12 hex digits, version 4, RFC 4122 variant.
    let uuid = a.strip_prefix("xfer-").unwrap();
    let parts: Vec<&str> = uuid.split('-').collect();
    assert_eq!(parts.iter().map(|s| s.len()).collect::<Vec<_>>(), [8, 4, 4, 4, 12], "{a}");
    assert!(parts[2].starts_with('4') && matches!(&parts[3][..1], "8" | "9" | "a" | "b"), "{a}");
}

#[test]
fn logprob_merge_only_for_bootstrap_generate_with_return_logprob() {
    let lp = req(Endpoint::Generate, json!({"text": "a", "return_logprob": true}));
    assert!(plan(KvConnector::Bootstrap, &lp, 1).merge_input_logprobs);
    let no = req(Endpoint::Generate, json!({"text": "a"}));
    assert!(!plan(KvConnector::Bootstrap, &no, 1).merge_input_logprobs);
}

#[test]
fn nixl_runs_a_one_token_prefill_first_then_the_original_decode() {
    let r = req(Endpoint::ChatCompletions, json!({"messages": [{"role": "user", "content": "hi"}], "stream": true, "max_tokens": 9, "stream_options": {"include_usage": true}}));
    let p = plan(KvConnector::Nixl, &r, 1);
    assert_eq!((p.order, p.rendezvous.clone()), (Order::PrefillFirst, Some(Rendezvous::RequestId("rid-1".into()))));
    let pre = p.prefill.as_ref().unwrap();
    let pb = json_body(&pre.body);
    assert_eq!((pb["stream"].clone(), pb["max_tokens"].clone(), pb["max_completion_tokens"].clone()), (json!(false), json!(1), json!(1)));
    assert!(!pb.contains_key("stream_options"));
    assert_eq!(pb["kv_transfer_params"]["do_remote_decode"], true);
    assert_eq!((p.relayed.body.clone(), p.relayed.stream), (LegBody::FromPrefillAnswer, true));
    assert_eq!(pre.abort, AbortStyle::CloseConnection);
    assert_eq!(p.release_prefill, Some(AbortStyle::AbortRequest { rid: "rid-1".into() }), "a hold nobody will pull is released");
    // The decode gets the prefill's params verbatim, or none at all.
    let params = json!({"remote_block_ids": [1], "remote_engine_id": "e", "remote_request_id": "r", "remote_host": "h", "remote_port": 1});
    let d = nixl_decode(&r, &json!({"kv_transfer_params": params}));
    assert_eq!((d.body["kv_transfer_params"].clone(), d.recompute, d.body["max_tokens"].clone()), (params.clone(), None, json!(9)));
    let d = nixl_decode(&r, &json!({"kv_transfer_params": {"remote_host": "h"}}));
    assert_eq!((d.recompute, d.missing.len()), (Some("incomplete_params"), 4));
    let d = nixl_decode(&r, &json!({"choices": []}));
    assert_eq!((d.recompute, d.body.contains_key("kv_transfer_params")), (Some("no_params"), false));
    assert!(!d.decode_reports_prefill_cache);
    // vLLM 0.32's prefill adds its own prefix-cache hits, which the decode reports as cached.
    let mut with_hits = params.clone();
    with_hits["remote_prefill_cached_tokens"] = json!(0);
    let d = nixl_decode(&r, &json!({"kv_transfer_params": with_hits}));
    assert!(d.decode_reports_prefill_cache && d.recompute.is_none());
    assert!(!nixl_decode(&r, &json!({"kv_transfer_params": params})).decode_reports_prefill_cache);
}

#[test]
fn mooncake_shares_a_minted_transfer_id_and_points_the_decode_at_ps_bootstrap_server() {
    let r = req(Endpoint::Completions, json!({"prompt": "a", "max_tokens": 5}));
    let p = plan(KvConnector::Mooncake, &r, 3);
    assert_eq!(p.order, Order::Concurrent);
    let Some(Rendezvous::TransferId(id)) = &p.rendezvous else { panic!() };
    let pb = json_body(&p.prefill.as_ref().unwrap().body);
    assert_eq!((&pb["kv_transfer_params"]["transfer_id"], &pb["max_tokens"]), (&json!(id), &json!(1)));
    let LegBody::NeedsEngineId { transfer_id, bootstrap_addr } = &p.relayed.body else { panic!("{:?}", p.relayed.body) };
    assert_eq!((transfer_id, bootstrap_addr.as_str()), (id, "http://10.0.0.1:8998"));
    let d = mooncake_decode(&r, transfer_id, "engine-7", bootstrap_addr);
    assert_eq!(d["kv_transfer_params"]["remote_engine_id"], "engine-7");
    assert_eq!(d["max_tokens"], 5);
}

#[test]
fn generate_is_refused_in_vllm_modes_before_any_leg() {
    let r = req(Endpoint::Generate, json!({"text": "a"}));
    for c in [KvConnector::Nixl, KvConnector::Mooncake] {
        let snap = snapshot(c, None);
        let err = pd(&snap, &Selection::new(0, "t"), &Selection::new(1, "t"), &r, "x", &mut StdRng::seed_from_u64(1)).unwrap_err();
        assert_eq!(err.status(), 400, "{c:?}");
        assert!(err.message.contains("/generate"));
    }
    assert!(check_compatible(Mode::Pd(KvConnector::Bootstrap), Endpoint::Generate).is_ok());
    assert!(check_compatible(Mode::Regular, Endpoint::Generate).is_ok());
}

#[test]
fn bootstrap_base_brackets_ipv6_and_defaults_the_port() {
    let mut s = WorkerSpec::new("http://[::1]:30000", WorkerRole::Prefill).unwrap();
    assert_eq!(bootstrap_base(&s), "http://[::1]:8998");
    s.bootstrap_port = Some(9000);
    assert_eq!(bootstrap_base(&s), "http://[::1]:9000");
}

#[test]
fn a_grpc_leg_gets_rooms_in_the_contracts_int32_range() {
    let p = WorkerSpec::new("http://10.0.0.1:30000", WorkerRole::Prefill).unwrap();
    let d = WorkerSpec::new("grpc://10.0.0.2:30001", WorkerRole::Decode).unwrap();
    let snap = PoolSnapshot::build(vec![WorkerView::new(Arc::new(p), true), WorkerView::new(Arc::new(d), true)], KvConnector::Bootstrap);
    let r = req(Endpoint::Completions, json!({"prompt": "a", "n": 3}));
    let mut rng = StdRng::seed_from_u64(7);
    for _ in 0..200 {
        let plan = pd(&snap, &Selection::new(0, "t"), &Selection::new(1, "t"), &r, "rid-1", &mut rng).unwrap();
        let Some(Rendezvous::Rooms(Rooms::Batch(rooms))) = plan.rendezvous else { panic!("{:?}", plan.rendezvous) };
        assert!(rooms.iter().all(|r| *r <= MAX_GRPC_ROOM), "{rooms:?}");
    }
}
