//! Rendezvous fields and request ids belong to the gateway (issue 11). A client that sends its
//! own `bootstrap_*`, `kv_transfer_params`, `transfer_id`, engine ids or `rid` never has them
//! reach a worker, on any leg, in any mode; the recording mocks see the gateway's values only.
//! The id the legs rendezvous on is minted per attempt from the client's `X-Request-Id`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

mod common;

use std::collections::HashSet;
use std::sync::Arc;

use common::mocks::{spawn, spawn_mooncake_bootstrap, Fault, Mock, Rendezvous};
use common::{client, gateway, wait_ready};
use serde_json::{json, Map, Value};

/// Everything a hostile client might put in a body to steer a worker.
fn hostile(mut body: Value) -> Value {
    let evil = json!({
        "bootstrap_host": "203.0.113.9", "bootstrap_port": 6666, "bootstrap_room": 5, "bootstrap_pair_key": "k",
        "kv_transfer_params": {"do_remote_prefill": true, "do_remote_decode": false, "remote_host": "203.0.113.9",
                               "remote_port": 6666, "remote_engine_id": "evil", "remote_block_ids": [1],
                               "remote_request_id": "victim", "transfer_id": "xfer-mine"},
        "transfer_id": "xfer-mine", "remote_engine_id": "evil", "remote_bootstrap_addr": "http://203.0.113.9:6666",
        "data_parallel_rank": 3, "disagg_prefill_dp_rank": 1, "rid": "victim", "request_id": "victim",
    });
    body.as_object_mut().unwrap().extend(evil.as_object().unwrap().clone());
    body
}

const CLIENT_ONLY: [&str; 10] = [
    "bootstrap_pair_key",
    "transfer_id",
    "remote_engine_id",
    "remote_bootstrap_addr",
    "data_parallel_rank",
    "disagg_prefill_dp_rank",
    "rid",
    "request_id",
    "remote_host",
    "remote_port",
];

fn assert_no_client_fields(body: &Value, leg: &str) {
    let obj: &Map<String, Value> = body.as_object().unwrap();
    for k in CLIENT_ONLY {
        assert!(!obj.contains_key(k), "{leg} got the client's {k}: {body}");
    }
    let text = body.to_string();
    assert!(!text.contains("203.0.113.9") && !text.contains("evil") && !text.contains("victim") && !text.contains("xfer-mine"), "{leg}: {text}");
}

#[tokio::test]
async fn bootstrap_legs_see_the_gateways_room_and_host_only() {
    let rdv = Arc::new(Rendezvous::default());
    let (p, d) = (spawn("prefill", rdv.clone(), Fault::None).await, spawn("decode", rdv, Fault::None).await);
    let (_gw, url) = gateway(json!({"pd_disaggregation": true, "prefill": [[p.url, 8998]], "decode": [d.url]})).await;
    wait_ready(&url).await;
    let body = hostile(json!({"text": "hi", "sampling_params": {"max_new_tokens": 2, "bootstrap_room": 5, "kv_transfer_params": {}}}));
    let r = client().post(format!("{url}/generate")).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let ids = [p.log().request_ids.lock().unwrap()[0].clone(), d.log().request_ids.lock().unwrap()[0].clone()];
    assert_eq!(ids[0], ids[1], "both legs carry one request id");
    for (leg, mut b) in [("prefill", p.log().bodies()[0].clone()), ("decode", d.log().bodies()[0].clone())] {
        // SGLang matches `/abort_request` on the body's `rid`: both legs carry the gateway's id
        // (the one in X-Request-Id), never the client's.
        assert_eq!(b["rid"], ids[0].as_str(), "{leg}: {b}");
        b.as_object_mut().unwrap().remove("rid");
        let b = &b;
        assert_eq!(b["bootstrap_host"], "127.0.0.1", "{leg}");
        assert_eq!(b["bootstrap_port"], 8998, "{leg}");
        assert_ne!(b["bootstrap_room"], 5, "{leg}");
        assert!(b.get("kv_transfer_params").is_none(), "{leg}: {b}");
        assert_eq!(b["sampling_params"], json!({"max_new_tokens": 2}), "{leg}: nothing in sampling_params either");
        assert_no_client_fields(b, leg);
    }
}

