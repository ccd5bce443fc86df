//! The client edge on loopback, under tokio's paused clock where time matters (real sockets
//! still work; the clock jumps to the next timer whenever every task waits): slow clients are
//! cut by the header, body and idle timeouts, connections beyond --max-connections are closed,
//! the worker API is closed by default, loops are refused or cut with 508, and a burst of
//! failing requests logs a bounded amount. After each, the gateway still serves.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::gateway;
use common::mocks::{spawn, Fault};
use pdgate_gateway::{start, GatewayConfig};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

/// A client without its own timeout: under a paused clock, a timer of the client's would be
/// one more thing for the clock to jump to.
fn plain_client() -> reqwest::Client {
    reqwest::Client::new()
}

/// The value of one sample line of the Prometheus text, e.g. `pdgate_client_timeouts_total{kind="header"}`.
async fn metric(url: &str, sample: &str) -> f64 {
    let text = plain_client().get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(sample).and_then(|rest| rest.strip_prefix(' ')).map(|v| v.trim().parse::<f64>().unwrap()))
        .unwrap_or_else(|| panic!("no sample {sample} in:\n{text}"))
}

async fn completion_status(url: &str) -> u16 {
    plain_client().post(format!("{url}/v1/completions")).json(&json!({"prompt": "x", "max_tokens": 2})).send().await.unwrap().status().as_u16()
}

/// Reads until the peer closes; what it sent before.
async fn read_to_close(s: &mut TcpStream) -> String {
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf).await;
    String::from_utf8_lossy(&buf).into_owned()
}

async fn served_gateway(extra: Value) -> (pdgate_gateway::RunningGateway, String) {
    let w = spawn("regular", Default::default(), Fault::None).await;
    let mut cfg = json!({"worker_urls": [w.url]});
    cfg.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    let (gw, url) = gateway(cfg).await;
    // Keep the mock alive with the gateway.
    std::mem::forget(w);
    (gw, url)
}

