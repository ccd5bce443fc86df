//! Workers behind TLS and a worker key, through real sockets: `https://` workers whose
//! certificate a private CA made in the test signs, `--worker-ca-cert`, and
//! `--worker-api-key` on every call to a worker, never the client's key.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

mod common;
#[path = "common/tls.rs"]
mod tls;

use std::sync::{Arc, Mutex};

use axum::routing::get;
use axum::{Json, Router};
use common::mocks::{app, mock_state, Fault, Rendezvous};
use common::{client, gateway, wait_ready};
use serde_json::{json, Value};
use tls::{recording, serve, Seen, ServerTls, TestCa};

const WORKER_KEY: &str = "worker-secret-1";
const CLIENT_KEY: &str = "client-secret-2";

/// A mock engine of `role` over TLS with a certificate for 127.0.0.1 signed by `ca`.
async fn tls_worker(role: &'static str, rdv: Arc<Rendezvous>, ca: &TestCa, keep_alive: bool) -> (String, Seen, ServerTls) {
    let seen = Seen::default();
    let tls: ServerTls = Arc::new(Mutex::new(ca.server_config(&["127.0.0.1", "localhost"])));
    let addr = serve(recording(app(mock_state(role, rdv, Fault::None)), seen.clone()), tls.clone(), keep_alive).await;
    (format!("https://127.0.0.1:{}", addr.port()), seen, tls)
}

async fn workers_view(url: &str) -> Value {
    client().get(format!("{url}/workers")).send().await.unwrap().json().await.unwrap()
}

#[tokio::test]
async fn https_worker_signed_by_the_given_ca_serves_and_sees_only_the_worker_key() {
    let ca = TestCa::new("pdgate test CA");
    let (w, seen, _) = tls_worker("regular", Default::default(), &ca, true).await;
    let (_gw, url) = gateway(json!({
        "worker_urls": [w], "worker_ca_cert": ca.write_pem(), "worker_api_key": WORKER_KEY, "api_key": CLIENT_KEY,
    }))
    .await;
    wait_ready(&url).await;
    for stream in [false, true] {
        let r = client()
            .post(format!("{url}/v1/completions"))
            .bearer_auth(CLIENT_KEY)
            .json(&json!({"model": "m", "prompt": "hi", "max_tokens": 3, "stream": stream}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "stream={stream}");
        let body = r.text().await.unwrap();
        assert!(body.contains("decoded") || body.contains("tok0"), "{body}");
    }
    let all = seen.all();
    let paths = seen.paths();
    // Requests, health checks and the start-up probes all reached the worker over TLS...
    for path in ["/v1/completions", "/health", "/v1/models", "/server_info"] {
        assert!(paths.iter().any(|p| p == path), "{path} never reached the worker: {paths:?}");
    }
    // ...each with the worker key, none with the client's.
    for (path, auth) in &all {
        assert_eq!(auth, &format!("Bearer {WORKER_KEY}"), "{path}");
        assert!(!auth.contains(CLIENT_KEY), "{path}: the client's key reached a worker");
    }
}

#[tokio::test]
async fn without_the_ca_an_https_worker_is_refused_cleanly_and_never_sees_a_request() {
    let ca = TestCa::new("a CA the gateway does not know");
    let (w, seen, _) = tls_worker("regular", Default::default(), &ca, true).await;
    // The system roots do not include a CA made a moment ago.
    let (_gw, url) = gateway(json!({"worker_urls": [w], "admin_api_open": true})).await;
    // Health checks cannot complete a handshake, so the worker never turns healthy, and a
    // request is answered at once instead of hanging.
    let r = client().post(format!("{url}/v1/completions")).json(&json!({"prompt": "x"})).send().await.unwrap();
    assert_eq!(r.status(), 503);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "no_available_workers", "{v}");
    assert!(seen.all().is_empty(), "no request got through a refused handshake: {:?}", seen.all());
    let workers = workers_view(&url).await;
    assert_eq!(workers["workers"][0]["healthy"], false, "{workers}");
}

