//! In-process mock workers on loopback that enforce the PD protocols, and a gateway launcher.
#![allow(dead_code)]

pub mod mocks;

use std::net::SocketAddr;
use std::time::Duration;

use pdgate_gateway::{start, GatewayConfig, RunningGateway};

pub async fn gateway(json: serde_json::Value) -> (RunningGateway, String) {
    let mut cfg = json;
    let obj = cfg.as_object_mut().unwrap();
    obj.entry("port").or_insert(0.into());
    obj.entry("health_check_interval_secs").or_insert(1.into());
    obj.entry("retry_initial_backoff_ms").or_insert(1.into());
    obj.entry("retry_max_backoff_ms").or_insert(5.into());
    let config = GatewayConfig::from_json(&cfg.to_string()).unwrap();
    let gw = start(config).await.unwrap();
    let url = format!("http://{}", gw.local_addr());
    (gw, url)
}

/// Waits (bounded) until `/readiness` says ready.
pub async fn wait_ready(url: &str) {
    let client = reqwest::Client::new();
    for _ in 0..100 {
        if let Ok(r) = client.get(format!("{url}/readiness")).send().await {
            if r.status() == 200 {
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("gateway {url} never became ready");
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(20)).build().unwrap()
}

pub fn addr_url(addr: SocketAddr) -> String {
    format!("http://{addr}")
}
