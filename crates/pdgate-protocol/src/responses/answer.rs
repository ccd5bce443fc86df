//! A chat completion (JSON) as a Response object, and the pieces the stream shares.

use serde_json::{json, Map, Value};

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
    let n = |v: Option<&Value>| v.and_then(Value::as_u64).unwrap_or(0);
    let obj = usage.as_object()?;
    let input = n(obj.get("prompt_tokens"));
    let output = n(obj.get("completion_tokens"));
    let cached = n(usage.pointer("/prompt_tokens_details/cached_tokens"));
    let reasoning = n(usage.pointer("/completion_tokens_details/reasoning_tokens"));
    let total = obj.get("total_tokens").and_then(Value::as_u64).unwrap_or(input + output);
    Some(json!({
        "input_tokens": input,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": total,
    }))
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
    let usage = chat.get("usage").and_then(usage_of);
    meta.response(status, output, usage, chat.get("model").and_then(Value::as_str))
}
