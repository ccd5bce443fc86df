//! A chat completions SSE stream → Anthropic's Messages event sequence, incrementally:
//! `message_start`, then per content block `content_block_start`, `content_block_delta`s
//! (`text_delta`, or `input_json_delta` for a tool call's arguments), `content_block_stop`;
//! then `message_delta` (stop reason, usage) and `message_stop`. A `ping` follows the first
//! block's start. A pdgate error event becomes Anthropic's `error` event, and a stream that ends
//! without `[DONE]` ends with one too, so a client never takes a cut answer for a whole one.
//!
//! A small state machine over the chat chunks: which block is open (text or which tool call),
//! the next block index, the finish reason and the usage once they come.

use serde_json::{json, Value};

use super::answer::write_usage;
use super::error::{body_of, from_stream_error};
use super::{message_id, stop_reason};
use crate::chat_chunk::{each_payload, Chunk, ChunkReader};
use crate::chat_usage::UsageCounts;
use crate::sse::SseDecoder;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Block {
    None,
    Text,
    /// A tool call, by its OpenAI `tool_calls[].index`.
    Tool(u64),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Nothing sent yet: `message_start` goes out with the first chunk.
    Start,
    Open,
    /// `message_stop` or `error` went out: the rest is ignored.
    Ended,
}

/// The translator for one stream.
#[derive(Debug)]
pub struct MessagesStream {
    sse: SseDecoder,
    chunks: ChunkReader,
    /// The client's model name as a JSON string, written into `message_start`.
    model_json: Vec<u8>,
    stop_sequences: Vec<String>,
    phase: Phase,
    block: Block,
    /// Index of the open block, or of the next one when none is open.
    index: u64,
    pinged: bool,
    finish_reason: Option<String>,
    matched: Option<Value>,
    saw_tool_call: bool,
    /// The usage chunk's counts (`None` until it comes, or when it is not an object).
    usage: Option<UsageCounts>,
}

impl MessagesStream {
    pub fn new(model: String, stop_sequences: Vec<String>) -> Self {
        MessagesStream {
            sse: SseDecoder::new(),
            chunks: ChunkReader::default(),
            model_json: json_string(&model),
            stop_sequences,
            phase: Phase::Start,
            block: Block::None,
            index: 0,
            pinged: false,
            finish_reason: None,
            matched: None,
            saw_tool_call: false,
            usage: None,
        }
    }

    /// Takes the chat stream's next bytes; returns the Anthropic events they complete.
    pub fn feed(&mut self, chunk: &[u8]) -> Vec<u8> {
        // Room for what the chunk's events usually come to: no regrowth per event.
        let mut out = Vec::with_capacity(2 * chunk.len() + 128);
        // The decoder is lent out while `self.event` runs on each payload.
        let mut decoder = std::mem::take(&mut self.sse);
        each_payload(&mut decoder, chunk, |payload| self.event(payload, &mut out));
        self.sse = decoder;
        out
    }

    /// The chat stream ended: whatever is left, and an `error` event if it ended without
    /// `[DONE]` (the gateway's own error event comes before its end, so this is a cut stream).
    pub fn finish(&mut self) -> Vec<u8> {
        let mut out = Vec::new();
        if let Some(ev) = self.sse.finish() {
            self.event(ev.data.as_bytes(), &mut out);
        }
        if self.phase != Phase::Ended {
            self.error(body_of("api_error", "the answer's stream ended before its end"), &mut out);
        }
        out
    }

    /// Whether the Anthropic stream is complete (`message_stop` or `error` went out).
    pub fn ended(&self) -> bool {
        self.phase == Phase::Ended
    }

