//! The Responses event stream, built incrementally from a chat completion's SSE chunks.
//!
//! A small state machine: bytes of `chat.completion.chunk` events in (any split), Responses
//! events out (`event:` + `data:`, each with the next `sequence_number`):
//! `response.created`, `response.in_progress`, then per output item `response.output_item.added`
//! (+ `response.content_part.added`, `response.output_text.delta`*, `response.output_text.done`,
//! `response.content_part.done` for a message; `response.function_call_arguments.delta`*,
//! `.done` for a function call) and `response.output_item.done`, and one terminal event:
//! `response.completed` or `response.incomplete` at the chat stream's `[DONE]`, or
//! `response.failed` at the gateway's error event or at an end without `[DONE]`.

use std::ops::Range;

use serde_json::{json, Value};

use super::answer::{self, Outcome, ResponseMeta};
use crate::chat_chunk::{each_payload, Chunk, ChunkReader};
use crate::chat_usage::UsageCounts;
use crate::sse::SseDecoder;

struct Call {
    output_index: usize,
    item_id: String,
    call_id: String,
    name: String,
    arguments: String,
    /// The chat `tool_calls[].index` this item follows.
    chat_index: u64,
}

/// The terminal Response object (completed, incomplete or failed), as written in its event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Terminal {
    /// Its JSON.
    pub json: Vec<u8>,
    /// Where its output items lie in `json` (the `output` array's contents).
    pub output: Range<usize>,
    pub status: &'static str,
}

impl Terminal {
    /// The object as a value (tests, and whoever needs to look inside).
    pub fn value(&self) -> Value {
        serde_json::from_slice(&self.json).unwrap_or(Value::Null)
    }
}

/// See the module doc. Feed the chat stream's bytes, write what each call returns.
///
/// The usual chunks (a piece of text, the finish reason, the usage) are read from their bytes
/// (`chat_chunk.rs`) and their text pasted into the delta event as the escaped JSON string it
/// was; anything else (tool calls, errors) is parsed. The Response objects and output items are
/// written directly, never built as values.
pub struct StreamTranslator {
    meta: ResponseMeta,
    /// `meta.message_id()`, made once (ids are `[A-Za-z0-9_]`: no JSON escaping).
    message_id: String,
    decoder: SseDecoder,
    chunks: ChunkReader,
    seq: u64,
    model: Option<String>,
    /// Output items finished, as JSON (comma-separated, by output index): the terminal
    /// Response's `output`.
    output: Vec<u8>,
    /// How many items `output` holds.
    done_items: usize,
    /// The open message: its output index and text so far, as the contents of a JSON string
    /// (escaped as the worker wrote it; decoded once, when the message is done).
    message: Option<(usize, Vec<u8>)>,
    calls: Vec<Call>,
    usage: Option<UsageCounts>,
    finish_reason: Option<String>,
    terminal: Option<Terminal>,
    /// The terminal event went out (the terminal value may have been taken since).
    ended: bool,
}

impl StreamTranslator {
    pub fn new(meta: ResponseMeta) -> Self {
        StreamTranslator {
            message_id: meta.message_id(),
            meta,
            decoder: SseDecoder::new(),
            chunks: ChunkReader::default(),
            seq: 0,
            model: None,
            output: Vec::new(),
            done_items: 0,
            message: None,
            calls: Vec::new(),
            usage: None,
            finish_reason: None,
            terminal: None,
            ended: false,
        }
    }

    /// The first two events, before any chunk. The Response object is written once for both.
    pub fn start(&mut self) -> Vec<u8> {
        let mut r = Vec::with_capacity(1024);
        self.meta.write_response(&mut r, &Outcome { status: "in_progress", output: b"", usage: None, model: None, error: None });
        // Both events in one allocation.
        let mut out = Vec::with_capacity(2 * r.len() + 192);
        self.emit_response(&mut out, "response.created", &r);
        self.emit_response(&mut out, "response.in_progress", &r);
        out
    }

    /// The events a piece of the chat stream completes.
    pub fn feed(&mut self, bytes: &[u8]) -> Vec<u8> {
        // Room for what the chunk's events usually come to: no regrowth per event.
        let mut out = Vec::with_capacity(2 * bytes.len() + 128);
        // The decoder is lent out while `self.event` runs on each payload.
        let mut decoder = std::mem::take(&mut self.decoder);
        each_payload(&mut decoder, bytes, |payload| self.event(payload, &mut out));
        self.decoder = decoder;
        out
    }

    /// The chat stream ended: a stream that ended without `[DONE]` or an error fails here.
    pub fn end(&mut self) -> Vec<u8> {
        let mut out = Vec::new();
        if let Some(ev) = self.decoder.finish() {
            self.event(ev.data.as_bytes(), &mut out);
        }
        if !self.ended {
            self.fail(&mut out, "stream_truncated", "the answer's stream ended before it was complete");
        }
        out
    }

