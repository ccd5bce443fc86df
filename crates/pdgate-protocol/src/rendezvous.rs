//! Fields that steer a worker's KV rendezvous or identity belong to the gateway, never to the
//! client (docs/protocols.md §1-3). A client that sends them could point a decode at a host of its
//! choosing (`kv_transfer_params.remote_host`, `bootstrap_host`), join another request's room,
//! or collide with another request's id. They are removed from every client body before any
//! leg is built; the gateway then adds its own values where the protocol needs them.

use serde_json::{Map, Value};

/// Client fields removed from the body (top level and inside `sampling_params`):
/// - SGLang: `bootstrap_host`, `bootstrap_port`, `bootstrap_room`, `bootstrap_pair_key`,
///   `decode_tp_size`, `disagg_prefill_dp_rank`, `data_parallel_rank` (rank routing), `rid`
///   (the engine's request id);
/// - vLLM: `kv_transfer_params` (NIXL and Mooncake), `request_id` (the engine's request id);
/// - the fields of `kv_transfer_params` at the top level, where a lenient engine might read
///   them: `transfer_id`, `remote_engine_id`, `remote_bootstrap_addr`, `remote_host`,
///   `remote_port`, `remote_block_ids`, `remote_request_id`, `do_remote_prefill`,
///   `do_remote_decode`;
/// - EPD (docs/protocols.md §8): TokenSpeed's `encode_bootstrap_info` (where a prefill fetches
///   a request's image embeddings) and vLLM's `ec_transfer_params` (the encoder's answer, which
///   may name the host a prefill reads an embedding from).
pub const GATEWAY_FIELDS: [&str; 21] = [
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "bootstrap_pair_key",
    "decode_tp_size",
    "disagg_prefill_dp_rank",
    "data_parallel_rank",
    "rid",
    "kv_transfer_params",
    "request_id",
    "transfer_id",
    "remote_engine_id",
    "remote_bootstrap_addr",
    "remote_host",
    "remote_port",
    "remote_block_ids",
    "remote_request_id",
    "do_remote_prefill",
    "do_remote_decode",
    "encode_bootstrap_info",
    "ec_transfer_params",
];

/// Whether `key` is one of [`GATEWAY_FIELDS`] (a `match`: this runs for every key of every
/// request).
pub fn is_gateway_field(key: &str) -> bool {
    matches!(
        key,
        "bootstrap_host"
            | "bootstrap_port"
            | "bootstrap_room"
            | "bootstrap_pair_key"
            | "decode_tp_size"
            | "disagg_prefill_dp_rank"
            | "data_parallel_rank"
            | "rid"
            | "kv_transfer_params"
            | "request_id"
            | "transfer_id"
            | "remote_engine_id"
            | "remote_bootstrap_addr"
            | "remote_host"
            | "remote_port"
            | "remote_block_ids"
            | "remote_request_id"
            | "do_remote_prefill"
            | "do_remote_decode"
            | "encode_bootstrap_info"
            | "ec_transfer_params"
    )
}

/// Whether the body carries any gateway-owned field (top level or in `sampling_params`).
/// The parser finds this in its own pass over the keys; this is the standalone check.
pub fn has_gateway_fields(body: &Map<String, Value>) -> bool {
    let present = |o: &Map<String, Value>| o.keys().any(|k| is_gateway_field(k));
    present(body) || sampling_objects(body).any(present)
}

fn sampling_objects(body: &Map<String, Value>) -> impl Iterator<Item = &Map<String, Value>> {
    let sp = body.get("sampling_params");
    let list: &[Value] = match sp {
        Some(Value::Array(a)) => a,
        Some(v @ Value::Object(_)) => std::slice::from_ref(v),
        _ => &[],
    };
    list.iter().filter_map(Value::as_object)
}

/// Removes every gateway-owned field; returns the names removed (for one debug line).
pub fn strip_gateway_fields(body: &mut Map<String, Value>) -> Vec<&'static str> {
    let mut removed = Vec::new();
    let mut strip = |obj: &mut Map<String, Value>| {
        for k in GATEWAY_FIELDS {
            if obj.remove(k).is_some() && !removed.contains(&k) {
                removed.push(k);
            }
        }
    };
    strip(body);
    match body.get_mut("sampling_params") {
        Some(Value::Object(sp)) => strip(sp),
        Some(Value::Array(list)) => list.iter_mut().filter_map(Value::as_object_mut).for_each(strip),
        _ => {}
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn every_gateway_field_is_removed_top_level_and_in_sampling_params() {
        let mut body = json!({
            "prompt": "x", "max_tokens": 5,
            "bootstrap_host": "evil", "bootstrap_port": 1, "bootstrap_room": 7, "rid": "r",
            "kv_transfer_params": {"remote_host": "evil", "remote_port": 1},
            "transfer_id": "xfer-mine", "remote_engine_id": "e", "remote_bootstrap_addr": "http://evil:1",
            "data_parallel_rank": 3, "request_id": "mine",
            "sampling_params": {"temperature": 0, "bootstrap_room": 9, "kv_transfer_params": {}}
        })
        .as_object()
        .unwrap()
        .clone();
        assert!(has_gateway_fields(&body));
        let removed = strip_gateway_fields(&mut body);
        assert!(removed.contains(&"kv_transfer_params") && removed.contains(&"bootstrap_room"));
        assert_eq!(serde_json::Value::Object(body.clone()), json!({"prompt": "x", "max_tokens": 5, "sampling_params": {"temperature": 0}}));
        assert!(!has_gateway_fields(&body));
    }

    #[test]
    fn the_match_and_the_list_agree() {
        assert!(GATEWAY_FIELDS.iter().all(|k| is_gateway_field(k)));
        assert!(!is_gateway_field("prompt") && !is_gateway_field("bootstrap"));
    }

    #[test]
    fn a_clean_body_is_left_alone() {
        let body = json!({"prompt": "x", "sampling_params": [{"n": 1}], "user": "u"}).as_object().unwrap().clone();
        assert!(!has_gateway_fields(&body));
        let mut list = json!({"text": ["a"], "sampling_params": [{"bootstrap_host": "evil"}]}).as_object().unwrap().clone();
        assert!(has_gateway_fields(&list));
        strip_gateway_fields(&mut list);
        assert_eq!(list["sampling_params"], json!([{}]));
    }
}
