//! Resume after decode death (issue 12 item 2), through the whole transaction: a decode that
//! dies after k token chunks, a second decode that continues the answer. The mock decodes are
//! a tiny deterministic "model" (the token at position j of the sequence is `b'a' + j % 26`),
//! so a continued answer can be compared with an uninterrupted one.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use common::{client, gateway, wait_ready};
use futures_util::StreamExt;
use serde_json::{json, Value};

/// One mock engine; all decodes of a test share `kill`: the first stream any of them serves
/// dies after `die_after` token chunks (the connection drops, no `[DONE]`).
struct Engine {
    url: String,
    bodies: Arc<Mutex<Vec<Value>>>,
    died: Arc<AtomicBool>,
}

#[derive(Clone)]
struct EngineState {
    chat: bool,
    die_after: usize,
    kill: Arc<AtomicBool>,
    /// Dies on every stream, not just the first of the fleet.
    always: bool,
    bodies: Arc<Mutex<Vec<Value>>>,
    died: Arc<AtomicBool>,
}

fn prompt_ids(body: &Value) -> Vec<u64> {
    match body.get("prompt") {
        Some(Value::Array(ids)) => ids.iter().map(|t| t.as_u64().unwrap()).collect(),
        Some(Value::String(s)) => std::iter::once(256).chain(s.bytes().map(u64::from)).collect(),
        _ => {
            let text: String = body["messages"].as_array().unwrap().iter().map(|m| format!("<{}>{}", m["role"].as_str().unwrap(), m["content"].as_str().unwrap())).collect();
            std::iter::once(256).chain(text.bytes().map(u64::from)).collect()
        }
    }
}

fn token_at(position: usize) -> u64 {
    u64::from(b'a') + (position % 26) as u64
}

fn sse(v: &Value) -> String {
    format!("data: {v}\n\n")
}

/// The stream a vLLM-style engine sends with `return_token_ids` (chat: the prompt ids on the
/// role chunk; completions: on the first choice).
fn stream_events(chat: bool, body: &Value) -> Vec<String> {
    let prompt = prompt_ids(body);
    let ids = body["return_token_ids"] == json!(true);
    let max = body.get("max_tokens").and_then(Value::as_u64).unwrap_or(16) as usize;
    let (id, object) = if chat { ("chatcmpl-1", "chat.completion.chunk") } else { ("cmpl-1", "text_completion") };
    let head = |choice: Value| json!({"id": id, "object": object, "created": 1, "model": "m", "choices": [choice]});
    let mut out = Vec::new();
    if chat {
        let mut role = head(json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}));
        if ids {
            role["prompt_token_ids"] = json!(prompt);
        }
        out.push(sse(&role));
    }
    for j in 0..max {
        let tok = token_at(prompt.len() + j);
        let text = char::from(tok as u8).to_string();
        let finish = if j + 1 == max { json!("length") } else { Value::Null };
        let mut c = if chat { json!({"index": 0, "delta": {"content": text}, "finish_reason": finish}) } else { json!({"index": 0, "text": text, "finish_reason": finish}) };
        if ids {
            c["token_ids"] = json!([tok]);
            if j == 0 && !chat {
                c["prompt_token_ids"] = json!(prompt);
            }
        }
        out.push(sse(&head(c)));
    }
    if body["stream_options"]["include_usage"] == json!(true) {
        let usage = json!({"prompt_tokens": prompt.len(), "completion_tokens": max, "total_tokens": prompt.len() + max});
        out.push(sse(&json!({"id": id, "object": object, "created": 1, "model": "m", "choices": [], "usage": usage})));
    }
    out.push("data: [DONE]\n\n".into());
    out
}