    /// The terminal Response object (completed, incomplete or failed) once there is one.
    pub fn terminal(&self) -> Option<&Terminal> {
        self.terminal.as_ref()
    }

    /// [`Self::terminal`], taken (once): for the store, without a copy.
    pub fn take_terminal(&mut self) -> Option<Terminal> {
        self.terminal.take()
    }

    fn event(&mut self, data: &[u8], out: &mut Vec<u8>) {
        if self.ended {
            return;
        }
        if data.trim_ascii() == b"[DONE]" {
            self.complete(out);
            return;
        }
        if let Some(c) = self.chunks.read(data) {
            self.usual(&c, out);
            return;
        }
        match serde_json::from_slice::<Value>(data) {
            Ok(v) if v.get("error").is_some() => {
                let e = &v["error"];
                let msg = e.get("message").and_then(Value::as_str).unwrap_or("the worker's stream failed");
                let code = e.get("code").and_then(Value::as_str).unwrap_or("server_error");
                self.fail(out, code, msg);
            }
            Ok(v) => self.chunk(out, &v),
            Err(_) => self.fail(out, "bad_worker_response", "the worker sent an event that is not JSON"),
        }
    }

    fn emit(&mut self, out: &mut Vec<u8>, kind: &str, mut data: Value) {
        data["type"] = kind.into();
        data["sequence_number"] = self.seq.into();
        self.seq += 1;
        out.extend_from_slice(b"event: ");
        out.extend_from_slice(kind.as_bytes());
        out.extend_from_slice(b"\ndata: ");
        // Writing a Value into a Vec cannot fail.
        let _ = serde_json::to_writer(&mut *out, &data);
        out.extend_from_slice(b"\n\n");
    }

    /// An event whose data is `{"response": <response>}`, `response` already written as JSON;
    /// the same fields as [`Self::emit`] would write, in its order.
    fn emit_response(&mut self, out: &mut Vec<u8>, kind: &str, response: &[u8]) {
        let seq = self.seq;
        self.seq += 1;
        out.extend_from_slice(b"event: ");
        out.extend_from_slice(kind.as_bytes());
        out.extend_from_slice(b"\ndata: {\"response\":");
        out.extend_from_slice(response);
        out.extend_from_slice(b",\"sequence_number\":");
        push_u64(out, seq);
        out.extend_from_slice(b",\"type\":\"");
        out.extend_from_slice(kind.as_bytes());
        out.extend_from_slice(b"\"}\n\n");
    }

    fn next_index(&self) -> usize {
        self.done_items + usize::from(self.message.is_some()) + self.calls.len()
    }

    /// A chunk of the usual shape, from its raw parts.
    fn usual(&mut self, c: &Chunk<'_>, out: &mut Vec<u8>) {
        if let (None, Some(m)) = (&self.model, c.model) {
            self.model = Some(decode(m));
        }
        if let Some(u) = c.usage {
            self.usage = UsageCounts::read(u);
        }
        if let Some(raw) = c.text.filter(|t| !t.is_empty()) {
            self.text(out, raw);
        }
        if let Some(f) = c.finish {
            self.finish_reason = Some(String::from_utf8_lossy(f).into_owned());
        }
    }

