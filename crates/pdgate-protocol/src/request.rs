//! Parsing and validating client requests before anything is sent to a worker.
//!
//! The gateway forwards the client's JSON as it came (engines accept many extension fields), so
//! validation only checks what the gateway itself relies on and what would otherwise become a
//! worker-side 5xx: the shape of the prompt, the types of the fields routing reads.

use serde_json::{Map, Value};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    ChatCompletions,
    Generate,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::ChatCompletions => "/v1/chat/completions",
            Endpoint::Generate => "/generate",
        }
    }
}

/// A client mistake, with the offending field when there is one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InvalidRequest {
    pub param: Option<String>,
    pub message: String,
}

fn invalid(param: &str, message: impl Into<String>) -> InvalidRequest {
    InvalidRequest { param: Some(param.to_string()), message: message.into() }
}

/// A validated request body and the facts about it that the gateway needs.
#[derive(Clone, Debug)]
pub struct ParsedRequest {
    pub endpoint: Endpoint,
    pub body: Map<String, Value>,
    pub stream: bool,
    /// Number of items the engine will see: `None` for one prompt, `Some(n)` for a batch or
    /// n>1 (then PD fields become lists with one entry per item).
    pub batch_items: Option<usize>,
    /// `/generate` with `return_logprob`: prefill's input logprobs must be merged into decode's.
    pub wants_input_logprobs: bool,
    pub model: Option<String>,
}

impl ParsedRequest {
    /// Text a cache-aware policy would key on: the prompt, or the concatenated messages.
    pub fn routing_text(&self) -> Option<String> {
        let key = match self.endpoint {
            Endpoint::Completions => "prompt",
            Endpoint::Generate => "text",
            Endpoint::ChatCompletions => {
                let msgs = self.body.get("messages")?.as_array()?;
                let parts: Vec<&str> = msgs.iter().filter_map(|m| m.get("content").and_then(Value::as_str)).collect();
                return Some(parts.join("\n"));
            }
        };
        match self.body.get(key)? {
            Value::String(s) => Some(s.clone()),
            Value::Array(items) => items.first().and_then(Value::as_str).map(str::to_string),
            _ => None,
        }
    }
}

pub fn parse_request(endpoint: Endpoint, bytes: &[u8]) -> Result<ParsedRequest, InvalidRequest> {
    let value: Value = serde_json::from_slice(bytes).map_err(|e| InvalidRequest {
        param: None,
        message: format!("request body is not valid JSON: {e}"),
    })?;
    let Value::Object(body) = value else {
        return Err(InvalidRequest { param: None, message: "request body must be a JSON object".into() });
    };
    check_common(&body)?;
    let (prompt_items, n) = match endpoint {
        Endpoint::Completions => (completion_prompt_items(&body)?, positive_int(&body, "n")?),
        Endpoint::ChatCompletions => {
            check_messages(&body)?;
            (None, positive_int(&body, "n")?)
        }
        Endpoint::Generate => generate_items(&body)?,
    };
    let n = n.unwrap_or(1);
    let batch_items = match (prompt_items, n) {
        (None, 1) => None,
        (None, n) => Some(n as usize),
        (Some(items), n) => Some(items * n as usize),
    };
    let stream = optional_bool(&body, "stream")?.unwrap_or(false);
    let wants_input_logprobs = endpoint == Endpoint::Generate && optional_bool(&body, "return_logprob")?.unwrap_or(false);
    let model = body.get("model").and_then(Value::as_str).map(str::to_string);
    Ok(ParsedRequest { endpoint, body, stream, batch_items, wants_input_logprobs, model })
}

fn check_common(body: &Map<String, Value>) -> Result<(), InvalidRequest> {
    optional_bool(body, "stream")?;
    if let Some(m) = body.get("model") {
        if !m.is_string() && !m.is_null() {
            return Err(invalid("model", "'model' must be a string"));
        }
    }
    for key in ["max_tokens", "max_completion_tokens"] {
        if let Some(v) = body.get(key).filter(|v| !v.is_null()) {
            if v.as_u64().is_none() {
                return Err(invalid(key, format!("'{key}' must be a non-negative integer")));
            }
        }
    }
    for key in ["temperature", "top_p"] {
        if let Some(v) = body.get(key).filter(|v| !v.is_null()) {
            if !v.is_number() {
                return Err(invalid(key, format!("'{key}' must be a number")));
            }
        }
    }
    if let Some(v) = body.get("stream_options").filter(|v| !v.is_null()) {
        if !v.is_object() {
            return Err(invalid("stream_options", "'stream_options' must be an object"));
        }
    }
    Ok(())
}

