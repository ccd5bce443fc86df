//! Workers are not trusted: a broken worker's answer never reaches the client as a success.
//! Each finding is run against the regular and the PD (SGLang bootstrap) topology, with one
//! broken and one good worker (the decode pool in PD): before commit the client gets 502
//! `bad_worker_response`; after commit the stream ends with an error event naming the leg. The
//! broken worker's breaker (threshold 1) opens, and the gateway keeps serving from the good one.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

mod common;

use std::sync::Arc;

use common::mocks::{spawn, Fault, Mock, Rendezvous};
use common::{client, gateway, wait_ready};
use pdgate_gateway::RunningGateway;
use serde_json::{json, Value};

#[derive(Clone, Copy)]
enum Topo {
    Regular,
    Bootstrap,
}

impl Topo {
    /// The `leg` label of the relayed leg.
    fn leg(self) -> &'static str {
        match self {
            Topo::Regular => "worker",
            Topo::Bootstrap => "decode",
        }
    }
}

struct Setup {
    _gw: RunningGateway,
    url: String,
    bad: Mock,
    good: Mock,
    _prefill: Option<Mock>,
}

async fn setup(topo: Topo, fault: Fault, extra: Value) -> Setup {
    let rdv = Arc::new(Rendezvous::default());
    let (bad, good, prefill, mut cfg) = match topo {
        Topo::Regular => {
            let bad = spawn("regular", rdv.clone(), fault).await;
            let good = spawn("regular", rdv, Fault::None).await;
            let cfg = json!({"worker_urls": [bad.url, good.url]});
            (bad, good, None, cfg)
        }
        Topo::Bootstrap => {
            let p = spawn("prefill", rdv.clone(), Fault::None).await;
            let bad = spawn("decode", rdv.clone(), fault).await;
            let good = spawn("decode", rdv, Fault::None).await;
            let cfg = json!({"pd_disaggregation": true, "prefill": [p.url], "decode": [bad.url, good.url]});
            (bad, good, Some(p), cfg)
        }
    };
    let obj = cfg.as_object_mut().unwrap();
    obj.insert("policy".into(), "round_robin".into());
    obj.insert("retry_max_retries".into(), 0.into());
    obj.insert("breaker_failure_threshold".into(), 1.into());
    for (k, v) in extra.as_object().unwrap() {
        obj.insert(k.clone(), v.clone());
    }
    let (gw, url) = gateway(cfg).await;
    wait_ready(&url).await;
    Setup { _gw: gw, url, bad, good, _prefill: prefill }
}

