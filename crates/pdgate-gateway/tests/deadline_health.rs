//! Health is the worker's, not the client's: requests that outlive their deadline while the
//! worker is still answering end in 504 (or an error event) but leave its breaker closed; a
//! silent one (no answer by the deadline, nobody answered since) is judged by a health probe of
//! the worker: a worker that answers it keeps its breaker closed, one that does not (a hung
//! engine) opens it. On tokio's paused clock: the one-second deadlines, the trickling mocks and
//! the probe's timeout run in virtual time.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::mocks::{spawn, Fault, Mock, Rendezvous};
use common::{client, gateway, wait_ready};
use futures_util::future::join_all;
use pdgate_gateway::RunningGateway;
use serde_json::{json, Value};

/// More than the default breaker threshold (5), all at once as in the finding.
const N: usize = 6;

struct Setup {
    _gw: RunningGateway,
    url: String,
    worker: Mock,
    _prefill: Option<Mock>,
}

/// The fault is set once the gateway is ready (a worker failing `/health` never makes it so).
async fn regular(fault: Fault) -> Setup {
    regular_with(fault, json!({})).await
}

async fn regular_with(fault: Fault, extra: Value) -> Setup {
    let worker = spawn("regular", Default::default(), Fault::None).await;
    let mut cfg = json!({"worker_urls": [worker.url], "request_timeout_secs": 1});
    cfg.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    let (gw, url) = gateway(cfg).await;
    wait_ready(&url).await;
    worker.set_fault(fault);
    Setup { _gw: gw, url, worker, _prefill: None }
}

async fn bootstrap(fault: Fault) -> Setup {
    let rdv = Arc::new(Rendezvous::default());
    let p = spawn("prefill", rdv.clone(), Fault::None).await;
    let worker = spawn("decode", rdv, Fault::None).await;
    let (gw, url) = gateway(json!({"pd_disaggregation": true, "prefill": [p.url], "decode": [worker.url], "request_timeout_secs": 1})).await;
    wait_ready(&url).await;
    worker.set_fault(fault);
    Setup { _gw: gw, url, worker, _prefill: Some(p) }
}

