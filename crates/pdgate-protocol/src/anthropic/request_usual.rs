//! The usual Messages body read from its bytes, without a `serde_json::Value` of it (the parse
//! was ~7 k instructions of a streamed request's translation; docs/performance.md, fourth
//! pass): `model`, `system`, `messages` of a role and a string, `max_tokens`, `stream`, each at
//! most once, strings without escapes. Anything else (another key, an escape, a block list, a
//! number that is not plain digits, a first message not the user's) is `None`, and `to_chat`
//! parses the body: every error comes from that path, so a usual body is always a valid one.

use serde_json::{json, Map, Value};

use super::request::{Kind, Translated};
use crate::json_scan::Scan;

/// The usual body's translation, the same `to_chat` gives it (tests compare the two).
pub(crate) fn usual(raw: &[u8], kind: Kind) -> Option<Translated> {
    let mut s = Scan { b: raw, i: 0 };
    let (mut model, mut system, mut max_tokens, mut stream) = (None, None, None, None);
    let mut messages: Option<Vec<Value>> = None;
    s.object(|s, key, _, _| {
        match key {
            b"model" if model.is_none() => model = Some(s.plain_str()?),
            b"system" if system.is_none() => system = Some(s.plain_str()?),
            b"max_tokens" if max_tokens.is_none() => max_tokens = Some(digits(s)?),
            b"stream" if stream.is_none() => stream = Some(s.boolean()?),
            b"messages" if messages.is_none() => messages = Some(turns(s)?),
            _ => return None,
        }
        Some(())
    })?;
    s.end()?;
    let model = model.filter(|m| !m.is_empty())?.to_string();
    let turns = messages?;
    let max_tokens = match (max_tokens, kind) {
        (Some(n), _) => Some(n),
        (None, Kind::CountTokens) => None,
        (None, Kind::Create) => return None,
    };
    let mut chat = Map::new();
    chat.insert("model".into(), Value::String(model.clone()));
    let mut out = Vec::with_capacity(turns.len() + 1);
    if let Some(text) = system.filter(|t| !t.is_empty()) {
        out.push(json!({"role": "system", "content": text}));
    }
    let last_is_assistant = turns.last().and_then(|m| m.get("role")).and_then(Value::as_str) == Some("assistant");
    out.extend(turns);
    chat.insert("messages".into(), Value::Array(out));
    if last_is_assistant {
        chat.insert("add_generation_prompt".into(), Value::Bool(false));
        chat.insert("continue_final_message".into(), Value::Bool(true));
    }
    if let Some(n) = max_tokens {
        chat.insert("max_tokens".into(), json!(n));
    }
    let stream = stream.unwrap_or(false) && kind == Kind::Create;
    if stream {
        chat.insert("stream".into(), Value::Bool(true));
        chat.insert("stream_options".into(), json!({"include_usage": true}));
    }
    Some(Translated { chat, stream, stop_sequences: Vec::new(), model })
}

/// A count >= 1 in plain digits (no sign, fraction, exponent or leading zero).
fn digits(s: &mut Scan<'_>) -> Option<u64> {
    s.plain_u64().filter(|&n| n >= 1)
}

/// `messages`: at least one, each `{"role": "user" | "assistant", "content": "..."}` (the keys
/// once each, in either order), the first the user's.
fn turns(s: &mut Scan<'_>) -> Option<Vec<Value>> {
    let mut out = Vec::new();
    s.array(|s| {
        let (mut role, mut content) = (None, None);
        s.object(|s, key, _, _| {
            match key {
                b"role" if role.is_none() => role = Some(s.plain_str()?),
                b"content" if content.is_none() => content = Some(s.plain_str()?),
                _ => return None,
            }
            Some(())
        })?;
        let role = match role? {
            "user" => "user",
            "assistant" if !out.is_empty() => "assistant",
            _ => return None,
        };
        out.push(json!({"role": role, "content": content?}));
        Some(())
    })?;
    (!out.is_empty()).then_some(out)
}

#[cfg(test)]
#[path = "request_usual_tests.rs"]
mod tests;