#[tokio::test]
async fn a_certificate_the_gateway_does_not_trust_fails_the_leg_with_a_tls_error_the_breaker_counts() {
    let ca = TestCa::new("pdgate test CA");
    // One request per connection, so each request makes a fresh handshake.
    let (w, _seen, tls) = tls_worker("regular", Default::default(), &ca, false).await;
    let (_gw, url) = gateway(json!({
        "worker_urls": [w], "worker_ca_cert": ca.write_pem(), "admin_api_open": true,
        "breaker_failure_threshold": 1, "retry_max_retries": 0, "health_check_interval_secs": 3600,
    }))
    .await;
    wait_ready(&url).await;
    // The worker now presents a certificate from a CA the gateway was not told about.
    *tls.lock().unwrap() = TestCa::new("an impostor CA").server_config(&["127.0.0.1"]);
    let r = client().post(format!("{url}/v1/completions")).json(&json!({"prompt": "x"})).send().await.unwrap();
    assert_eq!(r.status(), 503);
    let v: Value = r.json().await.unwrap();
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert_eq!(v["error"]["code"], "worker_unavailable", "{v}");
    assert!(message.contains("TLS handshake failed") && message.contains("certificate"), "{message}");
    let workers = workers_view(&url).await;
    assert_eq!(workers["workers"][0]["breaker"], "open", "the TLS failure counts as a worker failure: {workers}");
}

