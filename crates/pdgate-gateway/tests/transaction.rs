//! The transaction (issue 12): every leg's outcome reaches its worker's breaker when the leg
//! really ends, a leg the gateway gives up is aborted at its engine (SGLang
//! `POST /abort_request {"rid"}`), both legs carry one request id, and a timeout names the leg
//! that hung. Recording mocks on loopback (below) and the protocol mocks of `common`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use common::mocks::{spawn, Fault, Rendezvous};
use common::{client, gateway, wait_ready};
use futures_util::StreamExt;
use serde_json::{json, Value};
use tokio::sync::Notify;

/// What a recording mock does with a generation request.
#[derive(Clone, Copy)]
enum Gen {
    /// Never answers.
    Hang,
    /// Answers 500 at once.
    Status500,
    /// Answers 500 after this many milliseconds.
    Status500After(u64),
    /// A whole JSON answer (a prefill's or a non-stream decode's), with NIXL params.
    Json,
    /// An SSE head and one event, then nothing (a decode whose client will leave).
    OneEventThenHang,
    /// An SSE head and no event ever (a decode waiting for KV that never comes).
    HeadThenHang,
    /// Ten events this many milliseconds apart, then `[DONE]`.
    SlowStream(u64),
}

struct Rec {
    gen: Gen,
    request_ids: Mutex<Vec<String>>,
    aborts: Mutex<Vec<String>>,
    aborted: Notify,
}

struct RecMock {
    url: String,
    rec: Arc<Rec>,
}

impl RecMock {
    fn ids(&self) -> Vec<String> {
        self.rec.request_ids.lock().unwrap().clone()
    }
    fn aborts(&self) -> Vec<String> {
        self.rec.aborts.lock().unwrap().clone()
    }
    /// Waits (bounded: a hang guard, not a timing assertion) until `n` aborts arrived.
    async fn wait_aborts(&self, n: usize) -> Vec<String> {
        let wait = async {
            loop {
                let notified = self.rec.aborted.notified();
                if self.aborts().len() >= n {
                    return self.aborts();
                }
                notified.await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), wait).await.unwrap_or_else(|_| panic!("{}: {} aborts, wanted {n}", self.url, self.aborts().len()))
    }
}

fn sse_event(i: usize) -> String {
    format!("data: {}\n\n", json!({"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": format!("t{i}"), "finish_reason": null}]}))
}

fn sse_response(body: Body) -> Response {
    Response::builder().header("content-type", "text/event-stream").body(body).unwrap()
}

async fn generate(State(rec): State<Arc<Rec>>, headers: HeaderMap, Json(_body): Json<Value>) -> Response {
    let id = headers.get("x-request-id").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    rec.request_ids.lock().unwrap().push(id.clone());
    match rec.gen {
        Gen::Hang => std::future::pending().await,
        Gen::Status500 => (StatusCode::INTERNAL_SERVER_ERROR, "injected").into_response(),
        Gen::Status500After(ms) => {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            (StatusCode::INTERNAL_SERVER_ERROR, "injected late").into_response()
        }
        Gen::Json => Json(json!({
            "id": "cmpl-1", "object": "text_completion", "text": "x", "meta_info": {},
            "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 5}},
            "kv_transfer_params": {"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [1], "remote_engine_id": "e",
                                   "remote_request_id": id, "remote_host": "127.0.0.1", "remote_port": 1}
        }))
        .into_response(),
        Gen::OneEventThenHang => {
            let s = futures_util::stream::iter([Ok::<_, std::io::Error>(sse_event(0))]).chain(futures_util::stream::pending());
            sse_response(Body::from_stream(s))
        }
        Gen::HeadThenHang => sse_response(Body::from_stream(futures_util::stream::pending::<Result<String, std::io::Error>>())),
        Gen::SlowStream(ms) => {
            let events = (0..10).map(sse_event).chain(["data: [DONE]\n\n".to_string()]);
            let s = futures_util::stream::iter(events).then(move |e| async move {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                Ok::<_, std::io::Error>(e)
            });
            sse_response(Body::from_stream(s))
        }
    }
}

async fn abort_request(State(rec): State<Arc<Rec>>, Json(body): Json<Value>) -> Json<Value> {
    rec.aborts.lock().unwrap().push(body["rid"].as_str().unwrap_or("(no rid)").to_string());
    rec.aborted.notify_waiters();
    Json(json!({"aborted": true}))
}

async fn rec_mock(gen: Gen) -> RecMock {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let rec = Arc::new(Rec { gen, request_ids: Mutex::default(), aborts: Mutex::default(), aborted: Notify::new() });
    let app = Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/v1/completions", post(generate))
        .route("/v1/chat/completions", post(generate))
        .route("/generate", post(generate))
        .route("/abort_request", post(abort_request))
        .with_state(rec.clone());
    tokio::spawn(async move {
        axum::serve(listener, app).await.ok();
    });
    RecMock { url, rec }
}

async fn pd_gateway(connector: &str, p: &RecMock, d: &RecMock, extra: Value) -> (pdgate_gateway::RunningGateway, String) {
    let mut cfg = json!({"pd_disaggregation": true, "kv_connector": connector, "prefill": [p.url], "decode": [d.url], "retry_max_retries": 0});
    cfg.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    let (gw, url) = gateway(cfg).await;
    wait_ready(&url).await;
    (gw, url)
}

async fn metrics(url: &str) -> String {
    client().get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap()
}

fn sample(text: &str, prefix: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(prefix).and_then(|v| v.trim().parse().ok()))
}

