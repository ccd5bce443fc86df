//! Without `--enable-trace`: nothing is exported, even with a collector listening at
//! --otlp-traces-endpoint, and a client's valid W3C trace context reaches the workers unchanged
//! (an invalid one does not). A test binary of its own: tracing is set up once per process.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

mod common;
#[path = "common/otlp.rs"]
mod otlp;

use common::mocks::{spawn, Fault};
use common::{client, gateway, wait_ready};
use pdgate_gateway::GatewayConfig;
use serde_json::json;

const CLIENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tracing_off_exports_nothing_and_passes_the_clients_context_on() {
    let (rx, addr) = otlp::start();
    let endpoint = addr.to_string();
    pdgate_gateway::init_logging(&GatewayConfig { otlp_traces_endpoint: endpoint.clone(), log_level: "warn".into(), ..GatewayConfig::default() }).unwrap();
    let w = spawn("regular", Default::default(), Fault::None).await;
    let (gw, url) = gateway(json!({"worker_urls": [w.url], "otlp_traces_endpoint": endpoint})).await;
    wait_ready(&url).await;
    let send = |headers: Vec<(&'static str, &'static str)>| {
        let mut req = client().post(format!("{url}/v1/completions")).json(&json!({"prompt": "x", "max_tokens": 2, "stream": true}));
        for (k, v) in headers {
            req = req.header(k, v);
        }
        req.send()
    };
    assert_eq!(send(vec![("traceparent", CLIENT), ("tracestate", "rojo=00f067aa0ba902b7")]).await.unwrap().status(), 200);
    assert_eq!(send(vec![]).await.unwrap().status(), 200);
    assert_eq!(send(vec![("traceparent", "00-not-a-trace-01"), ("tracestate", "x=y")]).await.unwrap().status(), 200);
    let seen = w.log().trace_headers();
    assert_eq!(seen[0], (CLIENT.to_string(), "rojo=00f067aa0ba902b7".to_string()), "passed on as it came");
    assert_eq!(seen[1], (String::new(), String::new()), "none invented");
    assert_eq!(seen[2], (String::new(), String::new()), "an invalid traceparent (and its tracestate) is not passed on");
    // With tracing on, a flush exports every ended span before it returns.
    pdgate_gateway::flush_traces().await;
    gw.shutdown().await;
    assert!(rx.all().is_empty(), "nothing exported: {:?}", rx.all());
    assert_eq!(*rx.exports.lock().unwrap(), 0);
}