async fn post(url: &str, body: &Value) -> (u16, String) {
    let r = client().post(format!("{url}/v1/completions")).json(body).send().await.unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

async fn breaker(s: &Setup) -> Option<f64> {
    let text = client().get(format!("{}/metrics", s.url)).send().await.unwrap().text().await.unwrap();
    let sample = format!("pdgate_worker_breaker_state{{worker=\"{}\"}}", s.worker.url);
    text.lines().find_map(|l| l.strip_prefix(sample.as_str()).and_then(|v| v.trim().parse().ok()))
}

/// The code of a JSON error body, or of a stream's last (error) event.
fn error_code(text: &str) -> String {
    let last = text.trim_end().rsplit("\n\n").next().unwrap();
    let v: Value = serde_json::from_str(last.strip_prefix("data: ").unwrap_or(last)).unwrap_or_else(|_| panic!("no error in {text}"));
    v["error"]["code"].as_str().unwrap_or_else(|| panic!("no error code in {text}")).to_string()
}

/// N requests all outlive the deadline; each ends with `status` and an error `code`.
async fn n_past_the_deadline(s: &Setup, stream: bool, status: u16, code: &str) {
    let body = json!({"prompt": "a long one", "max_tokens": 4000, "stream": stream});
    for (st, text) in join_all((0..N).map(|_| post(&s.url, &body))).await {
        assert_eq!(st, status, "{text:.300}");
        assert_eq!(error_code(&text), code, "{text:.300}");
    }
}

/// The worker's breaker is closed, and once it answers normally the next request succeeds.
async fn still_trusted(s: &Setup) {
    assert_ne!(breaker(s).await, Some(1.0), "the breaker opened on long requests");
    s.worker.set_fault(Fault::None);
    let (status, text) = post(&s.url, &json!({"prompt": "x"})).await;
    assert_eq!(status, 200, "{text}");
}

#[tokio::test(start_paused = true)]
async fn long_non_streamed_requests_leave_the_breaker_closed_regular() {
    let s = regular(Fault::Trickle(100)).await;
    n_past_the_deadline(&s, false, 504, "worker_timeout").await;
    still_trusted(&s).await;
}

#[tokio::test(start_paused = true)]
async fn long_streams_leave_the_breaker_closed_regular() {
    let s = regular(Fault::Trickle(100)).await;
    n_past_the_deadline(&s, true, 200, "worker_timeout").await;
    still_trusted(&s).await;
}

#[tokio::test(start_paused = true)]
async fn long_non_streamed_requests_leave_the_breaker_closed_pd() {
    let s = bootstrap(Fault::Trickle(100)).await;
    n_past_the_deadline(&s, false, 504, "decode_timeout").await;
    still_trusted(&s).await;
}

#[tokio::test(start_paused = true)]
async fn long_streams_leave_the_breaker_closed_pd() {
    let s = bootstrap(Fault::Trickle(100)).await;
    n_past_the_deadline(&s, true, 200, "decode_timeout").await;
    still_trusted(&s).await;
}

/// Past the probe's timeout (`--health-check-timeout-secs`, 3 by default): the verdict is in.
async fn probe_verdict() {
    tokio::time::sleep(Duration::from_secs(4)).await;
}

/// A worker that never answers, not even its health check, is still judged: its breaker opens
/// and clients are turned away at once (503) instead of waiting out the deadline.
async fn never_answers(s: &Setup, code: &str) {
    n_past_the_deadline(s, false, 504, code).await;
    probe_verdict().await;
    assert_eq!(breaker(s).await, Some(1.0), "a worker that never answered kept its breaker closed");
    s.worker.set_fault(Fault::None);
    let (status, text) = post(&s.url, &json!({"prompt": "x"})).await;
    assert_eq!(status, 503, "{text}");
}

#[tokio::test(start_paused = true)]
async fn a_worker_that_never_answers_opens_its_breaker_regular() {
    never_answers(&regular(Fault::HangAll).await, "worker_timeout").await;
}

#[tokio::test(start_paused = true)]
async fn a_decode_that_never_answers_opens_its_breaker_pd() {
    never_answers(&bootstrap(Fault::HangAll).await, "decode_timeout").await;
}

/// Real engines send a non-streamed answer's head only with its end, so a long one is silent
/// until then. While the worker answers other clients, such silences are not held against it.
#[tokio::test(start_paused = true)]
async fn silent_long_requests_on_a_worker_answering_others_leave_the_breaker_closed() {
    let s = regular(Fault::HangIfLong).await;
    let long = n_past_the_deadline(&s, false, 504, "worker_timeout");
    let others = async {
        for _ in 0..8 {
            let (status, text) = post(&s.url, &json!({"prompt": "short", "max_tokens": 3})).await;
            assert_eq!(status, 200, "{text}");
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    };
    tokio::join!(long, others);
    assert_ne!(breaker(&s).await, Some(1.0), "the breaker opened on long requests");
    assert_eq!(post(&s.url, &json!({"prompt": "x"})).await.0, 200);
}

/// The original finding: long non-streamed requests to an engine with no other traffic are
/// silent until their end, so nothing in the record tells them from a hung worker. The probe
/// does: the worker answers its health check, and its breaker stays closed.
#[tokio::test(start_paused = true)]
async fn silent_long_requests_on_an_otherwise_idle_healthy_worker_leave_the_breaker_closed_regular() {
    let s = regular(Fault::HangIfLong).await;
    n_past_the_deadline(&s, false, 504, "worker_timeout").await;
    probe_verdict().await;
    assert_ne!(breaker(&s).await, Some(1.0), "the breaker opened on long requests");
    assert_eq!(post(&s.url, &json!({"prompt": "x"})).await.0, 200);
}

#[tokio::test(start_paused = true)]
async fn silent_long_requests_on_an_otherwise_idle_healthy_decode_leave_the_breaker_closed_pd() {
    let s = bootstrap(Fault::HangIfLong).await;
    n_past_the_deadline(&s, false, 504, "decode_timeout").await;
    probe_verdict().await;
    assert_ne!(breaker(&s).await, Some(1.0), "the breaker opened on long requests");
    assert_eq!(post(&s.url, &json!({"prompt": "x"})).await.0, 200);
}

/// A worker hung on generation whose health check fails outright (503, not a hang) opens its
/// breaker too: a failed probe is a failure for every timeout that waited on it.
#[tokio::test(start_paused = true)]
async fn a_silent_worker_whose_health_check_fails_opens_its_breaker() {
    let s = regular(Fault::HangUnhealthy).await;
    n_past_the_deadline(&s, false, 504, "worker_timeout").await;
    probe_verdict().await;
    assert_eq!(breaker(&s).await, Some(1.0), "a silent worker failing its health check kept its breaker closed");
}

/// A burst of silent timeouts asks the worker once: one probe in flight per worker, and every
/// timeout of the burst takes its verdict (here a hang, so all N fail and the breaker opens).
#[tokio::test(start_paused = true)]
async fn a_burst_of_silent_timeouts_sends_one_probe() {
    // Active checks an hour apart: after the first, every `/health` hit is a probe.
    let s = regular_with(Fault::HangAll, json!({"health_check_interval_secs": 3600})).await;
    let before = s.worker.log().health_checks.load(std::sync::atomic::Ordering::SeqCst);
    n_past_the_deadline(&s, false, 504, "worker_timeout").await;
    probe_verdict().await;
    let probes = s.worker.log().health_checks.load(std::sync::atomic::Ordering::SeqCst) - before;
    assert_eq!(probes, 1, "{N} timeouts sent {probes} probes");
    assert_eq!(breaker(&s).await, Some(1.0), "the timeouts did not take the failed probe's verdict");
}
