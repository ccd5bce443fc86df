//! A chat completion (JSON) as a Response object, and the pieces the stream shares.

use serde_json::{json, Map, Value};

use super::stream::push_u64;
use crate::chat_usage::UsageCounts;

/// What a Response object says besides the worker's answer: its ids, time, and the request's
/// echoed fields.
#[derive(Clone, Debug, PartialEq)]
pub struct ResponseMeta {
    /// `resp_<hex>`; item ids are derived from it (`msg_<hex>`, `fc_<hex>_<i>`).
    pub id: String,
    pub created_at: u64,
    /// `ResponsesRequest::echo`.
    pub echo: Map<String, Value>,
}

impl ResponseMeta {
    fn suffix(&self) -> &str {
        self.id.strip_prefix("resp_").unwrap_or(&self.id)
    }
    pub fn message_id(&self) -> String {
        format!("msg_{}", self.suffix())
    }
    pub fn call_item_id(&self, i: usize) -> String {
        format!("fc_{}_{i}", self.suffix())
    }

    /// The Response object in `status`, with these output items and usage.
    pub fn response(&self, status: &str, output: Vec<Value>, usage: Option<Value>, model: Option<&str>) -> Value {
        let mut r = self.response_base();
        Self::set_outcome(&mut r, status, output, usage, model);
        r
    }