    fn chunk(&mut self, out: &mut Vec<u8>, v: &Value) {
        if let Some(m) = v.get("model").and_then(Value::as_str) {
            self.model.get_or_insert_with(|| m.to_string());
        }
        if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
            self.usage = UsageCounts::of_value(u);
        }
        let Some(choice) = v.pointer("/choices/0") else { return };
        let delta = choice.get("delta");
        if let Some(text) = delta.and_then(|d| d.get("content")).and_then(Value::as_str).filter(|t| !t.is_empty()) {
            let quoted = json_bytes(&Value::from(text));
            self.text(out, &quoted[1..quoted.len() - 1]);
        }
        if let Some(calls) = delta.and_then(|d| d.get("tool_calls")).and_then(Value::as_array) {
            for c in calls {
                self.call_delta(out, c);
            }
        }
        if let Some(r) = choice.get("finish_reason").and_then(Value::as_str) {
            self.finish_reason = Some(r.to_string());
        }
    }

    /// The message's two opening events, written directly (the same fields as [`Self::emit`]
    /// would write, in its order).
    fn open_message(&mut self, out: &mut Vec<u8>) {
        self.close_calls(out);
        let index = self.next_index();
        self.event_head(out, "response.output_item.added");
        out.extend_from_slice(b"{\"item\":{\"content\":[],\"id\":\"");
        out.extend_from_slice(self.message_id.as_bytes());
        out.extend_from_slice(b"\",\"role\":\"assistant\",\"status\":\"in_progress\",\"type\":\"message\"},\"output_index\":");
        push_u64(out, index as u64);
        self.event_tail(out, "response.output_item.added");
        self.event_head(out, "response.content_part.added");
        out.extend_from_slice(b"{\"content_index\":0,\"item_id\":\"");
        out.extend_from_slice(self.message_id.as_bytes());
        out.extend_from_slice(b"\",\"output_index\":");
        push_u64(out, index as u64);
        out.extend_from_slice(b",\"part\":{\"annotations\":[],\"logprobs\":[],\"text\":\"\",\"type\":\"output_text\"}");
        self.event_tail(out, "response.content_part.added");
        self.message = Some((index, Vec::new()));
    }

    /// `event: <kind>` and the `data: ` prefix.
    fn event_head(&self, out: &mut Vec<u8>, kind: &str) {
        out.extend_from_slice(b"event: ");
        out.extend_from_slice(kind.as_bytes());
        out.extend_from_slice(b"\ndata: ");
    }

    /// The data's last two fields (`sequence_number`, `type`; the object is open before) and
    /// the event's end.
    fn event_tail(&mut self, out: &mut Vec<u8>, kind: &str) {
        out.extend_from_slice(b",\"sequence_number\":");
        push_u64(out, self.seq);
        self.seq += 1;
        out.extend_from_slice(b",\"type\":\"");
        out.extend_from_slice(kind.as_bytes());
        out.extend_from_slice(b"\"}\n\n");
    }

    /// The hot path (one event per token): written directly, not built as a JSON value. The
    /// same fields as [`Self::emit`] would write, in its order. `raw` is the text as the
    /// contents of a JSON string.
    fn text(&mut self, out: &mut Vec<u8>, raw: &[u8]) {
        if self.message.is_none() {
            self.open_message(out);
        }
        let Some((index, acc)) = self.message.as_mut() else { return };
        acc.extend_from_slice(raw);
        let index = *index;
        let seq = self.seq;
        self.seq += 1;
        out.extend_from_slice(b"event: response.output_text.delta\ndata: {\"content_index\":0,\"delta\":\"");
        out.extend_from_slice(raw);
        out.extend_from_slice(b"\",\"item_id\":\"");
        out.extend_from_slice(self.message_id.as_bytes());
        out.extend_from_slice(b"\",\"logprobs\":[],\"output_index\":");
        push_u64(out, index as u64);
        out.extend_from_slice(b",\"sequence_number\":");
        push_u64(out, seq);
        out.extend_from_slice(b",\"type\":\"response.output_text.delta\"}\n\n");
    }

    /// The message's three closing events, written directly with its text as it came (the
    /// escaped contents of a JSON string); the text is decoded once, for the Response object.
    fn close_message(&mut self, out: &mut Vec<u8>) {
        let Some((index, raw)) = self.message.take() else { return };
        // The three events: the text three times, ~700 bytes of fields.
        out.reserve(3 * raw.len() + 768);
        let status = answer::item_status(answer::status_of(self.finish_reason.as_deref()));
        let id = std::mem::take(&mut self.message_id);
        let part = |out: &mut Vec<u8>| {
            out.extend_from_slice(b"{\"annotations\":[],\"logprobs\":[],\"text\":\"");
            out.extend_from_slice(&raw);
            out.extend_from_slice(b"\",\"type\":\"output_text\"}");
        };
        self.event_head(out, "response.output_text.done");
        out.extend_from_slice(b"{\"content_index\":0,\"item_id\":\"");
        out.extend_from_slice(id.as_bytes());
        out.extend_from_slice(b"\",\"logprobs\":[],\"output_index\":");
        push_u64(out, index as u64);
        out.extend_from_slice(b",\"text\":\"");
        out.extend_from_slice(&raw);
        out.push(b'"');
        self.event_tail(out, "response.output_text.done");
        self.event_head(out, "response.content_part.done");
        out.extend_from_slice(b"{\"content_index\":0,\"item_id\":\"");
        out.extend_from_slice(id.as_bytes());
        out.extend_from_slice(b"\",\"output_index\":");
        push_u64(out, index as u64);
        out.extend_from_slice(b",\"part\":");
        part(out);
        self.event_tail(out, "response.content_part.done");
        self.event_head(out, "response.output_item.done");
        out.extend_from_slice(b"{\"item\":");
        let item = out.len();
        out.extend_from_slice(b"{\"content\":[");
        part(out);
        out.extend_from_slice(b"],\"id\":\"");
        out.extend_from_slice(id.as_bytes());
        out.extend_from_slice(b"\",\"role\":\"assistant\",\"status\":\"");
        out.extend_from_slice(status.as_bytes());
        out.extend_from_slice(b"\",\"type\":\"message\"}");
        self.push_item(&out[item..]);
        out.extend_from_slice(b",\"output_index\":");
        push_u64(out, index as u64);
        self.event_tail(out, "response.output_item.done");
        self.message_id = id;
    }

    fn call_delta(&mut self, out: &mut Vec<u8>, c: &Value) {
        let chat_index = c.get("index").and_then(Value::as_u64).unwrap_or(self.calls.len() as u64);
        let fragment = c.pointer("/function/arguments").and_then(Value::as_str).unwrap_or("");
        let pos = match self.calls.iter().position(|k| k.chat_index == chat_index) {
            Some(p) => p,
            None => {
                self.close_message(out);
                let output_index = self.next_index();
                let item_id = self.meta.call_item_id(output_index);
                let call_id = c.get("id").and_then(Value::as_str).map_or_else(|| item_id.replacen("fc_", "call_", 1), str::to_string);
                let name = c.pointer("/function/name").and_then(Value::as_str).unwrap_or("").to_string();
                let item = answer::call_item(&item_id, &call_id, &name, "", "in_progress");
                self.emit(out, "response.output_item.added", json!({"output_index": output_index, "item": item}));
                self.calls.push(Call { output_index, item_id, call_id, name, arguments: String::new(), chat_index });
                self.calls.len() - 1
            }
        };
        if fragment.is_empty() {
            return;
        }
        let call = &mut self.calls[pos];
        call.arguments.push_str(fragment);
        let data = json!({"output_index": call.output_index, "item_id": call.item_id, "delta": fragment});
        self.emit(out, "response.function_call_arguments.delta", data);
    }

    fn close_calls(&mut self, out: &mut Vec<u8>) {
        for call in std::mem::take(&mut self.calls) {
            self.emit(out, "response.function_call_arguments.done", json!({"output_index": call.output_index, "item_id": call.item_id, "arguments": call.arguments}));
            let item = answer::call_item(&call.item_id, &call.call_id, &call.name, &call.arguments, "completed");
            self.push_item(&json_bytes(&item));
            self.emit(out, "response.output_item.done", json!({"output_index": call.output_index, "item": item}));
        }
    }

    /// A finished output item's JSON, for the terminal Response.
    fn push_item(&mut self, item: &[u8]) {
        if self.done_items > 0 {
            self.output.push(b',');
        }
        self.output.extend_from_slice(item);
        self.done_items += 1;
    }

    fn complete(&mut self, out: &mut Vec<u8>) {
        if self.message.is_none() && self.calls.is_empty() && self.done_items == 0 {
            // An empty answer is still one (empty) message, as in the whole answer.
            self.open_message(out);
        }
        self.close_message(out);
        self.close_calls(out);
        let status = answer::status_of(self.finish_reason.as_deref());
        let kind = if status == "incomplete" { "response.incomplete" } else { "response.completed" };
        self.end_with(out, kind, status, None);
    }

    fn fail(&mut self, out: &mut Vec<u8>, code: &str, message: &str) {
        self.end_with(out, "response.failed", "failed", Some((code, message)));
    }

    /// The terminal event, and the Response object it carries kept for [`Self::terminal`].
    fn end_with(&mut self, out: &mut Vec<u8>, kind: &str, status: &'static str, error: Option<(&str, &str)>) {
        let usage = self.usage.take().map(|c| {
            let mut u = Vec::with_capacity(160);
            answer::write_usage(&mut u, &c);
            u
        });
        let mut json = Vec::with_capacity(1024 + self.output.len());
        let output = self.meta.write_response(&mut json, &Outcome { status, output: &self.output, usage: usage.as_deref(), model: self.model.as_deref(), error });
        out.reserve(json.len() + 96);
        self.emit_response(out, kind, &json);
        self.terminal = Some(Terminal { json, output, status });
        self.ended = true;
    }
}

/// The contents of a JSON string (escapes and all) as the text they stand for; bytes that are
/// not valid UTF-8 (which a worker should never send) as U+FFFD.
fn decode(raw: &[u8]) -> String {
    if !raw.contains(&b'\\') {
        return String::from_utf8_lossy(raw).into_owned();
    }
    let mut quoted = Vec::with_capacity(raw.len() + 2);
    quoted.push(b'"');
    quoted.extend_from_slice(raw);
    quoted.push(b'"');
    serde_json::from_slice(&quoted).unwrap_or_else(|_| String::from_utf8_lossy(raw).into_owned())
}

/// A value as JSON bytes (writing into a Vec cannot fail; `to_string` would go through
/// `fmt`, several times slower).
fn json_bytes(v: &Value) -> Vec<u8> {
    serde_json::to_vec(v).unwrap_or_default()
}

/// A number's decimal digits (`write!` goes through `fmt`: several times the cost, per token).
pub fn push_u64(out: &mut Vec<u8>, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[i..]);
}