#[tokio::test(start_paused = true)]
async fn a_client_that_never_finishes_its_headers_is_closed_after_the_header_timeout() {
    let (gw, url) = served_gateway(json!({})).await;
    assert_eq!(metric(&url, r#"pdgate_client_timeouts_total{kind="header"}"#).await, 0.0, "present at 0 from the start");
    let mut slow = TcpStream::connect(gw.local_addr()).await.unwrap();
    slow.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: appl").await.unwrap();
    let t = Instant::now();
    let answer = read_to_close(&mut slow).await;
    let waited = t.elapsed();
    assert!(waited >= Duration::from_secs(10) && waited < Duration::from_secs(11), "closed after {waited:?}");
    // hyper has no request to answer: it closes without a response.
    assert_eq!(answer, "");
    assert_eq!(metric(&url, r#"pdgate_client_timeouts_total{kind="header"}"#).await, 1.0);
    assert_eq!(completion_status(&url).await, 200, "still serving");
}

#[tokio::test(start_paused = true)]
async fn a_body_that_never_finishes_is_answered_408() {
    let (gw, url) = served_gateway(json!({})).await;
    let mut slow = TcpStream::connect(gw.local_addr()).await.unwrap();
    slow.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\":").await.unwrap();
    let t = Instant::now();
    let answer = read_to_close(&mut slow).await;
    let waited = t.elapsed();
    assert!(waited >= Duration::from_secs(30) && waited < Duration::from_secs(31), "answered after {waited:?}");
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.to_ascii_lowercase().contains("connection: close"), "{answer}");
    let body: Value = serde_json::from_str(answer.split("\r\n\r\n").nth(1).unwrap()).unwrap();
    assert_eq!(body["error"]["code"], "body_read_timeout");
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert_eq!(metric(&url, r#"pdgate_client_timeouts_total{kind="body"}"#).await, 1.0);
    assert_eq!(completion_status(&url).await, 200, "still serving");
}

#[tokio::test(start_paused = true)]
async fn the_translated_routes_answer_a_body_that_never_finishes_408() {
    // With a chat-template tokenizer, count_tokens is answered by the gateway alone: its body is
    // read under the same deadline as every route's (a slow client never holds it forever).
    let model = concat!(env!("CARGO_MANIFEST_DIR"), "/../pdgate-tokenizer/tests/fixtures/bpe");
    let (gw, url) = served_gateway(json!({"model_path": model})).await;
    for route in ["/v1/messages/count_tokens", "/v1/messages", "/v1/responses"] {
        let mut slow = TcpStream::connect(gw.local_addr()).await.unwrap();
        let head = format!("POST {route} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"model\":");
        slow.write_all(head.as_bytes()).await.unwrap();
        let t = Instant::now();
        let answer = read_to_close(&mut slow).await;
        assert!(answer.starts_with("HTTP/1.1 408"), "{route}: {answer}");
        assert!(t.elapsed() >= Duration::from_secs(30) && t.elapsed() < Duration::from_secs(31), "{route}: {:?}", t.elapsed());
    }
    assert_eq!(metric(&url, r#"pdgate_client_timeouts_total{kind="body"}"#).await, 3.0);
    assert_eq!(completion_status(&url).await, 200, "still serving");
}

#[tokio::test(start_paused = true)]
async fn the_body_timeout_never_outlasts_the_request_deadline() {
    let (gw, _url) = served_gateway(json!({"request_timeout_secs": 3})).await;
    let mut slow = TcpStream::connect(gw.local_addr()).await.unwrap();
    slow.write_all(b"POST /generate HTTP/1.1\r\nHost: gw\r\nContent-Length: 100\r\n\r\n{").await.unwrap();
    let t = Instant::now();
    let answer = read_to_close(&mut slow).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(t.elapsed() >= Duration::from_secs(3) && t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
}

#[tokio::test(start_paused = true)]
async fn an_idle_keep_alive_connection_is_closed_after_the_idle_timeout() {
    let (gw, url) = served_gateway(json!({"idle_timeout_secs": 3})).await;
    let mut conn = TcpStream::connect(gw.local_addr()).await.unwrap();
    conn.write_all(b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n").await.unwrap();
    let mut buf = vec![0u8; 4096];
    let n = conn.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    let t = Instant::now();
    let rest = read_to_close(&mut conn).await;
    assert_eq!(rest, "");
    assert!(t.elapsed() >= Duration::from_secs(3) && t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
    assert_eq!(metric(&url, r#"pdgate_client_timeouts_total{kind="idle"}"#).await, 1.0);
    assert_eq!(metric(&url, r#"pdgate_client_timeouts_total{kind="header"}"#).await, 0.0);
}

#[tokio::test(start_paused = true)]
async fn connections_beyond_the_cap_are_closed_at_once_and_counted() {
    let (gw, url) = served_gateway(json!({"max_connections": 2})).await;
    assert_eq!(metric(&url, "pdgate_connections_rejected_total").await, 0.0);
    // Until the scrape's connection is closed on the gateway's side too.
    while metric(&url, "pdgate_client_connections").await > 1.0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(10)).await;
    let held = [TcpStream::connect(gw.local_addr()).await.unwrap(), TcpStream::connect(gw.local_addr()).await.unwrap()];
    tokio::time::sleep(Duration::from_millis(10)).await;
    let mut third = TcpStream::connect(gw.local_addr()).await.unwrap();
    let t = Instant::now();
    third.write_all(b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n").await.ok();
    let answer = read_to_close(&mut third).await;
    assert_eq!(answer, "", "closed without an answer");
    assert!(t.elapsed() < Duration::from_secs(1), "closed at once, not after a timeout: {:?}", t.elapsed());
    drop(held);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(metric(&url, "pdgate_connections_rejected_total").await, 1.0);
    assert_eq!(completion_status(&url).await, 200, "serving again once connections closed");
    assert_eq!(metric(&url, "pdgate_client_connections").await, 1.0, "only the scrape's own connection");
}

/// Collects what the tracing subscriber of this thread writes.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
    fn subscriber(&self) -> impl tracing::Subscriber + Send + Sync {
        let out = self.clone();
        tracing_subscriber::fmt().with_writer(move || out.clone()).with_ansi(false).with_max_level(tracing::Level::INFO).finish()
    }
}

#[tokio::test]
async fn the_worker_api_is_closed_without_an_admin_key_and_the_client_key_does_not_open_it() {
    let (_gw, url) = served_gateway(json!({"api_key": "client-k"})).await;
    let c = plain_client();
    for req in [
        c.get(format!("{url}/workers")),
        c.get(format!("{url}/workers/w0")),
        c.post(format!("{url}/workers")).json(&json!({"url": "http://127.0.0.1:9", "worker_type": "regular"})),
        c.delete(format!("{url}/workers/w0")),
    ] {
        for req in [req.try_clone().unwrap(), req.bearer_auth("client-k")] {
            let r = req.send().await.unwrap();
            assert_eq!(r.status(), 403);
            let v: Value = r.json().await.unwrap();
            assert_eq!(v["error"]["code"], "admin_api_closed");
            assert!(v["error"]["message"].as_str().unwrap().contains("--admin-api-key"), "{v}");
        }
    }
    let ready: Value = c.get(format!("{url}/readiness")).send().await.unwrap().json().await.unwrap();
    assert_eq!(ready["admin_api"], "closed");
}

#[tokio::test]
async fn the_worker_api_opens_with_the_admin_key_or_explicitly_with_a_warning() {
    let (_gw, url) = served_gateway(json!({"admin_api_key": "admin-k"})).await;
    let c = plain_client();
    assert_eq!(c.get(format!("{url}/workers")).send().await.unwrap().status(), 401);
    assert_eq!(c.get(format!("{url}/workers")).bearer_auth("admin-k").send().await.unwrap().status(), 200);
    let ready: Value = c.get(format!("{url}/readiness")).send().await.unwrap().json().await.unwrap();
    assert_eq!(ready["admin_api"], "key");

    let logs = Captured::default();
    let (_gw2, url2) = {
        let _guard = tracing::subscriber::set_default(logs.subscriber());
        served_gateway(json!({"admin_api_open": true})).await
    };
    let text = logs.text();
    let warning = text.lines().find(|l| l.contains("WARN") && l.contains("/workers") && l.contains("--admin-api-open"));
    assert!(warning.is_some(), "no start-up warning in:\n{text}");
    assert_eq!(c.get(format!("{url2}/workers")).send().await.unwrap().status(), 200);
    let ready: Value = c.get(format!("{url2}/readiness")).send().await.unwrap().json().await.unwrap();
    assert_eq!(ready["admin_api"], "open");
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[tokio::test]
async fn a_static_worker_at_the_gateways_own_address_is_a_start_error() {
    for host in ["127.0.0.1", "localhost", "0.0.0.0"] {
        let port = free_port();
        let cfg = json!({"port": port, "worker_urls": [format!("http://{host}:{port}")]});
        let err = start(GatewayConfig::from_json(&cfg.to_string()).unwrap()).await.err().expect("refused");
        assert!(err.to_string().contains("own listener"), "{err}");
    }
    // The same port on another address is another server.
    let port = free_port();
    let cfg = json!({"port": port, "worker_urls": [format!("http://127.0.0.2:{port}")]});
    start(GatewayConfig::from_json(&cfg.to_string()).unwrap()).await.unwrap().shutdown().await;
}

#[tokio::test]
async fn registering_the_gateway_itself_through_the_api_is_400() {
    let (gw, url) = served_gateway(json!({"admin_api_open": true})).await;
    let port = gw.local_addr().port();
    let c = plain_client();
    for me in [url.clone(), format!("http://localhost:{port}"), format!("http://0.0.0.0:{port}")] {
        let r = c.post(format!("{url}/workers")).json(&json!({"url": me, "worker_type": "regular"})).send().await.unwrap();
        assert_eq!(r.status(), 400, "{me}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["param"], "url");
        assert!(v["error"]["message"].as_str().unwrap().contains("loop"), "{v}");
    }
    assert_eq!(metric(&url, r#"pdgate_loops_refused_total{kind="registration"}"#).await, 3.0);
    let list: Value = c.get(format!("{url}/workers")).send().await.unwrap().json().await.unwrap();
    assert_eq!(list["total"], 1, "only the real worker");
    assert_eq!(completion_status(&url).await, 200);
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

#[tokio::test]
async fn a_loop_through_two_gateways_is_cut_with_508() {
    // Without breakers: with them, each gateway stops sending to the other after five 508s
    // (503 then), which hides the loop verdict this test is about.
    let (_a, a) = gateway(json!({"admin_api_open": true, "disable_circuit_breaker": true})).await;
    let (_b, b) = gateway(json!({"admin_api_open": true, "disable_circuit_breaker": true})).await;
    let c = plain_client();
    for (at, worker) in [(&a, &b), (&b, &a)] {
        let r = c.post(format!("{at}/workers")).json(&json!({"url": worker, "worker_type": "regular"})).send().await.unwrap();
        assert_eq!(r.status(), 201, "{}", r.text().await.unwrap());
    }
    common::wait_ready(&a).await;
    common::wait_ready(&b).await;
    let before = open_fds();
    for _ in 0..30 {
        let r = c.post(format!("{a}/v1/completions")).json(&json!({"prompt": "x", "max_tokens": 2})).send().await.unwrap();
        let status = r.status();
        let v: Value = r.json().await.unwrap();
        assert_eq!(status, 508, "{v}");
        assert_eq!(v["error"]["code"], "loop_detected", "{v}");
    }
    let after = open_fds();
    assert!(after <= before + 16, "file descriptors grew from {before} to {after}");
    // A is cut by its own token on the second visit, once per request (no retries of a loop).
    assert_eq!(metric(&a, r#"pdgate_loops_refused_total{kind="via"}"#).await, 30.0);
    // A chain of too many pdgate gateways is cut too, whoever they were.
    let chain: Vec<String> = (0..8).map(|i| format!("1.1 pdgate-{i:016x}")).collect();
    let r = c.post(format!("{b}/v1/completions")).header("via", chain.join(", ")).json(&json!({"prompt": "x"})).send().await.unwrap();
    assert_eq!(r.status(), 508);
    assert_eq!(metric(&b, r#"pdgate_loops_refused_total{kind="hops"}"#).await, 1.0);
    // Both still serve.
    assert_eq!(c.get(format!("{a}/readiness")).send().await.unwrap().status(), 200);
    assert_eq!(c.get(format!("{b}/liveness")).send().await.unwrap().status(), 200);
}

/// A worker that records the `via` header of each completion it answers.
async fn via_recorder() -> (String, Arc<Mutex<Vec<String>>>) {
    use axum::routing::{get, post};
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    let app = axum::Router::new().route("/health", get(|| async { "ok" })).route(
        "/v1/completions",
        post(move |headers: axum::http::HeaderMap| {
            let record = record.clone();
            async move {
                let via = headers.get_all("via").iter().map(|v| v.to_str().unwrap().to_string()).collect::<Vec<_>>().join(", ");
                record.lock().unwrap().push(via);
                axum::Json(json!({"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]}))
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, seen)
}

#[tokio::test]
async fn forwarded_requests_carry_the_clients_via_and_the_gateways_entry() {
    let (worker, seen) = via_recorder().await;
    let (_gw, url) = gateway(json!({"worker_urls": [worker]})).await;
    common::wait_ready(&url).await;
    let c = plain_client();
    for via in [None, Some("1.0 edge-proxy")] {
        let req = c.post(format!("{url}/v1/completions")).json(&json!({"prompt": "x", "max_tokens": 2}));
        let req = match via {
            Some(v) => req.header("via", v),
            None => req,
        };
        assert_eq!(req.send().await.unwrap().status(), 200);
    }
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2, "{seen:?}");
    let token = seen[0].strip_prefix("1.1 ").unwrap();
    assert!(token.starts_with("pdgate-") && token.len() == "pdgate-".len() + 16, "{seen:?}");
    assert_eq!(seen[1], format!("1.0 edge-proxy, 1.1 {token}"));
}

#[tokio::test]
async fn a_burst_of_identical_failing_requests_logs_a_bounded_amount() {
    let logs = Captured::default();
    let _guard = tracing::subscriber::set_default(logs.subscriber());
    // Nothing listens on port 9: every request fails the same way, after its retries.
    let (_gw, url) = gateway(json!({"worker_urls": ["http://127.0.0.1:9"], "retry_max_retries": 0, "health_failure_threshold": 100})).await;
    let c = plain_client();
    for i in 0..200 {
        let r = c.post(format!("{url}/v1/completions")).header("x-request-id", format!("burst-{i}")).json(&json!({"prompt": "x"})).send().await.unwrap();
        assert!(r.status().is_server_error());
    }
    let text = logs.text();
    let failed: Vec<&str> = text.lines().filter(|l| l.contains("request failed")).collect();
    assert!(!failed.is_empty() && failed.len() <= 10, "{} warning lines:\n{text}", failed.len());
    assert!(failed.iter().all(|l| l.len() < 1200 && l.contains("request_id=burst-")), "{failed:?}");
    // The access log is one short line per request by design (turn it off with
    // `pdgate::access=off`); everything else stays bounded whatever the number of requests.
    let (access, rest): (Vec<&str>, Vec<&str>) = text.lines().partition(|l| l.contains("pdgate::access"));
    assert_eq!(access.len(), 200, "one access line per request");
    assert!(access.iter().all(|l| l.len() < 600), "{:?}", access.iter().max_by_key(|l| l.len()));
    let rest_len: usize = rest.iter().map(|l| l.len() + 1).sum();
    assert!(rest_len < 20_000, "{rest_len} bytes of log besides the access lines for 200 requests");
    assert_eq!(metric(&url, "pdgate_log_lines_suppressed_total").await, (200 - failed.len()) as f64);
}
