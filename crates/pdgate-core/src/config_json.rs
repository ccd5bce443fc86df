//! The JSON view of `GatewayConfig` (the Python API): each option's type as JSON Schema, and
//! parse errors that name the option and its value.
//!
//! The types are read off the one declaration (clap's value parser and action, the serde
//! default), so the Python `GatewayOptions` TypedDict generated from them cannot drift. serde's
//! own errors point at a line and column of a JSON text the user never wrote; here a failed parse
//! is retried option by option to find the one at fault.

use std::any::TypeId;

use clap::{Arg, ArgAction, CommandFactory};
use serde_json::{json, Map, Value};

use crate::config::{ConfigError, GatewayConfig};

/// Options whose entries are worker descriptions (`crate::config_serde`), with whether an entry
/// carries a bootstrap port. Their JSON shape is custom, so it is described here.
const WORKER_LIST_OPTIONS: [(&str, bool); 3] = [("prefill", true), ("decode", false), ("encode", true)];

/// The KV connector names a worker entry accepts (`KvConnector::from_name`'s canonical ones).
const KV_CONNECTORS: [&str; 3] = ["bootstrap", "nixl", "mooncake"];

/// Longest rendering of a bad value in an error message.
const VALUE_SHOWN_CHARS: usize = 200;

/// JSON Schema of one scalar value of `arg`, or `None` for a type this module does not know
/// (a test keeps that from happening).
fn scalar_schema(arg: &Arg) -> Option<Value> {
    if matches!(arg.get_action(), ArgAction::SetTrue | ArgAction::SetFalse) {
        return Some(json!({"type": "boolean"}));
    }
    let choices: Vec<String> = arg.get_possible_values().iter().map(|v| v.get_name().to_string()).collect();
    if !choices.is_empty() {
        return Some(json!({"enum": choices}));
    }
    let id = arg.get_value_parser().type_id();
    let int = |min: i128, max: i128| Some(json!({"type": "integer", "minimum": min, "maximum": max}));
    let is = |t: TypeId| id == t;
    if is(TypeId::of::<bool>()) {
        Some(json!({"type": "boolean"}))
    } else if is(TypeId::of::<u8>()) {
        int(0, u8::MAX.into())
    } else if is(TypeId::of::<u16>()) {
        int(0, u16::MAX.into())
    } else if is(TypeId::of::<u32>()) {
        int(0, u32::MAX.into())
    } else if is(TypeId::of::<u64>()) {
        int(0, u64::MAX.into())
    } else if is(TypeId::of::<usize>()) {
        int(0, i128::try_from(usize::MAX).unwrap_or(i128::MAX))
    } else if is(TypeId::of::<i32>()) {
        int(i32::MIN.into(), i32::MAX.into())
    } else if is(TypeId::of::<i64>()) {
        int(i64::MIN.into(), i64::MAX.into())
    } else if is(TypeId::of::<f64>()) || is(TypeId::of::<f32>()) {
        Some(json!({"type": "number"}))
    } else if is(TypeId::of::<String>()) || is(TypeId::of::<std::path::PathBuf>()) {
        Some(json!({"type": "string"}))
    } else {
        None
    }
}

/// One worker entry: `"URL"`, `["URL", PORT?, "kv_connector=NAME"?]` or an object.
fn worker_entry_schema(id: &str, with_port: bool) -> Value {
    let mut properties = json!({"url": {"type": "string"}});
    if id != "encode" {
        properties["kv_connector"] = json!({"enum": [KV_CONNECTORS[0], KV_CONNECTORS[1], KV_CONNECTORS[2], null]});
    }
    let (title, max_tokens, token_types) = if with_port {
        properties["bootstrap_port"] = json!({"type": ["integer", "null"], "minimum": 1, "maximum": 65535});
        (if id == "encode" { "EncodeWorker" } else { "PrefillWorker" }, 3, json!(["string", "integer", "null"]))
    } else {
        ("DecodeWorker", 2, json!(["string"]))
    };
    json!({"anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": token_types}, "minItems": 1, "maxItems": max_tokens},
        {"type": "object", "title": title, "properties": properties, "required": ["url"],
         "additionalProperties": false},
    ]})
}

