//! Whether an OpenAI stream event carries output for the client, read from its bytes.
//!
//! The gateway's accounting reads a stream's events until the first that carries output (its
//! time is the time to first token). Parsing that event into a `serde_json::Value` cost more
//! than relaying it, and the first event of a stream that asked for token ids holds the whole
//! prompt's ids. This answers from a structural scan instead (`json_scan.rs`); `None` for any
//! shape it does not recognise (the caller parses then), so it never guesses.

use serde_json::Value;

use crate::json_scan::{event_object, Scan};
use crate::request::Endpoint;

fn non_empty_value(v: Option<&Value>) -> bool {
    match v {
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        _ => false,
    }
}

/// Whether a parsed stream event carries output for the client: chat `delta.content` (or
/// reasoning, or tool calls), completion `text`, `/generate` `text` or `output_ids`. The
/// role-only first chat chunk and empty deltas do not count.
pub fn has_content(endpoint: Endpoint, v: &Value) -> bool {
    let choices = || v.get("choices").and_then(Value::as_array).into_iter().flatten();
    match endpoint {
        Endpoint::ChatCompletions => choices().any(|c| {
            let d = c.get("delta");
            ["content", "reasoning_content", "tool_calls"].iter().any(|k| non_empty_value(d.and_then(|d| d.get(*k))))
        }),
        Endpoint::Completions => choices().any(|c| non_empty_value(c.get("text"))),
        Endpoint::Generate => non_empty_value(v.get("text")) || non_empty_value(v.get("output_ids")),
    }
}

/// [`has_content`] of one raw event (`data: {...}`, its separator excluded) of a chat
/// (`chat`) or completions stream, read without parsing it. `None`: not one `data:` line
/// holding an object of the usual shape (a repeated key included: which one counts is the
/// parser's call).
pub fn carries_output(chat: bool, raw: &[u8]) -> Option<bool> {
    let payload = event_object(raw)?;
    let mut s = Scan { b: payload, i: 0 };
    let (mut found, mut choices_seen) = (false, false);
    s.object(|s, key, _, _| {
        if key != b"choices" {
            return s.value().map(drop);
        }
        if choices_seen {
            return None;
        }
        choices_seen = true;
        s.array(|s| {
            found |= choice(s, chat)?;
            Some(())
        })
        .map(drop)
    })?;
    s.ws();
    (s.i == payload.len()).then_some(found)
}

/// One choice: whether it carries output.
fn choice(s: &mut Scan<'_>, chat: bool) -> Option<bool> {
    if s.peek_after_ws()? != b'{' {
        return s.value().map(|_| false);
    }
    let (mut found, mut seen) = (false, 0u8);
    s.object(|s, key, _, _| {
        let bit = match key {
            b"delta" if chat => 1,
            b"text" if !chat => 2,
            _ => return s.value().map(drop),
        };
        if seen & bit != 0 {
            return None;
        }
        seen |= bit;
        if !chat {
            let (a, z) = s.value()?;
            found = non_empty(&s.b[a..z]);
            return Some(());
        }
        if s.peek_after_ws()? != b'{' {
            return s.value().map(drop);
        }
        let mut members = 0u8;
        s.object(|s, k, _, _| {
            let bit = match k {
                b"content" => 1,
                b"reasoning_content" => 2,
                b"tool_calls" => 4,
                _ => return s.value().map(drop),
            };
            if members & bit != 0 {
                return None;
            }
            members |= bit;
            let (a, z) = s.value()?;
            found |= non_empty(&s.b[a..z]);
            Some(())
        })
    })?;
    Some(found)
}

/// A non-empty string or array (as `non_empty_value` on the parsed value).
fn non_empty(raw: &[u8]) -> bool {
    match raw {
        [b'"', ..] => raw.len() > 2,
        [b'[', inner @ .., b']'] => !inner.iter().all(|c| matches!(c, b' ' | b'\t' | b'\n' | b'\r')),
        _ => false,
    }
}

#[cfg(test)]
#[path = "content_tests.rs"]
mod tests;
