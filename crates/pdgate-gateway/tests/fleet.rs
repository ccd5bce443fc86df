//! Fleet management on loopback: the worker API, draining, API keys, circuit breakers, and
//! load-aware routing around a slow worker.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::mocks::{spawn, Fault, Rendezvous};
use common::{client, gateway, wait_ready};
use serde_json::{json, Value};

/// A worker's API path segment: its URL, percent-encoded (its id works too).
fn enc(worker_url: &str) -> String {
    worker_url.replace(':', "%3A").replace('/', "%2F")
}

async fn eventually(mut check: impl AsyncFnMut() -> bool, what: &str) {
    for _ in 0..200 {
        if check().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("never happened: {what}");
}

#[tokio::test]
async fn workers_added_through_the_api_make_the_gateway_ready() {
    let rdv = Arc::new(Rendezvous::default());
    let p = spawn("prefill", rdv.clone(), Fault::None).await;
    let d = spawn("decode", rdv, Fault::None).await;
    let (_gw, url) = gateway(json!({"admin_api_open": true, "pd_disaggregation": true, "prefill": [[p.url, 8998]]})).await;
    let c = client();
    assert_eq!(c.get(format!("{url}/readiness")).send().await.unwrap().status(), 503);
    let r = c.post(format!("{url}/workers")).json(&json!({"url": d.url, "worker_type": "decode", "labels": {"zone": "a"}})).send().await.unwrap();
    assert_eq!(r.status(), 201);
    let w: Value = r.json().await.unwrap();
    assert_eq!((w["worker_type"].as_str(), w["source"].as_str()), (Some("decode"), Some("api")));
    assert_eq!(w["pd_pairing"]["transport"], "bootstrap");
    wait_ready(&url).await;
    let r = c.post(format!("{url}/v1/completions")).json(&json!({"prompt": "x"})).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let list: Value = c.get(format!("{url}/workers")).send().await.unwrap().json().await.unwrap();
    assert_eq!(list["total"], 2);
    // Duplicates, wrong types and bad fields are refused with a reason.
    let dup = c.post(format!("{url}/workers")).json(&json!({"url": d.url, "worker_type": "decode"})).send().await.unwrap();
    assert_eq!(dup.status(), 409);
    for bad in [
        json!({"url": "http://x:1", "worker_type": "regular"}),
        json!({"url": "nope", "worker_type": "decode"}),
        json!({"url": "http://x:1"}),
        json!({"url": "http://x:1", "worker_type": "decode", "bootstrap_port": 1}),
        json!({"url": "http://x:1", "worker_type": "decode", "colour": 1}),
    ] {
        let r = c.post(format!("{url}/workers")).json(&bad).send().await.unwrap();
        assert_eq!(r.status(), 400, "{bad}");
        let v: Value = r.json().await.unwrap();
        assert!(v["error"]["message"].is_string());
    }
    assert_eq!(c.get(format!("{url}/workers/nope")).send().await.unwrap().status(), 404);
}

#[tokio::test]
async fn a_drained_worker_finishes_its_stream_and_gets_nothing_new() {
    let slow = spawn("regular", Default::default(), Fault::SlowStream(150)).await;
    let other = spawn("regular", Default::default(), Fault::None).await;
    let (_gw, url) = gateway(json!({"admin_api_open": true, "worker_urls": [slow.url, other.url], "policy": "round_robin"})).await;
    wait_ready(&url).await;
    let c = client();
    // Round robin starts at the first worker: this stream runs on the slow one.
    let stream = c.post(format!("{url}/v1/completions")).json(&json!({"prompt": "x", "stream": true})).send().await.unwrap();
    assert!(stream.headers()["x-pdgate-route"].to_str().unwrap().contains(&slow.url));
    let id = c.get(format!("{url}/workers/{}", enc(&slow.url))).send().await.unwrap().json::<Value>().await.unwrap()["id"].as_str().unwrap().to_string();
    let r = c.delete(format!("{url}/workers/{id}")).send().await.unwrap();
    assert_eq!(r.status(), 202);
    for _ in 0..6 {
        let r = c.post(format!("{url}/v1/completions")).json(&json!({"prompt": "y"})).send().await.unwrap();
        assert_eq!(r.status(), 200);
    }
    let text = stream.text().await.unwrap();
    assert!(text.contains("tok2") && text.ends_with("data: [DONE]\n\n"), "the in-flight stream completed: {text}");
    assert_eq!(slow.log().count(), 1, "nothing new went to the draining worker");
    eventually(async || c.get(format!("{url}/workers/{id}")).send().await.unwrap().status() == 404, "drained worker removed").await;
}

#[tokio::test]
async fn disabled_workers_take_no_traffic_until_enabled() {
    let a = spawn("regular", Default::default(), Fault::None).await;
    let b = spawn("regular", Default::default(), Fault::None).await;
    let (_gw, url) = gateway(json!({"admin_api_open": true, "worker_urls": [a.url, b.url]})).await;
    wait_ready(&url).await;
    let c = client();
    let r = c.put(format!("{url}/workers/{}", enc(&a.url))).json(&json!({"enabled": false})).send().await.unwrap();
    assert_eq!(r.status(), 200);
    for _ in 0..4 {
        c.post(format!("{url}/v1/completions")).json(&json!({"prompt": "x"})).send().await.unwrap();
    }
    assert_eq!((a.log().count(), b.log().count()), (0, 4));
    c.put(format!("{url}/workers/{}", enc(&a.url))).json(&json!({"enabled": true})).send().await.unwrap();
    for _ in 0..4 {
        c.post(format!("{url}/v1/completions")).json(&json!({"prompt": "x"})).send().await.unwrap();
    }
    assert!(a.log().count() > 0);
}

#[tokio::test]
async fn api_keys_guard_client_and_admin_endpoints() {
    let w = spawn("regular", Default::default(), Fault::None).await;
    let (_gw, url) = gateway(json!({"worker_urls": [w.url], "api_key": "client-k", "admin_api_key": "admin-k"})).await;
    let c = client();
    let body = json!({"prompt": "x"});
    let none = c.post(format!("{url}/v1/completions")).json(&body).send().await.unwrap();
    assert_eq!(none.status(), 401);
    assert_eq!(none.json::<Value>().await.unwrap()["error"]["type"], "authentication_error");
    assert_eq!(c.post(format!("{url}/v1/completions")).bearer_auth("wrong").json(&body).send().await.unwrap().status(), 403);
    wait_ready(&url).await;
    assert_eq!(c.post(format!("{url}/v1/completions")).bearer_auth("client-k").json(&body).send().await.unwrap().status(), 200);
    assert_eq!(c.get(format!("{url}/workers")).send().await.unwrap().status(), 401);
    assert_eq!(c.get(format!("{url}/workers")).bearer_auth("client-k").send().await.unwrap().status(), 403);
    assert_eq!(c.get(format!("{url}/workers")).bearer_auth("admin-k").send().await.unwrap().status(), 200);
    assert_eq!(c.get(format!("{url}/health")).send().await.unwrap().status(), 200, "probes stay open");
    assert_eq!(c.get(format!("{url}/metrics")).send().await.unwrap().status(), 200);
}

#[tokio::test]
async fn a_breaker_opens_on_failures_and_recovers_after_its_cooldown() {
    let bad = spawn("regular", Default::default(), Fault::Status(500)).await;
    let good = spawn("regular", Default::default(), Fault::None).await;
    let (_gw, url) = gateway(json!({"worker_urls": [bad.url, good.url], "policy": "round_robin",
        "breaker_failure_threshold": 2, "breaker_success_threshold": 1, "breaker_cooldown_secs": 1, "retry_max_retries": 2}))
    .await;
    wait_ready(&url).await;
    let c = client();
    for _ in 0..10 {
        let r = c.post(format!("{url}/v1/completions")).json(&json!({"prompt": "x"})).send().await.unwrap();
        assert_eq!(r.status(), 200, "retried on the good worker");
    }
    assert_eq!(bad.log().count(), 2, "the breaker opened after two failures");
    // After the cool-down the bad worker is probed again (half-open); it has recovered.
    bad.set_fault(Fault::None);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    eventually(
        async || {
            c.post(format!("{url}/v1/completions")).json(&json!({"prompt": "x"})).send().await.unwrap();
            bad.log().count() > 2
        },
        "half-open probe",
    )
    .await;
}

#[tokio::test]
async fn power_of_two_never_picks_the_busier_worker() {
    let slow = spawn("regular", Default::default(), Fault::SlowStream(400)).await;
    let fast = spawn("regular", Default::default(), Fault::None).await;
    let (_gw, url) = gateway(json!({"admin_api_open": true, "worker_urls": [slow.url, fast.url], "policy": "power_of_two", "load_poll_interval_secs": 0})).await;
    wait_ready(&url).await;
    let c = client();
    // Pin two long streams on the slow worker: take the fast one out while they start.
    c.put(format!("{url}/workers/{}", enc(&fast.url))).json(&json!({"enabled": false})).send().await.unwrap();
    let mut streams = Vec::new();
    for _ in 0..2 {
        let r = c.post(format!("{url}/v1/completions")).json(&json!({"prompt": "x", "stream": true})).send().await.unwrap();
        assert!(r.headers()["x-pdgate-route"].to_str().unwrap().contains(&slow.url));
        streams.push(r);
    }
    c.put(format!("{url}/workers/{}", enc(&fast.url))).json(&json!({"enabled": true})).send().await.unwrap();
    // With two workers both are always sampled: every request goes to the idle one.
    for _ in 0..10 {
        let r = c.post(format!("{url}/v1/completions")).json(&json!({"prompt": "y"})).send().await.unwrap();
        assert_eq!(r.status(), 200);
        assert!(r.headers()["x-pdgate-route"].to_str().unwrap().contains(&fast.url));
    }
    assert_eq!((slow.log().count(), fast.log().count()), (2, 10));
    for s in streams {
        assert!(s.text().await.unwrap().ends_with("data: [DONE]\n\n"));
    }
}

#[tokio::test]
async fn cache_aware_keeps_a_prompt_on_the_worker_that_has_its_prefix() {
    let a = spawn("regular", Default::default(), Fault::None).await;
    let b = spawn("regular", Default::default(), Fault::None).await;
    let (_gw, url) = gateway(json!({"worker_urls": [a.url, b.url], "policy": "cache_aware", "load_poll_interval_secs": 0})).await;
    wait_ready(&url).await;
    let c = client();
    let long = "You are a helpful assistant. ".repeat(10);
    let mut workers = Vec::new();
    for i in 0..6 {
        let r = c.post(format!("{url}/v1/completions")).json(&json!({"prompt": format!("{long} question {i}")})).send().await.unwrap();
        let route = r.headers()["x-pdgate-route"].to_str().unwrap().to_string();
        workers.push(route.split("; ").find(|p| p.starts_with("worker=")).unwrap().to_string());
        if i > 0 {
            assert!(route.contains("cache_hit"), "{route}");
        }
    }
    assert!(workers.iter().all(|w| w == &workers[0]), "{workers:?}");
    let m = c.get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(m.contains("pdgate_policy_decisions_total{outcome=\"cache_hit\",pool=\"regular\"} 5"), "{m}");
}

#[tokio::test]
async fn strict_pairing_refuses_workers_whose_layout_is_unknown() {
    // The mocks serve no /server_info: runtime and KV layout stay unknown.
    let rdv = Arc::new(Rendezvous::default());
    let p = spawn("prefill", rdv.clone(), Fault::None).await;
    let d = spawn("decode", rdv, Fault::None).await;
    let (_gw, url) = gateway(json!({"admin_api_open": true, "pd_disaggregation": true, "prefill": [p.url], "decode": [d.url], "pd_pairing_mode": "strict"})).await;
    let c = client();
    eventually(
        async || {
            let l: Value = c.get(format!("{url}/workers")).send().await.unwrap().json().await.unwrap();
            l["workers"].as_array().unwrap().iter().all(|w| w["healthy"] == true)
        },
        "workers healthy",
    )
    .await;
    let r = c.post(format!("{url}/v1/completions")).json(&json!({"prompt": "x"})).send().await.unwrap();
    assert_eq!(r.status(), 503);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "no_compatible_pd_pair");
    assert!(v["error"]["message"].as_str().unwrap().contains("runtime"), "{v}");
    assert_eq!(c.get(format!("{url}/readiness")).send().await.unwrap().status(), 503, "readiness does not lie");
    let m = c.get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(m.contains(r#"pdgate_pairing_refusals_total{mode="strict"} 1"#), "{m}");
    let l: Value = c.get(format!("{url}/workers")).send().await.unwrap().json().await.unwrap();
    assert_eq!(l["workers"][0]["pd_pairing"]["transport"], "bootstrap");
    assert_eq!(l["workers"][0]["pd_pairing"]["runtime"], Value::Null);
}
