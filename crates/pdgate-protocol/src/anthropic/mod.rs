//! The Anthropic Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) as a
//! translation to and from OpenAI chat completions: the gateway runs a Messages request as the
//! equivalent `/v1/chat/completions` request, so every placement and worker kind serves it with
//! the same transaction (docs/protocols.md, "Messages API").
//!
//! - [`request`]: a Messages body → the chat body (validation: a client mistake is an
//!   [`InvalidRequest`](crate::InvalidRequest), answered 400 before any worker is asked).
//! - [`answer`]: a whole chat answer → a Messages answer.
//! - [`stream`]: chat.completion.chunk events → Anthropic's SSE event sequence, incrementally.
//! - [`error`]: pdgate's OpenAI-style error bodies → Anthropic's error shape.
//!
//! Pure data transformations, like the rest of the crate.

pub mod answer;
pub mod error;
pub mod request;
mod request_usual;
pub mod stream;

#[cfg(test)]
mod tests;

/// Anthropic's `stop_reason` for an OpenAI `finish_reason` (and vLLM's `stop_reason`, the stop
/// string that matched, when the engine reports one). Returns the reason and the stop sequence.
pub fn stop_reason(finish_reason: Option<&str>, matched: Option<&serde_json::Value>, stop_sequences: &[String]) -> (&'static str, Option<String>) {
    match finish_reason {
        Some("length") => ("max_tokens", None),
        Some("tool_calls") | Some("function_call") => ("tool_use", None),
        Some("content_filter") => ("refusal", None),
        _ => match matched.and_then(|m| m.as_str()) {
            Some(s) if stop_sequences.iter().any(|x| x == s) => ("stop_sequence", Some(s.to_string())),
            _ => ("end_turn", None),
        },
    }
}

/// A Messages answer's id from the chat answer's: `msg_` and the engine's id (which pdgate's
/// legs set to the request id), so a log line and the answer name the same request.
pub fn message_id(chat_id: Option<&str>) -> String {
    let id = chat_id.unwrap_or("pdgate");
    let id = id.strip_prefix("chatcmpl-").unwrap_or(id);
    format!("msg_{id}")
}
