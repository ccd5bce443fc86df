//! Load in tokens and KV, through real sockets: a prefill's routing load ends when its KV is
//! handed off while its drain count lasts until the decode is done; mock vLLM workers' `/metrics`
//! feed free KV to `most_free_kv` and their `cache_config_info` to strict pairing.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

mod common;

use std::sync::Arc;
use std::time::Duration;

use axum::routing::get;
use common::mocks::{app, mock_state, spawn, Fault, Rendezvous};
use common::{client, gateway, wait_ready};
use serde_json::json;

/// The value of the series `name{worker="url",...}` on the gateway's `/metrics`.
async fn gauge(url: &str, name: &str, worker: &str) -> Option<i64> {
    let text = client().get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap();
    let prefix = format!("{name}{{");
    text.lines().filter(|l| l.starts_with(&prefix) && l.contains(&format!("worker=\"{worker}\""))).find_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).map(|v| v as i64)
}

/// Polls until `check` holds (bounded: 10 s); panics with `what` otherwise.
async fn until<F: std::future::Future<Output = bool>>(what: &str, mut check: impl FnMut() -> F) {
    for _ in 0..500 {
        if check().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("never: {what}");
}

#[tokio::test]
async fn a_prefill_stops_loading_routing_at_handoff_but_drain_still_holds_it() {
    let rdv = Arc::new(Rendezvous::default());
    let p = spawn("nixl_prefill", rdv.clone(), Fault::Slow(300)).await;
    let d = spawn("nixl_decode", rdv, Fault::SlowStream(300)).await;
    let cfg = json!({"pd_disaggregation": true, "kv_connector": "nixl", "prefill": [p.url], "decode": [d.url], "load_poll_interval_secs": 0, "chars_per_token": 1.0});
    let (_gw, url) = gateway(cfg).await;
    wait_ready(&url).await;
    let gw = url.clone();
    let request = tokio::spawn(async move {
        let body = json!({"prompt": "x".repeat(400), "max_tokens": 100, "stream": true});
        client().post(format!("{gw}/v1/completions")).json(&body).send().await.unwrap().text().await.unwrap()
    });
    // While the prefill computes: its 400 prompt tokens are queued there.
    until("the prefill shows the prompt's tokens", || async { gauge(&url, "pdgate_worker_prompt_tokens", &p.url).await == Some(400) }).await;
    // Once it answered (KV handed off) and while the decode still streams: routing sees an idle
    // prefill, drain still counts the request on it.
    until("handoff while the decode streams", || async {
        let text = client().get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap();
        let series = |name: &str, w: &str| text.lines().any(|l| l.starts_with(name) && l.contains(&format!("worker=\"{w}\"")) && l.ends_with(" 1"));
        if !series("pdgate_worker_queued_requests{", &d.url) {
            return false;
        }
        assert!(series("pdgate_worker_inflight{", &p.url), "drain count lasts while the decode runs");
        let idle = |name: &str| text.lines().any(|l| l.starts_with(name) && l.contains(&format!("worker=\"{}\"", p.url)) && l.ends_with(" 0"));
        idle("pdgate_worker_prompt_tokens{") && idle("pdgate_worker_queued_requests{")
    })
    .await;
    let text = tokio::time::timeout(Duration::from_secs(10), request).await.unwrap().unwrap();
    assert!(text.contains("[DONE]"), "{text}");
    until("everything released", || async {
        gauge(&url, "pdgate_worker_inflight", &p.url).await == Some(0) && gauge(&url, "pdgate_worker_queued_requests", &d.url).await == Some(0)
    })
    .await;
}

/// A vLLM `/metrics` page: `running` requests, `blocks` KV blocks of 16 tokens, none used.
fn vllm_page(running: u32, blocks: u32) -> String {
    format!(
        "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{engine=\"0\",model_name=\"m\"}} {running}.0\nvllm:num_requests_waiting{{engine=\"0\",model_name=\"m\"}} 0.0\n\
         vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"m\"}} 0.0\nvllm:cache_config_info{{block_size=\"16\",cache_dtype=\"auto\",engine=\"0\",num_gpu_blocks=\"{blocks}\"}} 1.0\n"
    )
}

/// A mock worker of `role` that also serves `page` at `/metrics`.
async fn spawn_with_metrics(role: &'static str, rdv: Arc<Rendezvous>, page: String) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let router = app(mock_state(role, rdv, Fault::None)).route("/metrics", get(move || std::future::ready(page.clone())));
    tokio::spawn(async move { axum::serve(listener, router).await.ok() });
    url
}

#[tokio::test]
async fn vllm_metrics_give_strict_pairing_keys_and_free_kv() {
    let rdv = Arc::new(Rendezvous::default());
    let p = spawn_with_metrics("nixl_prefill", rdv.clone(), vllm_page(0, 1000)).await;
    // `small` has room for 160 tokens and an empty batch; `big` for 16,000 and 5 running.
    let small = spawn_with_metrics("nixl_decode", rdv.clone(), vllm_page(0, 10)).await;
    let big = spawn_with_metrics("nixl_decode", rdv, vllm_page(5, 1000)).await;
    let cfg = json!({"pd_disaggregation": true, "kv_connector": "nixl", "prefill": [p], "decode": [small, big], "pd_pairing_mode": "strict",
                     "decode_policy": "most_free_kv", "load_poll_interval_secs": 1, "chars_per_token": 1.0, "admin_api_open": true});
    let (_gw, url) = gateway(cfg).await;
    // Strict pairing refuses unknown KV layouts: ready only once the scrape supplied them.
    wait_ready(&url).await;
    let workers: serde_json::Value = client().get(format!("{url}/workers")).send().await.unwrap().json().await.unwrap();
    for w in workers["workers"].as_array().unwrap() {
        assert_eq!(w["pd_pairing"]["runtime"], "vllm", "{w}");
        assert_eq!((w["pd_pairing"]["kv_layout"]["page_size"].clone(), w["pd_pairing"]["kv_layout"]["kv_dtype"].clone()), (json!(16), json!("auto")), "{w}");
    }
    until("free KV scraped", || async { gauge(&url, "pdgate_worker_free_kv_tokens", &small).await == Some(160) }).await;
    assert_eq!(gauge(&url, "pdgate_worker_free_kv_tokens", &big).await, Some(16_000));
    let send = |prompt: usize, max_tokens: u64| {
        let url = url.clone();
        async move {
            let r = client().post(format!("{url}/v1/completions")).json(&json!({"prompt": "y".repeat(prompt), "max_tokens": max_tokens})).send().await.unwrap();
            assert_eq!(r.status(), 200);
            r.headers()["x-pdgate-route"].to_str().unwrap().to_string()
        }
    };
    // 100 + 100 tokens do not fit in 160: the big decode, whatever its batch.
    let route = send(100, 100).await;
    assert!(route.contains(&format!("decode={big}")), "{route}");
    // 10 + 10 fit in both: the smaller batch.
    let route = send(10, 10).await;
    assert!(route.contains(&format!("decode={small}")), "{route}");
}
