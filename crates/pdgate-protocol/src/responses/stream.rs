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

use serde_json::{json, Value};

use super::answer::{self, ResponseMeta};
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

/// See the module doc. Feed the chat stream's bytes, write what each call returns.
pub struct StreamTranslator {
    meta: ResponseMeta,
    /// `meta.message_id()`, made once (ids are `[A-Za-z0-9_]`: no JSON escaping).
    message_id: String,
    decoder: SseDecoder,
    seq: u64,
    model: Option<String>,
    /// Output items finished, by output index.
    done_items: Vec<Value>,
    /// The open message: its output index and text so far.
    message: Option<(usize, String)>,
    calls: Vec<Call>,
    usage: Option<Value>,
    finish_reason: Option<String>,
    terminal: Option<Value>,
}

impl StreamTranslator {
    pub fn new(meta: ResponseMeta) -> Self {
        StreamTranslator {
            message_id: meta.message_id(),
            meta,
            decoder: SseDecoder::new(),
            seq: 0,
            model: None,
            done_items: Vec::new(),
            message: None,
            calls: Vec::new(),
            usage: None,
            finish_reason: None,
            terminal: None,
        }
    }

    /// The first two events, before any chunk.
    pub fn start(&mut self) -> String {
        let mut out = String::new();
        let r = self.meta.response("in_progress", Vec::new(), None, None);
        self.emit(&mut out, "response.created", json!({"response": r}));
        self.emit(&mut out, "response.in_progress", json!({"response": r}));
        out
    }

    /// The events a piece of the chat stream completes.
    pub fn feed(&mut self, bytes: &[u8]) -> String {
        let mut out = String::new();
        for ev in self.decoder.feed(bytes) {
            if self.terminal.is_some() {
                break;
            }
            if ev.is_done() {
                self.complete(&mut out);
                continue;
            }
            match serde_json::from_str::<Value>(&ev.data) {
                Ok(v) if v.get("error").is_some() => {
                    let e = &v["error"];
                    let msg = e.get("message").and_then(Value::as_str).unwrap_or("the worker's stream failed");
                    let code = e.get("code").and_then(Value::as_str).unwrap_or("server_error");
                    self.fail(&mut out, code, msg);
                }
                Ok(v) => self.chunk(&mut out, &v),
                Err(_) => self.fail(&mut out, "bad_worker_response", "the worker sent an event that is not JSON"),
            }
        }
        out
    }

    /// The chat stream ended: a stream that ended without `[DONE]` or an error fails here.
    pub fn end(&mut self) -> String {
        let mut out = String::new();
        if self.terminal.is_none() {
            self.fail(&mut out, "stream_truncated", "the answer's stream ended before it was complete");
        }
        out
    }

    /// The terminal Response object (completed, incomplete or failed) once there is one.
    pub fn terminal(&self) -> Option<&Value> {
        self.terminal.as_ref()
    }

    fn emit(&mut self, out: &mut String, kind: &str, mut data: Value) {
        data["type"] = kind.into();
        data["sequence_number"] = self.seq.into();
        self.seq += 1;
        out.push_str("event: ");
        out.push_str(kind);
        out.push_str("\ndata: ");
        out.push_str(&data.to_string());
        out.push_str("\n\n");
    }

    fn next_index(&self) -> usize {
        self.done_items.len() + usize::from(self.message.is_some()) + self.calls.len()
    }

    fn chunk(&mut self, out: &mut String, v: &Value) {
        if let Some(m) = v.get("model").and_then(Value::as_str) {
            self.model.get_or_insert_with(|| m.to_string());
        }
        if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
            self.usage = answer::usage_of(u);
        }
        let Some(choice) = v.pointer("/choices/0") else { return };
        let delta = choice.get("delta");
        if let Some(text) = delta.and_then(|d| d.get("content")).and_then(Value::as_str).filter(|t| !t.is_empty()) {
            self.text(out, text);
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

    fn open_message(&mut self, out: &mut String) {
        self.close_calls(out);
        let index = self.next_index();
        let id = self.meta.message_id();
        self.emit(out, "response.output_item.added", json!({"output_index": index, "item": answer::message_item(&id, "", "in_progress")}));
        self.emit(out, "response.content_part.added", json!({"output_index": index, "item_id": id, "content_index": 0, "part": answer::text_part("")}));
        self.message = Some((index, String::new()));
    }

    /// The hot path (one event per token): written directly, not built as a JSON value. The
    /// same fields as [`Self::emit`] would write, in a fixed order.
    fn text(&mut self, out: &mut String, text: &str) {
        if self.message.is_none() {
            self.open_message(out);
        }
        let Some((index, acc)) = self.message.as_mut() else { return };
        acc.push_str(text);
        let index = *index;
        let delta = Value::from(text).to_string();
        let id = &self.message_id;
        let seq = self.seq;
        self.seq += 1;
        out.push_str("event: response.output_text.delta\ndata: ");
        out.push_str(&format!(
            "{{\"content_index\":0,\"delta\":{delta},\"item_id\":\"{id}\",\"logprobs\":[],\"output_index\":{index},\"sequence_number\":{seq},\"type\":\"response.output_text.delta\"}}\n\n"
        ));
    }

    fn close_message(&mut self, out: &mut String) {
        let Some((index, text)) = self.message.take() else { return };
        let id = self.meta.message_id();
        self.emit(out, "response.output_text.done", json!({"output_index": index, "item_id": id, "content_index": 0, "text": text, "logprobs": []}));
        self.emit(out, "response.content_part.done", json!({"output_index": index, "item_id": id, "content_index": 0, "part": answer::text_part(&text)}));
        let item = answer::message_item(&id, &text, answer::item_status(answer::status_of(self.finish_reason.as_deref())));
        self.emit(out, "response.output_item.done", json!({"output_index": index, "item": item}));
        self.done_items.push(item);
    }

    fn call_delta(&mut self, out: &mut String, c: &Value) {
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

    fn close_calls(&mut self, out: &mut String) {
        for call in std::mem::take(&mut self.calls) {
            self.emit(out, "response.function_call_arguments.done", json!({"output_index": call.output_index, "item_id": call.item_id, "arguments": call.arguments}));
            let item = answer::call_item(&call.item_id, &call.call_id, &call.name, &call.arguments, "completed");
            self.emit(out, "response.output_item.done", json!({"output_index": call.output_index, "item": item}));
            self.done_items.push(item);
        }
    }

    fn complete(&mut self, out: &mut String) {
        if self.message.is_none() && self.calls.is_empty() && self.done_items.is_empty() {
            // An empty answer is still one (empty) message, as in the whole answer.
            self.open_message(out);
        }
        self.close_message(out);
        self.close_calls(out);
        let status = answer::status_of(self.finish_reason.as_deref());
        let r = self.meta.response(status, self.done_items.clone(), self.usage.clone(), self.model.as_deref());
        let kind = if status == "incomplete" { "response.incomplete" } else { "response.completed" };
        self.emit(out, kind, json!({"response": r}));
        self.terminal = Some(r);
    }

    fn fail(&mut self, out: &mut String, code: &str, message: &str) {
        let mut r = self.meta.response("failed", self.done_items.clone(), self.usage.clone(), self.model.as_deref());
        r["error"] = json!({"code": code, "message": message});
        self.emit(out, "response.failed", json!({"response": r}));
        self.terminal = Some(r);
    }
}
