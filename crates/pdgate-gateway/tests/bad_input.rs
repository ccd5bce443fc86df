//! Client mistakes get a 4xx with an OpenAI-style error body, never a 5xx or a hang.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

mod common;

use common::mocks::{spawn, Fault};
use common::{client, gateway};
use serde_json::{json, Value};

#[tokio::test]
async fn bad_requests_are_4xx_with_openai_errors() {
    let w = spawn("regular", Default::default(), Fault::None).await;
    let (_gw, url) = gateway(json!({"worker_urls": [w.url], "max_payload_size": 1000})).await;
    let c = client();
    let cases: Vec<(&str, &str, String, u16, Option<&str>)> = vec![
        ("POST", "/v1/completions", "{not json".into(), 400, None),
        ("POST", "/v1/completions", "[]".into(), 400, None),
        ("POST", "/v1/completions", r#"{"model":"m"}"#.into(), 400, Some("prompt")),
        ("POST", "/v1/completions", r#"{"prompt":"x","max_tokens":-1}"#.into(), 400, Some("max_tokens")),
        ("POST", "/v1/chat/completions", r#"{"messages":"hi"}"#.into(), 400, Some("messages")),
        ("POST", "/generate", r#"{"sampling_params":{}}"#.into(), 400, Some("text")),
        ("POST", "/v1/completions", format!(r#"{{"prompt":"{}"}}"#, "x".repeat(2000)), 413, None),
        ("POST", "/v1/nope", "{}".into(), 404, None),
        ("GET", "/v1/completions", String::new(), 405, None),
    ];
    for (method, path, body, status, param) in cases {
        let req = if method == "GET" { c.get(format!("{url}{path}")) } else { c.post(format!("{url}{path}")).body(body.clone()) };
        let r = req.send().await.unwrap();
        assert_eq!(r.status().as_u16(), status, "{method} {path} {body:.60}");
        let v: Value = r.json().await.unwrap();
        assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
        assert!(v["error"]["type"].is_string() && v["error"]["code"].is_string(), "{v}");
        assert_eq!(v["error"]["param"].as_str(), param, "{v}");
    }
    assert_eq!(w.log().count(), 0, "nothing invalid reached a worker");
}

#[tokio::test]
async fn no_workers_is_a_clear_503() {
    let (_gw, url) = gateway(json!({"worker_urls": ["http://127.0.0.1:9"]})).await;
    let r = client().post(format!("{url}/v1/completions")).json(&json!({"prompt": "x"})).send().await.unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["x-pdgate-dropped-reason"], "no_available_workers");
    assert_eq!(r.headers()["retry-after"], "1");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "no_available_workers");
}
