//! Mock engines. The bootstrap pair really rendezvous: the prefill refuses to answer until the
//! decode has registered the same room, and the decode waits for the prefill's "KV" — so a
//! gateway that sends the legs one after the other fails. The NIXL decode "pulls" from the
//! prefill with exactly the relayed params. Every mock counts requests still being handled, so
//! a test can prove that no leg was left waiting.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicI64, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::sync::oneshot;

/// The context length every mock reports in `/v1/models` (`max_model_len`).
pub const MOCK_CONTEXT: u64 = 4096;

/// What a mock does with a request.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum Fault {
    #[default]
    None,
    /// Answer this HTTP status.
    Status(u16),
    /// Never answer.
    Hang,
    /// A hung engine: never answer, not even `/health`.
    HangAll,
    /// Never answer a generation; `/health` answers 503.
    HangUnhealthy,
    /// Never answer a request for 1000 tokens or more (a long non-streamed request, whose
    /// head real engines send only with its end); answer the others.
    HangIfLong,
    /// Stream two chunks, then drop the connection.
    DieMidStream,
    /// Answer normally after this many milliseconds.
    Slow(u64),
    /// Stream slowly: this many milliseconds between chunks.
    SlowStream(u64),
    // Broken workers (answers after the PD rendezvous, so a decode's prefill completes):
    /// 200 with a JSON body cut off half-way.
    MalformedJson,
    /// 200 with an HTML error page (text/html), to streams too.
    Html,
    /// A streaming request answered with a plain JSON body (application/json).
    JsonForStream,
    /// 200 with `content-encoding: gzip` (and gzip's magic bytes).
    Gzip,
    /// A stream that ends cleanly, but without `data: [DONE]`.
    NoDone,
    /// One endless line (`data: xxxx...` without a newline), or an endless JSON body.
    Endless,
    /// Streams normally, `data: [DONE]` included, then keeps the body open this many
    /// milliseconds before ending it (counted in [`HELD_BODIES_ENDED`] when it does).
    HoldAfterDone(u64),
    /// A busy engine: `/health` never answers, generations answer normally (vLLM's API server
    /// answers health from the process that is decoding).
    StallHealth,
    /// Keeps producing, never finishing: a token event (stream) or a byte of JSON whitespace
    /// (non-stream, after the head and `{"choices":[`) every this many milliseconds.
    Trickle(u64),
}

/// Bodies a [`Fault::HoldAfterDone`] worker ended (after its hold).
pub static HELD_BODIES_ENDED: AtomicU32 = AtomicU32::new(0);

#[derive(Default)]
pub struct Log {
    pub bodies: Mutex<Vec<Value>>,
    pub request_ids: Mutex<Vec<String>>,
    /// The `accept-encoding` header of each request ("" when absent).
    pub accept_encodings: Mutex<Vec<String>>,
    /// The `traceparent` and `tracestate` headers of each request ("" when absent).
    pub trace_headers: Mutex<Vec<(String, String)>>,
    /// The `authorization` header of each request ("" when absent).
    pub authorizations: Mutex<Vec<String>>,
    /// Requests being handled right now (decremented when the handler ends or is dropped).
    pub active: AtomicI64,
    pub count: AtomicU32,
    /// `GET /health` requests received.
    pub health_checks: AtomicU32,
}

impl Log {
    pub fn bodies(&self) -> Vec<Value> {
        self.bodies.lock().unwrap().clone()
    }
    pub fn active(&self) -> i64 {
        self.active.load(Ordering::SeqCst)
    }
    pub fn count(&self) -> u32 {
        self.count.load(Ordering::SeqCst)
    }
    pub fn trace_headers(&self) -> Vec<(String, String)> {
        self.trace_headers.lock().unwrap().clone()
    }
}

struct ActiveGuard(Arc<Log>);
impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::SeqCst);
    }
}

fn enter(log: &Arc<Log>, body: &Value, headers: &HeaderMap) -> ActiveGuard {
    log.active.fetch_add(1, Ordering::SeqCst);
    log.count.fetch_add(1, Ordering::SeqCst);
    log.bodies.lock().unwrap().push(body.clone());
    if let Some(id) = headers.get("x-request-id").and_then(|v| v.to_str().ok()) {
        log.request_ids.lock().unwrap().push(id.to_string());
    }
    let enc = headers.get("accept-encoding").and_then(|v| v.to_str().ok()).unwrap_or("");
    log.accept_encodings.lock().unwrap().push(enc.to_string());
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    log.trace_headers.lock().unwrap().push((header("traceparent"), header("tracestate")));
    log.authorizations.lock().unwrap().push(header("authorization"));
    ActiveGuard(log.clone())
}