fn is_repeated(arg: &Arg) -> bool {
    matches!(arg.get_action(), ArgAction::Append) || arg.get_num_args().is_some_and(|n| n.max_values() > 1)
}

/// JSON Schema of option `arg`'s value in the JSON view; `default` is its serde default (`null`
/// for an optional option). `{}` (anything) for an unknown type.
pub fn option_schema(arg: &Arg, default: Option<&Value>) -> Value {
    let id = arg.get_id().as_str();
    if let Some((_, with_port)) = WORKER_LIST_OPTIONS.iter().find(|(name, _)| *name == id) {
        return json!({"type": "array", "items": worker_entry_schema(id, *with_port)});
    }
    let Some(scalar) = scalar_schema(arg) else { return json!({}) };
    if is_repeated(arg) {
        return json!({"type": "array", "items": scalar});
    }
    if default.is_some_and(Value::is_null) {
        return nullable(scalar);
    }
    scalar
}

fn nullable(mut schema: Value) -> Value {
    if let Some(choices) = schema.get_mut("enum").and_then(Value::as_array_mut) {
        choices.push(Value::Null);
    } else if let Some(kind) = schema.get("type").cloned() {
        schema["type"] = json!([kind, "null"]);
    }
    schema
}

/// What a value of `schema` is, in words: "an integer from 0 to 65535", "one of a, b".
fn describe(schema: &Value) -> Option<String> {
    if let Some(choices) = schema.get("enum").and_then(Value::as_array) {
        let names: Vec<String> = choices.iter().map(|c| if c.is_null() { "null".into() } else { c.to_string() }).collect();
        return Some(format!("one of {}", names.join(", ")));
    }
    let kinds: Vec<&str> = match schema.get("type")? {
        Value::String(k) => vec![k.as_str()],
        Value::Array(ks) => ks.iter().filter_map(Value::as_str).collect(),
        _ => return None,
    };
    let words: Vec<String> = kinds
        .iter()
        .map(|k| match *k {
            "integer" => match (schema.get("minimum"), schema.get("maximum")) {
                (Some(lo), Some(hi)) => format!("an integer from {lo} to {hi}"),
                _ => "an integer".into(),
            },
            "number" => "a number".into(),
            "boolean" => "true or false".into(),
            "string" => "a string".into(),
            "null" => "null".into(),
            "array" => match schema.get("items").and_then(describe) {
                Some(item) => format!("a list, each item {item}"),
                None => "a list".into(),
            },
            other => other.to_string(),
        })
        .collect();
    Some(words.join(" or "))
}

fn shown(value: &Value) -> String {
    let text = value.to_string();
    if text.chars().count() <= VALUE_SHOWN_CHARS {
        return text;
    }
    let cut: String = text.chars().take(VALUE_SHOWN_CHARS).collect();
    format!("{cut}...")
}

/// The option of `options` that serde refuses, as an error naming it and its value.
fn blame(options: &Map<String, Value>) -> Option<ConfigError> {
    let command = GatewayConfig::command();
    let defaults = serde_json::to_value(GatewayConfig::default()).unwrap_or_default();
    for (name, value) in options {
        let Some(arg) = command.get_arguments().find(|a| a.get_id().as_str() == name) else {
            return Some(ConfigError::UnknownOption { name: name.clone() });
        };
        let alone = Value::Object(Map::from_iter([(name.clone(), value.clone())]));
        let Err(err) = serde_json::from_value::<GatewayConfig>(alone) else { continue };
        let schema = option_schema(arg, defaults.get(name));
        // A type mismatch reads best as what was expected; a custom error (a worker entry's
        // bad port or connector) already says what is wrong with the value.
        let text = err.to_string();
        let generic = ["invalid type", "invalid value", "invalid length", "unknown variant"].iter().any(|p| text.starts_with(p));
        let reason = match describe(&schema) {
            Some(expected) if generic => format!("expected {expected}"),
            _ => text,
        };
        return Some(ConfigError::BadValue { name: name.clone(), value: shown(value), reason });
    }
    None
}

