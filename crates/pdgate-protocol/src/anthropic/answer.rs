//! A whole chat completions answer → a Messages answer.

use serde_json::{json, Map, Value};

use super::{message_id, stop_reason};
use crate::chat_usage::UsageCounts;
use crate::responses::stream::push_u64;

/// [`usage`]'s JSON, written directly from the counts (the stream's way); `None` is no usage.
pub(crate) fn write_usage(out: &mut Vec<u8>, c: Option<&UsageCounts>) {
    let c = c.copied().unwrap_or_default();
    let prompt = c.prompt.unwrap_or(0);
    out.push(b'{');
    if let Some(cached) = c.cached {
        out.extend_from_slice(b"\"cache_read_input_tokens\":");
        push_u64(out, cached.min(prompt));
        out.push(b',');
    }
    out.extend_from_slice(b"\"input_tokens\":");
    push_u64(out, prompt.saturating_sub(c.cached.unwrap_or(0)));
    out.extend_from_slice(b",\"output_tokens\":");
    push_u64(out, c.completion.unwrap_or(0));
    out.push(b'}');
}

/// Anthropic's `usage` from an OpenAI `usage`: `input_tokens` counts the prompt tokens not read
/// from a cache (Anthropic's total input is `input_tokens + cache_read_input_tokens`), and
/// `cache_read_input_tokens` is the worker's `prompt_tokens_details.cached_tokens` when it
/// reports one.
pub fn usage(chat_usage: Option<&Value>) -> Map<String, Value> {
    let get = |k: &str| chat_usage.and_then(|u| u.get(k)).and_then(Value::as_u64).unwrap_or(0);
    let cached = chat_usage.and_then(|u| u.get("prompt_tokens_details")).and_then(|d| d.get("cached_tokens")).and_then(Value::as_u64);
    let prompt = get("prompt_tokens");
    let mut out = Map::new();
    out.insert("input_tokens".into(), json!(prompt.saturating_sub(cached.unwrap_or(0))));
    out.insert("output_tokens".into(), json!(get("completion_tokens")));
    if let Some(c) = cached {
        out.insert("cache_read_input_tokens".into(), json!(c.min(prompt)));
    }
    out
}

/// A tool call's `arguments` (a JSON string) as the `input` object of a `tool_use` block; an
/// engine's malformed arguments are kept, as a string under `_raw`, rather than lost.
pub fn tool_input(arguments: Option<&Value>) -> Value {
    match arguments {
        Some(Value::String(s)) if s.trim().is_empty() => json!({}),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(v @ Value::Object(_)) => v,
            _ => json!({"_raw": s}),
        },
        Some(v @ Value::Object(_)) => v.clone(),
        _ => json!({}),
    }
}

/// The Messages answer for a chat answer. `model` is the client's (the chat answer's names the
/// engine's served model, which may differ).
pub fn from_chat(chat: &Value, model: &str, stop_sequences: &[String]) -> Value {
    let choice = chat.get("choices").and_then(|c| c.get(0));
    let message = choice.and_then(|c| c.get("message"));
    let mut content = Vec::new();
    let text = message.and_then(|m| m.get("content")).and_then(Value::as_str).unwrap_or("");
    let calls = message.and_then(|m| m.get("tool_calls")).and_then(Value::as_array).map(Vec::as_slice).unwrap_or(&[]);
    if !text.is_empty() || calls.is_empty() {
        content.push(json!({"type": "text", "text": text}));
    }
    for call in calls {
        let f = call.get("function");
        content.push(json!({
            "type": "tool_use",
            "id": call.get("id").and_then(Value::as_str).unwrap_or_default(),
            "name": f.and_then(|f| f.get("name")).and_then(Value::as_str).unwrap_or_default(),
            "input": tool_input(f.and_then(|f| f.get("arguments"))),
        }));
    }
    let finish = choice.and_then(|c| c.get("finish_reason")).and_then(Value::as_str);
    let (mut reason, sequence) = stop_reason(finish, choice.and_then(|c| c.get("stop_reason")), stop_sequences);
    if !calls.is_empty() && reason == "end_turn" {
        // Engines that parse tool calls report `tool_calls`; some say `stop`.
        reason = "tool_use";
    }
    json!({
        "id": message_id(chat.get("id").and_then(Value::as_str)),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(chat.get("usage")),
    })
}