    /// [`Self::response`]'s object with an empty outcome (what the request alone says), for
    /// [`Self::set_outcome`]: a stream builds it once, for its first events and its last.
    pub fn response_base(&self) -> Value {
        let e = |k: &str, default: Value| self.echo.get(k).cloned().unwrap_or(default);
        json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "background": false,
            "status": "in_progress",
            "error": null,
            "incomplete_details": null,
            "instructions": e("instructions", Value::Null),
            "max_output_tokens": e("max_output_tokens", Value::Null),
            "metadata": e("metadata", json!({})),
            "model": e("model", "".into()),
            "output": [],
            "parallel_tool_calls": e("parallel_tool_calls", true.into()),
            "previous_response_id": e("previous_response_id", Value::Null),
            "reasoning": e("reasoning", Value::Null),
            "store": e("store", true.into()),
            "temperature": e("temperature", 1.0.into()),
            "text": e("text", json!({"format": {"type": "text"}})),
            "tool_choice": e("tool_choice", "auto".into()),
            "tools": e("tools", json!([])),
            "top_p": e("top_p", 1.0.into()),
            "truncation": e("truncation", "disabled".into()),
            "usage": null,
            "user": e("user", Value::Null),
        })
    }

    /// [`Self::response`]'s JSON written directly, without building the value: the same bytes
    /// as `serde_json::to_vec` of it (its keys in its order; tests check it). A stream writes
    /// two or three Response objects: built as values, they were a tenth of its instructions.
    /// Returns where the output items lie in `out` (the array's contents), for the store.
    pub fn write_response(&self, out: &mut Vec<u8>, o: &Outcome<'_>) -> std::ops::Range<usize> {
        // The echo is a sorted map and the fields are written in its order: one walk over it
        // finds each (a lookup each cost more). `echo` must be called in key order.
        let mut entries = self.echo.iter().peekable();
        let mut echo = |out: &mut Vec<u8>, key: &str, default: &[u8]| {
            while entries.next_if(|(k, _)| k.as_str() < key).is_some() {}
            match entries.next_if(|(k, _)| k.as_str() == key) {
                // Writing a value into a Vec cannot fail.
                Some((_, v)) => drop(serde_json::to_writer(&mut *out, v)),
                None => out.extend_from_slice(default),
            }
        };
        out.extend_from_slice(b"{\"background\":false,\"created_at\":");
        push_u64(out, self.created_at);
        out.extend_from_slice(b",\"error\":");
        match o.error {
            Some((code, message)) => {
                out.extend_from_slice(b"{\"code\":");
                json_str(out, code);
                out.extend_from_slice(b",\"message\":");
                json_str(out, message);
                out.push(b'}');
            }
            None => out.extend_from_slice(b"null"),
        }
        out.extend_from_slice(b",\"id\":");
        json_str(out, &self.id);
        out.extend_from_slice(if o.status == "incomplete" { b",\"incomplete_details\":{\"reason\":\"max_output_tokens\"}" } else { b",\"incomplete_details\":null" });
        out.extend_from_slice(b",\"instructions\":");
        echo(out, "instructions", b"null");
        out.extend_from_slice(b",\"max_output_tokens\":");
        echo(out, "max_output_tokens", b"null");
        out.extend_from_slice(b",\"metadata\":");
        echo(out, "metadata", b"{}");
        out.extend_from_slice(b",\"model\":");
        match o.model {
            Some(m) => json_str(out, m),
            None => echo(out, "model", b"\"\""),
        }
        out.extend_from_slice(b",\"object\":\"response\",\"output\":[");
        let start = out.len();
        out.extend_from_slice(o.output);
        let output = start..out.len();
        out.extend_from_slice(b"],\"parallel_tool_calls\":");
        echo(out, "parallel_tool_calls", b"true");
        out.extend_from_slice(b",\"previous_response_id\":");
        echo(out, "previous_response_id", b"null");
        out.extend_from_slice(b",\"reasoning\":");
        echo(out, "reasoning", b"null");
        out.extend_from_slice(b",\"status\":");
        json_str(out, o.status);
        out.extend_from_slice(b",\"store\":");
        echo(out, "store", b"true");
        out.extend_from_slice(b",\"temperature\":");
        echo(out, "temperature", b"1.0");
        out.extend_from_slice(b",\"text\":");
        echo(out, "text", br#"{"format":{"type":"text"}}"#);
        out.extend_from_slice(b",\"tool_choice\":");
        echo(out, "tool_choice", b"\"auto\"");
        out.extend_from_slice(b",\"tools\":");
        echo(out, "tools", b"[]");
        out.extend_from_slice(b",\"top_p\":");
        echo(out, "top_p", b"1.0");
        out.extend_from_slice(b",\"truncation\":");
        echo(out, "truncation", b"\"disabled\"");
        out.extend_from_slice(b",\"usage\":");
        out.extend_from_slice(o.usage.unwrap_or(b"null"));
        out.extend_from_slice(b",\"user\":");
        echo(out, "user", b"null");
        out.push(b'}');
        output
    }

    /// [`Self::write_response`] with the output items as values (the whole answer's way).
    pub fn write_response_of(&self, out: &mut Vec<u8>, status: &str, output: &[Value], usage: Option<&Value>, model: Option<&str>) -> std::ops::Range<usize> {
        let mut items = Vec::new();
        for (i, item) in output.iter().enumerate() {
            if i > 0 {
                items.push(b',');
            }
            let _ = serde_json::to_writer(&mut items, item);
        }
        let usage = usage.map(|u| serde_json::to_vec(u).unwrap_or_default());
        self.write_response(out, &Outcome { status, output: &items, usage: usage.as_deref(), model, error: None })
    }

    /// Makes `r` (from [`Self::response_base`]) the Response in `status` with this output,
    /// usage and (the worker's) model; the request's model when `model` is `None`.
    pub fn set_outcome(r: &mut Value, status: &str, output: Vec<Value>, usage: Option<Value>, model: Option<&str>) {
        r["status"] = status.into();
        r["output"] = Value::Array(output);
        r["usage"] = usage.unwrap_or(Value::Null);
        if let Some(m) = model {
            r["model"] = m.into();
        }
        if status == "incomplete" {
            r["incomplete_details"] = json!({"reason": "max_output_tokens"});
        }
    }
}

/// What [`ResponseMeta::write_response`] writes besides the request's echo.
#[derive(Clone, Copy, Debug)]
pub struct Outcome<'a> {
    pub status: &'a str,
    /// The output items as JSON, comma-separated (the array's contents).
    pub output: &'a [u8],
    /// The Responses `usage` object as JSON; `null` when `None`.
    pub usage: Option<&'a [u8]>,
    /// The worker's model; the request's when `None`.
    pub model: Option<&'a str>,
    /// A failed response's `(code, message)`.
    pub error: Option<(&'a str, &'a str)>,
}

/// A string as JSON (writing into a Vec cannot fail).
pub(crate) fn json_str(out: &mut Vec<u8>, s: &str) {
    let _ = serde_json::to_writer(&mut *out, s);
}

/// The Response status of a chat `finish_reason`.
pub fn status_of(finish_reason: Option<&str>) -> &'static str {
    match finish_reason {
        Some("length") => "incomplete",
        _ => "completed",
    }
}