#[tokio::test]
async fn nixl_legs_see_the_gateways_and_the_prefills_params_only() {
    let rdv = Arc::new(Rendezvous::default());
    let (p, d) = (spawn("nixl_prefill", rdv.clone(), Fault::None).await, spawn("nixl_decode", rdv, Fault::None).await);
    let (_gw, url) = gateway(json!({"pd_disaggregation": true, "kv_connector": "nixl", "prefill": [p.url], "decode": [d.url]})).await;
    wait_ready(&url).await;
    let r = client().post(format!("{url}/v1/completions")).json(&hostile(json!({"prompt": "x", "max_tokens": 4}))).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let (pb, db) = (&p.log().bodies()[0], &d.log().bodies()[0]);
    assert_eq!(pb["kv_transfer_params"]["do_remote_decode"], true);
    assert_eq!(pb["kv_transfer_params"]["remote_host"], Value::Null, "the gateway's request for remote decode");
    assert_eq!(db["kv_transfer_params"]["remote_host"], "127.0.0.1", "the prefill's params, not the client's");
    assert_eq!(db["kv_transfer_params"]["remote_engine_id"], "engine-p");
    for (leg, b) in [("prefill", pb), ("decode", db)] {
        assert!(b.get("bootstrap_host").is_none() && b.get("bootstrap_room").is_none(), "{leg}: {b}");
        assert_no_client_fields(b, leg);
    }
}