/// Rooms shared by a bootstrap prefill/decode pair: decode registers, prefill delivers.
#[derive(Default)]
pub struct Rendezvous {
    rooms: Mutex<HashMap<u64, oneshot::Sender<Vec<f64>>>>,
    /// NIXL: blocks published by the prefill, keyed by remote_request_id.
    blocks: Mutex<HashMap<String, Vec<u64>>>,
}

#[derive(Clone)]
pub struct MockState {
    pub role: &'static str,
    pub fault: Arc<Mutex<Fault>>,
    pub log: Arc<Log>,
    pub rdv: Arc<Rendezvous>,
    pub self_host: String,
    pub bootstrap_port: u16,
}

pub struct Mock {
    pub url: String,
    pub addr: SocketAddr,
    pub state: MockState,
}

impl Mock {
    pub fn log(&self) -> &Log {
        &self.state.log
    }
    pub fn set_fault(&self, f: Fault) {
        *self.state.fault.lock().unwrap() = f;
    }
}

/// Starts a mock of `role` ("regular", "prefill", "decode", "nixl_prefill", "nixl_decode",
/// "mooncake_prefill", "mooncake_decode") sharing `rdv` with its partner.
pub async fn spawn(role: &'static str, rdv: Arc<Rendezvous>, fault: Fault) -> Mock {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let state = mock_state(role, rdv, fault);
    let app = app(state.clone());
    tokio::spawn(async move {
        axum::serve(listener, app).await.ok();
    });
    Mock { url: format!("http://{addr}"), addr, state }
}

/// A fresh mock's state, before it is served (over plain HTTP by `spawn`, or TLS, see tls.rs).
pub fn mock_state(role: &'static str, rdv: Arc<Rendezvous>, fault: Fault) -> MockState {
    MockState { role, fault: Arc::new(Mutex::new(fault)), log: Arc::new(Log::default()), rdv, self_host: "127.0.0.1".into(), bootstrap_port: 0 }
}

/// The mock engine's routes.
pub fn app(state: MockState) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(|| async { Json(json!({"object": "list", "data": [{"id": "mock-model", "object": "model", "max_model_len": MOCK_CONTEXT}]})) }))
        .route("/v1/completions", post(handle))
        .route("/v1/chat/completions", post(handle))
        .route("/generate", post(handle))
        .with_state(state)
}

/// A Mooncake-style bootstrap server answering `GET /query`.
pub async fn spawn_mooncake_bootstrap(engine_id: &str) -> (u16, Arc<Log>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let log = Arc::new(Log::default());
    let id = engine_id.to_string();
    let l2 = log.clone();
    let app = Router::new().route(
        "/query",
        get(move || {
            let id = id.clone();
            let l2 = l2.clone();
            async move {
                l2.count.fetch_add(1, Ordering::SeqCst);
                Json(json!({"0": {"engine_id": id, "worker_addr": {"host": "127.0.0.1"}}}))
            }
        }),
    );
    tokio::spawn(async move {
        axum::serve(listener, app).await.ok();
    });
    (port, log)
}

fn bad(msg: &str) -> Response {
    (StatusCode::BAD_REQUEST, Json(json!({"error": {"message": msg, "type": "invalid_request_error", "code": "mock_check", "param": null}}))).into_response()
}

async fn health(State(s): State<MockState>) -> (StatusCode, &'static str) {
    s.log.health_checks.fetch_add(1, Ordering::SeqCst);
    let fault = *s.fault.lock().unwrap();
    match fault {
        Fault::HangAll | Fault::StallHealth => std::future::pending().await,
        Fault::HangUnhealthy => (StatusCode::SERVICE_UNAVAILABLE, "sick"),
        _ => (StatusCode::OK, "ok"),
    }
}

