//! What a regular stream asks of its engine for the gateway's own accounting (issue 12: the
//! workers' CPU). A stream whose token ids the gateway reads (resume is on) counts its prompt
//! and its answer from them, so an engine known to send ids is not asked for the usage event;
//! one that ignores `return_token_ids` (or is not known yet) still is. Either way the request
//! log has the counts and the client sees neither usage nor ids it did not ask for.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

mod common;

use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::State;
use axum::response::Response;
use axum::routing::{get, post};
use axum::{Json, Router};
use common::{client, gateway, wait_ready};
use serde_json::{json, Value};

const PROMPT_IDS: [u64; 4] = [256, 104, 105, 33];
const TOKENS: usize = 3;

#[derive(Clone)]
struct Engine {
    /// Honours `return_token_ids` (vLLM); else ignores it (an engine without the field).
    gives_ids: bool,
    bodies: Arc<Mutex<Vec<Value>>>,
}

async fn completions(State(e): State<Engine>, Json(body): Json<Value>) -> Response {
    e.bodies.lock().unwrap().push(body.clone());
    let ids = e.gives_ids && body["return_token_ids"] == json!(true);
    let mut out = String::new();
    for j in 0..TOKENS {
        let mut c = json!({"index": 0, "text": format!("t{j}"), "finish_reason": if j + 1 == TOKENS { json!("length") } else { Value::Null }});
        if ids {
            c["token_ids"] = json!([100 + j]);
            if j == 0 {
                c["prompt_token_ids"] = json!(PROMPT_IDS);
            }
        }
        out.push_str(&format!("data: {}\n\n", json!({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [c]})));
    }
    if body["stream_options"]["include_usage"] == json!(true) {
        let usage = json!({"prompt_tokens": PROMPT_IDS.len(), "completion_tokens": TOKENS, "total_tokens": PROMPT_IDS.len() + TOKENS});
        out.push_str(&format!("data: {}\n\n", json!({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [], "usage": usage})));
    }
    out.push_str("data: [DONE]\n\n");
    Response::builder().header("content-type", "text/event-stream").body(Body::from(out)).unwrap()
}

async fn engine(gives_ids: bool) -> (String, Arc<Mutex<Vec<Value>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let bodies = Arc::new(Mutex::new(Vec::new()));
    let app = Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/v1/models", get(|| async { Json(json!({"object": "list", "data": [{"id": "m", "object": "model"}]})) }))
        .route("/v1/completions", post(completions))
        .with_state(Engine { gives_ids, bodies: bodies.clone() });
    tokio::spawn(async move {
        axum::serve(listener, app).await.ok();
    });
    (url, bodies)
}

/// The request log's lines once there are `n` (written off the request path: bounded poll).
async fn log_lines(path: &std::path::Path, n: usize) -> Vec<Value> {
    for _ in 0..200 {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        if text.lines().count() >= n {
            return text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("the request log never had {n} lines: {:?}", std::fs::read_to_string(path));
}

/// Three streams through a regular gateway to one engine: the bodies it got, the texts the
/// client got, the log lines.
async fn three_streams(gives_ids: bool, extra: Value) -> (Vec<Value>, Vec<String>, Vec<Value>) {
    let (url, bodies) = engine(gives_ids).await;
    let dir = std::env::temp_dir().join(format!("pdgate-usage-ask-{}-{gives_ids}-{}", std::process::id(), extra.as_object().unwrap().len()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("requests.jsonl");
    let _ = std::fs::remove_file(&log);
    let mut cfg = json!({"worker_urls": [url], "request_log": log.to_str().unwrap()});
    cfg.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    let (_gw, gw) = gateway(cfg).await;
    wait_ready(&gw).await;
    let mut texts = Vec::new();
    for _ in 0..3 {
        let r = client().post(format!("{gw}/v1/completions")).json(&json!({"prompt": "hi!", "max_tokens": TOKENS, "stream": true})).send().await.unwrap();
        assert_eq!(r.status(), 200);
        texts.push(r.text().await.unwrap());
    }
    let lines = log_lines(&log, 3).await;
    let bodies = bodies.lock().unwrap().iter().filter(|b| b["stream"] == json!(true)).cloned().collect();
    (bodies, texts, lines)
}

fn asked_usage(body: &Value) -> bool {
    body["stream_options"]["include_usage"] == json!(true)
}

fn assert_clean_and_counted(texts: &[String], lines: &[Value]) {
    for t in texts {
        assert!(t.contains("t2") && t.ends_with("data: [DONE]\n\n"), "{t}");
        assert!(!t.contains("usage") && !t.contains("token_ids"), "nothing the client did not ask for: {t}");
    }
    for line in lines {
        let counts = (line["prompt_tokens"].as_u64(), line["output_tokens"].as_u64());
        assert_eq!(counts, (Some(PROMPT_IDS.len() as u64), Some(TOKENS as u64)), "{line}");
        assert!(line["tpot_ms"].is_number(), "TPOT over the counted tokens: {line}");
    }
}

#[tokio::test]
async fn an_engine_known_to_send_token_ids_is_not_asked_for_the_usage_event() {
    let (bodies, texts, lines) = three_streams(true, json!({})).await;
    assert!(bodies.iter().all(|b| b["return_token_ids"] == json!(true)), "resume is on: ids asked for");
    let asked: Vec<bool> = bodies.iter().map(asked_usage).collect();
    assert_eq!(asked, [true, false, false], "usage only until the engine showed it sends ids");
    assert_clean_and_counted(&texts, &lines);
}

#[tokio::test]
async fn an_engine_that_ignores_return_token_ids_keeps_being_asked_for_usage() {
    let (bodies, texts, lines) = three_streams(false, json!({})).await;
    assert!(bodies.iter().all(asked_usage), "its counts can only come from its usage event");
    assert_clean_and_counted(&texts, &lines);
}

#[tokio::test]
async fn without_resume_no_ids_are_asked_for_and_usage_always_is() {
    let (bodies, texts, lines) = three_streams(true, json!({"max_resumes": 0})).await;
    assert!(bodies.iter().all(|b| asked_usage(b) && b.get("return_token_ids").is_none()), "{bodies:?}");
    assert_clean_and_counted(&texts, &lines);
}
