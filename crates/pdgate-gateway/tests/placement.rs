//! `--pd-placement` and early rejection through the gateway, against mock workers on loopback:
//! a regular pool as the colocated target beside a bootstrap prefill/decode pair.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

mod common;

use std::sync::Arc;

use common::mocks::{spawn, Fault, Rendezvous};
use common::{client, gateway, wait_ready};
use serde_json::{json, Value};

/// A prompt of `n` tokens under `--chars-per-token 1`.
fn prompt(n: usize) -> String {
    "a".repeat(n)
}

async fn route(url: &str, prompt: &str) -> (u16, String) {
    let r = client().post(format!("{url}/v1/completions")).json(&json!({"prompt": prompt, "max_tokens": 16})).send().await.unwrap();
    let route = r.headers().get("x-pdgate-route").map(|h| h.to_str().unwrap().to_string()).unwrap_or_default();
    (r.status().as_u16(), route)
}

/// Holds one slow stream open on the regular worker, so the colocated target has a running
/// decode that a long local prefill would stall. The stream is placed colocated itself (an
/// idle target wins), and the caller keeps the response unread.
async fn hold_a_stream(url: &str) -> reqwest::Response {
    let r = client().post(format!("{url}/v1/completions")).json(&json!({"prompt": "hold", "max_tokens": 16, "stream": true})).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let route = r.headers()["x-pdgate-route"].to_str().unwrap().to_string();
    assert!(route.contains("placement=colocated; reason=local_ttft_lower"), "{route}");
    r
}

