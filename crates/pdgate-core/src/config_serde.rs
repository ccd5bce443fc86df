//! The worker lists of `GatewayConfig` in their two spellings.
//!
//! On the command line a worker is a few tokens: `URL [BOOTSTRAP_PORT] [kv_connector=NAME]`.
//! In JSON it may also be `"URL"`, `["URL", 8998]` or `{"url", "bootstrap_port", "kv_connector"}`.
//! Both are stored as the token form, so the CLI and the JSON views are one schema.

use serde::{Deserialize, Deserializer};
use serde_json::Value;

use crate::config::{PrefillArg, WorkerArg};
use crate::worker::KvConnector;

fn parse_connector(value: &str) -> Result<KvConnector, String> {
    KvConnector::from_name(value)
        .ok_or_else(|| format!("unknown kv_connector {value:?} (expected bootstrap, nixl or mooncake)"))
}

/// `[URL, PORT?, kv_connector=NAME?]` → a prefill worker.
pub fn prefill_from_tokens(tokens: &[String]) -> Result<PrefillArg, String> {
    let (url, rest) = tokens.split_first().ok_or("--prefill needs a URL")?;
    let mut arg = PrefillArg { url: url.clone(), bootstrap_port: None, kv_connector: None };
    for (i, token) in rest.iter().enumerate() {
        if let Some(name) = token.strip_prefix("kv_connector=") {
            arg.kv_connector = Some(parse_connector(name)?);
        } else if i == 0 {
            arg.bootstrap_port = parse_port(token)?;
        } else {
            return Err(format!("unexpected token {token:?} after prefill {url}"));
        }
    }
    Ok(arg)
}

/// `[URL, kv_connector=NAME?]` → a decode worker.
pub fn decode_from_tokens(tokens: &[String]) -> Result<WorkerArg, String> {
    let (url, rest) = tokens.split_first().ok_or("--decode needs a URL")?;
    let mut arg = WorkerArg { url: url.clone(), kv_connector: None };
    for token in rest {
        let name = token
            .strip_prefix("kv_connector=")
            .ok_or_else(|| format!("unexpected token {token:?} after decode {url}"))?;
        arg.kv_connector = Some(parse_connector(name)?);
    }
    Ok(arg)
}

fn parse_port(token: &str) -> Result<Option<u16>, String> {
    if token.eq_ignore_ascii_case("none") || token.eq_ignore_ascii_case("null") {
        return Ok(None);
    }
    match token.parse::<u16>() {
        Ok(0) | Err(_) => Err(format!("invalid bootstrap port {token:?} (expected 1-65535 or none)")),
        Ok(p) => Ok(Some(p)),
    }
}

fn json_token(v: &Value) -> Result<String, String> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Number(n) => Ok(n.to_string()),
        Value::Null => Ok("none".into()),
        other => Err(format!("unexpected {other} in a worker entry")),
    }
}

/// One JSON worker entry → tokens.
fn entry_tokens(v: &Value, with_port: bool) -> Result<Vec<String>, String> {
    match v {
        Value::String(url) => Ok(vec![url.clone()]),
        Value::Array(items) => items.iter().map(json_token).collect(),
        Value::Object(map) => {
            let url = map.get("url").and_then(Value::as_str).ok_or("worker entry needs \"url\"")?;
            let mut tokens = vec![url.to_string()];
            for key in map.keys() {
                let known = key == "url" || key == "kv_connector" || (with_port && key == "bootstrap_port");
                if !known {
                    return Err(format!("unknown key {key:?} in a worker entry"));
                }
            }
            if with_port {
                tokens.push(json_token(map.get("bootstrap_port").unwrap_or(&Value::Null))?);
            }
            if let Some(c) = map.get("kv_connector").filter(|c| !c.is_null()) {
                tokens.push(format!("kv_connector={}", json_token(c)?));
            }
            Ok(tokens)
        }
        other => Err(format!("a worker entry must be a URL, a list or an object, not {other}")),
    }
}

fn list<'de, D: Deserializer<'de>>(d: D, with_port: bool) -> Result<Vec<Vec<String>>, D::Error> {
    let entries = Vec::<Value>::deserialize(d)?;
    let tokens: Result<Vec<_>, String> = entries.iter().map(|e| entry_tokens(e, with_port)).collect();
    let tokens = tokens.map_err(serde::de::Error::custom)?;
    for t in &tokens {
        let checked = if with_port { prefill_from_tokens(t).map(|_| ()) } else { decode_from_tokens(t).map(|_| ()) };
        checked.map_err(serde::de::Error::custom)?;
    }
    Ok(tokens)
}

pub fn prefill_list<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Vec<String>>, D::Error> {
    list(d, true)
}

pub fn decode_list<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Vec<String>>, D::Error> {
    list(d, false)
}
