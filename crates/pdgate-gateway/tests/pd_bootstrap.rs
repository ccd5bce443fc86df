//! SGLang bootstrap PD against mocks that really rendezvous: a gateway that sent the legs one
//! after the other would fail every test here.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

mod common;

use std::sync::Arc;

use common::mocks::{spawn, Fault, Rendezvous};
use common::{client, gateway, wait_ready};
use serde_json::{json, Value};

async fn pair() -> (common::mocks::Mock, common::mocks::Mock) {
    let rdv = Arc::new(Rendezvous::default());
    (spawn("prefill", rdv.clone(), Fault::None).await, spawn("decode", rdv, Fault::None).await)
}

#[tokio::test]
async fn both_legs_get_the_same_body_with_bootstrap_fields() {
    let (p, d) = pair().await;
    let (_gw, url) = gateway(json!({"pd_disaggregation": true, "prefill": [[p.url, 8998]], "decode": [d.url]})).await;
    wait_ready(&url).await;
    let r = client().post(format!("{url}/v1/completions")).json(&json!({"prompt": "hello", "max_tokens": 4})).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let route = r.headers()["x-pdgate-route"].to_str().unwrap().to_string();
    assert!(route.starts_with("protocol=bootstrap") && route.contains("room="), "{route}");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["choices"][0]["text"], " decoded", "client receives the decode's answer");
    let (pb, db) = (p.log().bodies(), d.log().bodies());
    assert_eq!(pb, db, "prefill and decode get the same body");
    assert_eq!(pb[0]["bootstrap_host"], "127.0.0.1");
    assert_eq!(pb[0]["bootstrap_port"], 8998);
    let room = pb[0]["bootstrap_room"].as_u64().unwrap();
    assert!(room < (1u64 << 63));
    assert!(route.contains(&format!("room={room}")));
}

#[tokio::test]
async fn generate_batches_get_one_room_per_item() {
    let (p, d) = pair().await;
    let (_gw, url) = gateway(json!({"pd_disaggregation": true, "prefill": [p.url], "decode": [d.url]})).await;
    wait_ready(&url).await;
    let r = client().post(format!("{url}/generate")).json(&json!({"text": ["a", "b", "c"], "sampling_params": {"max_new_tokens": 2}})).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v.as_array().unwrap().len(), 3);
    let body = &d.log().bodies()[0];
    let rooms: Vec<u64> = body["bootstrap_room"].as_array().unwrap().iter().map(|r| r.as_u64().unwrap()).collect();
    assert_eq!(rooms.len(), 3);
    assert_eq!(rooms.iter().collect::<std::collections::HashSet<_>>().len(), 3, "distinct rooms");
    assert_eq!(body["bootstrap_port"], json!([null, null, null]), "no port given: engine default");
    assert_eq!(body["bootstrap_host"].as_array().unwrap().len(), 3);
}

#[tokio::test]
async fn input_logprobs_are_merged_from_a_json_prefill() {
    let (p, d) = pair().await;
    let (_gw, url) = gateway(json!({"pd_disaggregation": true, "prefill": [p.url], "decode": [d.url]})).await;
    wait_ready(&url).await;
    let r = client().post(format!("{url}/generate")).json(&json!({"text": "hi", "return_logprob": true})).send().await.unwrap();
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["meta_info"]["input_token_logprobs"], json!([[-1.0, 11, null], [-2.0, 12, null]]));
}

