//! vLLM `kv_transfer_params` for the NIXL (pull) and Mooncake (push) connectors
//! (docs/protocols.md §2 and §3).

use serde_json::{json, Map, Value};

/// Fields the decode needs to pull blocks; without all of them it silently recomputes.
pub const NIXL_REQUIRED: [&str; 5] = ["remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host", "remote_port"];

/// The prefill leg: one token, no stream, and a request for remote decode.
fn prefill_common(original: &Map<String, Value>, params: Value) -> Map<String, Value> {
    let mut body = original.clone();
    body.insert("kv_transfer_params".into(), params);
    body.insert("stream".into(), Value::Bool(false));
    body.insert("max_tokens".into(), Value::from(1));
    if body.contains_key("messages") {
        body.insert("max_completion_tokens".into(), Value::from(1));
    }
    // The prefill's answer is read for its params only: no ids to send (`return_token_ids`).
    for key in ["stream_options", "min_tokens", "min_completion_tokens", "return_token_ids"] {
        body.remove(key);
    }
    body
}

pub fn nixl_prefill_body(original: &Map<String, Value>) -> Map<String, Value> {
    prefill_common(
        original,
        json!({
            "do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
            "remote_block_ids": null, "remote_host": null, "remote_port": null
        }),
    )
}

/// The original request with the prefill's params attached verbatim.
pub fn nixl_decode_body(original: &Map<String, Value>, params: Value) -> Map<String, Value> {
    let mut body = original.clone();
    body.insert("kv_transfer_params".into(), params);
    body
}

/// The original request without any `kv_transfer_params`, for a decode whose prefill returned
/// none: it recomputes the prompt (counted as a silent recompute), and never acts on params a
/// client put in its own body.
pub fn nixl_decode_without_params(original: &Map<String, Value>) -> Map<String, Value> {
    let mut body = original.clone();
    body.remove("kv_transfer_params");
    body
}

/// The prefill's returned params, if it returned any at all.
pub fn returned_params(response: &Value) -> Option<&Value> {
    response.get("kv_transfer_params").filter(|v| v.is_object())
}

/// Names of pull fields missing from returned params (empty = the decode can pull).
pub fn nixl_missing_fields(params: &Value) -> Vec<&'static str> {
    NIXL_REQUIRED.iter().copied().filter(|k| params.get(*k).is_none_or(Value::is_null)).collect()
}

/// A fresh Mooncake transfer id: `xfer-<uuid>` (the caller supplies the uuid text).
pub fn mooncake_transfer_id(uuid: &str) -> String {
    format!("xfer-{uuid}")
}

pub fn mooncake_prefill_body(original: &Map<String, Value>, transfer_id: &str) -> Map<String, Value> {
    prefill_common(original, json!({"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": transfer_id}))
}

pub fn mooncake_decode_body(original: &Map<String, Value>, transfer_id: &str, engine_id: &str, bootstrap_addr: &str) -> Map<String, Value> {
    let mut body = original.clone();
    body.insert(
        "kv_transfer_params".into(),
        json!({
            "do_remote_decode": false, "do_remote_prefill": true, "transfer_id": transfer_id,
            "remote_engine_id": engine_id, "remote_bootstrap_addr": bootstrap_addr
        }),
    );
    body
}

/// Engine id from a Mooncake bootstrap server's `GET /query`: `{dp_rank: {"engine_id": ...}}`.
/// Takes the lowest dp rank present.
pub fn mooncake_engine_id(query: &Value) -> Option<String> {
    let ranks = query.as_object()?;
    let mut best: Option<(i64, &Value)> = None;
    for (rank, entry) in ranks {
        let r = rank.parse::<i64>().unwrap_or(i64::MAX);
        if best.is_none_or(|(b, _)| r < b) {
            best = Some((r, entry));
        }
    }
    let id = best?.1.get("engine_id")?;
    match id {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn nixl_prefill_is_one_token_no_stream_and_asks_for_remote_decode() {
        let orig = obj(json!({"messages": [], "stream": true, "max_tokens": 50, "stream_options": {"include_usage": true}, "min_tokens": 3, "return_token_ids": true}));
        let p = nixl_prefill_body(&orig);
        assert!(!p.contains_key("return_token_ids"), "the prefill's answer is not relayed: no ids asked of it");
        assert_eq!(p["stream"], false);
        assert_eq!((p["max_tokens"].clone(), p["max_completion_tokens"].clone()), (json!(1), json!(1)));
        assert!(!p.contains_key("stream_options") && !p.contains_key("min_tokens"));
        assert_eq!(p["kv_transfer_params"]["do_remote_decode"], true);
        assert_eq!(p["kv_transfer_params"]["remote_block_ids"], Value::Null);
        assert_eq!(orig["max_tokens"], 50, "the original is untouched");
    }

    #[test]
    fn nixl_decode_gets_original_plus_params_verbatim() {
        let orig = obj(json!({"prompt": "x", "stream": true, "max_tokens": 50}));
        let params = json!({"do_remote_prefill": true, "remote_block_ids": [1, 2], "remote_engine_id": "e", "remote_request_id": "r",
                            "remote_host": "h", "remote_port": 5, "tp_size": 1, "extra": {"kept": true}});
        let d = nixl_decode_body(&orig, params.clone());
        assert_eq!(d["kv_transfer_params"], params);
        assert_eq!((d["stream"].clone(), d["max_tokens"].clone()), (json!(true), json!(50)));
        assert!(nixl_missing_fields(&params).is_empty());
        assert_eq!(nixl_missing_fields(&json!({"remote_block_ids": [1], "remote_host": null})).len(), 4);
    }

    #[test]
    fn without_params_from_the_prefill_the_decode_gets_none() {
        let orig = obj(json!({"prompt": "x", "kv_transfer_params": {"remote_host": "evil", "remote_port": 1}}));
        let d = nixl_decode_without_params(&orig);
        assert_eq!(Value::Object(d), json!({"prompt": "x"}));
    }

    #[test]
    fn mooncake_legs_share_the_transfer_id() {
        let orig = obj(json!({"prompt": "x", "max_tokens": 9}));
        let id = mooncake_transfer_id("abc");
        let p = mooncake_prefill_body(&orig, &id);
        let d = mooncake_decode_body(&orig, &id, "engine-7", "http://10.0.0.2:8998");
        assert_eq!(p["kv_transfer_params"]["transfer_id"], "xfer-abc");
        assert_eq!(d["kv_transfer_params"]["transfer_id"], "xfer-abc");
        assert_eq!(d["kv_transfer_params"]["remote_engine_id"], "engine-7");
        assert_eq!(d["kv_transfer_params"]["remote_bootstrap_addr"], "http://10.0.0.2:8998");
        assert_eq!(d["kv_transfer_params"]["do_remote_prefill"], true);
        assert_eq!(d["max_tokens"], 9);
    }

    #[test]
    fn engine_id_from_query_takes_lowest_rank() {
        let q = json!({"1": {"engine_id": "b"}, "0": {"engine_id": "a", "worker_addr": {}}});
        assert_eq!(mooncake_engine_id(&q).as_deref(), Some("a"));
        assert_eq!(mooncake_engine_id(&json!({})), None);
        assert_eq!(mooncake_engine_id(&json!({"0": {}})), None);
    }
}