async fn handle(State(s): State<MockState>, headers: HeaderMap, Json(body): Json<Value>) -> Response {
    let _guard = enter(&s.log, &body, &headers);
    let fault = *s.fault.lock().unwrap();
    match fault {
        Fault::Status(code) => return (StatusCode::from_u16(code).unwrap(), Json(json!({"error": {"message": "injected", "type": "x", "code": "injected"}}))).into_response(),
        Fault::Hang | Fault::HangAll | Fault::HangUnhealthy => {
            std::future::pending::<()>().await;
        }
        Fault::HangIfLong if body.get("max_tokens").and_then(Value::as_u64).unwrap_or(0) >= 1000 => {
            std::future::pending::<()>().await;
        }
        Fault::Slow(ms) => tokio::time::sleep(Duration::from_millis(ms)).await,
        _ => {}
    }
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    match s.role {
        "prefill" => bootstrap_prefill(&s, &body, stream).await,
        "decode" => bootstrap_decode(&s, &body, stream, fault).await,
        "nixl_prefill" => nixl_prefill(&s, &body, &headers),
        "nixl_decode" => nixl_decode(&s, &body, stream, fault),
        "mooncake_prefill" | "mooncake_decode" => mooncake(&s, &body, stream, fault),
        _ => answer(&body, stream, fault, json!({"prompt_tokens": 5, "cached_tokens": 0}), None),
    }
}

fn rooms_of(body: &Value) -> Option<Vec<u64>> {
    match body.get("bootstrap_room")? {
        Value::Number(n) => Some(vec![n.as_u64()?]),
        Value::Array(a) => a.iter().map(Value::as_u64).collect(),
        _ => None,
    }
}

