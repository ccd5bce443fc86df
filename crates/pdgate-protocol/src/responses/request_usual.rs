//! The usual Responses body read from its bytes, without a `serde_json::Value` of it (the
//! parse was ~26 k instructions of a streamed request's ~54 k translation; docs/performance.md,
//! "Fifth pass"): `model`, `instructions`, `previous_response_id`, `input` (a string, or
//! message items of a role and a string), `max_output_tokens`, `stream`, `store`, each at most
//! once, strings without escapes. Anything else (another key, an escape, a content list, a
//! `null`, a number that is not plain digits) is `None`, and `parse_responses` parses the body:
//! every error comes from that path, so a usual body is always a valid one.

use serde_json::{json, Map, Value};

use super::request::ResponsesRequest;
use crate::json_scan::Scan;

/// The usual body's request, equal to what the parse makes of it (tests compare the two).
pub(crate) fn usual(raw: &[u8]) -> Option<ResponsesRequest> {
    let mut s = Scan { b: raw, i: 0 };
    let (mut model, mut instructions, mut previous, mut input) = (None, None, None, None);
    let (mut max_output_tokens, mut stream, mut store) = (None, None, None);
    s.object(|s, key, _, _| {
        match key {
            b"model" if model.is_none() => model = Some(s.plain_str()?),
            b"instructions" if instructions.is_none() => instructions = Some(s.plain_str()?),
            b"previous_response_id" if previous.is_none() => previous = Some(s.plain_str()?),
            b"input" if input.is_none() => input = Some(input_items(s)?),
            b"max_output_tokens" if max_output_tokens.is_none() => max_output_tokens = Some(s.plain_u64().filter(|&n| n >= 1)?),
            b"stream" if stream.is_none() => stream = Some(s.boolean()?),
            b"store" if store.is_none() => store = Some(s.boolean()?),
            _ => return None,
        }
        Some(())
    })?;
    s.end()?;
    let input = input?;
    let (stream, store) = (stream.unwrap_or(false), store.unwrap_or(true));
    let mut chat = Map::new();
    let mut echo = Map::new();
    if let Some(m) = model {
        chat.insert("model".into(), m.into());
        echo.insert("model".into(), m.into());
    }
    if let Some(n) = max_output_tokens {
        chat.insert("max_tokens".into(), n.into());
        echo.insert("max_output_tokens".into(), n.into());
    }
    if let Some(i) = instructions {
        echo.insert("instructions".into(), i.into());
    }
    if let Some(p) = previous {
        echo.insert("previous_response_id".into(), p.into());
    }
    echo.insert("store".into(), store.into());
    chat.insert("stream".into(), stream.into());
    if stream {
        chat.insert("stream_options".into(), json!({"include_usage": true}));
    }
    Some(ResponsesRequest { stream, store, previous_response_id: previous.map(str::to_string), instructions: instructions.map(str::to_string), input, echo, chat })
}

/// `input`: a string (one user message item, as the parse makes it), or a non-empty list of
/// `{"role": ..., "content": "..."}` items (optionally `"type": "message"`; the keys once each,
/// in any order) of a role the parse takes.
fn input_items(s: &mut Scan<'_>) -> Option<Vec<Value>> {
    if s.peek_after_ws()? == b'"' {
        let text = s.plain_str()?;
        return Some(vec![json!({"type": "message", "role": "user", "content": text})]);
    }
    let mut out = Vec::new();
    s.array(|s| {
        let (mut kind, mut role, mut content) = (None, None, None);
        s.object(|s, key, _, _| {
            match key {
                b"type" if kind.is_none() => kind = Some(s.plain_str().filter(|t| *t == "message")?),
                b"role" if role.is_none() => role = Some(s.plain_str().filter(|r| matches!(*r, "user" | "assistant" | "system" | "developer"))?),
                b"content" if content.is_none() => content = Some(s.plain_str()?),
                _ => return None,
            }
            Some(())
        })?;
        let mut item = Map::new();
        if let Some(k) = kind {
            item.insert("type".into(), k.into());
        }
        item.insert("role".into(), role?.into());
        item.insert("content".into(), content?.into());
        out.push(Value::Object(item));
        Some(())
    })?;
    (!out.is_empty()).then_some(out)
}

#[cfg(test)]
#[path = "request_usual_tests.rs"]
mod tests;
