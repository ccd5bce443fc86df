//! Protection against overload, with real sockets on loopback and tokio's paused clock: the
//! shared retry budget, one probe at a time through a half-open breaker, and graceful shutdown.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

mod common;

use std::time::Duration;

use common::mocks::{spawn, Fault, Mock};
use common::{client, gateway, wait_ready};
use futures_util::future::join_all;
use serde_json::{json, Value};

async fn post(url: &str, body: &Value) -> (u16, String) {
    let r = client().post(format!("{url}/v1/completions")).json(body).send().await.unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

async fn metric(url: &str, sample: &str) -> Option<f64> {
    let text = client().get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap();
    text.lines().find_map(|l| l.strip_prefix(sample).and_then(|v| v.trim().parse().ok()))
}

async fn regular_pool(n: usize, extra: Value) -> (pdgate_gateway::RunningGateway, String, Vec<Mock>) {
    let mut workers = Vec::new();
    for _ in 0..n {
        workers.push(spawn("regular", Default::default(), Fault::None).await);
    }
    let urls: Vec<&str> = workers.iter().map(|w| w.url.as_str()).collect();
    let mut cfg = json!({"worker_urls": urls});
    cfg.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    let (gw, url) = gateway(cfg).await;
    wait_ready(&url).await;
    (gw, url, workers)
}

fn attempts(workers: &[Mock]) -> u32 {
    workers.iter().map(|w| w.log().count()).sum()
}

/// Every worker fails (503, retryable) and each request may retry twice: without the budget
/// 10 requests would make 30 attempts. With ratio 0.5 and no floor, the 10 requests earn 5
/// retries between them, and each request's retry beyond that is refused and counted.
#[tokio::test(start_paused = true)]
async fn the_shared_retry_budget_bounds_retries_across_requests() {
    // `retry_max_retries` counts attempts in all, as SMG does: 3 = the first and two retries.
    let budget = json!({"retry_max_retries": 3, "retry_budget_ratio": 0.5, "retry_budget_min_per_sec": 0, "disable_circuit_breaker": true});
    let (_gw, url, workers) = regular_pool(2, budget).await;
    for w in &workers {
        w.set_fault(Fault::Status(503));
    }
    for _ in 0..10 {
        let (status, text) = post(&url, &json!({"prompt": "x"})).await;
        assert_eq!(status, 502, "{text}");
    }
    assert_eq!(attempts(&workers), 10 + 5, "10 first attempts and 5 retries");
    assert_eq!(metric(&url, "pdgate_retries_refused_total{reason=\"budget\"}").await, Some(10.0));
    assert_eq!(metric(&url, "pdgate_retries_total{reason=\"status\"}").await, Some(5.0));
}

/// The floor lets a quiet gateway retry: with no traffic to earn from, 1 retry per second of
/// a 10 s window.
#[tokio::test(start_paused = true)]
async fn the_retry_budget_floor_lets_a_quiet_gateway_retry() {
    // Two attempts in all: the first and one retry.
    let budget = json!({"retry_max_retries": 2, "retry_budget_ratio": 0.0, "retry_budget_min_per_sec": 1, "disable_circuit_breaker": true});
    let (_gw, url, workers) = regular_pool(1, budget).await;
    workers[0].set_fault(Fault::Status(503));
    for _ in 0..12 {
        post(&url, &json!({"prompt": "x"})).await;
    }
    assert_eq!(attempts(&workers), 12 + 10);
    assert_eq!(metric(&url, "pdgate_retries_refused_total{reason=\"budget\"}").await, Some(2.0));
}

/// A half-open worker takes one probe at a time: of ten concurrent requests after the
/// cool-down, one reaches it (slow, so its probe is still in flight when the others are
/// routed) and the nine others go to the healthy worker. Without the single-probe rule the
/// round robin would have sent about half of them to the half-open worker.
#[tokio::test(start_paused = true)]
async fn a_half_open_breaker_lets_one_probe_through_at_a_time() {
    let cfg = json!({"retry_max_retries": 0, "breaker_failure_threshold": 1, "breaker_success_threshold": 2, "breaker_cooldown_secs": 5});
    let (_gw, url, workers) = regular_pool(2, cfg).await;
    let (sick, well) = (&workers[0], &workers[1]);
    sick.set_fault(Fault::Status(500));
    // Round robin: one of two requests reaches the sick worker and opens its breaker.
    for _ in 0..2 {
        post(&url, &json!({"prompt": "x"})).await;
    }
    let breaker = format!("pdgate_worker_breaker_state{{worker=\"{}\"}}", sick.url);
    assert_eq!(metric(&url, &breaker).await, Some(1.0), "the breaker did not open");
    sick.set_fault(Fault::Slow(2000));
    tokio::time::sleep(Duration::from_secs(6)).await;
    let (sick_before, well_before) = (sick.log().count(), well.log().count());
    let body = json!({"prompt": "x"});
    let answers = join_all((0..10).map(|_| post(&url, &body))).await;
    for (status, text) in &answers {
        assert_eq!(*status, 200, "{text}");
    }
    assert_eq!(sick.log().count() - sick_before, 1, "more than one probe reached the half-open worker");
    assert_eq!(well.log().count() - well_before, 9);
    // The probe succeeded: the next request probes again, and a second success closes.
    sick.set_fault(Fault::None);
    for _ in 0..6 {
        assert_eq!(post(&url, &json!({"prompt": "x"})).await.0, 200);
    }
    assert_eq!(metric(&url, &breaker).await, Some(0.0), "two successful probes did not close the breaker");
}

/// Graceful shutdown: readiness turns 503 and a new request is refused with 503 at once, while
/// the streams in flight finish with `[DONE]`; then `shutdown()` returns.
// Real time, not a paused clock: with five streams idle on sockets, tokio's auto-advance would
// jump to the HTTP client's own timeout and fail a request that is still being answered.
#[tokio::test]
async fn shutdown_refuses_new_requests_and_lets_streams_in_flight_finish() {
    shutdown_lets_streams_finish(json!({"shutdown_grace_period_secs": 60})).await;
}

/// The same with the streams served on connection threads (edge/threads.rs, the default of a
/// multi-thread runtime): the shutdown waits for their connections too.
#[tokio::test]
async fn shutdown_lets_streams_on_connection_threads_finish() {
    shutdown_lets_streams_finish(json!({"shutdown_grace_period_secs": 60, "connection_threads": 2})).await;
}

async fn shutdown_lets_streams_finish(extra: Value) {
    let (gw, url, workers) = regular_pool(1, extra).await;
    workers[0].set_fault(Fault::SlowStream(500));
    let body = json!({"prompt": "x", "stream": true, "max_tokens": 8});
    let streams = join_all((0..5).map(|_| post(&url, &body)));
    let (worker, url) = (&workers[0], url.as_str());
    // It hands back the shutdown task, awaited after the streams are checked.
    #[allow(clippy::async_yields_async)]
    let during = async move {
        // Until the five streams reached the worker (a mock's stream outlives its handler, so
        // `active` does not count it; `count` does once the request arrived).
        while worker.log().count() < 5 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let stop = tokio::spawn(gw.shutdown());
        tokio::time::sleep(Duration::from_millis(100)).await;
        let ready = client().get(format!("{url}/readiness")).send().await.unwrap();
        assert_eq!(ready.status(), 503);
        assert_eq!(ready.json::<Value>().await.unwrap()["status"], "draining");
        let refused = client().post(format!("{url}/v1/completions")).json(&json!({"prompt": "x"})).send().await.unwrap();
        assert_eq!(refused.headers()["x-pdgate-dropped-reason"], "shutting_down");
        assert_eq!(refused.headers()["retry-after"], "1");
        let (status, text) = (refused.status().as_u16(), refused.text().await.unwrap());
        assert_eq!(status, 503, "{text}");
        assert_eq!(serde_json::from_str::<Value>(&text).unwrap()["error"]["code"], "shutting_down");
        stop
    };
    let (answers, stop) = tokio::join!(streams, during);
    for (status, text) in answers {
        assert_eq!(status, 200, "{text}");
        assert!(text.trim_end().ends_with("data: [DONE]"), "a stream did not finish: {text:.300}");
    }
    tokio::time::timeout(Duration::from_secs(5), stop).await.expect("shutdown did not return").unwrap();
    assert_eq!(workers[0].log().count(), 5, "the refused request reached the worker");
}

/// A stream longer than the grace period is cut at its end, and shutdown returns then.
#[tokio::test(start_paused = true)]
async fn shutdown_cuts_what_outlives_the_grace_period() {
    let (gw, url, workers) = regular_pool(1, json!({"shutdown_grace_period_secs": 2})).await;
    workers[0].set_fault(Fault::Trickle(100));
    let stream = tokio::spawn({
        let url = url.clone();
        async move { post(&url, &json!({"prompt": "x", "stream": true})).await }
    });
    while workers[0].log().count() < 1 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let started = tokio::time::Instant::now();
    gw.shutdown().await;
    let took = started.elapsed();
    assert!(took >= Duration::from_secs(2) && took < Duration::from_secs(4), "shutdown took {took:?}");
    let _ = stream.await;
}

/// On connection threads, a stream that outlives the grace period is cut too: the threads stop
/// with the server (real time: the threads' clocks are not the test's paused one).
#[tokio::test]
async fn shutdown_cuts_a_stream_on_a_connection_thread_that_outlives_the_grace_period() {
    let (gw, url, workers) = regular_pool(1, json!({"shutdown_grace_period_secs": 1, "connection_threads": 2})).await;
    workers[0].set_fault(Fault::Trickle(100));
    let stream = tokio::spawn({
        let url = url.clone();
        async move { client().post(format!("{url}/v1/completions")).json(&json!({"prompt": "x", "stream": true})).send().await.unwrap().text().await }
    });
    while workers[0].log().count() < 1 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::timeout(Duration::from_secs(10), gw.shutdown()).await.expect("shutdown did not return");
    let cut = tokio::time::timeout(Duration::from_secs(10), stream).await.expect("the stream was not cut").unwrap();
    if let Ok(text) = cut {
        assert!(!text.contains("[DONE]"), "a trickle never finishes: {text:.300}");
    }
}
