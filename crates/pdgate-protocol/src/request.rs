//! Parsing and validating client requests before anything is sent to a worker.
//!
//! The gateway forwards the client's JSON as it came (engines accept many extension fields), so
//! validation only checks what the gateway itself relies on and what would otherwise become a
//! worker-side 5xx: the shape of the prompt, the types of the fields routing reads, and the
//! bounds of [`Limits`]. Fields that steer the rendezvous are removed here (see `rendezvous`),
//! so no path can forward them.

use serde_json::{Map, Value};

use crate::limits::{self, Limits};
use crate::rendezvous;

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

pub(crate) fn invalid(param: &str, message: impl Into<String>) -> InvalidRequest {
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
    /// The output length asked for, with the field that asked: the largest of `max_tokens`,
    /// `max_completion_tokens` and `/generate` `sampling_params.max_new_tokens`.
    pub max_tokens: Option<(u64, &'static str)>,
    /// The prompt's length in tokens, summed over a batch's prompts (not multiplied by `n`: the
    /// samples share one prefill): exact for token ids (`prompt` ids, `input_ids`), else the
    /// text's UTF-8 bytes / `Limits::chars_per_token`, rounded up (chat: the messages' content,
    /// without the chat template's own tokens). Token-based load counts this.
    pub prompt_tokens: u64,
    /// Gateway-owned fields were removed, or a field the client sent was changed: `body`
    /// differs from the bytes received, so a leg that would forward those bytes must encode
    /// `body` instead.
    pub rewritten: bool,
    /// Top-level fields the gateway added that the client's body did not have (their values are
    /// in `body`): a forwarding leg sends the received bytes with these appended
    /// ([`ParsedRequest::forward_bytes`]) instead of encoding `body`, which for a long prompt
    /// cost more than the rest of the request.
    pub added: Vec<&'static str>,
    /// A resumed stream's continuation: the prompt's last `resumed_ids` ids are the answer's
    /// own, generated before its decode died (0 for a client's request). A gateway that
    /// detokenizes (gRPC workers) replays them, so the text it held back at the death (an
    /// incomplete UTF-8 character, a possible stop string) is written by the continuation.
    pub resumed_ids: usize,
}

impl ParsedRequest {
    /// Sets a top-level field the gateway asks of the engine (e.g. `return_token_ids`). One the
    /// client's body did not have is appended to its bytes when forwarded; changing one it had
    /// means encoding the body.
    pub fn add_field(&mut self, key: &'static str, value: Value) {
        let had = self.body.insert(key.to_string(), value).is_some();
        if self.added.contains(&key) {
            // Added before: still appended, with its new value.
        } else if had {
            self.rewritten = true;
        } else {
            self.added.push(key);
        }
    }

    /// Whether a forwarding leg sends something other than the bytes received.
    pub fn differs(&self) -> bool {
        self.rewritten || !self.added.is_empty()
    }

    /// What a leg that forwards the client's body sends, given the bytes received: `None` for
    /// those bytes as they are; else the bytes with the added fields before the closing brace,
    /// or `body` encoded (fields removed or changed, or bytes that do not end in `}`).
    pub fn forward_bytes(&self, raw: &[u8]) -> serde_json::Result<Option<Vec<u8>>> {
        if !self.differs() {
            return Ok(None);
        }
        let end = raw.iter().rposition(|b| !b.is_ascii_whitespace());
        let (false, Some(end)) = (self.rewritten, end.filter(|&e| raw[e] == b'}')) else {
            return serde_json::to_vec(&self.body).map(Some);
        };
        // The received object has members unless `{` comes right before its closing brace.
        let empty = raw[..end].iter().rev().find(|b| !b.is_ascii_whitespace()) == Some(&b'{');
        let mut out = Vec::with_capacity(raw.len() + 32 * self.added.len());
        out.extend_from_slice(&raw[..end]);
        for (i, key) in self.added.iter().enumerate() {
            if !empty || i > 0 {
                out.push(b',');
            }
            serde_json::to_writer(&mut out, key)?;
            out.push(b':');
            serde_json::to_writer(&mut out, &self.body[*key])?;
        }
        out.extend_from_slice(&raw[end..]);
        Ok(Some(out))
    }

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

/// Parses and validates one client body against `limits`, and removes the fields that belong
/// to the gateway (the request then says `rewritten`).
pub fn parse_request(endpoint: Endpoint, bytes: &[u8], limits: &Limits) -> Result<ParsedRequest, InvalidRequest> {
    let value: Value = serde_json::from_slice(bytes).map_err(|e| InvalidRequest { param: None, message: format!("request body is not valid JSON: {e}") })?;
    let Value::Object(body) = value else {
        return Err(InvalidRequest { param: None, message: "request body must be a JSON object".into() });
    };
    parse_object(endpoint, body, limits)
}

/// [`parse_request`] of a body already parsed: a translated route (Messages, Responses) builds
/// its chat body as a value and hands it here, rather than writing it out and reading it again.
pub fn parse_object(endpoint: Endpoint, mut body: Map<String, Value>, limits: &Limits) -> Result<ParsedRequest, InvalidRequest> {
    check_common(&body)?;
    let scanned = limits::scan(&body, "", limits)?;
    let batch_items = match endpoint {
        Endpoint::Completions => {
            let items = completion_prompt_items(&body)?;
            limits::check_prompt_bytes(body.get("prompt").map_or(0, limits::text_bytes), "prompt", limits)?;
            let n = limits::bounded_count(&body, "n", "n", limits.max_n)?.unwrap_or(1);
            // Bounded like n; not an item count: the engine's items (and rooms) are prompts x n.
            limits::bounded_count(&body, "best_of", "best_of", limits.max_n)?;
            limits::batch_size(items, "prompt", n, "n", limits)?
        }
        Endpoint::ChatCompletions => {
            check_messages(&body)?;
            limits::check_prompt_bytes(body.get("messages").map_or(0, limits::text_bytes), "messages", limits)?;
            let n = limits::bounded_count(&body, "n", "n", limits.max_n)?.unwrap_or(1);
            limits::batch_size(None, "messages", n, "n", limits)?
        }
        Endpoint::Generate => generate_items(&body, limits)?,
    };
    let stream = optional_bool(&body, "stream")?.unwrap_or(false);
    let wants_input_logprobs = endpoint == Endpoint::Generate && optional_bool(&body, "return_logprob")?.unwrap_or(false);
    let model = body.get("model").and_then(Value::as_str).map(str::to_string);
    let max_tokens = requested_tokens(&body);
    let prompt_tokens = count_prompt_tokens(endpoint, &body, limits.chars_per_token);
    let rewritten = scanned.gateway_fields;
    if rewritten {
        rendezvous::strip_gateway_fields(&mut body);
    }
    Ok(ParsedRequest { endpoint, body, stream, batch_items, wants_input_logprobs, model, max_tokens, prompt_tokens, rewritten, added: Vec::new(), resumed_ids: 0 })
}

/// See `ParsedRequest::prompt_tokens`. Runs on a validated body.
fn count_prompt_tokens(endpoint: Endpoint, body: &Map<String, Value>, chars_per_token: f64) -> u64 {
    let (ids, text_bytes) = match endpoint {
        Endpoint::Completions => body.get("prompt").map_or((0, 0), split_prompt),
        Endpoint::ChatCompletions => (0, body.get("messages").map_or(0, limits::text_bytes)),
        Endpoint::Generate => match body.get("input_ids").filter(|v| !v.is_null()) {
            Some(ids) => split_prompt(ids),
            None => (0, body.get("text").map_or(0, limits::text_bytes)),
        },
    };
    ids.saturating_add(estimate_tokens(text_bytes, chars_per_token))
}

/// (token ids, text bytes) of a prompt value: a string, ids, or lists of either.
fn split_prompt(v: &Value) -> (u64, usize) {
    match v {
        Value::String(s) => (0, s.len()),
        Value::Array(items) if items.iter().all(|t| t.is_u64()) => (items.len() as u64, 0),
        Value::Array(items) => items.iter().map(split_prompt).fold((0, 0), |(a, b), (c, d)| (a + c, b + d)),
        _ => (0, 0),
    }
}

/// Text bytes as tokens, rounded up; any non-empty text is at least one token.
pub fn estimate_tokens(text_bytes: usize, chars_per_token: f64) -> u64 {
    if text_bytes == 0 {
        return 0;
    }
    let cpt = if chars_per_token.is_finite() && chars_per_token > 0.0 { chars_per_token } else { 4.0 };
    ((text_bytes as f64 / cpt).ceil() as u64).max(1)
}

/// The largest output length the request asks for, and the field it is in.
fn requested_tokens(body: &Map<String, Value>) -> Option<(u64, &'static str)> {
    let sp = body.get("sampling_params").and_then(Value::as_object);
    let found = [
        (body.get("max_tokens"), "max_tokens"),
        (body.get("max_completion_tokens"), "max_completion_tokens"),
        (sp.and_then(|sp| sp.get("max_new_tokens")), "sampling_params.max_new_tokens"),
    ];
    found.into_iter().filter_map(|(v, k)| Some((v?.as_u64()?, k))).max_by_key(|(v, _)| *v)
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
/// `sampling_params` there. Returns the batch size as `ParsedRequest::batch_items`.
fn generate_items(body: &Map<String, Value>, limits: &Limits) -> Result<Option<usize>, InvalidRequest> {
    let (items, items_param) = match (body.get("text").filter(|v| !v.is_null()), body.get("input_ids").filter(|v| !v.is_null())) {
        (Some(_), Some(_)) => return Err(invalid("text", "give either 'text' or 'input_ids', not both")),
        (None, None) => return Err(invalid("text", "'text' or 'input_ids' is required")),
        (Some(Value::String(_)), None) => (None, "text"),
        (Some(Value::Array(items)), None) if !items.is_empty() && items.iter().all(Value::is_string) => (Some(items.len()), "text"),
        (Some(_), None) => return Err(invalid("text", "'text' must be a string or a non-empty list of strings")),
        (None, Some(ids)) if is_token_list(ids) && !ids.as_array().is_some_and(Vec::is_empty) => (None, "input_ids"),
        (None, Some(Value::Array(items))) if !items.is_empty() && items.iter().all(is_token_list) => (Some(items.len()), "input_ids"),
        (None, Some(_)) => return Err(invalid("input_ids", "'input_ids' must be a list of token ids or a list of such lists")),
    };
    limits::check_prompt_bytes(body.get("text").map_or(0, limits::text_bytes), "text", limits)?;
    let n = match body.get("sampling_params") {
        None | Some(Value::Null) => None,
        Some(Value::Object(sp)) => {
            if let Some(v) = sp.get("max_new_tokens").filter(|v| !v.is_null()) {
                if v.as_u64().is_none() {
                    return Err(invalid("sampling_params.max_new_tokens", "'max_new_tokens' must be a non-negative integer"));
                }
            }
            limits::bounded_count(sp, "n", "sampling_params.n", limits.max_n)?
        }
        Some(_) => return Err(invalid("sampling_params", "'sampling_params' must be an object")),
    };
    optional_bool(body, "return_logprob")?;
    limits::batch_size(items, items_param, n.unwrap_or(1), "sampling_params.n", limits)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(ep: Endpoint, s: &str) -> Result<ParsedRequest, InvalidRequest> {
        parse_request(ep, s.as_bytes(), &Limits::default())
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

    /// The bodies from issue 11: each is refused with the field named, before any allocation in
    /// proportion to the number (n = 10^12 used to abort the gateway collecting 10^12 rooms).
    #[test]
    fn client_numbers_are_bounded() {
        let big_text = format!(r#"{{"text":[{}]}}"#, vec![r#""a""#; 1025].join(","));
        let many_ids = format!(r#"{{"input_ids":[{}]}}"#, vec!["[1]"; 1025].join(","));
        let many_prompts = format!(r#"{{"prompt":[{}]}}"#, vec![r#""a""#; 1025].join(","));
        let long_prompt = format!(r#"{{"prompt":"{}"}}"#, "x".repeat(8 * 1024 * 1024 + 1));
        let many_stops = format!(r#"{{"prompt":"x","stop":[{}]}}"#, vec![r#""s""#; 33].join(","));
        let long_stop = format!(r#"{{"prompt":"x","stop":"{}"}}"#, "s".repeat(1025));
        let bias: Vec<String> = (0..2049).map(|i| format!(r#""{i}":1"#)).collect();
        let many_bias = format!(r#"{{"prompt":"x","logit_bias":{{{}}}}}"#, bias.join(","));
        let many_tools = format!(r#"{{"messages":[{{"role":"user"}}],"tools":[{}]}}"#, vec!["{}"; 513].join(","));
        let cases: Vec<(Endpoint, String, &str)> = vec![
            (Endpoint::Completions, r#"{"prompt":"x","n":1000000000000}"#.into(), "n"),
            (Endpoint::Completions, r#"{"prompt":"x","n":4611686018427387904}"#.into(), "n"),
            (Endpoint::Completions, r#"{"prompt":"x","n":18446744073709551615}"#.into(), "n"),
            (Endpoint::Completions, r#"{"prompt":"x","n":129}"#.into(), "n"),
            (Endpoint::Completions, r#"{"prompt":"x","best_of":10000}"#.into(), "best_of"),
            (Endpoint::Completions, r#"{"prompt":"x","n":1e300}"#.into(), "n"),
            (Endpoint::ChatCompletions, r#"{"messages":[{"role":"user"}],"n":10000}"#.into(), "n"),
            (Endpoint::Generate, r#"{"text":"a","sampling_params":{"n":10000}}"#.into(), "sampling_params.n"),
            (Endpoint::Generate, big_text, "text"),
            (Endpoint::Generate, many_ids, "input_ids"),
            (Endpoint::Completions, many_prompts, "prompt"),
            (Endpoint::Completions, format!(r#"{{"prompt":[{}],"n":128}}"#, [r#""a""#; 9].join(",")), "n"),
            (Endpoint::Completions, long_prompt, "prompt"),
            (Endpoint::Completions, many_stops, "stop"),
            (Endpoint::Completions, long_stop, "stop"),
            (Endpoint::Completions, r#"{"prompt":"x","stop":[1]}"#.into(), "stop"),
            (Endpoint::Generate, format!(r#"{{"text":"a","sampling_params":{{"stop":[{}]}}}}"#, vec![r#""s""#; 33].join(",")), "sampling_params.stop"),
            (Endpoint::Completions, many_bias, "logit_bias"),
            (Endpoint::ChatCompletions, many_tools, "tools"),
        ];
        for (ep, body, param) in cases {
            let err = parse(ep, &body).unwrap_err();
            assert_eq!(err.param.as_deref(), Some(param), "{:.80}: {}", body, err.message);
            assert!(err.message.len() < 200, "messages stay short: {}", err.message);
        }
    }

    #[test]
    fn limits_are_inclusive_and_configurable() {
        let at = format!(r#"{{"text":[{}],"sampling_params":{{"n":1}}}}"#, vec![r#""a""#; 1024].join(","));
        assert_eq!(parse(Endpoint::Generate, &at).unwrap().batch_items, Some(1024));
        assert_eq!(parse(Endpoint::Completions, r#"{"prompt":"x","n":128}"#).unwrap().batch_items, Some(128));
        let tight = Limits { max_n: 2, max_batch_size: 4, ..Limits::default() };
        let r = parse_request(Endpoint::Completions, br#"{"prompt":["a","b"],"n":2}"#, &tight).unwrap();
        assert_eq!(r.batch_items, Some(4));
        let e = parse_request(Endpoint::Completions, br#"{"prompt":["a","b","c"],"n":2}"#, &tight).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("n"));
        let e = parse_request(Endpoint::Completions, br#"{"prompt":"a","n":3}"#, &tight).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("n"));
    }

    #[test]
    fn requested_output_length_and_its_field() {
        assert_eq!(parse(Endpoint::Completions, r#"{"prompt":"x"}"#).unwrap().max_tokens, None);
        let r = parse(Endpoint::ChatCompletions, r#"{"messages":[{"role":"user"}],"max_tokens":5,"max_completion_tokens":18446744073709551615}"#).unwrap();
        assert_eq!(r.max_tokens, Some((u64::MAX, "max_completion_tokens")));
        let g = parse(Endpoint::Generate, r#"{"text":"a","sampling_params":{"max_new_tokens":10000000}}"#).unwrap();
        assert_eq!(g.max_tokens, Some((10_000_000, "sampling_params.max_new_tokens")));
    }

    #[test]
    fn prompt_tokens_are_exact_for_ids_and_estimated_for_text() {
        let tokens = |ep, body: &str, cpt: f64| parse_request(ep, body.as_bytes(), &Limits { chars_per_token: cpt, ..Limits::default() }).unwrap().prompt_tokens;
        assert_eq!(tokens(Endpoint::Completions, r#"{"prompt":[1,2,3]}"#, 4.0), 3);
        assert_eq!(tokens(Endpoint::Completions, r#"{"prompt":[[1,2],[3,4,5]],"n":2}"#, 4.0), 5);
        assert_eq!(tokens(Endpoint::Generate, r#"{"input_ids":[7,8,9,10]}"#, 4.0), 4);
        assert_eq!(tokens(Endpoint::Generate, r#"{"input_ids":[[7],[8,9]]}"#, 4.0), 3);
        assert_eq!(tokens(Endpoint::Completions, r#"{"prompt":"abcdefghi"}"#, 4.0), 3, "9 bytes / 4, rounded up");
        assert_eq!(tokens(Endpoint::Completions, r#"{"prompt":"abcdefghi"}"#, 1.0), 9);
        assert_eq!(tokens(Endpoint::Completions, r#"{"prompt":["ab","cd"]}"#, 1.0), 4);
        assert_eq!(tokens(Endpoint::Completions, r#"{"prompt":"x"}"#, 4.0), 1, "any text is at least one token");
        assert_eq!(tokens(Endpoint::Completions, r#"{"prompt":""}"#, 4.0), 0);
        assert_eq!(tokens(Endpoint::Generate, r#"{"text":"héllo"}"#, 1.0), 6, "UTF-8 bytes, not chars");
        let chat = r#"{"messages":[{"role":"system","content":"abcd"},{"role":"user","content":[{"type":"text","text":"efgh"}]}]}"#;
        assert_eq!(tokens(Endpoint::ChatCompletions, chat, 1.0), 8);
        assert_eq!(tokens(Endpoint::ChatCompletions, chat, 4.0), 2);
    }

    #[test]
    fn gateway_fields_are_stripped_and_flagged() {
        let clean = parse(Endpoint::Completions, r#"{"prompt":"x","max_tokens":3}"#).unwrap();
        assert!(!clean.rewritten);
        let r = parse(Endpoint::Completions, r#"{"prompt":"x","kv_transfer_params":{"remote_host":"evil"},"bootstrap_room":1}"#).unwrap();
        assert!(r.rewritten);
        assert!(!r.body.contains_key("kv_transfer_params") && !r.body.contains_key("bootstrap_room"));
        let g = parse(Endpoint::Generate, r#"{"text":"a","sampling_params":{"bootstrap_host":"evil","max_new_tokens":2}}"#).unwrap();
        assert!(g.rewritten && !g.body["sampling_params"].as_object().unwrap().contains_key("bootstrap_host"));
    }

    #[test]
    fn added_fields_are_appended_to_the_bytes_received_and_anything_else_is_encoded() {
        let sent = |req: &ParsedRequest, raw: &str| req.forward_bytes(raw.as_bytes()).unwrap().map(|b| String::from_utf8(b).unwrap());
        let raw = "{ \"prompt\": \"a \\\"quoted\\\" prompt\" ,\"stream\":true } \n";
        let mut r = parse(Endpoint::Completions, raw).unwrap();
        assert_eq!(sent(&r, raw), None, "nothing added: the bytes as they came");
        r.add_field("return_token_ids", Value::Bool(true));
        r.add_field("stream_options", serde_json::json!({"include_usage": true}));
        r.add_field("return_token_ids", Value::Bool(true)); // again: still one member
        let out = sent(&r, raw).unwrap();
        assert_eq!(out, "{ \"prompt\": \"a \\\"quoted\\\" prompt\" ,\"stream\":true ,\"return_token_ids\":true,\"stream_options\":{\"include_usage\":true}} \n");
        assert_eq!(serde_json::from_str::<Map<String, Value>>(&out).unwrap(), r.body, "what is sent is the body");
        assert!(!r.rewritten && r.differs());
        // An empty object gets no leading comma.
        let mut e = parse(Endpoint::Generate, r#"{"input_ids":[1]}"#).unwrap();
        e.body.clear(); // as if the client had sent `{ }`
        e.add_field("stream", Value::Bool(true));
        e.add_field("rid", Value::from("x"));
        assert_eq!(sent(&e, "{ }").unwrap(), r#"{ "stream":true,"rid":"x"}"#);
        // A field the client sent, changed: encoded, never a duplicate key.
        let mut c = parse(Endpoint::Completions, r#"{"prompt":"x","return_token_ids":false}"#).unwrap();
        c.add_field("return_token_ids", Value::Bool(true));
        assert!(c.rewritten);
        let out = sent(&c, r#"{"prompt":"x","return_token_ids":false}"#).unwrap();
        assert_eq!(serde_json::from_str::<Value>(&out).unwrap(), serde_json::json!({"prompt": "x", "return_token_ids": true}));
        // Gateway fields removed by the parser: encoded (the added field included).
        let smuggled = r#"{"prompt":"x","bootstrap_room":1}"#;
        let mut g = parse(Endpoint::Completions, smuggled).unwrap();
        g.add_field("return_token_ids", Value::Bool(true));
        let out = sent(&g, smuggled).unwrap();
        assert_eq!(serde_json::from_str::<Value>(&out).unwrap(), serde_json::json!({"prompt": "x", "return_token_ids": true}));
    }
}