async fn post(url: &str, path: &str, body: &Value) -> (u16, String) {
    let r = client().post(format!("{url}{path}")).json(body).send().await.unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

/// The value of one sample in `/metrics`, e.g. `name{a="x"}`.
async fn metric(url: &str, sample: &str) -> Option<f64> {
    let text = client().get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap();
    text.lines().find_map(|l| l.strip_prefix(sample).and_then(|rest| rest.trim().parse().ok()))
}

fn last_event(text: &str) -> Value {
    let last = text.trim_end().rsplit("\n\n").next().unwrap();
    serde_json::from_str(last.trim_start().strip_prefix("data: ").unwrap_or(last)).unwrap_or(Value::Null)
}

/// Sends requests until the broken worker got one; returns its answer. The good worker's
/// answers on the way must be whole successes.
async fn hit_bad(s: &Setup, path: &str, body: &Value) -> (u16, String) {
    for _ in 0..4 {
        let before = s.bad.log().count();
        let (status, text) = post(&s.url, path, body).await;
        if s.bad.log().count() > before {
            return (status, text);
        }
        assert_eq!(status, 200, "{text}");
    }
    panic!("round robin never reached the broken worker");
}

/// The breaker of the broken worker opened, and the gateway serves from the good one.
async fn breaker_opened_and_serving(s: &Setup, path: &str, body: &Value) {
    assert_eq!(metric(&s.url, &format!("pdgate_worker_breaker_state{{worker=\"{}\"}}", s.bad.url)).await, Some(1.0), "breaker did not open");
    let bad_before = s.bad.log().count();
    for _ in 0..3 {
        let (status, text) = post(&s.url, path, body).await;
        assert_eq!(status, 200, "{text}");
        if body["stream"] == json!(true) {
            assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
        }
    }
    assert_eq!(s.bad.log().count(), bad_before, "an open breaker still got traffic");
}

async fn refused_before_commit(topo: Topo, fault: Fault, path: &str, body: Value, reason: &str) {
    let s = setup(topo, fault, json!({})).await;
    let (status, text) = hit_bad(&s, path, &body).await;
    assert_eq!(status, 502, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("not an OpenAI error: {text}"));
    assert_eq!(v["error"]["code"], "bad_worker_response", "{v}");
    assert_eq!(v["error"]["type"], "upstream_error", "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains(&format!("{} worker", topo.leg())) || (topo.leg() == "worker" && msg.contains("the worker")), "{msg}");
    let sample = format!("pdgate_bad_worker_responses_total{{leg=\"{}\",reason=\"{reason}\"}}", topo.leg());
    assert_eq!(metric(&s.url, &sample).await, Some(1.0), "{sample}");
    breaker_opened_and_serving(&s, path, &body).await;
    assert_eq!(s.good.log().accept_encodings.lock().unwrap()[0], "identity", "the gateway asks for no encoding");
}

async fn cut_after_commit(topo: Topo, fault: Fault, extra: Value, code: &str, sample: String) {
    let s = setup(topo, fault, extra).await;
    let body = json!({"prompt": "x", "stream": true});
    let (status, text) = hit_bad(&s, "/v1/completions", &body).await;
    assert_eq!(status, 200, "bytes were on their way: {text:.300}");
    let err = last_event(&text);
    assert_eq!(err["error"]["code"], code, "{:.300}", &text[text.len().saturating_sub(600)..]);
    assert!(err["error"]["message"].as_str().unwrap().contains(topo.leg()), "{err}");
    assert_eq!(metric(&s.url, &sample).await, Some(1.0), "{sample}");
    breaker_opened_and_serving(&s, "/v1/completions", &body).await;
}

fn completion(stream: bool) -> Value {
    json!({"prompt": "x", "max_tokens": 3, "stream": stream})
}

#[tokio::test]
async fn malformed_json_is_refused_regular() {
    refused_before_commit(Topo::Regular, Fault::MalformedJson, "/v1/completions", completion(false), "not_json").await;
}

#[tokio::test]
async fn malformed_json_is_refused_pd() {
    refused_before_commit(Topo::Bootstrap, Fault::MalformedJson, "/v1/completions", completion(false), "not_json").await;
}

#[tokio::test]
async fn an_html_page_is_refused_regular() {
    refused_before_commit(Topo::Regular, Fault::Html, "/v1/chat/completions", json!({"messages": [{"role": "user", "content": "x"}]}), "not_json").await;
}

#[tokio::test]
async fn an_html_page_is_refused_pd_generate() {
    refused_before_commit(Topo::Bootstrap, Fault::Html, "/generate", json!({"text": "x"}), "not_json").await;
}

#[tokio::test]
async fn an_html_page_to_a_stream_is_refused_regular() {
    refused_before_commit(Topo::Regular, Fault::Html, "/v1/completions", completion(true), "not_sse").await;
}

#[tokio::test]
async fn json_to_a_stream_is_refused_regular() {
    refused_before_commit(Topo::Regular, Fault::JsonForStream, "/v1/completions", completion(true), "not_sse").await;
}

#[tokio::test]
async fn json_to_a_stream_is_refused_pd() {
    refused_before_commit(Topo::Bootstrap, Fault::JsonForStream, "/v1/completions", completion(true), "not_sse").await;
}

#[tokio::test]
async fn gzip_is_refused_not_half_forwarded_regular() {
    refused_before_commit(Topo::Regular, Fault::Gzip, "/v1/completions", completion(false), "content_encoding").await;
}

#[tokio::test]
async fn gzip_is_refused_not_half_forwarded_pd_stream() {
    refused_before_commit(Topo::Bootstrap, Fault::Gzip, "/v1/completions", completion(true), "content_encoding").await;
}

#[tokio::test]
async fn an_oversized_answer_is_refused_regular() {
    // The endless body passes the limit of the default config only after 64 MiB; the bound here
    // is 64 KiB, set through the flag.
    let s = setup(Topo::Regular, Fault::Endless, json!({"max_response_bytes": 65536})).await;
    let (status, text) = hit_bad(&s, "/v1/completions", &completion(false)).await;
    assert_eq!(status, 502, "{text}");
    assert!(text.contains("bad_worker_response") && text.contains("65536"), "{text}");
    assert_eq!(metric(&s.url, "pdgate_bad_worker_responses_total{leg=\"worker\",reason=\"too_large\"}").await, Some(1.0));
    breaker_opened_and_serving(&s, "/v1/completions", &completion(false)).await;
}

#[tokio::test]
async fn a_stream_without_done_ends_with_an_error_event_regular() {
    cut_after_commit(Topo::Regular, Fault::NoDone, json!({}), "worker_stream_truncated", "pdgate_worker_streams_truncated_total{leg=\"worker\"}".into()).await;
}

#[tokio::test]
async fn a_stream_without_done_ends_with_an_error_event_pd() {
    cut_after_commit(Topo::Bootstrap, Fault::NoDone, json!({}), "decode_stream_truncated", "pdgate_worker_streams_truncated_total{leg=\"decode\"}".into()).await;
}

#[tokio::test]
async fn an_endless_line_ends_the_stream_regular() {
    let sample = "pdgate_bad_worker_responses_total{leg=\"worker\",reason=\"sse_event_too_long\"}".to_string();
    cut_after_commit(Topo::Regular, Fault::Endless, json!({"max_sse_event_bytes": 65536}), "bad_worker_response", sample).await;
}

#[tokio::test]
async fn an_endless_line_ends_the_stream_pd() {
    let sample = "pdgate_bad_worker_responses_total{leg=\"decode\",reason=\"sse_event_too_long\"}".to_string();
    cut_after_commit(Topo::Bootstrap, Fault::Endless, json!({"max_sse_event_bytes": 65536}), "bad_worker_response", sample).await;
}

#[tokio::test]
async fn a_worker_dying_mid_stream_opens_its_breaker() {
    // The chunked-truncation variant (already an error event) now also reaches the breaker.
    cut_after_commit(Topo::Regular, Fault::DieMidStream, json!({}), "worker_unavailable", "pdgate_worker_errors_total{code=\"worker_unavailable\",leg=\"worker\"}".into()).await;
}

#[tokio::test]
async fn broken_answer_counters_exist_at_zero() {
    let w = spawn("regular", Default::default(), Fault::None).await;
    let (_gw, url) = gateway(json!({"worker_urls": [w.url]})).await;
    for sample in [
        "pdgate_worker_streams_truncated_total{leg=\"worker\"}",
        "pdgate_worker_streams_truncated_total{leg=\"decode\"}",
        "pdgate_bad_worker_responses_total{leg=\"decode\",reason=\"not_sse\"}",
        "pdgate_bad_worker_responses_total{leg=\"worker\",reason=\"sse_event_too_long\"}",
    ] {
        assert_eq!(metric(&url, sample).await, Some(0.0), "{sample}");
    }
}
