//! A fast streaming mock engine for the streaming benchmarks (`bench/gateway/stream_bench.sh`):
//! answers OpenAI completions like vLLM/SGLang do, as fast as the stack allows, so that what a
//! benchmark measures through a gateway is the gateway. Not a product, not a test fixture.
//!
//!   cargo build --release -p pdgate-gateway --example stream_mock
//!   target/release/examples/stream_mock PORT [decode|prefill] [CHUNK_DELAY_MS]
//!
//! - `decode` (also a regular worker): a stream has `STREAM_CHUNKS` (default 8) content events,
//!   the usage event when `stream_options.include_usage` is set, then `data: [DONE]`. Each event
//!   is its own write, as an engine emitting one token at a time does: with a delay of 0 the
//!   body yields to the runtime between events (so hyper flushes each one), else it sleeps
//!   before each event (not before the body's end, which follows `[DONE]` at once).
//!   `return_token_ids` adds `prompt_token_ids` to the first event and `token_ids` to each.
//!   `/v1/chat/completions` is answered in the chat shape (`delta.content`, `message`).
//! - `prefill`: one token, the answer an SGLang prefill gives after its KV transfer; streamed
//!   only if asked to. A vLLM NIXL prefill request (`kv_transfer_params.do_remote_decode`) gets
//!   the `kv_transfer_params` a decode pulls with.
//! - `GET /stats`: how many POSTs it served and how many asked to stream (to see what a gateway
//!   asks of its workers).
#![allow(clippy::unwrap_used, clippy::expect_used)] // bench code: a panic is the failure report

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::{Body, Frame};
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use serde_json::Value;

static POSTS: AtomicU64 = AtomicU64::new(0);
static STREAMED: AtomicU64 = AtomicU64::new(0);

/// Events sent one per poll, with a pause (a yield or a sleep) between them.
struct Events {
    events: std::vec::IntoIter<Bytes>,
    delay: Duration,
    pause: Option<Pin<Box<tokio::time::Sleep>>>,
    yielded: bool,
}

impl Body for Events {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.delay.is_zero() {
            // Pending once between events: hyper flushes what it has, as after a real token.
            if !self.yielded {
                self.yielded = true;
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            self.yielded = false;
        } else if !self.events.as_slice().is_empty() {
            // No pause before the body's end: it follows `[DONE]` at once, as an engine's does
            // (a pause would hold the connection a whole delay after the answer).
            let delay = self.delay;
            let pause = self.pause.get_or_insert_with(|| Box::pin(tokio::time::sleep(delay)));
            if pause.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            self.pause = None;
        }
        Poll::Ready(self.events.next().map(|e| Ok(Frame::data(e))))
    }
}

type Answer = Response<http_body_util::combinators::UnsyncBoxBody<Bytes, Infallible>>;

fn whole(content_type: &'static str, body: String) -> Answer {
    Response::builder().header("content-type", content_type).body(Full::new(Bytes::from(body)).boxed_unsync()).unwrap()
}

fn event(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

fn answer(req: &Value, tokens: usize, delay: Duration, chat: bool) -> Answer {
    let stream = req.get("stream") == Some(&Value::Bool(true));
    let ids = req.get("return_token_ids") == Some(&Value::Bool(true));
    let usage = serde_json::json!({"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": 8 + tokens, "prompt_tokens_details": {"cached_tokens": 8}});
    let object = match (chat, stream) {
        (false, _) => "text_completion",
        (true, false) => "chat.completion",
        (true, true) => "chat.completion.chunk",
    };
    let head = |choices: Value| serde_json::json!({"id": "cmpl-mock", "object": object, "created": 0, "model": "mock-model", "choices": choices});
    if !stream {
        let mut choice = serde_json::json!({"index": 0, "text": " tok".repeat(tokens), "logprobs": null, "finish_reason": "length"});
        if chat {
            choice = serde_json::json!({"index": 0, "message": {"role": "assistant", "content": " tok".repeat(tokens)}, "logprobs": null, "finish_reason": "length"});
        }
        let mut v = head(serde_json::json!([choice]));
        v["usage"] = usage;
        // A vLLM NIXL prefill (`do_remote_decode`) says where its KV waits.
        if req.pointer("/kv_transfer_params/do_remote_decode") == Some(&Value::Bool(true)) {
            v["kv_transfer_params"] = serde_json::json!({"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [1],
                "remote_engine_id": "mock", "remote_request_id": "mock", "remote_host": "127.0.0.1", "remote_port": 5600});
        }
        return whole("application/json", v.to_string());
    }
    STREAMED.fetch_add(1, Ordering::Relaxed);
    let mut events = Vec::with_capacity(tokens + 2);
    for i in 0..tokens {
        let finish = if i + 1 == tokens { Value::from("length") } else { Value::Null };
        let mut choice = if chat {
            serde_json::json!({"index": 0, "delta": {"content": " tok"}, "logprobs": null, "finish_reason": finish})
        } else {
            serde_json::json!({"index": 0, "text": " tok", "logprobs": null, "finish_reason": finish})
        };
        if ids {
            choice["token_ids"] = serde_json::json!([100 + i]);
        }
        let mut v = head(serde_json::json!([choice]));
        if ids && i == 0 {
            v["choices"][0]["prompt_token_ids"] = serde_json::json!([1, 2, 3, 4, 5, 6, 7, 8]);
        }
        events.push(event(&v));
    }
    if req.pointer("/stream_options/include_usage") == Some(&Value::Bool(true)) {
        let mut v = head(serde_json::json!([]));
        v["usage"] = usage;
        events.push(event(&v));
    }
    events.push(Bytes::from_static(b"data: [DONE]\n\n"));
    let body = Events { events: events.into_iter(), delay, pause: None, yielded: false };
    Response::builder().header("content-type", "text/event-stream").body(body.boxed_unsync()).unwrap()
}

async fn serve(req: Request<hyper::body::Incoming>, tokens: usize, delay: Duration) -> Answer {
    match req.uri().path() {
        "/v1/models" => return whole("application/json", r#"{"object":"list","data":[{"id":"mock-model","object":"model","owned_by":"mock"}]}"#.into()),
        "/stats" => return whole("application/json", format!(r#"{{"posts":{},"streamed":{}}}"#, POSTS.load(Ordering::Relaxed), STREAMED.load(Ordering::Relaxed))),
        _ if req.method() == hyper::Method::GET => return whole("text/plain", String::new()),
        _ => {}
    }
    POSTS.fetch_add(1, Ordering::Relaxed);
    let chat = req.uri().path().ends_with("/chat/completions");
    let body = req.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    answer(&v, tokens, delay, chat)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let port: u16 = args.get(1).ok_or("usage: stream_mock PORT [decode|prefill] [CHUNK_DELAY_MS]")?.parse()?;
    let chunks: usize = std::env::var("STREAM_CHUNKS").ok().and_then(|s| s.parse().ok()).unwrap_or(8);
    let tokens = if args.get(2).map(String::as_str) == Some("prefill") { 1 } else { chunks };
    let delay = Duration::from_millis(args.get(3).and_then(|s| s.parse().ok()).unwrap_or(0));
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    loop {
        let (stream, _) = listener.accept().await?;
        stream.set_nodelay(true)?;
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| async move { Ok::<_, Infallible>(serve(req, tokens, delay).await) });
            let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), svc).await;
        });
    }
}