    fn event(&mut self, data: &[u8], out: &mut Vec<u8>) {
        if self.phase == Phase::Ended {
            return;
        }
        if data.trim_ascii() == b"[DONE]" {
            self.done(out);
            return;
        }
        if let Some(c) = self.chunks.read(data) {
            self.usual(&c, out);
            return;
        }
        let Ok(v) = serde_json::from_slice::<Value>(data) else {
            self.error(body_of("api_error", "the worker sent an event that is not JSON"), out);
            return;
        };
        if let Some(err) = v.get("error") {
            self.error(from_stream_error(err), out);
            return;
        }
        if self.phase == Phase::Start {
            let id = message_id(v.get("id").and_then(Value::as_str));
            self.start(&json_string(&id), out);
        }
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            self.usage = UsageCounts::of_value(u);
        }
        let Some(choice) = v.get("choices").and_then(|c| c.get(0)) else { return };
        if let Some(delta) = choice.get("delta") {
            if let Some(text) = delta.get("content").and_then(Value::as_str).filter(|t| !t.is_empty()) {
                self.open(Block::Text, None, out);
                let raw = json_string(text);
                text_event(out, self.index, &raw[1..raw.len() - 1]);
            }
            for call in delta.get("tool_calls").and_then(Value::as_array).map(Vec::as_slice).unwrap_or(&[]) {
                self.tool_delta(call, out);
            }
        }
        if let Some(f) = choice.get("finish_reason").and_then(Value::as_str) {
            self.finish_reason = Some(f.to_string());
            self.matched = choice.get("stop_reason").cloned();
        }
    }

    /// A chunk of the usual shape, from its raw parts (chat_chunk.rs).
    fn usual(&mut self, c: &Chunk<'_>, out: &mut Vec<u8>) {
        if self.phase == Phase::Start {
            let id = c.id.unwrap_or(b"pdgate");
            let id = id.strip_prefix(b"chatcmpl-").unwrap_or(id);
            let mut quoted = Vec::with_capacity(id.len() + 6);
            quoted.extend_from_slice(b"\"msg_");
            quoted.extend_from_slice(id);
            quoted.push(b'"');
            self.start(&quoted, out);
        }
        if let Some(u) = c.usage {
            self.usage = UsageCounts::read(u);
        }
        if let Some(raw) = c.text.filter(|t| !t.is_empty()) {
            self.open(Block::Text, None, out);
            text_event(out, self.index, raw);
        }
        if let Some(f) = c.finish {
            self.finish_reason = Some(String::from_utf8_lossy(f).into_owned());
            self.matched = c.stop_reason.and_then(|r| serde_json::from_slice(r).ok());
        }
    }

    /// `message_start`; `id` is the message id as a JSON string. The prompt's count comes with
    /// the usage chunk at the end (message_delta repeats it).
    fn start(&mut self, id: &[u8], out: &mut Vec<u8>) {
        self.phase = Phase::Open;
        out.extend_from_slice(b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":");
        out.extend_from_slice(id);
        out.extend_from_slice(b",\"type\":\"message\",\"role\":\"assistant\",\"model\":");
        out.extend_from_slice(&self.model_json);
        out.extend_from_slice(b",\"content\":[],\"stop_reason\":null,\"stop_sequence\":null,\"usage\":{\"input_tokens\":0,\"output_tokens\":0}}}\n\n");
    }

    fn tool_delta(&mut self, call: &Value, out: &mut Vec<u8>) {
        let idx = call.get("index").and_then(Value::as_u64).unwrap_or(0);
        let f = call.get("function");
        let starts = call.get("id").and_then(Value::as_str).is_some() || self.block != Block::Tool(idx);
        if starts {
            let id = call.get("id").and_then(Value::as_str).map(str::to_string).unwrap_or_else(|| format!("toolu_{idx}"));
            let name = f.and_then(|f| f.get("name")).and_then(Value::as_str).unwrap_or_default();
            self.saw_tool_call = true;
            self.open(Block::Tool(idx), Some(json!({"type": "tool_use", "id": id, "name": name, "input": {}})), out);
        }
        if let Some(args) = f.and_then(|f| f.get("arguments")).and_then(Value::as_str).filter(|a| !a.is_empty()) {
            emit(out, "content_block_delta", &json!({"type": "content_block_delta", "index": self.index, "delta": {"type": "input_json_delta", "partial_json": args}}));
        }
    }

    /// Makes `block` the open one: closes another, starts it if new (`start` is a tool's
    /// `content_block`; a text block starts empty).
    fn open(&mut self, block: Block, start: Option<Value>, out: &mut Vec<u8>) {
        if self.block == block && start.is_none() {
            return;
        }
        self.close(out);
        self.block = block;
        match start {
            Some(content_block) => emit(out, "content_block_start", &json!({"type": "content_block_start", "index": self.index, "content_block": content_block})),
            None => {
                out.extend_from_slice(b"event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":");
                push_int(out, self.index);
                out.extend_from_slice(b",\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n");
            }
        }
        if !self.pinged {
            self.pinged = true;
            out.extend_from_slice(b"event: ping\ndata: {\"type\":\"ping\"}\n\n");
        }
    }

    fn close(&mut self, out: &mut Vec<u8>) {
        if self.block != Block::None {
            out.extend_from_slice(b"event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":");
            push_int(out, self.index);
            out.extend_from_slice(b"}\n\n");
            self.block = Block::None;
            self.index += 1;
        }
    }

    fn done(&mut self, out: &mut Vec<u8>) {
        if self.phase == Phase::Start {
            self.start(b"\"msg_pdgate\"", out);
        }
        if self.index == 0 && self.block == Block::None {
            // Anthropic's answers have at least one block: an empty text one.
            self.open(Block::Text, None, out);
        }
        self.close(out);
        let (mut reason, sequence) = stop_reason(self.finish_reason.as_deref(), self.matched.as_ref(), &self.stop_sequences);
        if self.saw_tool_call && reason == "end_turn" {
            reason = "tool_use";
        }
        out.extend_from_slice(b"event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"");
        out.extend_from_slice(reason.as_bytes());
        out.extend_from_slice(b"\",\"stop_sequence\":");
        match &sequence {
            Some(seq) => out.extend_from_slice(&json_string(seq)),
            None => out.extend_from_slice(b"null"),
        }
        out.extend_from_slice(b"},\"usage\":");
        write_usage(out, self.usage.as_ref());
        out.extend_from_slice(b"}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n");
        self.phase = Phase::Ended;
    }

    fn error(&mut self, body: Value, out: &mut Vec<u8>) {
        emit(out, "error", &body);
        self.phase = Phase::Ended;
    }
}

/// An integer's digits, without an allocation.
fn push_int(out: &mut Vec<u8>, n: u64) {
    crate::responses::stream::push_u64(out, n);
}

/// A value as JSON bytes (writing into a Vec cannot fail).
fn json_string(v: &str) -> Vec<u8> {
    serde_json::to_vec(v).unwrap_or_default()
}

/// A `text_delta` event; `raw` is the text as the contents of a JSON string (escaped).
fn text_event(out: &mut Vec<u8>, index: u64, raw: &[u8]) {
    out.extend_from_slice(b"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":");
    push_int(out, index);
    out.extend_from_slice(b",\"delta\":{\"type\":\"text_delta\",\"text\":\"");
    out.extend_from_slice(raw);
    out.extend_from_slice(b"\"}}\n\n");
}

/// One SSE event with its name, as Anthropic writes them.
fn emit(out: &mut Vec<u8>, name: &str, data: &Value) {
    out.extend_from_slice(b"event: ");
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(b"\ndata: ");
    // Writing a Value into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, data);
    out.extend_from_slice(b"\n\n");
}
