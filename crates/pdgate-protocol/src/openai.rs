//! OpenAI-style error bodies: `{"error": {"message", "type", "code", "param"}}`.

use serde_json::{json, Value};

pub fn error_body(message: &str, error_type: &str, code: &str, param: Option<&str>) -> Value {
    json!({ "error": { "message": message, "type": error_type, "code": code, "param": param } })
}

/// The same error as one SSE event, for failures after the stream has started.
pub fn error_event(message: &str, error_type: &str, code: &str) -> String {
    format!("data: {}\n\n", error_body(message, error_type, code, None))
}