async fn bootstrap_prefill(s: &MockState, body: &Value, stream: bool) -> Response {
    let Some(rooms) = rooms_of(body) else { return bad("prefill: no bootstrap_room") };
    // Block until the decode has reserved every room (as a real prefill blocks on the decode's
    // destination); give up after 2 s, like a shortened engine bootstrap timeout.
    let mut senders = Vec::new();
    for room in &rooms {
        let mut waited = 0;
        loop {
            if let Some(tx) = s.rdv.rooms.lock().unwrap().remove(room) {
                senders.push(tx);
                break;
            }
            if waited > 2000 {
                return (StatusCode::INTERNAL_SERVER_ERROR, "bootstrap timeout: decode never registered the room").into_response();
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
            waited += 5;
        }
    }
    for tx in senders {
        let _ = tx.send(vec![-0.5, -0.25]);
    }
    let meta = json!({"prompt_tokens": 5, "cached_tokens": 0, "input_token_logprobs": [[-1.0, 11, null], [-2.0, 12, null]],
                      "finish_reason": {"type": "length", "length": 0}});
    if stream {
        let chunk = json!({"index": 0, "text": "x", "meta_info": meta});
        return sse(vec![format!("data: {chunk}\n\n"), "data: [DONE]\n\n".into()]);
    }
    Json(json!({"text": "x", "meta_info": meta})).into_response()
}

async fn bootstrap_decode(s: &MockState, body: &Value, stream: bool, fault: Fault) -> Response {
    let Some(rooms) = rooms_of(body) else { return bad("decode: no bootstrap_room") };
    if body.get("bootstrap_host").is_none() || body.get("bootstrap_port").is_none() {
        return bad("decode: bootstrap_host/port missing");
    }
    let mut waits = Vec::new();
    for room in rooms {
        let (tx, rx) = oneshot::channel();
        s.rdv.rooms.lock().unwrap().insert(room, tx);
        waits.push(rx);
    }
    for rx in waits {
        match tokio::time::timeout(Duration::from_secs(3), rx).await {
            Ok(Ok(_kv)) => {}
            _ => return (StatusCode::INTERNAL_SERVER_ERROR, "KV never arrived").into_response(),
        }
    }
    answer(body, stream, fault, json!({"prompt_tokens": 5, "cached_tokens": 5, "input_token_logprobs": []}), None)
}

fn nixl_prefill(s: &MockState, body: &Value, headers: &HeaderMap) -> Response {
    let params = body.get("kv_transfer_params");
    if params.and_then(|p| p.get("do_remote_decode")) != Some(&json!(true)) || body.get("max_tokens") != Some(&json!(1)) || body.get("stream") != Some(&json!(false)) {
        return bad("nixl prefill: expected do_remote_decode, max_tokens 1, stream false");
    }
    let rid = headers.get("x-request-id").and_then(|v| v.to_str().ok()).unwrap_or("none").to_string();
    s.rdv.blocks.lock().unwrap().insert(rid.clone(), vec![7, 8, 9]);
    Json(json!({
        "choices": [{"text": "x", "index": 0, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1},
        "kv_transfer_params": {"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [7, 8, 9],
                               "remote_engine_id": "engine-p", "remote_request_id": rid, "remote_host": s.self_host,
                               "remote_port": 5600, "tp_size": 1}
    }))
    .into_response()
}

fn nixl_decode(s: &MockState, body: &Value, stream: bool, fault: Fault) -> Response {
    // Pull only with every field present, exactly as vLLM's decode does; else recompute.
    let p = body.get("kv_transfer_params").cloned().unwrap_or(Value::Null);
    let fields = ["remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host", "remote_port"];
    let complete = fields.iter().all(|f| p.get(*f).is_some_and(|v| !v.is_null()));
    let pulled = complete
        && p["remote_request_id"].as_str().and_then(|rid| s.rdv.blocks.lock().unwrap().remove(rid)).as_deref()
            == p["remote_block_ids"].as_array().map(|a| a.iter().filter_map(Value::as_u64).collect::<Vec<_>>()).as_deref();
    let cached = if pulled { 5 } else { 0 };
    answer(body, stream, fault, json!({}), Some((5, cached)))
}

fn mooncake(s: &MockState, body: &Value, stream: bool, fault: Fault) -> Response {
    let p = body.get("kv_transfer_params").cloned().unwrap_or(Value::Null);
    let Some(tid) = p.get("transfer_id").and_then(Value::as_str) else { return bad("mooncake: no transfer_id") };
    if !tid.starts_with("xfer-") {
        return bad("mooncake: transfer_id must be xfer-<uuid>");
    }
    if s.role == "mooncake_prefill" {
        if p.get("do_remote_decode") != Some(&json!(true)) {
            return bad("mooncake prefill: expected do_remote_decode");
        }
        return Json(json!({"choices": [{"text": "x", "index": 0}], "usage": {"prompt_tokens": 5, "completion_tokens": 1}})).into_response();
    }
    let ok = p.get("do_remote_prefill") == Some(&json!(true))
        && p.get("remote_engine_id").and_then(Value::as_str) == Some("engine-mc")
        && p.get("remote_bootstrap_addr").and_then(Value::as_str).is_some_and(|a| a.starts_with("http://127.0.0.1:"));
    if !ok {
        return bad("mooncake decode: missing remote_engine_id / remote_bootstrap_addr");
    }
    answer(body, stream, fault, json!({}), Some((5, 5)))
}

/// A completion in the shape of the endpoint the body looks like; `usage` = (prompt, cached).
fn answer(body: &Value, stream: bool, fault: Fault, meta: Value, usage: Option<(u64, u64)>) -> Response {
    let is_generate = body.get("text").is_some() || body.get("input_ids").is_some();
    // A regular OpenAI worker reports usage in a stream only when asked, as engines do.
    let asked = body.pointer("/stream_options/include_usage") == Some(&json!(true));
    let usage = if usage.is_none() && stream && asked && !is_generate { Some((5, 0)) } else { usage };
    let usage_v = usage.map(|(p, c)| json!({"prompt_tokens": p, "completion_tokens": 3, "total_tokens": p + 3, "prompt_tokens_details": {"cached_tokens": c}}));
    let batch = body.get("text").and_then(Value::as_array).map(Vec::len);
    if let Some(broken) = broken_answer(stream, fault) {
        return broken;
    }
    if !stream {
        if is_generate {
            let one = |i: usize| json!({"index": i, "text": " decoded", "output_ids": [1, 2, 3], "meta_info": meta});
            return match batch {
                Some(n) => Json(Value::Array((0..n).map(one).collect())).into_response(),
                None => Json(one(0)).into_response(),
            };
        }
        let mut v = json!({"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": " decoded", "message": {"role": "assistant", "content": " decoded"}, "finish_reason": "stop"}]});
        if let Some(u) = usage_v {
            v["usage"] = u;
        }
        return Json(v).into_response();
    }
    let mut chunks: Vec<String> = (0..3)
        .map(|i| {
            let c = if is_generate {
                json!({"index": 0, "text": format!("tok{i}"), "meta_info": meta})
            } else {
                json!({"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": format!("tok{i}"), "delta": {"content": format!("tok{i}")}, "finish_reason": null}]})
            };
            format!("data: {c}\n\n")
        })
        .collect();
    if let Some(u) = usage_v {
        chunks.push(format!("data: {}\n\n", json!({"id": "cmpl-1", "choices": [], "usage": u})));
    }
    chunks.push("data: [DONE]\n\n".into());
    if fault == Fault::NoDone {
        chunks.pop();
    }
    if fault == Fault::DieMidStream {
        chunks.truncate(2);
        // Pause between chunks so they are flushed before the connection is cut.
        let items: Vec<Result<String, std::io::Error>> = chunks.into_iter().map(Ok).chain([Err(std::io::Error::other("worker died"))]).collect();
        let stream = futures_util::stream::iter(items).then(|item| async move {
            tokio::time::sleep(Duration::from_millis(30)).await;
            item
        });
        return Response::builder().header("content-type", "text/event-stream").body(Body::from_stream(stream)).unwrap();
    }
    if let Fault::SlowStream(ms) = fault {
        return sse_every(chunks, ms);
    }
    if let Fault::HoldAfterDone(ms) = fault {
        let events = futures_util::stream::iter(chunks).map(Ok::<_, std::io::Error>);
        let end = futures_util::stream::once(async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            HELD_BODIES_ENDED.fetch_add(1, Ordering::SeqCst);
            Ok(String::new())
        });
        return Response::builder().header("content-type", "text/event-stream").body(Body::from_stream(events.chain(end))).unwrap();
    }
    sse(chunks)
}