#[tokio::test]
async fn bootstrap_decode_failure_aborts_the_waiting_prefill_by_its_rid() {
    let (p, d) = (rec_mock(Gen::Hang).await, rec_mock(Gen::Status500).await);
    let (_gw, url) = pd_gateway("bootstrap", &p, &d, json!({})).await;
    let r = client().post(format!("{url}/generate")).json(&json!({"text": "hi"})).send().await.unwrap();
    assert_eq!(r.status(), 502, "{}", r.text().await.unwrap());
    let aborts = p.wait_aborts(1).await;
    assert_eq!(p.ids(), d.ids(), "both legs carry one request id");
    assert_eq!(aborts, p.ids(), "the prefill's engine is told which request to drop");
    assert!(d.aborts().is_empty(), "the decode failed by itself: nothing to abort there");
}

#[tokio::test]
async fn a_client_that_leaves_mid_stream_gets_its_decode_aborted() {
    let (p, d) = (rec_mock(Gen::Json).await, rec_mock(Gen::OneEventThenHang).await);
    let (_gw, url) = pd_gateway("bootstrap", &p, &d, json!({})).await;
    let r = client().post(format!("{url}/v1/completions")).json(&json!({"prompt": "hi", "stream": true})).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let mut body = r.bytes_stream();
    let first = body.next().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&first).contains("t0"));
    drop(body);
    assert_eq!(d.wait_aborts(1).await, d.ids());
    assert!(p.aborts().is_empty(), "the prefill had finished: nothing held there");
}

#[tokio::test]
async fn nixl_prefill_is_released_when_its_decode_fails_before_pulling() {
    let (p, ok_d) = (rec_mock(Gen::Json).await, rec_mock(Gen::Json).await);
    let (_gw, url) = pd_gateway("nixl", &p, &ok_d, json!({})).await;
    let r = client().post(format!("{url}/v1/completions")).json(&json!({"prompt": "hi"})).send().await.unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let bad_d = rec_mock(Gen::Status500).await;
    let (_gw2, url2) = pd_gateway("nixl", &p, &bad_d, json!({})).await;
    let r = client().post(format!("{url2}/v1/completions")).json(&json!({"prompt": "hi"})).send().await.unwrap();
    assert_eq!(r.status(), 502);
    let aborts = p.wait_aborts(1).await;
    assert_eq!(aborts, vec![p.ids()[1].clone()], "only the hold whose decode failed is released");
    assert_eq!(bad_d.ids(), vec![p.ids()[1].clone()], "both legs carry one request id");
}

#[tokio::test]
async fn a_prefill_failing_after_the_decode_started_is_counted_against_it() {
    let (p, d) = (rec_mock(Gen::Status500After(150)).await, rec_mock(Gen::SlowStream(40)).await);
    let (_gw, url) = pd_gateway("bootstrap", &p, &d, json!({"breaker_failure_threshold": 1})).await;
    let r = client().post(format!("{url}/v1/completions")).json(&json!({"prompt": "hi", "stream": true})).send().await.unwrap();
    let text = r.text().await.unwrap();
    assert!(text.ends_with("data: [DONE]\n\n") && !text.contains("error"), "the decode had its KV: {text}");
    let m = metrics(&url).await;
    assert_eq!(sample(&m, "pdgate_worker_errors_total{code=\"prefill_error\",leg=\"prefill\"}"), Some(1.0), "{m}");
    assert_eq!(sample(&m, &format!("pdgate_worker_breaker_state{{worker=\"{}\"}}", p.url)), Some(1.0), "{m}");
    assert_ne!(sample(&m, &format!("pdgate_worker_breaker_state{{worker=\"{}\"}}", d.url)), Some(1.0), "the decode did its part: {m}");
}

#[tokio::test]
async fn a_decode_that_always_dies_after_its_first_token_opens_its_breaker() {
    let rdv = Arc::new(Rendezvous::default());
    let p = spawn("prefill", rdv.clone(), Fault::None).await;
    let d = spawn("decode", rdv, Fault::None).await;
    let (_gw, url) = gateway(json!({"pd_disaggregation": true, "prefill": [p.url], "decode": [d.url], "breaker_failure_threshold": 2, "retry_max_retries": 0})).await;
    wait_ready(&url).await;
    d.set_fault(Fault::DieMidStream);
    for _ in 0..2 {
        let text = client().post(format!("{url}/v1/completions")).json(&json!({"prompt": "hi", "stream": true})).send().await.unwrap().text().await.unwrap();
        assert!(text.contains("tok0") && text.contains("\"code\":\"decode_unavailable\""), "{text}");
    }
    let m = metrics(&url).await;
    assert_eq!(sample(&m, &format!("pdgate_worker_breaker_state{{worker=\"{}\"}}", d.url)), Some(1.0), "{m}");
    assert_ne!(sample(&m, &format!("pdgate_worker_breaker_state{{worker=\"{}\"}}", p.url)), Some(1.0), "the prefill did its part: {m}");
}

#[tokio::test(start_paused = true)]
async fn a_bootstrap_prefill_that_hangs_is_named_not_the_waiting_decode() {
    let (p, d) = (rec_mock(Gen::Hang).await, rec_mock(Gen::HeadThenHang).await);
    let (_gw, url) = pd_gateway("bootstrap", &p, &d, json!({"request_timeout_secs": 1})).await;
    let r = client().post(format!("{url}/v1/completions")).json(&json!({"prompt": "hi", "stream": true})).send().await.unwrap();
    assert_eq!(r.status(), 504);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "prefill_timeout", "{v}");
}
