//! Bounds on what one client request may ask for, checked while parsing and before anything is
//! allocated in proportion to a client-supplied number (rooms per item, response choices, the
//! routing text). Each bound is a gateway flag (`GatewayConfig`); this crate only sees the
//! numbers, so it stays free of config.
//!
//! Every violation is an [`InvalidRequest`] naming the field, which the gateway answers with
//! 400. Counting happens on the parsed JSON; the body itself is already bounded by
//! `--max-payload-size`.

use serde_json::{Map, Value};

use crate::request::{invalid, InvalidRequest};

/// The bounds. `Default` matches the gateway's flag defaults.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// `n` (choices per prompt), `best_of`, `/generate` `sampling_params.n`.
    pub max_n: u64,
    /// Items the engine would run: prompts in a list × `n`.
    pub max_batch_size: u64,
    /// Prompt text in UTF-8 bytes, summed over the request (prompts, `text`, message contents).
    pub max_prompt_bytes: usize,
    /// Entries in `stop` (and in `stop_token_ids`).
    pub max_stop_sequences: usize,
    /// Bytes of one `stop` string.
    pub max_stop_bytes: usize,
    /// Entries in `logit_bias`.
    pub max_logit_bias: usize,
    /// Entries in `tools` (and the legacy `functions`).
    pub max_tools: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_n: 128,
            max_batch_size: 1024,
            max_prompt_bytes: 8 * 1024 * 1024,
            max_stop_sequences: 32,
            max_stop_bytes: 1024,
            max_logit_bias: 2048,
            max_tools: 512,
        }
    }
}

/// Largest value that can be echoed back in a message: the offending value, truncated.
fn shown(v: &Value) -> String {
    let s = v.to_string();
    match s.char_indices().nth(40) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s,
    }
}

/// `key` is absent, null, or a positive integer at most `max`.
pub(crate) fn bounded_count(body: &Map<String, Value>, key: &str, param: &str, max: u64) -> Result<Option<u64>, InvalidRequest> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if (1..=max).contains(&n) => Ok(Some(n)),
            Some(n) if n >= 1 => Err(invalid(param, format!("'{key}' is {n}; at most {max} is allowed"))),
            _ => Err(invalid(param, format!("'{key}' must be a positive integer, not {}", shown(v)))),
        },
    }
}

/// Items × n within the batch limit. `items_param` / `n_param` name the field blamed: the list
/// when it alone is too long, else `n`.
pub(crate) fn batch_size(items: Option<usize>, items_param: &str, n: u64, n_param: &str, limits: &Limits) -> Result<Option<usize>, InvalidRequest> {
    let listed = items.unwrap_or(1) as u64;
    let count = listed.saturating_mul(n);
    if count > limits.max_batch_size {
        let param = if listed > limits.max_batch_size || n == 1 { items_param } else { n_param };
        return Err(invalid(param, format!("the request would run {count} sequences (prompts x n); at most {} are allowed", limits.max_batch_size)));
    }
    Ok(match (items, n) {
        (None, 1) => None,
        _ => Some(count as usize),
    })
}

/// UTF-8 bytes of prompt text: strings, lists of strings, and `content` strings or text parts.
pub(crate) fn text_bytes(v: &Value) -> usize {
    match v {
        Value::String(s) => s.len(),
        Value::Array(items) => items.iter().map(text_bytes).sum(),
        Value::Object(o) => o.get("content").or_else(|| o.get("text")).map_or(0, text_bytes),
        _ => 0,
    }
}

pub(crate) fn check_prompt_bytes(bytes: usize, param: &str, limits: &Limits) -> Result<(), InvalidRequest> {
    if bytes > limits.max_prompt_bytes {
        return Err(invalid(param, format!("the prompt is {bytes} bytes; at most {} are allowed", limits.max_prompt_bytes)));
    }
    Ok(())
}

/// `stop`, `stop_token_ids`, `logit_bias` in one object (the body, or `sampling_params`).
/// `prefix` is put before the field name in `param` (e.g. `sampling_params.`).
pub(crate) fn check_sampling(obj: &Map<String, Value>, prefix: &str, limits: &Limits) -> Result<(), InvalidRequest> {
    let param = |k: &str| format!("{prefix}{k}");
    match obj.get("stop") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => check_stop(s, &param("stop"), limits)?,
        Some(Value::Array(list)) => {
            if list.len() > limits.max_stop_sequences {
                return Err(invalid(&param("stop"), format!("'stop' has {} entries; at most {} are allowed", list.len(), limits.max_stop_sequences)));
            }
            for s in list {
                let Some(s) = s.as_str() else { return Err(invalid(&param("stop"), "'stop' must be a string or a list of strings")) };
                check_stop(s, &param("stop"), limits)?;
            }
        }
        Some(_) => return Err(invalid(&param("stop"), "'stop' must be a string or a list of strings")),
    }
    if let Some(Value::Array(ids)) = obj.get("stop_token_ids") {
        if ids.len() > limits.max_stop_sequences {
            return Err(invalid(&param("stop_token_ids"), format!("'stop_token_ids' has {} entries; at most {} are allowed", ids.len(), limits.max_stop_sequences)));
        }
    }
    match obj.get("logit_bias") {
        None | Some(Value::Null) => {}
        Some(Value::Object(m)) if m.len() > limits.max_logit_bias => {
            return Err(invalid(&param("logit_bias"), format!("'logit_bias' has {} entries; at most {} are allowed", m.len(), limits.max_logit_bias)));
        }
        Some(Value::Object(_)) => {}
        Some(_) => return Err(invalid(&param("logit_bias"), "'logit_bias' must be an object of token id to bias")),
    }
    Ok(())
}

fn check_stop(s: &str, param: &str, limits: &Limits) -> Result<(), InvalidRequest> {
    if s.len() > limits.max_stop_bytes {
        return Err(invalid(param, format!("a 'stop' string is {} bytes; at most {} are allowed", s.len(), limits.max_stop_bytes)));
    }
    Ok(())
}

/// `tools` and the legacy `functions` (chat).
pub(crate) fn check_tools(body: &Map<String, Value>, limits: &Limits) -> Result<(), InvalidRequest> {
    for key in ["tools", "functions"] {
        match body.get(key) {
            None | Some(Value::Null) => {}
            Some(Value::Array(list)) if list.len() > limits.max_tools => {
                return Err(invalid(key, format!("'{key}' has {} entries; at most {} are allowed", list.len(), limits.max_tools)));
            }
            Some(Value::Array(_)) => {}
            Some(_) => return Err(invalid(key, format!("'{key}' must be a list"))),
        }
    }
    Ok(())
}
