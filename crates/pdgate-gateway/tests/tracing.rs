//! `--enable-trace`: spans exported over OTLP/gRPC to a receiver in the test, one trace per
//! request with the phases as children, and W3C `traceparent` sent to each worker naming its
//! leg's span. Tracing is set up once per process, so the "off" and "unreachable collector"
//! cases are test binaries of their own (tracing_off.rs, tracing_unreachable.rs).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

mod common;
#[path = "common/otlp.rs"]
mod otlp;

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use common::mocks::{spawn, Fault, Rendezvous};
use common::{client, gateway, wait_ready};
use otlp::{Got, Receiver};
use pdgate_gateway::GatewayConfig;
use serde_json::json;

/// The process's receiver, with the exporter pointed at it (once).
fn receiver() -> &'static Receiver {
    static RECEIVER: OnceLock<Receiver> = OnceLock::new();
    RECEIVER.get_or_init(|| {
        let (receiver, addr) = otlp::start();
        let config = GatewayConfig { enable_trace: true, otlp_traces_endpoint: addr.to_string(), log_level: "warn".into(), ..GatewayConfig::default() };
        pdgate_gateway::init_logging(&config).unwrap();
        receiver
    })
}

/// A fresh random trace id and span id, as a client's `traceparent`.
fn client_traceparent() -> (String, String, String) {
    let trace: String = (0..32).map(|_| format!("{:x}", rand_nibble())).collect();
    let span: String = (0..16).map(|_| format!("{:x}", rand_nibble())).collect();
    (format!("00-{trace}-{span}-01"), trace, span)
}

fn rand_nibble() -> u8 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static STATE: AtomicU64 = AtomicU64::new(0x9e37_79b9_7f4a_7c15);
    // A seeded xorshift: distinct ids per call, the same sequence every run.
    let mut x = STATE.load(Ordering::Relaxed);
    loop {
        let mut y = x;
        y ^= y << 13;
        y ^= y >> 7;
        y ^= y << 17;
        match STATE.compare_exchange(x, y, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return (y & 0xf) as u8,
            Err(now) => x = now,
        }
    }
}

fn one<'a>(spans: &'a [Got], name: &str) -> &'a Got {
    let found: Vec<&Got> = spans.iter().filter(|s| s.name == name).collect();
    assert_eq!(found.len(), 1, "one {name} span expected in {spans:#?}");
    found[0]
}

/// (trace id, parent span id) of a `traceparent` a worker received.
fn ids(traceparent: &str) -> (String, String) {
    let parts: Vec<&str> = traceparent.split('-').collect();
    assert_eq!(parts.len(), 4, "{traceparent:?}");
    (parts[1].to_string(), parts[2].to_string())
}

