//! What one client request may ask for is bounded (issue 11): each body below used to abort the
//! gateway (n = 10^12: SIGABRT collecting rooms), drop the connection (n = 2^62: a panic), grow
//! it by hundreds of MB (n = 10^6), make a response header no client accepts (n = 10,000, a
//! 20,000-item batch), or wait out the deadline (max_tokens = 2^64-1). Now each is a 400 naming
//! the field, nothing reaches a worker, and the gateway serves the next request.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::mocks::{spawn, Fault, Mock, Rendezvous, MOCK_CONTEXT};
use common::{client, gateway, wait_ready};
use serde_json::{json, Value};

async fn bootstrap_pair() -> (Mock, Mock) {
    let rdv = Arc::new(Rendezvous::default());
    (spawn("prefill", rdv.clone(), Fault::None).await, spawn("decode", rdv, Fault::None).await)
}

/// Waits until the gateway has learned the workers' models (and so their context length).
async fn wait_models(url: &str) {
    for _ in 0..100 {
        let v: Value = client().get(format!("{url}/v1/models")).send().await.unwrap().json().await.unwrap();
        if v["data"].as_array().is_some_and(|d| !d.is_empty()) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("gateway never learned the workers' models");
}

async fn assert_400(url: &str, path: &str, body: &Value, param: &str) {
    let r = client().post(format!("{url}{path}")).json(body).send().await.unwrap();
    assert_eq!(r.status(), 400, "{path} {:.100}", body.to_string());
    let route_len = r.headers().get("x-pdgate-route").map_or(0, |v| v.len());
    assert!(route_len < 200, "bounded header");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["param"], param, "{v}");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    assert!(v["error"]["message"].as_str().is_some_and(|m| m.len() < 300), "{v}");
}

async fn assert_serves(url: &str) {
    let r = client().post(format!("{url}/v1/completions")).json(&json!({"prompt": "still here", "max_tokens": 4})).send().await.unwrap();
    assert_eq!(r.status(), 200, "the gateway is alive and serving");
}

#[tokio::test]
async fn huge_n_and_batches_are_400_and_the_gateway_keeps_serving() {
    let (p, d) = bootstrap_pair().await;
    let (_gw, url) = gateway(json!({"pd_disaggregation": true, "prefill": [p.url], "decode": [d.url]})).await;
    wait_ready(&url).await;
    let text_batch: Vec<String> = (0..20_000).map(|i| format!("t{i}")).collect();
    let cases = [
        ("/v1/completions", json!({"prompt": "x", "n": 1_000_000_000_000u64}), "n"),
        ("/v1/completions", json!({"prompt": "x", "n": 1u64 << 62}), "n"),
        ("/v1/completions", json!({"prompt": "x", "n": 1_000_000}), "n"),
        ("/v1/completions", json!({"prompt": "x", "n": 10_000}), "n"),
        ("/v1/completions", json!({"prompt": "x", "best_of": 10_000}), "best_of"),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "x"}], "n": 10_000, "stream": true}), "n"),
        ("/generate", json!({"text": "x", "sampling_params": {"n": 10_000}}), "sampling_params.n"),
        ("/generate", json!({"text": text_batch}), "text"),
        ("/v1/completions", json!({"prompt": ["a", "b", "c", "d", "e", "f", "g", "h", "i"], "n": 128}), "n"),
        ("/v1/completions", json!({"prompt": "x", "stop": vec!["s"; 33]}), "stop"),
        ("/v1/completions", json!({"prompt": "x", "stop": "s".repeat(1025)}), "stop"),
        ("/v1/chat/completions", json!({"messages": [{"role": "user"}], "tools": vec![json!({}); 513]}), "tools"),
    ];
    for (path, body, param) in &cases {
        assert_400(&url, path, body, param).await;
    }
    assert_eq!((p.log().count(), d.log().count()), (0, 0), "nothing reached a worker");
    assert_serves(&url).await;
}

#[tokio::test]
async fn a_full_size_batch_gets_a_bounded_route_header() {
    let (p, d) = bootstrap_pair().await;
    let (_gw, url) = gateway(json!({"pd_disaggregation": true, "prefill": [p.url], "decode": [d.url]})).await;
    wait_ready(&url).await;
    let text: Vec<String> = (0..1024).map(|i| format!("t{i}")).collect();
    let r = client().post(format!("{url}/generate")).json(&json!({"text": text, "sampling_params": {"max_new_tokens": 2}})).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let route = r.headers()["x-pdgate-route"].to_str().unwrap().to_string();
    assert!(route.contains("rooms=1024,digest="), "{route}");
    assert!(route.len() < 300, "{} bytes: {route}", route.len());
    assert_eq!(d.log().bodies()[0]["bootstrap_room"].as_array().unwrap().len(), 1024, "the workers still get every room");
}

#[tokio::test]
async fn bounds_follow_their_flags() {
    let w = spawn("regular", Default::default(), Fault::None).await;
    let (_gw, url) = gateway(json!({"worker_urls": [w.url], "max_n": 2, "max_batch_size": 3, "max_prompt_bytes": 10, "max_logit_bias": 1})).await;
    wait_ready(&url).await;
    assert_400(&url, "/v1/completions", &json!({"prompt": "x", "n": 3}), "n").await;
    assert_400(&url, "/v1/completions", &json!({"prompt": ["a", "b"], "n": 2}), "n").await;
    assert_400(&url, "/v1/completions", &json!({"prompt": "x".repeat(11)}), "prompt").await;
    assert_400(&url, "/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "y".repeat(11)}]}), "messages").await;
    assert_400(&url, "/v1/completions", &json!({"prompt": "x", "logit_bias": {"1": 1, "2": 1}}), "logit_bias").await;
    assert_eq!(w.log().count(), 0);
    let r = client().post(format!("{url}/v1/completions")).json(&json!({"prompt": ["a", "b", "c"], "n": 1})).send().await.unwrap();
    assert_eq!(r.status(), 200, "at the limit is fine");
}

#[tokio::test]
async fn max_tokens_beyond_the_reported_context_length_is_400() {
    let (p, d) = bootstrap_pair().await;
    let (_gw, url) = gateway(json!({"pd_disaggregation": true, "prefill": [p.url], "decode": [d.url], "request_timeout_secs": 20})).await;
    wait_ready(&url).await;
    wait_models(&url).await;
    let cases = [
        ("/v1/completions", json!({"prompt": "x", "max_tokens": u64::MAX}), "max_tokens"),
        ("/v1/completions", json!({"prompt": "x", "max_tokens": 10_000_000}), "max_tokens"),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": MOCK_CONTEXT + 1}), "max_completion_tokens"),
        ("/generate", json!({"text": "x", "sampling_params": {"max_new_tokens": u64::MAX}}), "sampling_params.max_new_tokens"),
        ("/v1/completions", json!({"model": "mock-model", "prompt": "x", "max_tokens": MOCK_CONTEXT + 1}), "max_tokens"),
    ];
    for (path, body, param) in &cases {
        assert_400(&url, path, body, param).await;
    }
    assert_eq!((p.log().count(), d.log().count()), (0, 0), "refused before any leg (it used to wait out the deadline)");
    let r = client().post(format!("{url}/v1/completions")).json(&json!({"prompt": "x", "max_tokens": MOCK_CONTEXT})).send().await.unwrap();
    assert_eq!(r.status(), 200, "up to the context length is the engine's call");
}