/// A Mooncake-style bootstrap server (plain HTTP, as engines serve it) that records the
/// `Authorization` of each `GET /query`.
async fn recording_bootstrap(seen: Seen) -> u16 {
    let app = Router::new().route("/query", get(|| async { Json(json!({"0": {"engine_id": "engine-mc"}})) }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let app = recording(app, seen);
    tokio::spawn(async move { axum::serve(listener, app).await.ok() });
    port
}

#[tokio::test]
async fn pd_legs_over_tls_carry_the_worker_key_but_the_plain_bootstrap_query_does_not() {
    let ca = TestCa::new("pdgate test CA");
    let rdv = Arc::new(Rendezvous::default());
    let (p, p_seen, _) = tls_worker("mooncake_prefill", rdv.clone(), &ca, true).await;
    let (d, d_seen, _) = tls_worker("mooncake_decode", rdv, &ca, true).await;
    let q_seen = Seen::default();
    let bport = recording_bootstrap(q_seen.clone()).await;
    let (_gw, url) = gateway(json!({
        "pd_disaggregation": true, "kv_connector": "mooncake", "prefill": [[p, bport]], "decode": [d],
        "worker_ca_cert": ca.write_pem(), "worker_api_key": WORKER_KEY, "api_key": CLIENT_KEY,
    }))
    .await;
    wait_ready(&url).await;
    let r = client().post(format!("{url}/v1/completions")).bearer_auth(CLIENT_KEY).json(&json!({"prompt": "x", "max_tokens": 5})).send().await.unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    for (role, seen) in [("prefill", &p_seen), ("decode", &d_seen)] {
        assert!(seen.paths().iter().any(|p| p == "/v1/completions"), "{role} leg missing");
        for (path, auth) in seen.all() {
            assert_eq!(auth, format!("Bearer {WORKER_KEY}"), "{role} {path}");
        }
    }
    // The bootstrap server is plain HTTP: the key of a TLS worker is not sent there in clear.
    assert_eq!(q_seen.all(), vec![("/query".to_string(), String::new())]);
}

#[tokio::test]
async fn plain_http_workers_get_the_worker_key_everywhere_including_the_bootstrap_query() {
    let rdv = Arc::new(Rendezvous::default());
    let seen = [Seen::default(), Seen::default()];
    let mut urls = vec![];
    for (role, seen) in ["mooncake_prefill", "mooncake_decode"].into_iter().zip(&seen) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        urls.push(format!("http://{}", listener.local_addr().unwrap()));
        let app = recording(app(mock_state(role, rdv.clone(), Fault::None)), seen.clone());
        tokio::spawn(async move { axum::serve(listener, app).await.ok() });
    }
    let q_seen = Seen::default();
    let bport = recording_bootstrap(q_seen.clone()).await;
    let (_gw, url) = gateway(json!({
        "pd_disaggregation": true, "kv_connector": "mooncake", "prefill": [[urls[0], bport]], "decode": [urls[1]],
        "worker_api_key": WORKER_KEY, "api_key": CLIENT_KEY,
    }))
    .await;
    wait_ready(&url).await;
    let r = client().post(format!("{url}/v1/completions")).bearer_auth(CLIENT_KEY).json(&json!({"prompt": "x", "max_tokens": 5})).send().await.unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let everything: Vec<(String, String)> = seen.iter().flat_map(Seen::all).chain(q_seen.all()).collect();
    assert!(everything.iter().any(|(p, _)| p == "/query"), "{everything:?}");
    assert_eq!(everything.iter().filter(|(p, _)| p == "/v1/completions").count(), 2, "{everything:?}");
    for (path, auth) in &everything {
        assert_eq!(auth, &format!("Bearer {WORKER_KEY}"), "{path}");
    }
}

#[tokio::test]
async fn without_a_worker_key_the_clients_key_is_still_not_forwarded() {
    let seen = Seen::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let w = format!("http://{}", listener.local_addr().unwrap());
    let worker = recording(app(mock_state("regular", Default::default(), Fault::None)), seen.clone());
    tokio::spawn(async move { axum::serve(listener, worker).await.ok() });
    let (_gw, url) = gateway(json!({"worker_urls": [w], "api_key": CLIENT_KEY})).await;
    wait_ready(&url).await;
    let r = client().post(format!("{url}/v1/completions")).bearer_auth(CLIENT_KEY).json(&json!({"prompt": "x"})).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(seen.paths().iter().any(|p| p == "/v1/completions"));
    assert!(seen.all().iter().all(|(_, auth)| auth.is_empty()), "{:?}", seen.all());
}

#[tokio::test]
async fn an_unusable_ca_bundle_stops_the_gateway_from_starting() {
    let path = std::env::temp_dir().join(format!("pdgate-not-a-ca-{}.pem", std::process::id()));
    std::fs::write(&path, "this is not a certificate").unwrap();
    for bad in [path.to_string_lossy().into_owned(), "/nonexistent/ca.pem".to_string()] {
        let config = pdgate_gateway::GatewayConfig::from_json(&json!({"port": 0, "worker_ca_cert": bad}).to_string()).unwrap();
        let err = pdgate_gateway::start(config).await.err().expect("a gateway started with an unusable CA bundle");
        assert!(err.to_string().contains(&bad), "{err}");
    }
}

#[tokio::test]
async fn an_https_worker_registered_through_the_workers_api_serves_over_tls() {
    let ca = TestCa::new("pdgate test CA");
    let (w, seen, _) = tls_worker("regular", Default::default(), &ca, true).await;
    let (_gw, url) = gateway(json!({"worker_ca_cert": ca.write_pem(), "worker_api_key": WORKER_KEY, "admin_api_open": true})).await;
    let r = client().post(format!("{url}/workers")).json(&json!({"url": w, "worker_type": "regular"})).send().await.unwrap();
    assert_eq!(r.status(), 201, "{}", r.text().await.unwrap());
    wait_ready(&url).await;
    let r = client().post(format!("{url}/v1/completions")).json(&json!({"prompt": "x"})).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let route = r.headers()["x-pdgate-route"].to_str().unwrap().to_string();
    assert!(route.contains(&format!("worker={w}")), "{route}");
    assert!(seen.all().iter().all(|(_, auth)| auth == &format!("Bearer {WORKER_KEY}")), "{:?}", seen.all());
}
