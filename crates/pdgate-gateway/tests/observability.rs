//! Component tests, real sockets on loopback: the `--prometheus-port` listener, and the breaker
//! configured through its window option (the window itself, failures ageing out of it, is
//! unit-tested in pdgate-core's breaker.rs on an injected clock).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

mod common;

use common::mocks::{spawn, Fault, Rendezvous};
use common::{client, gateway, wait_ready};
use serde_json::json;
use std::sync::Arc;

#[tokio::test]
async fn metrics_have_their_own_listener_and_stay_on_the_main_port() {
    let (gw, url) = gateway(json!({"worker_urls": ["http://127.0.0.1:9"], "prometheus_port": 0})).await;
    let addr = gw.metrics_addr().expect("--prometheus-port 0 binds a free port");
    assert_ne!(addr.port(), gw.local_addr().port());
    let own = client().get(format!("http://{addr}/metrics")).send().await.unwrap();
    assert_eq!(own.status(), 200);
    let text = own.text().await.unwrap();
    assert!(text.contains("pdgate_retries_total{reason=\"unreachable\"} 0"), "series at 0 from the start");
    assert_eq!(client().get(format!("{url}/metrics")).send().await.unwrap().status(), 200);
    let api = client().get(format!("http://{addr}/v1/models")).send().await.unwrap();
    assert_eq!(api.status(), 404, "only /metrics on the metrics listener");
    gw.shutdown().await;
    assert!(tokio::net::TcpStream::connect(addr).await.is_err(), "the metrics listener stops with the gateway");
}

#[tokio::test]
async fn without_prometheus_port_there_is_no_second_listener() {
    let (gw, _url) = gateway(json!({"worker_urls": ["http://127.0.0.1:9"]})).await;
    assert_eq!(gw.metrics_addr(), None);
}

#[tokio::test]
async fn a_breaker_with_a_window_opens_on_consecutive_failures_within_it() {
    let w = spawn("regular", Arc::new(Rendezvous::default()), Fault::None).await;
    let (_gw, url) = gateway(json!({
        "worker_urls": [w.url], "breaker_failure_threshold": 2, "breaker_window_secs": 60, "retry_max_retries": 1,
        "breaker_cooldown_secs": 600, "health_failure_threshold": 100,
    }))
    .await;
    wait_ready(&url).await;
    w.set_fault(Fault::Status(500));
    for _ in 0..2 {
        let r = client().post(format!("{url}/v1/completions")).json(&json!({"prompt": "x", "max_tokens": 1})).send().await.unwrap();
        assert_eq!(r.status(), 502);
    }
    let r = client().post(format!("{url}/v1/completions")).json(&json!({"prompt": "x", "max_tokens": 1})).send().await.unwrap();
    assert_eq!(r.status(), 503, "two failures within the window opened the breaker");
    let metrics = client().get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains(&format!("pdgate_worker_breaker_state{{worker=\"{}\"}} 1", w.url)), "{metrics}");
}
