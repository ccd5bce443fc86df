//! vLLM-style PD: NIXL params relayed verbatim (the mock decode pulls with them), Mooncake
//! transfer ids and engine-id discovery, and silent-recompute accounting.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

mod common;

use std::sync::Arc;

use common::mocks::{spawn, spawn_mooncake_bootstrap, Fault, Rendezvous};
use common::{client, gateway, wait_ready};
use serde_json::json;

async fn metric(url: &str, needle: &str) -> bool {
    client().get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap().contains(needle)
}

/// The silent-recompute series that are not 0 (every one exists at 0 from the start).
async fn recomputes_counted(url: &str) -> Vec<String> {
    let text = client().get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap();
    text.lines().filter(|l| l.starts_with("pdgate_pd_silent_recompute_total{") && !l.ends_with(" 0")).map(str::to_string).collect()
}

#[tokio::test]
async fn nixl_prefill_params_reach_the_decode_verbatim() {
    let rdv = Arc::new(Rendezvous::default());
    let p = spawn("nixl_prefill", rdv.clone(), Fault::None).await;
    let d = spawn("nixl_decode", rdv, Fault::None).await;
    let (_gw, url) = gateway(json!({"pd_disaggregation": true, "kv_connector": "nixl", "prefill": [p.url], "decode": [d.url]})).await;
    wait_ready(&url).await;
    let r = client()
        .post(format!("{url}/v1/chat/completions"))
        .header("x-request-id", "req-abc")
        .json(&json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "stream": true, "stream_options": {"include_usage": true}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    assert!(text.contains("\"cached_tokens\":5"), "decode pulled the blocks: {text}");
    let pb = &p.log().bodies()[0];
    assert_eq!((pb["stream"].clone(), pb["max_tokens"].clone(), pb["max_completion_tokens"].clone()), (json!(false), json!(1), json!(1)));
    assert!(pb.get("stream_options").is_none());
    let db = &d.log().bodies()[0];
    assert_eq!(db["max_tokens"], 20, "decode gets the original request");
    assert_eq!(db["stream"], true);
    assert_eq!(db["kv_transfer_params"]["remote_block_ids"], json!([7, 8, 9]));
    assert_eq!(db["kv_transfer_params"]["tp_size"], 1, "params relayed verbatim, extra fields too");
    let (p_ids, d_ids) = (p.log().request_ids.lock().unwrap().clone(), d.log().request_ids.lock().unwrap().clone());
    assert_eq!(p_ids, d_ids, "same X-Request-Id on both legs");
    assert!(p_ids[0].starts_with("req-abc-") && p_ids[0] != "req-abc", "minted from, never equal to, the client's id: {p_ids:?}");
    assert_eq!(recomputes_counted(&url).await, Vec::<String>::new());
}

#[tokio::test]
async fn a_decode_that_recomputed_is_counted() {
    // The prefill is a plain worker: it returns no kv_transfer_params.
    let rdv = Arc::new(Rendezvous::default());
    let p = spawn("regular", rdv.clone(), Fault::None).await;
    let d = spawn("nixl_decode", rdv, Fault::None).await;
    let (_gw, url) = gateway(json!({"pd_disaggregation": true, "kv_connector": "nixl", "prefill": [p.url], "decode": [d.url]})).await;
    wait_ready(&url).await;
    let r = client().post(format!("{url}/v1/completions")).json(&json!({"prompt": "x"})).send().await.unwrap();
    assert_eq!(r.status(), 200, "still succeeds");
    assert!(metric(&url, r#"pdgate_pd_silent_recompute_total{cause="no_params",protocol="nixl"} 1"#).await);
    assert_eq!(recomputes_counted(&url).await.len(), 1, "one request is counted once");
}

#[tokio::test]
async fn a_decode_that_reports_too_few_cached_tokens_is_counted() {
    // Params complete, but the decode could not pull (the prefill published no blocks).
    let rdv = Arc::new(Rendezvous::default());
    let p = spawn("nixl_prefill", Arc::new(Rendezvous::default()), Fault::None).await;
    let d = spawn("nixl_decode", rdv, Fault::None).await;
    let (_gw, url) = gateway(json!({"pd_disaggregation": true, "kv_connector": "nixl", "prefill": [p.url], "decode": [d.url]})).await;
    wait_ready(&url).await;
    let r = client().post(format!("{url}/v1/completions")).json(&json!({"prompt": "x"})).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(metric(&url, r#"pdgate_pd_silent_recompute_total{cause="decode_reported",protocol="nixl"} 1"#).await);
}

#[tokio::test]
async fn generate_is_refused_before_any_leg_in_vllm_modes() {
    let rdv = Arc::new(Rendezvous::default());
    let p = spawn("nixl_prefill", rdv.clone(), Fault::None).await;
    let d = spawn("nixl_decode", rdv, Fault::None).await;
    let (_gw, url) = gateway(json!({"pd_disaggregation": true, "kv_connector": "nixl", "prefill": [p.url], "decode": [d.url]})).await;
    wait_ready(&url).await;
    let r = client().post(format!("{url}/generate")).json(&json!({"text": "x"})).send().await.unwrap();
    assert_eq!(r.status(), 400);
    let v: serde_json::Value = r.json().await.unwrap();
    assert!(v["error"]["message"].as_str().unwrap().contains("/v1/completions"), "{v}");
    assert_eq!((p.log().count(), d.log().count()), (0, 0));
}

#[tokio::test]
async fn mooncake_legs_share_a_transfer_id_and_the_engine_id_is_discovered_once() {
    let (bport, qlog) = spawn_mooncake_bootstrap("engine-mc").await;
    let rdv = Arc::new(Rendezvous::default());
    let p = spawn("mooncake_prefill", rdv.clone(), Fault::None).await;
    let d = spawn("mooncake_decode", rdv, Fault::None).await;
    let (_gw, url) = gateway(json!({"pd_disaggregation": true, "kv_connector": "mooncake", "prefill": [[p.url, bport]], "decode": [d.url]})).await;
    wait_ready(&url).await;
    for _ in 0..3 {
        let r = client().post(format!("{url}/v1/completions")).json(&json!({"prompt": "x", "max_tokens": 5})).send().await.unwrap();
        assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    }
    let (pb, db) = (p.log().bodies(), d.log().bodies());
    for (a, b) in pb.iter().zip(&db) {
        assert_eq!(a["kv_transfer_params"]["transfer_id"], b["kv_transfer_params"]["transfer_id"]);
        assert_eq!(b["kv_transfer_params"]["remote_bootstrap_addr"], format!("http://127.0.0.1:{bport}"));
    }
    assert_ne!(pb[0]["kv_transfer_params"]["transfer_id"], pb[1]["kv_transfer_params"]["transfer_id"], "fresh id per request");
    assert_eq!(qlog.count(), 1, "engine id is cached");
}