use futures_util::StreamExt;

fn sse(chunks: Vec<String>) -> Response {
    sse_every(chunks, 2)
}

fn sse_every(chunks: Vec<String>, ms: u64) -> Response {
    let stream = futures_util::stream::iter(chunks).then(move |c| async move {
        tokio::time::sleep(Duration::from_millis(ms)).await;
        Ok::<_, std::io::Error>(c)
    });
    Response::builder().header("content-type", "text/event-stream").body(Body::from_stream(stream)).unwrap()
}

/// The answers of a broken worker, or `None` for the others.
fn broken_answer(stream: bool, fault: Fault) -> Option<Response> {
    let ok = Response::builder().status(200);
    let resp = match fault {
        Fault::MalformedJson => ok.header("content-type", "application/json").body(Body::from(r#"{"id":"cmpl-1","choices":[{"text":" dec"#)),
        Fault::Html => ok.header("content-type", "text/html").body(Body::from("<!DOCTYPE html><html><body><h1>502 Bad Gateway</h1></body></html>")),
        Fault::JsonForStream if stream => ok.header("content-type", "application/json").body(Body::from(r#"{"id":"cmpl-1","choices":[{"text":" decoded"}]}"#)),
        Fault::Gzip => {
            let ct = if stream { "text/event-stream" } else { "application/json" };
            let bytes: Vec<u8> = vec![0x1f, 0x8b, 0x08, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x03, 0xab, 0x56, 0x4a, 0xce, 0xc8];
            ok.header("content-type", ct).header("content-encoding", "gzip").body(Body::from(bytes))
        }
        Fault::Endless => {
            let (ct, start) = if stream { ("text/event-stream", "data: {\"text\":\"") } else { ("application/json", "{\"choices\":[{\"text\":\"") };
            let chunk = "x".repeat(4096);
            let tail = futures_util::stream::repeat(chunk).then(|c| async move {
                tokio::time::sleep(Duration::from_millis(1)).await;
                c
            });
            let s = futures_util::stream::iter([start.to_string()]).chain(tail).map(Ok::<_, std::io::Error>);
            ok.header("content-type", ct).body(Body::from_stream(s))
        }
        Fault::Trickle(ms) => {
            let (ct, start, each) = if stream {
                let ev = json!({"id": "cmpl-1", "choices": [{"index": 0, "text": "tok", "finish_reason": null}], "meta_info": {}});
                ("text/event-stream", format!("data: {ev}\n\n"), format!("data: {ev}\n\n"))
            } else {
                ("application/json", r#"{"choices":["#.to_string(), " ".to_string())
            };
            let tail = futures_util::stream::repeat(each).then(move |c| async move {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                c
            });
            let s = futures_util::stream::iter([start]).chain(tail).map(Ok::<_, std::io::Error>);
            ok.header("content-type", ct).body(Body::from_stream(s))
        }
        _ => return None,
    };
    Some(resp.unwrap())
}