fn optional_bool(body: &Map<String, Value>, key: &str) -> Result<Option<bool>, InvalidRequest> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(invalid(key, format!("'{key}' must be a boolean"))),
    }
}

fn positive_int(body: &Map<String, Value>, key: &str) -> Result<Option<u64>, InvalidRequest> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 => Ok(Some(n)),
            _ => Err(invalid(key, format!("'{key}' must be a positive integer"))),
        },
    }
}

fn is_token_list(v: &Value) -> bool {
    v.as_array().is_some_and(|a| a.iter().all(|t| t.as_u64().is_some()))
}

/// `prompt`: a string, a list of strings, a list of token ids, or a list of token-id lists.
fn completion_prompt_items(body: &Map<String, Value>) -> Result<Option<usize>, InvalidRequest> {
    let bad = || invalid("prompt", "'prompt' must be a string, a list of strings, a list of token ids or a list of token-id lists");
    match body.get("prompt") {
        None | Some(Value::Null) => Err(invalid("prompt", "'prompt' is required")),
        Some(Value::String(_)) => Ok(None),
        Some(Value::Array(items)) if items.is_empty() => Err(invalid("prompt", "'prompt' must not be empty")),
        Some(Value::Array(items)) => {
            if items.iter().all(Value::is_string) || items.iter().all(is_token_list) {
                Ok(if items.len() == 1 { None } else { Some(items.len()) })
            } else if items.iter().all(|t| t.as_u64().is_some()) {
                Ok(None)
            } else {
                Err(bad())
            }
        }
        Some(_) => Err(bad()),
    }
}

fn check_messages(body: &Map<String, Value>) -> Result<(), InvalidRequest> {
    let msgs = match body.get("messages") {
        None | Some(Value::Null) => return Err(invalid("messages", "'messages' is required")),
        Some(Value::Array(m)) if !m.is_empty() => m,
        Some(_) => return Err(invalid("messages", "'messages' must be a non-empty list of messages")),
    };
    for (i, m) in msgs.iter().enumerate() {
        let ok = m.as_object().is_some_and(|o| o.get("role").is_some_and(Value::is_string));
        if !ok {
            return Err(invalid(&format!("messages[{i}]"), "each message must be an object with a string 'role'"));
        }
    }
    Ok(())
}

