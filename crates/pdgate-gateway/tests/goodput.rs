//! Component tests, real sockets on loopback: latency accounting through the gateway to mock
//! workers. The figures' arithmetic and the SLO judgement are unit-tested in pdgate-core
//! (slo.rs) and the stream reading in exec/accounting_tests.rs; here: the usage asked for and
//! stripped, the metrics by placement, the SLO headers, and the request log's lines.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

mod common;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use common::mocks::{spawn, Fault, Mock, Rendezvous};
use common::{client, gateway, wait_ready};
use serde_json::{json, Value};

async fn metrics(url: &str) -> String {
    client().get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap()
}

/// The value of the series `name{labels}` (labels as Prometheus prints them), 0 when absent.
fn value(text: &str, series: &str) -> f64 {
    text.lines().find_map(|l| l.strip_prefix(series).and_then(|rest| rest.strip_prefix(' '))).map_or(0.0, |v| v.parse().unwrap())
}

fn log_path(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pdgate-goodput-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("requests.jsonl");
    let _ = std::fs::remove_file(&path);
    path
}

/// The log's lines once there are `n` (the writer flushes off the request path: bounded poll).
async fn log_lines(path: &PathBuf, n: usize) -> Vec<Value> {
    for _ in 0..200 {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        if text.lines().count() >= n {
            return text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the request log never had {n} lines: {:?}", std::fs::read_to_string(path));
}

async fn regular(fault: Fault) -> Mock {
    spawn("regular", Arc::new(Rendezvous::default()), fault).await
}

async fn post(url: &str, path: &str, body: Value) -> (u16, String) {
    let r = client().post(format!("{url}{path}")).json(&body).send().await.unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

#[tokio::test]
async fn a_stream_gets_usage_asked_for_and_stripped_and_is_accounted() {
    let w = regular(Fault::SlowStream(5)).await;
    let path = log_path("strip");
    let (_gw, url) = gateway(json!({"worker_urls": [w.url], "request_log": path.to_str().unwrap()})).await;
    wait_ready(&url).await;
    let (status, text) = post(&url, "/v1/completions", json!({"prompt": "hi", "max_tokens": 3, "stream": true})).await;
    assert_eq!(status, 200);
    assert!(!text.contains("usage") && text.contains("tok2") && text.ends_with("data: [DONE]\n\n"), "usage stripped: {text}");
    assert_eq!(w.log().bodies()[0]["stream_options"], json!({"include_usage": true}), "the worker was asked for usage");
    let m = metrics(&url).await;
    assert_eq!(value(&m, "pdgate_slo_requests_total{result=\"met\"}"), 1.0, "{m}");
    assert_eq!(value(&m, "pdgate_ttft_seconds_count{placement=\"colocated\"}"), 1.0);
    assert_eq!(value(&m, "pdgate_tpot_seconds_count{placement=\"colocated\"}"), 1.0);
    assert_eq!(value(&m, "pdgate_e2e_seconds_count{placement=\"colocated\"}"), 1.0);
    assert_eq!(value(&m, "pdgate_e2e_seconds_count{placement=\"disaggregated\"}"), 0.0);
    assert!(value(&m, "pdgate_goodput_requests_per_second") > 0.0);
    let line = &log_lines(&path, 1).await[0];
    assert_eq!((line["prompt_tokens"].as_u64(), line["output_tokens"].as_u64(), line["cached_tokens"].as_u64()), (Some(5), Some(3), Some(0)), "{line}");
    assert_eq!((line["placement"].as_str(), line["protocol"].as_str(), line["worker"].as_str()), (Some("colocated"), Some("regular"), Some(w.url.as_str())));
    assert_eq!((line["status"].as_u64(), line["slo_result"].as_str(), line["attempts"].as_u64(), line["stream"].as_bool()), (Some(200), Some("met"), Some(1), Some(true)));
    let (ttft, tpot, e2e) = (line["ttft_ms"].as_f64().unwrap(), line["tpot_ms"].as_f64().unwrap(), line["e2e_ms"].as_f64().unwrap());
    // Three chunks 5 ms apart: the first token comes after the first gap, the end after more.
    assert!(ttft >= 5.0 && ttft < e2e, "{line}");
    assert!((tpot - (e2e - ttft) / 2.0).abs() < 1e-6, "TPOT = (E2E - TTFT) / (3 - 1): {line}");
    assert!(line["arrival_unix_s"].as_f64().unwrap() > 1.6e9 && line["error"].is_null() && line["request_id"].is_string());
}

#[tokio::test]
async fn usage_the_client_asked_for_is_kept() {
    let w = regular(Fault::None).await;
    let (_gw, url) = gateway(json!({"worker_urls": [w.url]})).await;
    wait_ready(&url).await;
    let (status, text) =
        post(&url, "/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "stream": true, "stream_options": {"include_usage": true}})).await;
    assert_eq!(status, 200);
    assert!(text.contains("\"usage\":{"), "{text}");
    let (_, whole) = post(&url, "/v1/completions", json!({"prompt": "hi"})).await;
    assert!(!w.log().bodies()[1].as_object().unwrap().contains_key("stream_options"), "a non-streamed request is forwarded as it came");
    assert!(whole.contains("decoded"));
    let m = metrics(&url).await;
    // The non-streamed request has a TTFT (its whole answer) but no observable TPOT.
    assert_eq!(value(&m, "pdgate_ttft_seconds_count{placement=\"colocated\"}"), 2.0);
    assert_eq!(value(&m, "pdgate_tpot_seconds_count{placement=\"colocated\"}"), 1.0);
}

#[tokio::test]
async fn pd_requests_are_disaggregated_with_the_decodes_counts() {
    let rdv = Arc::new(Rendezvous::default());
    let p = spawn("nixl_prefill", rdv.clone(), Fault::None).await;
    let d = spawn("nixl_decode", rdv, Fault::None).await;
    let path = log_path("pd");
    let (_gw, url) = gateway(json!({"pd_disaggregation": true, "kv_connector": "nixl", "prefill": [p.url], "decode": [d.url], "request_log": path.to_str().unwrap()})).await;
    wait_ready(&url).await;
    let (status, text) = post(&url, "/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "stream": true})).await;
    assert_eq!(status, 200);
    assert!(!text.contains("usage"), "the decode's usage chunk is stripped: {text}");
    let (status, _) = post(&url, "/v1/completions", json!({"prompt": "hi", "max_tokens": 9})).await;
    assert_eq!(status, 200);
    let m = metrics(&url).await;
    assert_eq!(value(&m, "pdgate_e2e_seconds_count{placement=\"disaggregated\"}"), 2.0, "{m}");
    assert_eq!(value(&m, "pdgate_tpot_seconds_count{placement=\"disaggregated\"}"), 1.0);
    assert_eq!(value(&m, "pdgate_e2e_seconds_count{placement=\"colocated\"}"), 0.0);
    let lines = log_lines(&path, 2).await;
    for line in &lines {
        assert_eq!((line["placement"].as_str(), line["protocol"].as_str()), (Some("disaggregated"), Some("nixl")), "{line}");
        assert_eq!((line["prefill"].as_str(), line["decode"].as_str()), (Some(p.url.as_str()), Some(d.url.as_str())));
        assert_eq!((line["prompt_tokens"].as_u64(), line["cached_tokens"].as_u64(), line["output_tokens"].as_u64()), (Some(5), Some(5), Some(3)));
    }
    assert_eq!(lines.iter().map(|l| l["stream"].as_bool().unwrap()).collect::<Vec<_>>(), [true, false]);
}

#[tokio::test]
async fn a_failed_request_is_failed_and_logged_with_its_error() {
    let w = regular(Fault::Status(500)).await;
    let path = log_path("failed");
    let (_gw, url) = gateway(json!({"worker_urls": [w.url], "request_log": path.to_str().unwrap(), "retry_max_retries": 2, "disable_circuit_breaker": true})).await;
    wait_ready(&url).await;
    let (status, _) = post(&url, "/v1/completions", json!({"prompt": "hi", "stream": true})).await;
    assert_eq!(status, 502);
    let m = metrics(&url).await;
    assert_eq!(value(&m, "pdgate_slo_requests_total{result=\"failed\"}"), 1.0, "{m}");
    assert_eq!(value(&m, "pdgate_slo_requests_total{result=\"met\"}"), 0.0);
    assert_eq!(value(&m, "pdgate_ttft_seconds_count{placement=\"colocated\"}"), 0.0, "no token reached the client");
    let line = &log_lines(&path, 1).await[0];
    assert_eq!((line["status"].as_u64(), line["slo_result"].as_str(), line["attempts"].as_u64()), (Some(502), Some("failed"), Some(2)), "{line}");
    assert!(line["error"].as_str().is_some_and(|e| !e.is_empty()) && line["ttft_ms"].is_null() && line["output_tokens"].is_null(), "{line}");
}

#[tokio::test]
async fn slo_headers_set_the_objectives_and_bad_ones_are_refused_by_name() {
    let w = regular(Fault::SlowStream(20)).await;
    let path = log_path("headers");
    let (_gw, url) = gateway(json!({"worker_urls": [w.url], "request_log": path.to_str().unwrap()})).await;
    wait_ready(&url).await;
    let body = json!({"prompt": "hi", "stream": true});
    for (header, value) in [("x-slo-ttft-ms", "fast"), ("x-llm-d-slo-tpot-ms", "-1")] {
        let r = client().post(format!("{url}/v1/completions")).header(header, value).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 400);
        let err: Value = r.json().await.unwrap();
        assert_eq!(err["error"]["param"], header, "{err}");
        assert!(err["error"]["message"].as_str().unwrap().contains(header));
    }
    assert_eq!(w.log().count(), 0, "a refused request reaches no worker");
    // 20 ms between chunks: a 1 ms TTFT objective is missed, a 1 ms TPOT objective too.
    let r = client().post(format!("{url}/v1/completions")).header("x-llm-d-slo-ttft-ms", "1").json(&body).send().await.unwrap();
    assert_eq!((r.status(), r.text().await.unwrap().contains("[DONE]")), (reqwest::StatusCode::OK, true));
    let r = client().post(format!("{url}/v1/completions")).header("x-slo-tpot-ms", "1").json(&body).send().await.unwrap();
    r.text().await.unwrap();
    let m = metrics(&url).await;
    assert_eq!(value(&m, "pdgate_slo_requests_total{result=\"ttft_missed\"}"), 1.0, "{m}");
    assert_eq!(value(&m, "pdgate_slo_requests_total{result=\"tpot_missed\"}"), 1.0);
    assert_eq!(value(&m, "pdgate_goodput_requests_per_second"), 0.0);
    let lines = log_lines(&path, 2).await;
    assert_eq!((lines[0]["slo_ttft_ms"].as_f64(), lines[0]["slo_tpot_ms"].as_f64()), (Some(1.0), Some(50.0)));
    assert_eq!((lines[1]["slo_ttft_ms"].as_f64(), lines[1]["slo_tpot_ms"].as_f64()), (Some(1000.0), Some(1.0)));
}

#[tokio::test]
async fn a_request_log_that_cannot_be_opened_stops_the_start() {
    let cfg = pdgate_gateway::GatewayConfig { port: 0, request_log: Some("/nonexistent-dir-pdgate/requests.jsonl".into()), ..Default::default() };
    let err = pdgate_gateway::start(cfg).await.err().expect("start refused");
    assert!(err.to_string().contains("request log"), "{err}");
}
