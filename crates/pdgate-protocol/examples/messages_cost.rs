//! The Messages translation's own cost per request, without a gateway: the request's translation
//! (`to_chat` and the chat body's bytes) and the stream translator over a usual streamed answer
//! (a role chunk, 8 text chunks, the finish chunk, the usage chunk, `[DONE]`), as
//! bench/gateway/messages_cpu.sh's mock sends it. docs/performance.md, "Messages API".
//!
//!   cargo run --release -p pdgate-protocol --example messages_cost
#![allow(clippy::unwrap_used, clippy::expect_used)] // bench code: a panic is the failure report

use std::time::Instant;

use pdgate_protocol::anthropic::request::{to_chat, Kind};
use pdgate_protocol::anthropic::stream::MessagesStream;

fn main() {
    let body = br#"{"model":"mock-model","system":"You answer briefly.","messages":[{"role":"user","content":"The capital of France is"}],"max_tokens":8,"stream":true}"#;
    let head = r#"{"id":"cmpl-mock","object":"chat.completion.chunk","created":0,"model":"mock-model","choices":"#;
    let mut chunks = vec![format!("data: {head}[{{\"index\":0,\"delta\":{{\"role\":\"assistant\",\"content\":\"\"}},\"logprobs\":null,\"finish_reason\":null}}]}}\n\n")];
    for i in 0..8 {
        let finish = if i == 7 { "\"length\"" } else { "null" };
        chunks.push(format!("data: {head}[{{\"index\":0,\"delta\":{{\"content\":\" tok\"}},\"logprobs\":null,\"finish_reason\":{finish}}}]}}\n\n"));
    }
    chunks.push(format!("data: {head}[],\"usage\":{{\"prompt_tokens\":8,\"completion_tokens\":8,\"total_tokens\":16,\"prompt_tokens_details\":{{\"cached_tokens\":8}}}}}}\n\n"));
    chunks.push("data: [DONE]\n\n".to_string());
    let n = 200_000u32;
    let t = Instant::now();
    let mut bytes = 0usize;
    for _ in 0..n {
        let tr = to_chat(body, Kind::Create).unwrap();
        bytes += serde_json::to_vec(&tr.chat).unwrap().len();
    }
    let req_us = t.elapsed().as_secs_f64() * 1e6 / f64::from(n);
    let t = Instant::now();
    for _ in 0..n {
        let mut s = MessagesStream::new("mock-model".into(), Vec::new());
        for c in &chunks {
            bytes += s.feed(c.as_bytes()).len();
        }
        bytes += s.finish().len();
    }
    let stream_us = t.elapsed().as_secs_f64() * 1e6 / f64::from(n);
    let mut s = MessagesStream::new("mock-model".into(), Vec::new());
    bytes += s.feed(chunks[0].as_bytes()).len();
    let t = Instant::now();
    for _ in 0..n {
        bytes += s.feed(chunks[3].as_bytes()).len();
    }
    let text_us = t.elapsed().as_secs_f64() * 1e6 / f64::from(n);
    println!("one text chunk: {text_us:.3} us");
    println!("request translation: {req_us:.2} us; stream translation ({} chunks): {stream_us:.2} us; ({bytes} bytes)", chunks.len());
}