/// Parse the JSON view (an object of option names to values); missing options take the CLI
/// defaults. Errors name the option and the value.
pub fn parse(text: &str) -> Result<GatewayConfig, ConfigError> {
    let value: Value = serde_json::from_str(text)?;
    let Value::Object(options) = &value else {
        return Err(ConfigError::Invalid(format!("the options must be an object of names to values, not {}", shown(&value))));
    };
    serde_json::from_value::<GatewayConfig>(value.clone()).map_err(|whole| blame(options).unwrap_or(ConfigError::Invalid(whole.to_string())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error_of(text: &str) -> String {
        parse(text).err().map(|e| e.to_string()).unwrap_or_default()
    }

    #[test]
    fn every_option_has_a_known_type() {
        let defaults = serde_json::to_value(GatewayConfig::default()).unwrap_or_default();
        for arg in GatewayConfig::command().get_arguments().filter(|a| a.get_long().is_some()) {
            let schema = option_schema(arg, defaults.get(arg.get_id().as_str()));
            assert_ne!(schema, json!({}), "option {} has a type config_json does not describe", arg.get_id());
        }
    }

    #[test]
    fn types_follow_the_declaration() {
        let schema = GatewayConfig::schema();
        let of = |name: &str| schema["options"].as_array().and_then(|o| o.iter().find(|o| o["name"] == name)).map(|o| o["json_schema"].clone());
        assert_eq!(of("port"), Some(json!({"type": "integer", "minimum": 0, "maximum": 65535})));
        assert_eq!(of("pd_disaggregation"), Some(json!({"type": "boolean"})));
        assert_eq!(of("cache_threshold"), Some(json!({"type": "number"})));
        assert_eq!(of("api_key"), Some(json!({"type": ["string", "null"]})));
        assert_eq!(of("worker_urls"), Some(json!({"type": "array", "items": {"type": "string"}})));
        let prefill_policy = of("prefill_policy").unwrap_or_default();
        assert_eq!(prefill_policy["enum"].as_array().and_then(|c| c.last()), Some(&Value::Null));
        assert_eq!(of("prefill").unwrap_or_default()["items"]["anyOf"][2]["title"], "PrefillWorker");
    }

    #[test]
    fn a_wrong_type_names_the_option_and_value_not_a_position() {
        let message = error_of(r#"{"host": "0.0.0.0", "port": "eighty"}"#);
        assert_eq!(message, r#"option port = "eighty": expected an integer from 0 to 65535"#);
        assert!(!message.contains("line") && !message.contains("column"));
        assert_eq!(error_of(r#"{"port": 70000}"#), "option port = 70000: expected an integer from 0 to 65535");
        assert_eq!(error_of(r#"{"pd_disaggregation": "yes"}"#), r#"option pd_disaggregation = "yes": expected true or false"#);
    }

    #[test]
    fn a_wrong_choice_lists_the_choices() {
        let message = error_of(r#"{"policy": "cache-aware"}"#);
        assert!(message.starts_with(r#"option policy = "cache-aware": expected one of "random""#), "{message}");
        assert!(message.contains(r#""cache_aware""#), "{message}");
    }

    #[test]
    fn a_bad_worker_entry_keeps_its_own_reason() {
        let message = error_of(r#"{"pd_disaggregation": true, "prefill": [["http://p:1", "eighty"]]}"#);
        assert!(message.starts_with(r#"option prefill = [["http://p:1","eighty"]]: invalid bootstrap port"#), "{message}");
    }

    #[test]
    fn unknown_options_and_non_objects_are_named() {
        assert_eq!(error_of(r#"{"prefil": []}"#), r#"unknown option "prefil""#);
        assert!(error_of("[1]").contains("must be an object"));
    }

    #[test]
    fn long_values_are_cut() {
        let long = "x".repeat(1000);
        let message = error_of(&format!(r#"{{"port": "{long}"}}"#));
        assert!(message.len() < 400 && message.contains("..."), "{message}");
    }
}