/// `/generate`: `text` (string or list) or `input_ids` (list or list of lists); `n` lives in
/// `sampling_params` there.
fn generate_items(body: &Map<String, Value>) -> Result<(Option<usize>, Option<u64>), InvalidRequest> {
    let items = match (body.get("text").filter(|v| !v.is_null()), body.get("input_ids").filter(|v| !v.is_null())) {
        (Some(_), Some(_)) => return Err(invalid("text", "give either 'text' or 'input_ids', not both")),
        (None, None) => return Err(invalid("text", "'text' or 'input_ids' is required")),
        (Some(Value::String(_)), None) => None,
        (Some(Value::Array(items)), None) if !items.is_empty() && items.iter().all(Value::is_string) => Some(items.len()),
        (Some(_), None) => return Err(invalid("text", "'text' must be a string or a non-empty list of strings")),
        (None, Some(ids)) if is_token_list(ids) && !ids.as_array().is_some_and(Vec::is_empty) => None,
        (None, Some(Value::Array(items))) if !items.is_empty() && items.iter().all(is_token_list) => Some(items.len()),
        (None, Some(_)) => return Err(invalid("input_ids", "'input_ids' must be a list of token ids or a list of such lists")),
    };
    let n = match body.get("sampling_params") {
        None | Some(Value::Null) => None,
        Some(Value::Object(sp)) => {
            if let Some(v) = sp.get("max_new_tokens").filter(|v| !v.is_null()) {
                if v.as_u64().is_none() {
                    return Err(invalid("sampling_params.max_new_tokens", "'max_new_tokens' must be a non-negative integer"));
                }
            }
            positive_int(sp, "n")?
        }
        Some(_) => return Err(invalid("sampling_params", "'sampling_params' must be an object")),
    };
    optional_bool(body, "return_logprob")?;
    Ok((items, n))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(ep: Endpoint, s: &str) -> Result<ParsedRequest, InvalidRequest> {
        parse_request(ep, s.as_bytes())
    }

    #[test]
    fn single_prompts_are_not_batches() {
        assert_eq!(parse(Endpoint::Completions, r#"{"prompt":"hi"}"#).unwrap().batch_items, None);
        assert_eq!(parse(Endpoint::Completions, r#"{"prompt":[1,2,3]}"#).unwrap().batch_items, None);
        assert_eq!(parse(Endpoint::Generate, r#"{"input_ids":[1,2]}"#).unwrap().batch_items, None);
        assert_eq!(parse(Endpoint::ChatCompletions, r#"{"messages":[{"role":"user","content":"x"}]}"#).unwrap().batch_items, None);
    }

    #[test]
    fn batches_and_parallel_samples_count_items() {
        assert_eq!(parse(Endpoint::Generate, r#"{"text":["a","b","c"]}"#).unwrap().batch_items, Some(3));
        assert_eq!(parse(Endpoint::Generate, r#"{"input_ids":[[1],[2]]}"#).unwrap().batch_items, Some(2));
        assert_eq!(parse(Endpoint::Generate, r#"{"text":"a","sampling_params":{"n":4}}"#).unwrap().batch_items, Some(4));
        assert_eq!(parse(Endpoint::Completions, r#"{"prompt":["a","b"],"n":2}"#).unwrap().batch_items, Some(4));
        assert_eq!(parse(Endpoint::ChatCompletions, r#"{"messages":[{"role":"user"}],"n":3}"#).unwrap().batch_items, Some(3));
    }

    #[test]
    fn client_mistakes_name_the_field() {
        let cases = [
            (Endpoint::Completions, "{not json", None),
            (Endpoint::Completions, "[1,2]", None),
            (Endpoint::Completions, r#"{"model":"m"}"#, Some("prompt")),
            (Endpoint::Completions, r#"{"prompt":"x","max_tokens":"ten"}"#, Some("max_tokens")),
            (Endpoint::Completions, r#"{"prompt":"x","stream":"yes"}"#, Some("stream")),
            (Endpoint::Completions, r#"{"prompt":"x","n":0}"#, Some("n")),
            (Endpoint::Completions, r#"{"prompt":{"a":1}}"#, Some("prompt")),
            (Endpoint::ChatCompletions, r#"{"messages":[]}"#, Some("messages")),
            (Endpoint::ChatCompletions, r#"{"messages":[{"content":"x"}]}"#, Some("messages[0]")),
            (Endpoint::Generate, r#"{}"#, Some("text")),
            (Endpoint::Generate, r#"{"text":"a","input_ids":[1]}"#, Some("text")),
            (Endpoint::Generate, r#"{"text":[1,2]}"#, Some("text")),
            (Endpoint::Generate, r#"{"text":"a","sampling_params":[]}"#, Some("sampling_params")),
        ];
        for (ep, body, param) in cases {
            let err = parse(ep, body).unwrap_err();
            assert_eq!(err.param.as_deref(), param, "{body}: {}", err.message);
        }
    }

    #[test]
    fn routing_text_and_flags() {
        let r = parse(Endpoint::Generate, r#"{"text":"hello","stream":true,"return_logprob":true}"#).unwrap();
        assert!(r.stream && r.wants_input_logprobs);
        assert_eq!(r.routing_text().as_deref(), Some("hello"));
        let c = parse(Endpoint::ChatCompletions, r#"{"messages":[{"role":"system","content":"a"},{"role":"user","content":"b"}]}"#).unwrap();
        assert_eq!(c.routing_text().as_deref(), Some("a\nb"));
    }
}
