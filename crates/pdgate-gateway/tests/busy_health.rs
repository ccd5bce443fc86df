//! A busy engine is not a dead one (issue 32, docs/fleet.md "Busy is not down"): a worker whose
//! `/health` stalls while its completions answer keeps serving through pdgate with no request
//! refused; a role whose workers are out by unanswered checks alone is routed to anyway (panic
//! routing, counted), and readiness says so; a worker whose checks are answered with an error
//! is still taken out within the failure threshold. Mocks on loopback, real time: one-second
//! checks, threshold 2.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::mocks::{spawn, Fault, Rendezvous};
use common::{client, gateway, wait_ready};
use serde_json::{json, Value};

const HEALTH: &str = r#""health_check_interval_secs": 1, "health_check_timeout_secs": 1, "health_failure_threshold": 2"#;

fn config(extra: &str) -> Value {
    serde_json::from_str(&format!("{{{HEALTH}, {extra}}}")).unwrap()
}

async fn metrics(url: &str) -> String {
    client().get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap()
}

/// The value of the first sample line starting with `series` (name and labels).
async fn sample(url: &str, series: &str) -> Option<f64> {
    metrics(url).await.lines().find(|l| l.starts_with(series)).and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// Polls until `series` reads `value` (at most 15 s).
async fn wait_sample(url: &str, series: &str, value: f64) {
    let until = Instant::now() + Duration::from_secs(15);
    while sample(url, series).await != Some(value) {
        assert!(Instant::now() < until, "{series} never reached {value}: {:?}", sample(url, series).await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A gateway in front of one healthy regular mock, ready.
async fn one_regular_worker() -> (pdgate_gateway::RunningGateway, String, common::mocks::Mock) {
    let w = spawn("regular", Default::default(), Fault::None).await;
    let (gw, url) = gateway(config(&format!(r#""worker_urls": ["{}"]"#, w.url))).await;
    wait_ready(&url).await;
    (gw, url, w)
}

async fn complete(url: &str) -> (u16, String) {
    let r = client().post(format!("{url}/v1/completions")).json(&json!({"prompt": "x", "max_tokens": 4})).send().await.unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

async fn readiness(url: &str) -> u16 {
    client().get(format!("{url}/readiness")).send().await.unwrap().status().as_u16()
}

#[tokio::test]
async fn a_worker_serving_requests_is_not_taken_out_by_its_stalled_health_checks() {
    let (_gw, url, w) = one_regular_worker().await;
    w.set_fault(Fault::StallHealth);
    // Five seconds of traffic: five checks go unanswered, more than the threshold of two.
    let until = Instant::now() + Duration::from_secs(5);
    let mut refused = Vec::new();
    let mut served = 0;
    while Instant::now() < until {
        match complete(&url).await {
            (200, _) => served += 1,
            other => refused.push(other),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(refused.is_empty(), "{} refused of {}: {:?}", refused.len(), served + refused.len(), &refused[..refused.len().min(3)]);
    let healthy = format!(r#"pdgate_worker_healthy{{role="regular",worker="{}"}}"#, w.url);
    assert_eq!(sample(&url, &healthy).await, Some(1.0), "the passive signal kept it healthy");
    assert!(sample(&url, r#"pdgate_health_unanswered_while_serving_total{role="regular"}"#).await.unwrap() >= 2.0);
    assert_eq!(sample(&url, r#"pdgate_health_panic_total{role="regular"}"#).await, Some(0.0));
}

#[tokio::test]
async fn a_role_out_by_unanswered_checks_alone_is_routed_to_in_panic_and_stays_ready() {
    let (_gw, url, w) = one_regular_worker().await;
    // No traffic, so no passive signal: two unanswered checks take it out.
    w.set_fault(Fault::StallHealth);
    wait_sample(&url, &format!(r#"pdgate_worker_healthy{{role="regular",worker="{}"}}"#, w.url), 0.0).await;
    assert_eq!(sample(&url, r#"pdgate_health_panic{role="regular"}"#).await, Some(1.0));
    assert_eq!(sample(&url, r#"pdgate_health_panic_total{role="regular"}"#).await, Some(1.0));
    assert_eq!(readiness(&url).await, 200, "readiness follows routing: a busy fleet is not pulled");
    for _ in 0..3 {
        assert_eq!(complete(&url).await.0, 200, "panic routing serves the role's only worker");
    }
    // Its checks pass again: out of panic.
    w.set_fault(Fault::None);
    wait_sample(&url, r#"pdgate_health_panic{role="regular"}"#, 0.0).await;
    assert_eq!(sample(&url, r#"pdgate_health_panic_total{role="regular"}"#).await, Some(1.0));
}

#[tokio::test]
async fn a_busy_decode_keeps_pd_requests_served() {
    let rdv = Arc::new(Rendezvous::default());
    let (p, d) = (spawn("prefill", rdv.clone(), Fault::None).await, spawn("decode", rdv, Fault::None).await);
    let (_gw, url) = gateway(config(&format!(r#""pd_disaggregation": true, "prefill": [["{}", 8998]], "decode": ["{}"]"#, p.url, d.url))).await;
    wait_ready(&url).await;
    d.set_fault(Fault::StallHealth);
    wait_sample(&url, r#"pdgate_health_panic{role="decode"}"#, 1.0).await;
    assert_eq!(sample(&url, r#"pdgate_health_panic{role="prefill"}"#).await, Some(0.0));
    let (status, text) = complete(&url).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(readiness(&url).await, 200);
}

#[tokio::test]
async fn a_worker_whose_checks_are_answered_with_an_error_is_still_taken_out() {
    let (_gw, url, w) = one_regular_worker().await;
    // `/health` answers 503: known down, not busy. Out within the threshold, and no panic.
    w.set_fault(Fault::HangUnhealthy);
    wait_sample(&url, &format!(r#"pdgate_worker_healthy{{role="regular",worker="{}"}}"#, w.url), 0.0).await;
    assert_eq!(sample(&url, r#"pdgate_health_panic{role="regular"}"#).await, Some(0.0));
    let (status, text) = complete(&url).await;
    assert_eq!(status, 503, "{text}");
    assert!(text.contains("no_available_workers"), "{text}");
    assert_eq!(readiness(&url).await, 503);
}
