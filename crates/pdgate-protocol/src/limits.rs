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
#[derive(Clone, Copy, Debug, PartialEq)]
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
    /// Not a bound: UTF-8 bytes per token, to estimate a text prompt's token count
    /// (`ParsedRequest::prompt_tokens`). Token-id prompts are counted exactly.
    pub chars_per_token: f64,
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
            chars_per_token: 4.0,
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

/// What one pass over an object's keys found besides the bounds it checked.
#[derive(Default)]
pub(crate) struct Scan {
    /// A gateway-owned rendezvous field is present (top level or in `sampling_params`).
    pub gateway_fields: bool,
}

/// One pass over the keys of the body (or of a `sampling_params` object, then `prefix` is
/// `sampling_params.`): the bounds on `stop`, `stop_token_ids`, `logit_bias`, `tools` and
/// `functions`, and whether a gateway-owned field is present. One pass, not one lookup per
/// field: this runs on every request, and each map lookup costs more than a key comparison.
pub(crate) fn scan(obj: &Map<String, Value>, prefix: &str, limits: &Limits) -> Result<Scan, InvalidRequest> {
    let mut found = Scan::default();
    for (k, v) in obj {
        match k.as_str() {
            "stop" => check_stop_field(v, prefix, limits)?,
            "stop_token_ids" => check_len(v, prefix, k, limits.max_stop_sequences)?,
            "logit_bias" => match v {
                Value::Null => {}
                Value::Object(m) if m.len() > limits.max_logit_bias => {
                    return Err(fail(prefix, k, format!("'logit_bias' has {} entries; at most {} are allowed", m.len(), limits.max_logit_bias)));
                }
                Value::Object(_) => {}
                _ => return Err(fail(prefix, k, "'logit_bias' must be an object of token id to bias".into())),
            },
            "tools" | "functions" if prefix.is_empty() => match v {
                Value::Null => {}
                Value::Array(_) => check_len(v, prefix, k, limits.max_tools)?,
                _ => return Err(fail(prefix, k, format!("'{k}' must be a list"))),
            },
            "sampling_params" if prefix.is_empty() => {
                let list: &[Value] = match v {
                    Value::Array(a) => a,
                    v @ Value::Object(_) => std::slice::from_ref(v),
                    _ => &[],
                };
                for sp in list.iter().filter_map(Value::as_object) {
                    found.gateway_fields |= scan(sp, "sampling_params.", limits)?.gateway_fields;
                }
            }
            other => found.gateway_fields |= crate::rendezvous::is_gateway_field(other),
        }
    }
    Ok(found)
}

/// The param name is built only for an error.
fn fail(prefix: &str, key: &str, message: String) -> InvalidRequest {
    invalid(&format!("{prefix}{key}"), message)
}

fn check_len(v: &Value, prefix: &str, key: &str, max: usize) -> Result<(), InvalidRequest> {
    match v {
        Value::Array(list) if list.len() > max => Err(fail(prefix, key, format!("'{key}' has {} entries; at most {max} are allowed", list.len()))),
        _ => Ok(()),
    }
}

fn check_stop_field(v: &Value, prefix: &str, limits: &Limits) -> Result<(), InvalidRequest> {
    let not_strings = || fail(prefix, "stop", "'stop' must be a string or a list of strings".into());
    match v {
        Value::Null => Ok(()),
        Value::String(s) => check_stop(s, prefix, limits),
        Value::Array(list) => {
            check_len(v, prefix, "stop", limits.max_stop_sequences)?;
            for s in list {
                check_stop(s.as_str().ok_or_else(not_strings)?, prefix, limits)?;
            }
            Ok(())
        }
        _ => Err(not_strings()),
    }
}

fn check_stop(s: &str, prefix: &str, limits: &Limits) -> Result<(), InvalidRequest> {
    if s.len() > limits.max_stop_bytes {
        return Err(fail(prefix, "stop", format!("a 'stop' string is {} bytes; at most {} are allowed", s.len(), limits.max_stop_bytes)));
    }
    Ok(())
}
