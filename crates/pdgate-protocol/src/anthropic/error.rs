//! pdgate's OpenAI-style errors in Anthropic's shape: `{"type": "error", "error": {"type",
//! "message"}}`, the type chosen by the HTTP status as Anthropic's API does.

use serde_json::{json, Value};

/// Anthropic's error type for an HTTP status.
pub fn error_type(status: u16) -> &'static str {
    match status {
        400 | 405 | 409 | 422 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        408 | 504 => "timeout_error",
        503 | 529 => "overloaded_error",
        400..=499 => "invalid_request_error",
        _ => "api_error",
    }
}

/// The Anthropic error body for an error response of `status` whose body was `body` (pdgate's
/// `{"error": {"message", "code", ...}}`, or anything a worker sent): the message is kept, and
/// pdgate's code, which says more than the type (but for `invalid_request`), is prefixed to it.
pub fn from_openai(status: u16, body: &[u8]) -> Value {
    let parsed: Option<Value> = serde_json::from_slice(body).ok();
    let err = parsed.as_ref().and_then(|v| v.get("error"));
    let message = match err {
        Some(Value::Object(e)) => {
            let msg = e.get("message").and_then(Value::as_str).unwrap_or("error");
            // A client mistake's code says nothing the type does not.
            match e.get("code").and_then(Value::as_str).filter(|c| !c.is_empty() && *c != "invalid_request") {
                Some(code) => format!("{code}: {msg}"),
                None => msg.to_string(),
            }
        }
        Some(Value::String(s)) => s.clone(),
        _ => String::from_utf8_lossy(body).chars().take(500).collect(),
    };
    body_of(error_type(status), &message)
}

/// Anthropic's error body; `with_request_id` adds the top-level `request_id` its API sends.
pub fn with_request_id(mut body: Value, request_id: Option<&str>) -> Value {
    if let (Some(id), Some(o)) = (request_id, body.as_object_mut()) {
        o.insert("request_id".into(), Value::String(id.to_string()));
    }
    body
}

pub fn body_of(error_type: &str, message: &str) -> Value {
    json!({"type": "error", "error": {"type": error_type, "message": message}})
}

/// A chat stream's error event (`{"error": {...}}`) as Anthropic's `error` event payload; the
/// status of a mid-stream failure is not known, so the type follows pdgate's error code.
pub fn from_stream_error(err: &Value) -> Value {
    let msg = err.get("message").and_then(Value::as_str).unwrap_or("the stream failed");
    let code = err.get("code").and_then(Value::as_str).unwrap_or("");
    let kind = if code.contains("timeout") {
        "timeout_error"
    } else if code.contains("overloaded") || code.contains("unavailable") {
        "overloaded_error"
    } else {
        "api_error"
    };
    let message = if code.is_empty() { msg.to_string() } else { format!("{code}: {msg}") };
    body_of(kind, &message)
}