/// A message item's status in a response of `status`: a text cut at the length limit is
/// `incomplete`, as OpenAI marks it.
pub fn item_status(status: &str) -> &'static str {
    if status == "incomplete" {
        "incomplete"
    } else {
        "completed"
    }
}

/// A chat `usage` object as the Responses one.
pub fn usage_of(usage: &Value) -> Option<Value> {
    let c = UsageCounts::of_value(usage)?;
    let (input, output) = (c.prompt.unwrap_or(0), c.completion.unwrap_or(0));
    Some(json!({
        "input_tokens": input,
        "input_tokens_details": {"cached_tokens": c.cached.unwrap_or(0)},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": c.reasoning.unwrap_or(0)},
        "total_tokens": c.total.unwrap_or(input + output),
    }))
}

/// [`usage_of`]'s JSON, written directly from the counts (a stream's way).
pub(crate) fn write_usage(out: &mut Vec<u8>, c: &UsageCounts) {
    let (input, output) = (c.prompt.unwrap_or(0), c.completion.unwrap_or(0));
    out.extend_from_slice(b"{\"input_tokens\":");
    push_u64(out, input);
    out.extend_from_slice(b",\"input_tokens_details\":{\"cached_tokens\":");
    push_u64(out, c.cached.unwrap_or(0));
    out.extend_from_slice(b"},\"output_tokens\":");
    push_u64(out, output);
    out.extend_from_slice(b",\"output_tokens_details\":{\"reasoning_tokens\":");
    push_u64(out, c.reasoning.unwrap_or(0));
    out.extend_from_slice(b"},\"total_tokens\":");
    push_u64(out, c.total.unwrap_or(input + output));
    out.push(b'}');
}

pub fn message_item(id: &str, text: &str, status: &str) -> Value {
    let content = if status == "in_progress" { json!([]) } else { json!([text_part(text)]) };
    json!({"type": "message", "id": id, "role": "assistant", "status": status, "content": content})
}

pub fn text_part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

pub fn call_item(id: &str, call_id: &str, name: &str, arguments: &str, status: &str) -> Value {
    json!({"type": "function_call", "id": id, "call_id": call_id, "name": name, "arguments": arguments, "status": status})
}

/// The Response object of a whole chat completion (its first choice).
pub fn response_from_chat(chat: &Value, meta: &ResponseMeta) -> Value {
    let (status, output, usage) = outcome_of_chat(chat, meta);
    meta.response(status, output, usage, chat.get("model").and_then(Value::as_str))
}

/// [`response_from_chat`]'s JSON, and where its output items lie in it (for the store).
pub fn response_json_from_chat(chat: &Value, meta: &ResponseMeta) -> (Vec<u8>, std::ops::Range<usize>, &'static str) {
    let (status, output, usage) = outcome_of_chat(chat, meta);
    let mut out = Vec::with_capacity(1024);
    let range = meta.write_response_of(&mut out, status, &output, usage.as_ref(), chat.get("model").and_then(Value::as_str));
    (out, range, status)
}

/// A whole chat completion's status, output items and usage, in the Responses shape.
fn outcome_of_chat(chat: &Value, meta: &ResponseMeta) -> (&'static str, Vec<Value>, Option<Value>) {
    let choice = chat.pointer("/choices/0");
    let message = choice.and_then(|c| c.get("message"));
    let text = message.and_then(|m| m.get("content")).and_then(Value::as_str).unwrap_or("");
    let calls = message.and_then(|m| m.get("tool_calls")).and_then(Value::as_array).map(Vec::as_slice).unwrap_or(&[]);
    let status = status_of(choice.and_then(|c| c.get("finish_reason")).and_then(Value::as_str));
    let mut output = Vec::new();
    if !text.is_empty() || calls.is_empty() {
        output.push(message_item(&meta.message_id(), text, item_status(status)));
    }
    for (i, call) in calls.iter().enumerate() {
        let s = |p: &str| call.pointer(p).and_then(Value::as_str).unwrap_or("");
        let call_id = match s("/id") {
            "" => meta.call_item_id(i).replacen("fc_", "call_", 1),
            id => id.to_string(),
        };
        output.push(call_item(&meta.call_item_id(i), &call_id, s("/function/name"), s("/function/arguments"), "completed"));
    }
    (status, output, chat.get("usage").and_then(usage_of))
}