fn has_trace_with(spans: &[Got], trace: &str, names: &[&str]) -> bool {
    names.iter().all(|n| spans.iter().any(|s| s.trace_id == trace && s.name == *n))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pd_stream_is_one_trace_under_the_clients_span_and_each_worker_gets_its_legs_span() {
    let rx = receiver();
    let rdv = Arc::new(Rendezvous::default());
    let (p, d) = (spawn("prefill", rdv.clone(), Fault::None).await, spawn("decode", rdv, Fault::None).await);
    let (gw, url) = gateway(json!({"pd_disaggregation": true, "prefill": [[p.url]], "decode": [d.url], "enable_trace": true})).await;
    wait_ready(&url).await;
    let (traceparent, trace, client_span) = client_traceparent();
    let r = client()
        .post(format!("{url}/v1/completions"))
        .header("traceparent", &traceparent)
        .header("tracestate", "vendor=abc")
        .json(&json!({"prompt": "hello", "max_tokens": 4, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let body = r.text().await.unwrap();
    assert!(body.contains("[DONE]"), "{body}");

    let names = ["request", "admit", "attempt", "select", "prefill", "decode", "relay", "finish"];
    let all = rx.wait_for("the PD request's spans", |s| has_trace_with(s, &trace, &names)).await;
    let spans: Vec<Got> = all.into_iter().filter(|s| s.trace_id == trace).collect();
    let by_name: HashMap<&str, &Got> = names.iter().map(|n| (*n, one(&spans, n))).collect();
    let parent_of = |child: &str| by_name[child].parent_span_id.clone();
    let id_of = |name: &str| by_name[name].span_id.clone();
    // The client's span is the request's parent: its trace continues.
    assert_eq!(parent_of("request"), client_span);
    for (child, parent) in
        [("admit", "request"), ("attempt", "request"), ("finish", "request"), ("select", "attempt"), ("prefill", "attempt"), ("decode", "attempt"), ("relay", "decode")]
    {
        assert_eq!(parent_of(child), id_of(parent), "{child} should be a child of {parent}");
    }
    let request = by_name["request"];
    assert_eq!(request.service, "pdgate");
    assert_eq!(request.attr("route"), Some("/v1/completions"));
    assert_eq!(request.attr("http.response.status_code"), Some("200"));
    assert!(request.attr("request_id").is_some_and(|id| !id.is_empty()));
    let select = by_name["select"];
    assert_eq!(select.attr("prefill"), Some(p.url.as_str()));
    assert_eq!(select.attr("decode"), Some(d.url.as_str()));
    assert!(select.attr("policy").is_some_and(|p| p.contains("prefill:") && p.contains("decode:")), "{select:?}");
    assert_eq!(by_name["prefill"].attr("worker"), Some(p.url.as_str()));
    assert_eq!(by_name["decode"].attr("worker"), Some(d.url.as_str()));
    let relay = by_name["relay"];
    assert_eq!(relay.attr("bytes"), Some(body.len().to_string().as_str()), "{relay:?}");
    assert!(relay.attr("chunks").is_some_and(|c| c.parse::<u64>().unwrap() >= 1), "{relay:?}");
    assert_eq!(relay.attr("outcome"), Some("done"));
    assert_eq!(by_name["finish"].attr("http.response.status_code"), Some("200"));

    // Each worker's traceparent: the request's trace, its own leg's span as the parent.
    let (pt, ps) = &p.log().trace_headers()[0];
    let (dt, ds) = &d.log().trace_headers()[0];
    assert_eq!(ids(pt), (trace.clone(), id_of("prefill")));
    assert_eq!(ids(dt), (trace.clone(), id_of("decode")));
    assert!(pt.ends_with("-01"), "sampled: {pt}");
    assert_eq!((ps.as_str(), ds.as_str()), ("vendor=abc", "vendor=abc"), "the client's tracestate goes on");
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_client_traceparent_the_request_starts_a_trace_of_its_own() {
    let rx = receiver();
    let w = spawn("regular", Default::default(), Fault::None).await;
    let (gw, url) = gateway(json!({"worker_urls": [w.url]})).await;
    wait_ready(&url).await;
    let r = client().post(format!("{url}/v1/chat/completions")).json(&json!({"model": "mock-model", "messages": [{"role": "user", "content": "hi"}]})).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let (tp, state) = w.log().trace_headers()[0].clone();
    let (trace, parent) = ids(&tp);
    assert_eq!(state, "", "no tracestate was given");
    let names = ["request", "admit", "attempt", "select", "regular", "relay", "finish"];
    let all = rx.wait_for("the regular request's spans", |s| has_trace_with(s, &trace, &names)).await;
    let spans: Vec<Got> = all.into_iter().filter(|s| s.trace_id == trace).collect();
    let request = one(&spans, "request");
    assert_eq!(request.parent_span_id, "", "a root span");
    assert_eq!(request.attr("model"), Some("mock-model"));
    assert_eq!(one(&spans, "regular").span_id, parent, "the worker's parent is the leg's span");
    assert_eq!(one(&spans, "select").attr("worker"), Some(w.url.as_str()));
    // Only this request's spans carry its trace id: one trace per request.
    assert_eq!(spans.len(), names.len(), "{spans:#?}");
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_is_an_attempt_span_of_its_own_and_the_failed_one_says_why() {
    let rx = receiver();
    let bad = spawn("regular", Default::default(), Fault::Status(503)).await;
    let good = spawn("regular", Default::default(), Fault::None).await;
    let (gw, url) = gateway(json!({"worker_urls": [bad.url, good.url], "policy": "round_robin"})).await;
    wait_ready(&url).await;
    // Round robin: once both workers passed a health check, within two requests one goes to the
    // failing worker first and is retried. Readiness needs only one healthy worker, so the bad
    // one may not be routable yet: send until it has had a request.
    for _ in 0..40 {
        let r = client().post(format!("{url}/v1/completions")).json(&json!({"prompt": "x", "max_tokens": 2})).send().await.unwrap();
        assert_eq!(r.status(), 200);
        if !bad.log().trace_headers().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (tp, _) = bad.log().trace_headers()[0].clone();
    let (trace, failed_leg) = ids(&tp);
    let all = rx
        .wait_for("the retried request's spans", |s| {
            s.iter().filter(|g| g.trace_id == trace && g.name == "attempt").count() == 2 && has_trace_with(s, &trace, &["request", "finish"])
        })
        .await;
    let spans: Vec<Got> = all.into_iter().filter(|s| s.trace_id == trace).collect();
    let attempts: Vec<&Got> = spans.iter().filter(|s| s.name == "attempt").collect();
    let first = attempts.iter().find(|a| a.attr("attempt") == Some("1")).unwrap();
    let second = attempts.iter().find(|a| a.attr("attempt") == Some("2")).unwrap();
    assert_eq!(first.status, 2, "the failed attempt is an error: {first:?}");
    assert!(first.attr("error.type").is_some(), "{first:?}");
    assert_eq!(second.status, 0, "{second:?}");
    assert_ne!(first.attr("request_id"), second.attr("request_id"), "a retry is a new rendezvous id");
    let legs: Vec<&Got> = spans.iter().filter(|s| s.name == "regular").collect();
    assert_eq!(legs.len(), 2);
    let failed = legs.iter().find(|l| l.span_id == failed_leg).expect("the failing worker's parent is a leg span of this trace");
    assert_eq!(failed.parent_span_id, first.span_id);
    assert_eq!(failed.status, 2);
    assert_eq!(failed.attr("worker"), Some(bad.url.as_str()));
    let (good_tp, _) = good.log().trace_headers().into_iter().find(|(t, _)| t.contains(&trace)).unwrap();
    let other = legs.iter().find(|l| l.span_id != failed_leg).unwrap();
    assert_eq!(ids(&good_tp).1, other.span_id);
    assert_eq!(other.parent_span_id, second.span_id);
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_request_has_its_status_and_error_code_on_the_request_and_finish_spans() {
    let rx = receiver();
    let bad = spawn("regular", Default::default(), Fault::Status(500)).await;
    let (gw, url) = gateway(json!({"worker_urls": [bad.url], "retry_max_retries": 1})).await;
    wait_ready(&url).await;
    let (traceparent, trace, _) = client_traceparent();
    let r = client().post(format!("{url}/v1/completions")).header("traceparent", &traceparent).json(&json!({"prompt": "x", "max_tokens": 2})).send().await.unwrap();
    let status = r.status().as_u16();
    assert!(status >= 500, "{status}");
    let v: serde_json::Value = r.json().await.unwrap();
    let code = v["error"]["code"].as_str().unwrap().to_string();
    let all = rx.wait_for("the failed request's spans", |s| has_trace_with(s, &trace, &["request", "finish"])).await;
    let spans: Vec<Got> = all.into_iter().filter(|s| s.trace_id == trace).collect();
    for name in ["request", "finish"] {
        let s = one(&spans, name);
        assert_eq!(s.attr("http.response.status_code"), Some(status.to_string().as_str()), "{s:?}");
        assert_eq!(s.attr("error.type"), Some(code.as_str()), "{s:?}");
        assert_eq!(s.status, 2, "{s:?}");
    }
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_exporter_counters_are_on_metrics() {
    let rx = receiver();
    let w = spawn("regular", Default::default(), Fault::None).await;
    let (gw, url) = gateway(json!({"worker_urls": [w.url]})).await;
    wait_ready(&url).await;
    let r = client().post(format!("{url}/v1/completions")).json(&json!({"prompt": "x", "max_tokens": 2})).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let (tp, _) = w.log().trace_headers()[0].clone();
    let trace = ids(&tp).0;
    rx.wait_for("a request's spans", |s| has_trace_with(s, &trace, &["request"])).await;
    let metrics = client().get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap();
    let exported = metrics.lines().find(|l| l.starts_with("pdgate_trace_spans_exported_total{result=\"ok\"}")).unwrap();
    assert!(exported.split_whitespace().last().unwrap().parse::<u64>().unwrap() > 0, "{exported}");
    assert!(metrics.contains("pdgate_trace_spans_dropped_total 0"), "nothing dropped with a live collector");
    gw.shutdown().await;
}
