//! Regular mode through real sockets: pass-through, streaming, decision record, models, metrics.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

mod common;

use std::sync::atomic::Ordering;

use common::mocks::{spawn, Fault, Rendezvous, HELD_BODIES_ENDED};
use common::{client, gateway, wait_ready};
use serde_json::{json, Value};

#[tokio::test]
async fn completions_pass_through_with_a_decision_record() {
    let w = spawn("regular", Default::default(), Fault::None).await;
    let (_gw, url) = gateway(json!({"worker_urls": [w.url]})).await;
    wait_ready(&url).await;
    let r = client().post(format!("{url}/v1/completions")).json(&json!({"model": "m", "prompt": "hi", "max_tokens": 3})).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let route = r.headers()["x-pdgate-route"].to_str().unwrap().to_string();
    assert!(route.contains(&format!("worker={}", w.url)) && route.contains("attempts=1"), "{route}");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["choices"][0]["text"], " decoded");
    assert_eq!(w.log().bodies()[0]["prompt"], "hi", "body forwarded unchanged");
}

#[tokio::test]
async fn streams_are_relayed_chunk_by_chunk_with_done() {
    let w = spawn("regular", Default::default(), Fault::None).await;
    let (_gw, url) = gateway(json!({"worker_urls": [w.url]})).await;
    wait_ready(&url).await;
    let r = client().post(format!("{url}/v1/chat/completions")).json(&json!({"messages": [{"role": "user", "content": "hi"}], "stream": true})).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    let text = r.text().await.unwrap();
    assert!(text.contains("tok0") && text.contains("tok2"), "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
}

#[tokio::test]
async fn a_stream_ends_for_the_client_at_its_done_event_not_at_the_workers_end_of_the_body() {
    // The worker keeps its body open 5 s after `[DONE]`: the client's response ends at `[DONE]`,
    // with the worker's body still open (its end is read off the client's path).
    let w = spawn("regular", Default::default(), Fault::HoldAfterDone(5000)).await;
    let (_gw, url) = gateway(json!({"worker_urls": [w.url]})).await;
    wait_ready(&url).await;
    let r = client().post(format!("{url}/v1/completions")).json(&json!({"prompt": "hi", "stream": true})).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    assert!(text.contains("tok2") && text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert!(!text.contains("error"), "{text}");
    assert_eq!(HELD_BODIES_ENDED.load(Ordering::SeqCst), 0, "the client's response ended before the worker's body did");
    let metrics = client().get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(!metrics.lines().any(|l| l.starts_with("pdgate_worker_streams_truncated_total") && !l.ends_with(" 0")), "a stream complete at [DONE] is not a truncation");
}

#[tokio::test]
async fn a_plain_http_worker_gets_the_worker_key_never_the_clients() {
    // Plain http:// workers are reached over the own HTTP/1.1 client (h1_client), https:// ones
    // over hyper's (tests/worker_tls.rs): both carry the same headers.
    let w = spawn("regular", Default::default(), Fault::None).await;
    let (_gw, url) = gateway(json!({"worker_urls": [w.url], "api_key": "client-key", "worker_api_key": "worker-key"})).await;
    wait_ready(&url).await;
    for stream in [false, true] {
        let r = client().post(format!("{url}/v1/completions")).bearer_auth("client-key").json(&json!({"prompt": "hi", "stream": stream})).send().await.unwrap();
        assert_eq!(r.status(), 200);
        r.text().await.unwrap();
    }
    let log = w.log();
    assert_eq!(log.authorizations.lock().unwrap().as_slice(), ["Bearer worker-key", "Bearer worker-key"]);
    assert_eq!(log.accept_encodings.lock().unwrap().as_slice(), ["identity", "identity"]);
    assert_eq!(log.request_ids.lock().unwrap().len(), 2, "each leg carries the gateway's request id");
}

#[tokio::test]
async fn a_failing_worker_is_retried_on_another() {
    let bad = spawn("regular", Default::default(), Fault::Status(503)).await;
    let good = spawn("regular", Default::default(), Fault::None).await;
    let (_gw, url) = gateway(json!({"worker_urls": [bad.url, good.url], "policy": "round_robin"})).await;
    wait_ready(&url).await;
    for _ in 0..4 {
        let r = client().post(format!("{url}/v1/completions")).json(&json!({"prompt": "x"})).send().await.unwrap();
        assert_eq!(r.status(), 200);
    }
    assert_eq!(good.log().count(), 4);
    assert!(bad.log().count() >= 1);
}

#[tokio::test]
async fn a_worker_client_error_is_passed_through_and_not_retried() {
    let w = spawn("regular", Default::default(), Fault::Status(422)).await;
    let (_gw, url) = gateway(json!({"worker_urls": [w.url]})).await;
    wait_ready(&url).await;
    let r = client().post(format!("{url}/v1/completions")).json(&json!({"prompt": "x"})).send().await.unwrap();
    assert_eq!(r.status(), 422);
    assert_eq!(w.log().count(), 1);
}

#[tokio::test]
async fn models_and_metrics() {
    let w = spawn("regular", Default::default(), Fault::None).await;
    let (_gw, url) = gateway(json!({"worker_urls": [w.url]})).await;
    wait_ready(&url).await;
    client().post(format!("{url}/v1/completions")).json(&json!({"prompt": "x"})).send().await.unwrap();
    let mut models = json!(null);
    for _ in 0..50 {
        models = client().get(format!("{url}/v1/models")).send().await.unwrap().json().await.unwrap();
        if !models["data"].as_array().unwrap().is_empty() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(models["data"][0]["id"], "mock-model");
    let m = client().get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(m.contains(r#"pdgate_requests_total{route="/v1/completions",status="200"} 1"#), "{m}");
    assert!(m.contains("pdgate_request_duration_seconds_bucket"));
    assert!(m.contains("pdgate_worker_healthy"));
}

#[tokio::test]
async fn readiness_needs_a_healthy_prefill_and_decode() {
    let rdv = std::sync::Arc::new(Rendezvous::default());
    let p = spawn("prefill", rdv.clone(), Fault::None).await;
    let d = spawn("decode", rdv, Fault::None).await;
    // Decode unreachable: not ready, and says why.
    let (_gw, url) = gateway(json!({"pd_disaggregation": true, "prefill": [[p.url, 8998]], "decode": ["http://127.0.0.1:9"]})).await;
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let r = client().get(format!("{url}/readiness")).send().await.unwrap();
    assert_eq!(r.status(), 503);
    let v: Value = r.json().await.unwrap();
    assert_eq!((v["healthy_prefill"].as_u64(), v["healthy_decode"].as_u64()), (Some(1), Some(0)), "{v}");
    assert_eq!(client().get(format!("{url}/liveness")).send().await.unwrap().status(), 200);
    // Both alive: ready.
    let (_gw2, url2) = gateway(json!({"pd_disaggregation": true, "prefill": [p.url], "decode": [d.url]})).await;
    wait_ready(&url2).await;
}