#[tokio::test]
async fn input_logprobs_are_merged_into_every_chunk_and_the_prefill_is_not_asked_to_stream() {
    let (p, d) = pair().await;
    let (_gw, url) = gateway(json!({"pd_disaggregation": true, "prefill": [p.url], "decode": [d.url]})).await;
    wait_ready(&url).await;
    let r = client().post(format!("{url}/generate")).json(&json!({"text": "hi", "return_logprob": true, "stream": true})).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    let chunks: Vec<Value> = text.split("\n\n").filter_map(|e| e.strip_prefix("data: ")).filter(|d| *d != "[DONE]").map(|d| serde_json::from_str(d).unwrap()).collect();
    assert_eq!(chunks.len(), 3);
    for c in chunks {
        assert_eq!(c["meta_info"]["input_token_logprobs"], json!([[-1.0, 11, null], [-2.0, 12, null]]), "{c}");
    }
    assert!(text.ends_with("data: [DONE]\n\n"));
    // The gateway only reads the prefill's whole answer: it asks for one (as SMG does), and
    // otherwise sends the decode's body, rendezvous fields and all.
    let (mut pb, mut db) = (p.log().bodies()[0].clone(), d.log().bodies()[0].clone());
    assert_eq!((pb["stream"].clone(), db["stream"].clone()), (json!(false), json!(true)));
    pb.as_object_mut().unwrap().remove("stream");
    db.as_object_mut().unwrap().remove("stream");
    assert_eq!(pb, db);
}

#[tokio::test]
async fn prefill_failure_cancels_the_waiting_decode_at_once() {
    let rdv = Arc::new(Rendezvous::default());
    let p = spawn("prefill", rdv.clone(), Fault::Status(500)).await;
    let d = spawn("decode", rdv, Fault::None).await;
    let (_gw, url) = gateway(json!({"pd_disaggregation": true, "prefill": [p.url], "decode": [d.url], "retry_max_retries": 2})).await;
    wait_ready(&url).await;
    let r = client().post(format!("{url}/v1/completions")).json(&json!({"prompt": "x"})).send().await.unwrap();
    assert_eq!(r.status(), 502);
    assert!(r.headers()["x-pdgate-route"].to_str().unwrap().contains("attempts=2"));
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "prefill_error");
    assert_eq!(p.log().count(), 2);
    // The decode legs were cancelled (connections dropped), not left waiting for KV.
    for _ in 0..100 {
        if d.log().active() == 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(d.log().active(), 0, "decode leg left waiting");
}

#[tokio::test]
async fn a_hung_prefill_ends_at_the_deadline_and_leaves_no_leg_waiting() {
    let rdv = Arc::new(Rendezvous::default());
    let p = spawn("prefill", rdv.clone(), Fault::Hang).await;
    let d = spawn("decode", rdv, Fault::None).await;
    let (_gw, url) = gateway(json!({"pd_disaggregation": true, "prefill": [p.url], "decode": [d.url], "request_timeout_secs": 1})).await;
    wait_ready(&url).await;
    let r = client().post(format!("{url}/v1/completions")).json(&json!({"prompt": "x"})).send().await.unwrap();
    // The decode gives up on KV after 3 s; the gateway's 1 s deadline comes first.
    assert_eq!(r.status(), 504);
    let v: Value = r.json().await.unwrap();
    assert!(v["error"]["code"].as_str().unwrap().ends_with("_timeout"), "{v}");
    for _ in 0..100 {
        if p.log().active() == 0 && d.log().active() == 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!((p.log().active(), d.log().active()), (0, 0), "a leg was left waiting");
}

#[tokio::test]
async fn decode_dying_mid_stream_ends_the_stream_with_an_error_event() {
    let rdv = Arc::new(Rendezvous::default());
    let p = spawn("prefill", rdv.clone(), Fault::None).await;
    let d = spawn("decode", rdv, Fault::DieMidStream).await;
    let (_gw, url) = gateway(json!({"pd_disaggregation": true, "prefill": [p.url], "decode": [d.url]})).await;
    wait_ready(&url).await;
    let r = client().post(format!("{url}/v1/completions")).json(&json!({"prompt": "x", "stream": true})).send().await.unwrap();
    assert_eq!(r.status(), 200, "bytes were already on their way");
    let text = r.text().await.unwrap();
    assert!(text.contains("tok0"), "{text}");
    let last = text.trim_end().rsplit("\n\n").next().unwrap();
    let err: Value = serde_json::from_str(last.strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(err["error"]["code"], "decode_unavailable", "{text}");
    assert_eq!(d.log().count(), 1, "no retry after bytes reached the client");
}