async fn generate(State(st): State<EngineState>, Json(body): Json<Value>) -> Response {
    st.bodies.lock().unwrap().push(body.clone());
    let chat = st.chat && body.get("messages").is_some();
    if body["stream"] != json!(true) {
        if body.get("max_tokens") != Some(&json!(1)) && st.die_after > 0 && !st.kill.swap(true, Ordering::SeqCst) {
            // A decode that dies before its whole answer.
            st.died.store(true, Ordering::SeqCst);
            let s = futures_util::stream::iter([Err::<String, _>(std::io::Error::other("engine died"))]);
            return Response::builder().header("content-type", "application/json").body(Body::from_stream(s)).unwrap();
        }
        // A prefill's (or a non-stream) answer.
        return Json(json!({"id": "cmpl-p", "object": "text_completion", "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                           "usage": {"prompt_tokens": 1, "completion_tokens": 1}}))
        .into_response();
    }
    let mut events = stream_events(chat, &body);
    let dies = st.die_after > 0 && (st.always || !st.kill.swap(true, Ordering::SeqCst));
    if dies {
        st.died.store(true, Ordering::SeqCst);
        events.truncate(st.die_after + usize::from(chat));
    }
    let items: Vec<Result<String, std::io::Error>> = events.into_iter().map(Ok).collect();
    // The death comes after the chunks were written out (hyper would drop a head not yet sent).
    let tail = futures_util::stream::iter(if dies { vec![Err(std::io::Error::other("engine died"))] } else { vec![] }).then(|e| async move {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        e
    });
    let s = futures_util::stream::iter(items).chain(tail);
    Response::builder().header("content-type", "text/event-stream").body(Body::from_stream(s)).unwrap()
}

async fn engine(die_after: usize, kill: Arc<AtomicBool>) -> Engine {
    engine_with(die_after, kill, false).await
}

async fn engine_with(die_after: usize, kill: Arc<AtomicBool>, always: bool) -> Engine {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (bodies, died) = (Arc::new(Mutex::new(Vec::new())), Arc::new(AtomicBool::new(false)));
    let st = EngineState { chat: true, die_after, kill, always, bodies: bodies.clone(), died: died.clone() };
    let app = Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/v1/models", get(|| async { Json(json!({"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": 4096}]})) }))
        .route("/v1/completions", post(generate))
        .route("/v1/chat/completions", post(generate))
        .route("/abort_request", post(|| async { Json(json!({})) }))
        .with_state(st);
    tokio::spawn(async move {
        axum::serve(listener, app).await.ok();
    });
    Engine { url, bodies, died }
}

impl Engine {
    fn streams(&self) -> Vec<Value> {
        self.bodies.lock().unwrap().iter().filter(|b| b["stream"] == json!(true)).cloned().collect()
    }
}

struct Stack {
    _gw: pdgate_gateway::RunningGateway,
    url: String,
    decodes: [Engine; 2],
}

/// A bootstrap PD stack, one prefill, two decodes; the first decode stream dies after
/// `die_after` chunks (0: never).
async fn stack(die_after: usize, extra: Value) -> Stack {
    let kill = Arc::new(AtomicBool::new(false));
    let p = engine(0, kill.clone()).await;
    let decodes = [engine(die_after, kill.clone()).await, engine(die_after, kill).await];
    let mut cfg = json!({"pd_disaggregation": true, "kv_connector": "bootstrap", "prefill": [p.url], "decode": [decodes[0].url, decodes[1].url],
                         "retry_max_retries": 0});
    cfg.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    let (gw, url) = gateway(cfg).await;
    wait_ready(&url).await;
    Stack { _gw: gw, url, decodes }
}

async fn post_stream(url: &str, path: &str, body: Value) -> String {
    let r = client().post(format!("{url}{path}")).json(&body).send().await.unwrap();
    if r.status() != 200 {
        panic!("{}: {}", r.status(), r.text().await.unwrap());
    }
    let mut out = Vec::new();
    let mut s = r.bytes_stream();
    while let Some(chunk) = s.next().await {
        out.extend_from_slice(&chunk.unwrap());
    }
    String::from_utf8(out).unwrap()
}

fn events(text: &str) -> Vec<Value> {
    text.split("\n\n").filter_map(|e| e.strip_prefix("data: ")).filter(|d| *d != "[DONE]").map(|d| serde_json::from_str(d).unwrap()).collect()
}

fn joined_text(evs: &[Value]) -> String {
    evs.iter().flat_map(|e| e["choices"].as_array().unwrap().iter()).filter_map(|c| c.get("text").or_else(|| c["delta"].get("content")).and_then(Value::as_str)).collect()
}

async fn metric(url: &str, line: &str) -> Option<f64> {
    let text = client().get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap();
    text.lines().find_map(|l| l.strip_prefix(line).and_then(|v| v.trim().parse().ok()))
}

/// Which decode served the dying stream, and the other one.
fn dead_and_live(s: &Stack) -> (&Engine, &Engine) {
    if s.decodes[0].died.load(Ordering::SeqCst) {
        (&s.decodes[0], &s.decodes[1])
    } else {
        (&s.decodes[1], &s.decodes[0])
    }
}

#[tokio::test]
async fn a_completions_stream_whose_decode_dies_is_continued_seamlessly() {
    let s = stack(3, json!({})).await;
    let body = json!({"prompt": "hello", "stream": true, "max_tokens": 8, "stream_options": {"include_usage": true}});
    let text = post_stream(&s.url, "/v1/completions", body.clone()).await;
    assert!(text.ends_with("data: [DONE]\n\n") && !text.contains("\"error\""), "{text}");
    let evs = events(&text);
    let uninterrupted = events(&post_stream(&s.url, "/v1/completions", body).await);
    assert_eq!(joined_text(&evs), joined_text(&uninterrupted), "no text lost or repeated");
    assert_eq!(joined_text(&evs).len(), 8);
    assert!(evs.iter().all(|e| e["id"] == "cmpl-1" && e["object"] == "text_completion" && e["created"] == 1), "{text}");
    assert!(evs.iter().flat_map(|e| e["choices"].as_array().unwrap()).all(|c| c["index"] == 0 && c.get("token_ids").is_none()), "ids hidden: {text}");
    let usage = &evs.last().unwrap()["usage"];
    assert_eq!(usage, &json!({"prompt_tokens": 6, "completion_tokens": 8, "total_tokens": 14}), "the whole answer");

    let (dead, live) = dead_and_live(&s);
    let first = &dead.streams()[0];
    assert_eq!(first["return_token_ids"], json!(true), "the gateway asks for ids");
    let cont = &live.streams()[0];
    let prompt: Vec<u64> = std::iter::once(256).chain(b"hello".iter().map(|&b| u64::from(b))).chain((6..9).map(token_at)).collect();
    assert_eq!(cont["prompt"], json!(prompt), "prompt ids + the 3 generated ids");
    assert_eq!(cont["max_tokens"], json!(5), "max_tokens less what was generated");
    assert_eq!(metric(&s.url, "pdgate_resumes_total{reason=\"decode_died\",result=\"resumed\"}").await, Some(1.0));
}

#[tokio::test]
async fn a_chat_stream_is_continued_inside_the_assistant_message() {
    let s = stack(2, json!({})).await;
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "stream": true, "max_tokens": 6, "return_token_ids": true});
    let text = post_stream(&s.url, "/v1/chat/completions", body.clone()).await;
    assert!(text.ends_with("data: [DONE]\n\n") && !text.contains("\"error\""), "{text}");
    let evs = events(&text);
    let uninterrupted = events(&post_stream(&s.url, "/v1/chat/completions", body).await);
    assert_eq!(joined_text(&evs), joined_text(&uninterrupted));
    assert!(evs.iter().all(|e| e["id"] == "chatcmpl-1" && e["object"] == "chat.completion.chunk"), "{text}");
    let ids: Vec<Value> = evs.iter().flat_map(|e| e["choices"].as_array().unwrap()).filter_map(|c| c.get("token_ids")).flat_map(|t| t.as_array().unwrap().clone()).collect();
    assert_eq!(ids.len(), 6, "the client asked for ids: all of them, once: {text}");
    let (_, live) = dead_and_live(&s);
    let cont = &live.streams()[0];
    assert!(cont.get("messages").is_none() && cont["prompt"].is_array(), "continued as completions on the rendered prompt: {cont}");
    assert_eq!(cont["max_tokens"], json!(4));
}

#[tokio::test]
async fn with_max_resumes_0_the_stream_ends_with_the_error_event() {
    let s = stack(3, json!({"max_resumes": 0})).await;
    let text = post_stream(&s.url, "/v1/completions", json!({"prompt": "hello", "stream": true, "max_tokens": 8})).await;
    assert!(text.contains("\"error\"") && !text.contains("[DONE]") && !text.contains("not resumed"), "no resume was tried: {text}");
    assert!(s.decodes.iter().all(|d| d.streams().iter().all(|b| b.get("return_token_ids").is_none())), "no ids asked for");
    assert_eq!(s.decodes.iter().map(|d| d.streams().len()).sum::<usize>(), 1, "no continuation");
}

#[tokio::test]
async fn guided_and_n_greater_than_1_streams_are_not_resumed_and_say_why() {
    let cases = [
        (json!({"response_format": {"type": "json_object"}}), "guided_decoding"),
        (json!({"guided_regex": "[a-z]+"}), "guided_decoding"),
        (json!({"regex": "[a-z]+"}), "guided_decoding"),
        (json!({"structured_outputs": {"choice": ["a", "b"]}}), "guided_decoding"),
        (json!({"n": 2}), "n_greater_than_1"),
    ];
    for (extra, reason) in cases {
        let s = stack(3, json!({})).await;
        let mut body = json!({"prompt": "hello", "stream": true, "max_tokens": 8});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let text = post_stream(&s.url, "/v1/completions", body).await;
        assert!(text.contains("\"error\"") && !text.contains("[DONE]"), "{text}");
        assert!(text.contains(&format!("not resumed: {reason}")), "the error event says why: {text}");
        assert_eq!(s.decodes.iter().map(|d| d.streams().len()).sum::<usize>(), 1, "no continuation");
        assert_eq!(metric(&s.url, &format!("pdgate_resumes_total{{reason=\"{reason}\",result=\"refused\"}}")).await, Some(1.0), "{reason}");
    }
}

#[tokio::test]
async fn a_second_death_beyond_max_resumes_ends_with_the_error_event() {
    // Both decodes die on their first stream: the continuation dies too, and one resume is all.
    let kill_a = Arc::new(AtomicBool::new(false));
    let kill_b = Arc::new(AtomicBool::new(false));
    let p = engine(0, Arc::new(AtomicBool::new(false))).await;
    let (a, b) = (engine(2, kill_a).await, engine(1, kill_b).await);
    let (_gw, url) = gateway(json!({"pd_disaggregation": true, "prefill": [p.url], "decode": [a.url, b.url], "retry_max_retries": 0})).await;
    wait_ready(&url).await;
    let text = post_stream(&url, "/v1/completions", json!({"prompt": "hello", "stream": true, "max_tokens": 8})).await;
    assert!(text.contains("\"error\"") && !text.contains("[DONE]"), "{text}");
    assert_eq!(a.streams().len() + b.streams().len(), 2, "one continuation, no more");
    assert_eq!(metric(&url, "pdgate_resumes_total{reason=\"max_resumes\",result=\"refused\"}").await, Some(1.0));
}

#[tokio::test]
async fn a_whole_answer_whose_decode_dies_is_resumed_even_without_retries() {
    for (max_resumes, status) in [(1, 200), (0, 503)] {
        let s = stack(3, json!({"max_resumes": max_resumes})).await;
        let r = client().post(format!("{}/v1/completions", s.url)).json(&json!({"prompt": "hello", "max_tokens": 8})).send().await.unwrap();
        assert_eq!(r.status(), status, "{}", r.text().await.unwrap());
        let sent = s.decodes.iter().map(|d| d.bodies.lock().unwrap().len()).sum::<usize>();
        assert_eq!(sent, max_resumes + 1);
        let resumed = metric(&s.url, "pdgate_resumes_total{reason=\"decode_died_whole\",result=\"resumed\"}").await;
        assert_eq!(resumed.unwrap_or(0.0), max_resumes as f64);
    }
}

#[tokio::test]
async fn a_decode_that_always_dies_is_taken_out_by_its_breaker_and_streams_resume_elsewhere() {
    let never = Arc::new(AtomicBool::new(false));
    let p = engine(0, never.clone()).await;
    let (bad, good) = (engine_with(1, never.clone(), true).await, engine(0, never).await);
    let (_gw, url) = gateway(json!({"pd_disaggregation": true, "prefill": [p.url], "decode": [bad.url, good.url], "policy": "round_robin",
                                    "breaker_failure_threshold": 2, "retry_max_retries": 0}))
    .await;
    wait_ready(&url).await;
    for _ in 0..6 {
        let text = post_stream(&url, "/v1/completions", json!({"prompt": "hello", "stream": true, "max_tokens": 4})).await;
        assert!(text.ends_with("data: [DONE]\n\n") && !text.contains("\"error\""), "{text}");
        assert_eq!(joined_text(&events(&text)).len(), 4);
    }
    let state = metric(&url, &format!("pdgate_worker_breaker_state{{worker=\"{}\"}}", bad.url)).await;
    assert_eq!(state, Some(1.0), "open after two deaths");
    assert_eq!(bad.streams().len(), 2, "no stream went to it once its breaker opened");
    assert_eq!(metric(&url, "pdgate_resumes_total{reason=\"decode_died\",result=\"resumed\"}").await, Some(2.0));
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

fn log_path(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("pdgate-resume-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("requests.jsonl");
    let _ = std::fs::remove_file(&path);
    path
}

#[tokio::test]
async fn the_gateways_accounting_of_a_resumed_stream_counts_the_whole_answer_and_names_the_resume() {
    // The client asks for no usage: the gateway asks for it, reads it and strips it. The
    // continuation's engine sees a 9-token prompt (6 + the 3 generated) and makes 5 tokens;
    // the request made a 6-token prompt and 8 tokens.
    let path = log_path("whole");
    let s = stack(3, json!({"request_log": path.to_str().unwrap()})).await;
    let text = post_stream(&s.url, "/v1/completions", json!({"prompt": "hello", "stream": true, "max_tokens": 8})).await;
    assert!(text.ends_with("data: [DONE]\n\n") && !text.contains("usage") && !text.contains("\"error\""), "{text}");
    let (dead, live) = dead_and_live(&s);
    let line = &log_lines(&path, 1).await[0];
    assert_eq!((line["prompt_tokens"].as_u64(), line["output_tokens"].as_u64()), (Some(6), Some(8)), "{line}");
    assert_eq!((line["status"].as_u64(), &line["error"]), (Some(200), &Value::Null), "{line}");
    assert_eq!(line["decode"].as_str(), Some(dead.url.as_str()), "the request's own pair is the first: {line}");
    assert_eq!(line["resumes"].as_u64(), Some(1), "{line}");
    assert_eq!(line["resumed_on"][0]["decode"].as_str(), Some(live.url.as_str()), "{line}");
    assert!(line["resumed_on"][0]["prefill"].is_string(), "{line}");
    // TPOT over the 8 tokens: (E2E - TTFT) / 7.
    let (ttft, tpot, e2e) = (line["ttft_ms"].as_f64().unwrap(), line["tpot_ms"].as_f64().unwrap(), line["e2e_ms"].as_f64().unwrap());
    assert!((tpot - (e2e - ttft) / 7.0).abs() < 1e-6, "{line}");
}

#[tokio::test]
async fn a_resumed_whole_answer_says_so_in_its_route_header_and_log() {
    let path = log_path("whole-nonstream");
    let s = stack(3, json!({"request_log": path.to_str().unwrap()})).await;
    let r = client().post(format!("{}/v1/completions", s.url)).json(&json!({"prompt": "hello", "max_tokens": 8})).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let route = r.headers()["x-pdgate-route"].to_str().unwrap().to_string();
    assert!(route.ends_with("; attempts=2; resumes=1"), "{route}");
    let line = &log_lines(&path, 1).await[0];
    assert_eq!((line["attempts"].as_u64(), line["resumes"].as_u64()), (Some(2), Some(1)), "{line}");
}

/// A URL on loopback where nothing listens: every connection is refused.
async fn refusing_url() -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    drop(l);
    url
}

#[tokio::test]
async fn a_decode_that_refuses_the_connection_is_a_plain_retry_not_a_resume() {
    // Health checks off: the refusing decode stays in rotation, as one that died a moment ago.
    let never = Arc::new(AtomicBool::new(false));
    let p = engine(0, never.clone()).await;
    let live = engine(0, never).await;
    let refusing = refusing_url().await;
    let base = json!({"pd_disaggregation": true, "prefill": [p.url], "decode": [refusing, live.url], "decode_policy": "round_robin", "disable_health_check": true});
    for stream in [false, true] {
        // Retries allowed: the request goes to the other decode as a retry.
        let mut cfg = base.clone();
        cfg.as_object_mut().unwrap().extend([("retry_max_retries".to_string(), json!(3)), ("disable_circuit_breaker".to_string(), json!(true))]);
        let (_gw, url) = gateway(cfg).await;
        wait_ready(&url).await;
        for _ in 0..2 {
            let r = client().post(format!("{url}/v1/completions")).json(&json!({"prompt": "hello", "max_tokens": 4, "stream": stream})).send().await.unwrap();
            assert_eq!(r.status(), 200);
            let body = r.text().await.unwrap();
            assert!(!body.contains("\"error\""), "{body}");
        }
        let retries = metric(&url, "pdgate_retries_total{reason=\"unreachable\"}").await.unwrap_or(0.0);
        assert!(retries >= 1.0, "round robin sent one of the two to the refusing decode: stream={stream}");
        for reason in ["decode_died", "decode_died_whole"] {
            assert_eq!(metric(&url, &format!("pdgate_resumes_total{{reason=\"{reason}\",result=\"resumed\"}}")).await.unwrap_or(0.0), 0.0, "stream={stream}");
        }
    }
    // Retries off: the refused request fails as a plain failure would; it is not re-sent as a
    // resume (it never started).
    let (_gw, url) = gateway(json!({"pd_disaggregation": true, "prefill": [p.url], "decode": [refusing_url().await], "disable_health_check": true, "retry_max_retries": 1})).await;
    wait_ready(&url).await;
    let r = client().post(format!("{url}/v1/completions")).json(&json!({"prompt": "hello", "max_tokens": 4})).send().await.unwrap();
    assert_eq!(r.status(), 503);
    assert!(r.text().await.unwrap().contains("decode_unavailable"));
    assert_eq!(metric(&url, "pdgate_resumes_total{reason=\"decode_died_whole\",result=\"resumed\"}").await.unwrap_or(0.0), 0.0);
}