#[tokio::test]
async fn conditional_sends_short_prompts_colocated_and_long_ones_disaggregated() {
    let rdv = Arc::new(Rendezvous::default());
    let (p, d) = (spawn("prefill", rdv.clone(), Fault::None).await, spawn("decode", rdv, Fault::None).await);
    let r = spawn("regular", Default::default(), Fault::SlowStream(400)).await;
    let cfg = json!({"pd_disaggregation": true, "pd_placement": "conditional", "chars_per_token": 1.0,
                     "worker_urls": [r.url], "prefill": [[p.url, 8998]], "decode": [d.url]});
    let (_gw, url) = gateway(cfg).await;
    wait_ready(&url).await;
    let held = hold_a_stream(&url).await;
    // 100 tokens: a 23.5 ms local prefill keeps the running decode's TPOT at 46.5 ms < 50.
    let (status, short) = route(&url, &prompt(100)).await;
    assert_eq!(status, 200);
    assert!(short.starts_with("protocol=regular") && short.contains("placement=colocated; reason=local_ttft_lower"), "{short}");
    // 3,000 tokens: 125 ms of local prefill would push that decode's TPOT to 52.8 ms.
    let (status, long) = route(&url, &prompt(3000)).await;
    assert_eq!(status, 200);
    assert!(long.starts_with("protocol=bootstrap") && long.contains("placement=disaggregated; reason=local_stall_breaks_tpot"), "{long}");
    assert_eq!((p.log().count(), d.log().count()), (1, 1), "only the long prompt went to the pair");
    drop(held);
    let metrics = client().get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains(r#"pdgate_placement_total{placement="colocated",reason="local_ttft_lower"} 2"#), "{metrics}");
    assert!(metrics.contains(r#"pdgate_placement_total{placement="disaggregated",reason="local_stall_breaks_tpot"} 1"#));
    assert!(metrics.contains(r#"pdgate_placement_model{param="prefill_observations"} 1"#), "the prefill leg fed the model");
}

#[tokio::test]
async fn a_request_predicted_to_miss_its_ttft_is_refused_at_once() {
    let rdv = Arc::new(Rendezvous::default());
    let (p, d) = (spawn("prefill", rdv.clone(), Fault::None).await, spawn("decode", rdv, Fault::None).await);
    let cfg = json!({"pd_disaggregation": true, "chars_per_token": 1.0, "slo_ttft_ms": 200.0, "admission_slack": 1.0,
                     "prefill": [[p.url, 8998]], "decode": [d.url]});
    let (_gw, url) = gateway(cfg).await;
    wait_ready(&url).await;
    // 10,000 tokens: 370 ms of prefill alone, over 200 ms × 1.
    let r = client().post(format!("{url}/v1/completions")).json(&json!({"prompt": prompt(10_000), "max_tokens": 16})).send().await.unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["x-pdgate-dropped-reason"], "predicted_ttft_over_budget");
    assert_eq!(r.headers()["retry-after"], "1");
    let route = r.headers()["x-pdgate-route"].to_str().unwrap().to_string();
    assert!(route.contains("placement=rejected; reason=predicted_ttft_over_budget"), "{route}");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "overloaded");
    assert_eq!(p.log().count() + d.log().count(), 0, "no leg was sent");
    // A short one fits and is served; in disaggregated mode the header names its placement too
    // (issue 28: every PD-mode response does).
    let (status, short) = route_of(&url, 100).await;
    assert_eq!(status, 200);
    assert!(short.contains("placement=disaggregated; reason=placement_disaggregated"), "{short}");
}

/// A bootstrap pair behind a gateway whose cost model believes prefill costs 1 ms per token:
/// a 10,000-token prompt is predicted at 10 s, far past the reporting objective (1000 ms) times
/// the default --admission-slack (2).
async fn slow_prefill_fleet(extra: Value) -> (pdgate_gateway::RunningGateway, String, [common::mocks::Mock; 2]) {
    let rdv = Arc::new(Rendezvous::default());
    let (p, d) = (spawn("prefill", rdv.clone(), Fault::None).await, spawn("decode", rdv, Fault::None).await);
    let mut cfg = json!({"pd_disaggregation": true, "chars_per_token": 1.0, "placement_prefill_ms_per_token": 1.0,
                         "prefill": [[p.url, 8998]], "decode": [d.url]});
    cfg.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    let (gw, url) = gateway(cfg).await;
    wait_ready(&url).await;
    (gw, url, [p, d])
}

async fn long_prompt(url: &str, header: Option<(&str, &str)>) -> reqwest::Response {
    let mut req = client().post(format!("{url}/v1/completions")).json(&json!({"prompt": prompt(10_000), "max_tokens": 16}));
    if let Some((k, v)) = header {
        req = req.header(k, v);
    }
    req.send().await.unwrap()
}

#[tokio::test]
async fn with_no_objective_set_a_slow_fleet_serves_every_request() {
    let (_gw, url, _workers) = slow_prefill_fleet(json!({})).await;
    for _ in 0..3 {
        let r = long_prompt(&url, None).await;
        assert_eq!(r.status(), 200, "nobody set an objective, so nothing may be refused for time");
    }
    // A TPOT objective alone does not arm it either (early rejection is judged on TTFT).
    assert_eq!(long_prompt(&url, Some(("x-slo-tpot-ms", "5"))).await.status(), 200);
    let metrics = client().get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap();
    let rejected: Vec<&str> = metrics.lines().filter(|l| l.contains(r#"placement="rejected""#) && !l.ends_with(" 0")).collect();
    assert!(rejected.is_empty(), "{rejected:?}");
}

#[tokio::test]
async fn an_operators_objective_rejects_early_as_before() {
    let (_gw, url, _workers) = slow_prefill_fleet(json!({"slo_ttft_ms": 1000.0})).await;
    let r = long_prompt(&url, None).await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["x-pdgate-dropped-reason"], "predicted_ttft_over_budget");
    assert!(r.headers()["retry-after"].to_str().unwrap().parse::<u64>().unwrap() >= 10, "the predicted TTFT, in seconds");
    let v: Value = r.json().await.unwrap();
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("1000 ms") && msg.contains("--admission-slack"), "the body names the objective and the knob: {msg}");
}

#[tokio::test]
async fn a_requests_own_objective_can_refuse_that_request_only() {
    let (_gw, url, _workers) = slow_prefill_fleet(json!({})).await;
    for header in ["x-slo-ttft-ms", "x-llm-d-slo-ttft-ms"] {
        let r = long_prompt(&url, Some((header, "1000"))).await;
        assert_eq!(r.status(), 429, "{header}");
        assert_eq!(r.headers()["x-pdgate-dropped-reason"], "predicted_ttft_over_budget");
    }
    assert_eq!(long_prompt(&url, None).await.status(), 200, "the next request, with no objective, is served");
}

async fn route_of(url: &str, tokens: usize) -> (u16, String) {
    route(url, &prompt(tokens)).await
}

#[tokio::test]
async fn early_rejection_off_lets_the_long_prompt_through() {
    let rdv = Arc::new(Rendezvous::default());
    let (p, d) = (spawn("prefill", rdv.clone(), Fault::None).await, spawn("decode", rdv, Fault::None).await);
    let cfg = json!({"pd_disaggregation": true, "chars_per_token": 1.0, "slo_ttft_ms": 200.0, "admission_slack": 0.0,
                     "prefill": [[p.url, 8998]], "decode": [d.url]});
    let (_gw, url) = gateway(cfg).await;
    wait_ready(&url).await;
    let (status, route) = route_of(&url, 10_000).await;
    assert_eq!(status, 200);
    // No decision was run, and the header still names the placement (issue 28).
    assert!(route.contains("placement=disaggregated; reason=placement_disaggregated"), "{route}");
}

/// Issue 28: `--worker-urls` is accepted under `--pd-placement disaggregated` (the colocated
/// pool, unused): every request still runs on the pair, and says so.
#[tokio::test]
async fn a_colocated_pool_is_accepted_and_unused_when_disaggregated() {
    let rdv = Arc::new(Rendezvous::default());
    let (p, d) = (spawn("prefill", rdv.clone(), Fault::None).await, spawn("decode", rdv, Fault::None).await);
    let r = spawn("regular", Default::default(), Fault::None).await;
    let cfg = json!({"pd_disaggregation": true, "pd_placement": "disaggregated", "chars_per_token": 1.0,
                     "prefill": [[p.url, 8998]], "decode": [d.url], "worker_urls": [r.url, "label=pool=colocated"]});
    let (_gw, url) = gateway(cfg).await;
    wait_ready(&url).await;
    for _ in 0..3 {
        let (status, route) = route_of(&url, 100).await;
        assert_eq!(status, 200);
        assert!(route.starts_with("protocol=bootstrap") && route.contains("placement=disaggregated"), "{route}");
    }
    assert_eq!(r.log().count(), 0, "the colocated pool is not used under disaggregated");
}

#[tokio::test]
async fn a_failed_prefill_is_recomputed_colocated_when_that_is_cheaper() {
    let rdv = Arc::new(Rendezvous::default());
    let (p, d) = (spawn("prefill", rdv.clone(), Fault::Status(500)).await, spawn("decode", rdv, Fault::None).await);
    let r = spawn("regular", Default::default(), Fault::SlowStream(400)).await;
    let cfg = json!({"pd_disaggregation": true, "pd_placement": "conditional", "chars_per_token": 1.0,
                     "worker_urls": [r.url], "prefill": [[p.url, 8998]], "decode": [d.url]});
    let (_gw, url) = gateway(cfg).await;
    wait_ready(&url).await;
    let held = hold_a_stream(&url).await;
    // Placed remote (the local stall), the prefill fails; a colocated recompute (170 ms) is
    // predicted cheaper than another pair (223 ms) and fits the deadline.
    let (status, route) = route_of(&url, 3000).await;
    assert_eq!(status, 200, "{route}");
    assert!(route.contains("recovery=recompute_colocated:colocated_cheaper") && route.contains("placement=colocated"), "{route}");
    assert!(route.starts_with("protocol=regular") && route.contains("attempts=2"), "{route}");
    assert_eq!(p.log().count(), 1);
    drop(held);
}

async fn post_with_priority(url: String, priority: Option<&'static str>) -> reqwest::Response {
    let mut req = client().post(format!("{url}/v1/completions")).json(&json!({"prompt": "x", "max_tokens": 4}));
    if let Some(p) = priority {
        req = req.header("x-pdgate-priority", p);
    }
    req.send().await.unwrap()
}

/// Waits (bounded) until the gateway's metrics have this line.
async fn wait_for_metric(url: &str, line: &str) {
    for _ in 0..200 {
        let text = client().get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap();
        if text.lines().any(|l| l == line) {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("the metrics never showed {line:?}");
}

#[tokio::test]
async fn a_full_admission_queue_sheds_its_lowest_priority_for_a_higher_one() {
    // The running request holds its slot for 3 s: longer than the steps below, which do not
    // depend on it otherwise (each waits on the gateway's own gauges).
    let w = spawn("regular", Default::default(), Fault::Slow(3000)).await;
    let (_gw, url) = gateway(json!({"worker_urls": [w.url], "max_concurrent_requests": 1, "queue_size": 1})).await;
    wait_ready(&url).await;
    let running = tokio::spawn(post_with_priority(url.clone(), None));
    wait_for_metric(&url, "pdgate_admission_running 1").await;
    let low = tokio::spawn(post_with_priority(url.clone(), Some("-1")));
    wait_for_metric(&url, "pdgate_admission_waiting 1").await;
    // The line (one place) is full; equal or lower priority is refused, higher sheds the waiter.
    // Each refusal names its cause and says when to come back.
    let full = post_with_priority(url.clone(), Some("-1")).await;
    assert_eq!(full.status(), 429);
    assert_eq!((&full.headers()["x-pdgate-dropped-reason"], &full.headers()["retry-after"]), (&"queue_full".parse().unwrap(), &"1".parse().unwrap()));
    let high = tokio::spawn(post_with_priority(url.clone(), Some("7")));
    let low = low.await.unwrap();
    assert_eq!(low.status(), 429);
    assert_eq!(low.headers()["x-pdgate-dropped-reason"], "shed");
    assert!(low.headers().contains_key("retry-after"));
    let v: Value = low.json().await.unwrap();
    assert!(v["error"]["message"].as_str().unwrap().contains("x-pdgate-priority"), "{v}");
    assert_eq!(high.await.unwrap().status(), 200);
    assert_eq!(running.await.unwrap().status(), 200);
    let bad = post_with_priority(url.clone(), Some("urgent")).await;
    assert_eq!(bad.status(), 400);
    let metrics = client().get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains(r#"pdgate_admission_refused_total{reason="shed"} 1"#), "{metrics}");
}
