//! The worker lists of `GatewayConfig` in their two spellings.
//!
//! On the command line a worker is a few tokens: `URL [BOOTSTRAP_PORT] [kv_connector=NAME]`.
//! In JSON it may also be `"URL"`, `["URL", 8998]` or `{"url", "bootstrap_port", "kv_connector"}`.
//! Both are stored as the token form, so the CLI and the JSON views are one schema.

use serde::{Deserialize, Deserializer};
use serde_json::Value;

use crate::registration::WorkerRegistration;
use crate::worker::WorkerRole;

/// `[URL, PORT?, kv_connector=NAME?, ...]` → a prefill registration (registration.rs).
pub fn prefill_from_tokens(tokens: &[String]) -> Result<WorkerRegistration, String> {
    crate::registration::from_tokens(tokens, WorkerRole::Prefill)
}

/// `[URL, kv_connector=NAME?, ...]` → a decode registration.
pub fn decode_from_tokens(tokens: &[String]) -> Result<WorkerRegistration, String> {
    crate::registration::from_tokens(tokens, WorkerRole::Decode)
}

/// `[URL, PORT?, label=K=V?, ...]` → an encode registration (EPD).
pub fn encode_from_tokens(tokens: &[String]) -> Result<WorkerRegistration, String> {
    crate::registration::from_tokens(tokens, WorkerRole::Encode)
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
                let known = matches!(key.as_str(), "url" | "kv_connector" | "kv_engine_id" | "kv_events" | "kv_events_replay" | "labels") || (with_port && key == "bootstrap_port");
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
            if let Some(id) = map.get("kv_engine_id").filter(|c| !c.is_null()) {
                tokens.push(format!("kv_engine_id={}", json_token(id)?));
            }
            for key in ["kv_events", "kv_events_replay"] {
                if let Some(ep) = map.get(key).filter(|c| !c.is_null()) {
                    tokens.push(format!("{key}={}", json_token(ep)?));
                }
            }
            if let Some(labels) = map.get("labels").filter(|c| !c.is_null()) {
                let labels = labels.as_object().ok_or("worker entry \"labels\" must be an object")?;
                for (k, v) in labels {
                    tokens.push(format!("label={k}={}", v.as_str().ok_or("label values must be strings")?));
                }
            }
            Ok(tokens)
        }
        other => Err(format!("a worker entry must be a URL, a list or an object, not {other}")),
    }
}

fn list<'de, D: Deserializer<'de>>(d: D, role: WorkerRole) -> Result<Vec<Vec<String>>, D::Error> {
    let entries = Vec::<Value>::deserialize(d)?;
    let tokens: Result<Vec<_>, String> = entries.iter().map(|e| entry_tokens(e, role.has_bootstrap_server())).collect();
    let tokens = tokens.map_err(serde::de::Error::custom)?;
    for t in &tokens {
        crate::registration::from_tokens(t, role).map_err(serde::de::Error::custom)?;
    }
    Ok(tokens)
}

pub fn prefill_list<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Vec<String>>, D::Error> {
    list(d, WorkerRole::Prefill)
}

pub fn decode_list<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Vec<String>>, D::Error> {
    list(d, WorkerRole::Decode)
}

pub fn encode_list<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Vec<String>>, D::Error> {
    list(d, WorkerRole::Encode)
}