#[tokio::test]
async fn nixl_without_params_from_the_prefill_the_decode_gets_none_and_it_is_counted() {
    // The prefill is a plain worker: no kv_transfer_params come back. The decode used to get the
    // client's original body, its own kv_transfer_params included: an attacker-chosen host.
    let rdv = Arc::new(Rendezvous::default());
    let (p, d) = (spawn("regular", rdv.clone(), Fault::None).await, spawn("nixl_decode", rdv, Fault::None).await);
    let (_gw, url) = gateway(json!({"pd_disaggregation": true, "kv_connector": "nixl", "prefill": [p.url], "decode": [d.url]})).await;
    wait_ready(&url).await;
    let r = client().post(format!("{url}/v1/completions")).json(&hostile(json!({"prompt": "x"}))).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let db = &d.log().bodies()[0];
    assert!(db.get("kv_transfer_params").is_none(), "decode got params nobody legitimate gave: {db}");
    assert_no_client_fields(db, "decode");
    let metrics = client().get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains(r#"pdgate_pd_silent_recompute_total{cause="no_params",protocol="nixl"} 1"#), "{metrics}");
}

#[tokio::test]
async fn mooncake_legs_see_the_gateways_transfer_id_and_engine_id() {
    let (bport, _q) = spawn_mooncake_bootstrap("engine-mc").await;
    let rdv = Arc::new(Rendezvous::default());
    let (p, d) = (spawn("mooncake_prefill", rdv.clone(), Fault::None).await, spawn("mooncake_decode", rdv, Fault::None).await);
    let (_gw, url) = gateway(json!({"pd_disaggregation": true, "kv_connector": "mooncake", "prefill": [[p.url, bport]], "decode": [d.url]})).await;
    wait_ready(&url).await;
    let r = client().post(format!("{url}/v1/chat/completions")).json(&hostile(json!({"messages": [{"role": "user", "content": "x"}]}))).send().await.unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let (pb, db) = (&p.log().bodies()[0], &d.log().bodies()[0]);
    let tid = pb["kv_transfer_params"]["transfer_id"].as_str().unwrap();
    assert!(tid.starts_with("xfer-") && tid != "xfer-mine");
    assert_eq!(db["kv_transfer_params"]["transfer_id"], tid);
    assert_eq!(db["kv_transfer_params"]["remote_engine_id"], "engine-mc");
    assert_eq!(db["kv_transfer_params"]["remote_bootstrap_addr"], format!("http://127.0.0.1:{bport}"));
    for (leg, b) in [("prefill", pb), ("decode", db)] {
        let top: HashSet<&str> = b.as_object().unwrap().keys().map(String::as_str).collect();
        assert!(!top.contains("bootstrap_host") && !top.contains("bootstrap_room"), "{leg}: {b}");
        assert_no_client_fields(b, leg);
    }
}

async fn regular() -> (Mock, (pdgate_gateway::RunningGateway, String)) {
    let w = spawn("regular", Default::default(), Fault::None).await;
    let (gw, url) = gateway(json!({"worker_urls": [w.url]})).await;
    wait_ready(&url).await;
    (w, (gw, url))
}

#[tokio::test]
async fn regular_mode_strips_them_too_and_forwards_clean_bodies_unchanged() {
    let (w, (_gw, url)) = regular().await;
    let r = client().post(format!("{url}/v1/completions")).json(&hostile(json!({"prompt": "x", "max_tokens": 3}))).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let b = &w.log().bodies()[0];
    assert_eq!(*b, json!({"prompt": "x", "max_tokens": 3}), "every gateway-owned field removed");
    let clean = r#"{"prompt":"y",  "max_tokens":2, "user":"u"}"#;
    let r = client().post(format!("{url}/v1/completions")).header("content-type", "application/json").body(clean).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(w.log().bodies()[1], serde_json::from_str::<Value>(clean).unwrap());
}

#[tokio::test]
async fn the_legs_id_is_minted_per_request_and_the_clients_is_echoed_only_when_safe() {
    let (w, (_gw, url)) = regular().await;
    let mut minted = Vec::new();
    for _ in 0..3 {
        let r = client().post(format!("{url}/v1/completions")).header("x-request-id", "shared-id").json(&json!({"prompt": "x"})).send().await.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["x-client-request-id"], "shared-id");
        minted.push(r.headers()["x-request-id"].to_str().unwrap().to_string());
    }
    let seen = w.log().request_ids.lock().unwrap().clone();
    assert_eq!(seen, minted, "the worker saw the ids the client was told");
    assert_eq!(seen.iter().collect::<HashSet<_>>().len(), 3, "unique per request: {seen:?}");
    assert!(seen.iter().all(|id| id.starts_with("shared-id-") && id != "shared-id"), "{seen:?}");

    for bad in ["cmpl-../../etc;room=1", &"a".repeat(129), "has space"] {
        let r = client().post(format!("{url}/v1/completions")).header("x-request-id", bad).json(&json!({"prompt": "x"})).send().await.unwrap();
        assert_eq!(r.status(), 200);
        assert!(r.headers().get("x-client-request-id").is_none(), "an unsafe id is never echoed: {bad}");
        let id = r.headers()["x-request-id"].to_str().unwrap().to_string();
        assert!(id.starts_with("pdgate-") && !id.contains(bad), "{id}");
        assert_eq!(w.log().request_ids.lock().unwrap().last(), Some(&id));
    }
}

#[tokio::test]
async fn a_retry_gets_a_fresh_id() {
    let bad = spawn("regular", Default::default(), Fault::Status(503)).await;
    let good = spawn("regular", Default::default(), Fault::None).await;
    let (_gw, url) = gateway(json!({"worker_urls": [bad.url, good.url], "policy": "round_robin"})).await;
    wait_ready(&url).await;
    for _ in 0..4 {
        let r = client().post(format!("{url}/v1/completions")).header("x-request-id", "c1").json(&json!({"prompt": "x"})).send().await.unwrap();
        assert_eq!(r.status(), 200);
    }
    let (b, g) = (bad.log().request_ids.lock().unwrap().clone(), good.log().request_ids.lock().unwrap().clone());
    assert!(!b.is_empty(), "some attempt went to the failing worker first");
    let all: HashSet<&String> = b.iter().chain(&g).collect();
    assert_eq!(all.len(), b.len() + g.len(), "every attempt had its own id: {b:?} {g:?}");
}
