//! `--enable-trace` with a collector that never answers (it accepts connections and says
//! nothing): requests are served all the same, the spans that find the export queue full are
//! dropped and counted, and a graceful shutdown still ends. A test binary of its own: tracing is
//! set up once per process.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

mod common;

use std::time::Duration;

use common::mocks::{spawn, Fault};
use common::{client, gateway, wait_ready};
use futures_util::StreamExt;
use pdgate_gateway::GatewayConfig;
use serde_json::json;

/// A TCP listener that accepts and holds connections without ever answering.
async fn black_hole() -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((conn, _)) = listener.accept().await {
            held.push(conn);
        }
    });
    addr
}

fn counter(metrics: &str, name: &str) -> u64 {
    let line = metrics.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("{name} missing"));
    line.split_whitespace().last().unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_collector_never_fails_a_request_and_full_queue_drops_are_counted() {
    let hole = black_hole().await;
    pdgate_gateway::init_logging(&GatewayConfig { enable_trace: true, otlp_traces_endpoint: hole.to_string(), log_level: "error".into(), ..GatewayConfig::default() }).unwrap();
    let w = spawn("regular", Default::default(), Fault::None).await;
    let (gw, url) = gateway(json!({"worker_urls": [w.url]})).await;
    wait_ready(&url).await;
    // About 7 spans a request: 500 requests overflow the 2048-span queue while the exporter
    // waits on the silent collector.
    let c = client();
    let statuses: Vec<u16> = futures_util::stream::iter(0..500)
        .map(|_| {
            let c = c.clone();
            let url = url.clone();
            async move { c.post(format!("{url}/v1/completions")).json(&json!({"prompt": "x", "max_tokens": 2})).send().await.unwrap().status().as_u16() }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    assert!(statuses.iter().all(|s| *s == 200), "every request served: {statuses:?}");
    let metrics = c.get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(counter(&metrics, "pdgate_trace_spans_dropped_total") > 0, "the full queue drops spans (and counts them)");
    assert_eq!(counter(&metrics, "pdgate_trace_spans_exported_total{result=\"ok\"}"), 0, "the collector never took a span");
    // The flush at the end of a graceful shutdown is bounded: the shutdown ends.
    tokio::time::timeout(Duration::from_secs(60), gw.shutdown()).await.expect("shutdown ended");
}
