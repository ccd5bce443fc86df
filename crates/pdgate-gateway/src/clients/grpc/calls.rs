//! The `GenerateRequest`s one leg is sent as. gRPC takes one prompt per call, so a batch is one
//! call per prompt (each with the request's `n`), and an SGLang bootstrap PD leg one call per
//! item (prompt × choice, `n` = 1), since the contract's `DisaggregatedParams` holds one room and
//! the plan minted one room per item (`bootstrap_room` a list, or a scalar stepped per item as
//! SGLang does).
//!
//! Calls are named `{rid}_{i}` when there are several (SGLang's names for a batch's items), so
//! `Abort(rid)` (the engine matches by prefix) reaches them all.

use pdgate_core::GatewayError;
use serde_json::{Map, Value};

use super::shape::{Call, Shape};

fn bad(param: &str, message: impl Into<String>) -> GatewayError {
    GatewayError::invalid(Some(param), message)
}

/// Item `i` of `total`'s value of a bootstrap field: a list is indexed (and must have one entry
/// per item), a scalar is every item's (a room stepped by `i` when `step`).
fn pick(body: &Map<String, Value>, key: &str, i: usize, total: usize, step: bool) -> Result<Value, GatewayError> {
    match body.get(key) {
        Some(Value::Array(list)) if list.len() == total => Ok(list[i].clone()),
        Some(Value::Array(list)) => Err(bad(key, format!("'{key}' has {} entries for {total} items", list.len()))),
        Some(Value::Number(n)) if step => n.as_i64().map(|r| Value::from(r + i as i64)).ok_or_else(|| bad(key, format!("'{key}' must be a non-negative integer"))),
        Some(v) => Ok(v.clone()),
        None => Ok(Value::Null),
    }
}

fn bootstrap(body: &Map<String, Value>, i: usize, total: usize) -> Result<(String, i32, i32), GatewayError> {
    let host = pick(body, "bootstrap_host", i, total, false)?;
    let host = host.as_str().ok_or_else(|| bad("bootstrap_host", "'bootstrap_host' must be a string"))?.to_string();
    let port = match pick(body, "bootstrap_port", i, total, false)? {
        Value::Null => 0,
        v => v.as_i64().and_then(|p| i32::try_from(p).ok()).ok_or_else(|| bad("bootstrap_port", "'bootstrap_port' must be a port number"))?,
    };
    let room = pick(body, "bootstrap_room", i, total, true)?;
    let room = room.as_i64().filter(|r| *r >= 0).ok_or_else(|| bad("bootstrap_room", "'bootstrap_room' must be a non-negative integer"))?;
    let room = i32::try_from(room).map_err(|_| bad("bootstrap_room", "bootstrap_room does not fit the gRPC contract's int32"))?;
    Ok((host, port, room))
}

/// vLLM NIXL / Mooncake `kv_transfer_params` of a PD leg, as the JSON text the contract's
/// `kv_transfer_params_json` carries (the plan's object, verbatim).
fn kv_transfer_params(body: &Map<String, Value>) -> Result<Option<String>, GatewayError> {
    match body.get("kv_transfer_params") {
        None | Some(Value::Null) => Ok(None),
        Some(v @ Value::Object(_)) => Ok(Some(v.to_string())),
        Some(_) => Err(bad("kv_transfer_params", "'kv_transfer_params' must be an object")),
    }
}

/// The calls for a parsed leg; `base` is the request id (the body's `rid`, else the gateway's).
pub fn calls(shape: &Shape, body: &Map<String, Value>, base: &str) -> Result<Vec<Call>, GatewayError> {
    let n = shape.sampling.n.max(1) as usize;
    let total = shape.choices();
    let is_set = |k: &str| body.get(k).is_some_and(|v| !v.is_null());
    let kv_transfer_params = kv_transfer_params(body)?;
    if !(is_set("bootstrap_host") && is_set("bootstrap_room")) {
        let several = shape.prompts.len() > 1;
        if several && kv_transfer_params.is_some() {
            // One prefill's returned params answer one prompt: a batch has no single pull handle.
            return Err(bad("kv_transfer_params", "a list of prompts cannot carry kv_transfer_params to a gRPC worker"));
        }
        return Ok((0..shape.prompts.len())
            .map(|p| Call {
                request_id: if several { format!("{base}_{p}") } else { base.to_string() },
                prompt: p,
                first: (p * n) as u32,
                sampling: shape.sampling.clone(),
                bootstrap: None,
                kv_transfer_params: kv_transfer_params.clone(),
            })
            .collect());
    }
    (0..total)
        .map(|i| {
            let mut sampling = shape.sampling.clone();
            sampling.n = 1;
            // Each choice its own draw, as the engines number a seeded request's choices.
            sampling.seed = sampling.seed.map(|s| s + (i % n) as i64);
            Ok(Call {
                request_id: if total > 1 { format!("{base}_{i}") } else { base.to_string() },
                prompt: i / n,
                first: i as u32,
                sampling,
                bootstrap: Some(bootstrap(body, i, total)?),
                kv_transfer_params: None,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use crate::clients::grpc::request::{parse, Route};
    use pdgate_tokenizer::ModelTokenizer;

    fn tok() -> ModelTokenizer {
        let dir = format!("{}/../pdgate-tokenizer/tests/fixtures/bpe", env!("CARGO_MANIFEST_DIR"));
        ModelTokenizer::from_path(std::path::Path::new(&dir)).unwrap()
    }

    #[test]
    fn a_batch_is_one_call_per_prompt_with_its_choices() {
        let p = parse(&tok(), Route::Completions, br#"{"prompt":[[1],[2],[3]],"n":2,"rid":"r"}"#, "x").unwrap();
        let got: Vec<(String, usize, u32, u32)> = p.calls.iter().map(|c| (c.request_id.clone(), c.prompt, c.first, c.sampling.n)).collect();
        assert_eq!(got, vec![("r_0".into(), 0, 0, 2), ("r_1".into(), 1, 2, 2), ("r_2".into(), 2, 4, 2)]);
        assert!(p.calls.iter().all(|c| c.bootstrap.is_none()));
        let one = parse(&tok(), Route::Completions, br#"{"prompt":[1],"n":3}"#, "x").unwrap();
        assert_eq!(one.calls.len(), 1);
        assert_eq!((one.calls[0].request_id.as_str(), one.calls[0].sampling.n), ("x", 3));
    }

    #[test]
    fn a_bootstrap_leg_is_one_call_per_item_with_its_room_and_seed() {
        let body = br#"{"input_ids":[[1],[2]],"sampling_params":{"n":2,"seed":10},"rid":"g","bootstrap_host":"h","bootstrap_port":8998,"bootstrap_room":[5,6,7,8]}"#;
        let p = parse(&tok(), Route::Generate, body, "x").unwrap();
        let got: Vec<(String, usize, u32, Option<i64>, i32)> =
            p.calls.iter().map(|c| (c.request_id.clone(), c.prompt, c.first, c.sampling.seed, c.bootstrap.as_ref().unwrap().2)).collect();
        assert_eq!(got, vec![("g_0".into(), 0, 0, Some(10), 5), ("g_1".into(), 0, 1, Some(11), 6), ("g_2".into(), 1, 2, Some(10), 7), ("g_3".into(), 1, 3, Some(11), 8)]);
        assert!(p.calls.iter().all(|c| c.sampling.n == 1 && c.bootstrap.as_ref().unwrap().1 == 8998));
        // A scalar room is stepped per item (SGLang's rule).
        let p = parse(&tok(), Route::Generate, br#"{"text":["a","b"],"bootstrap_host":"h","bootstrap_room":40}"#, "x").unwrap();
        assert_eq!(p.calls.iter().map(|c| c.bootstrap.as_ref().unwrap().2).collect::<Vec<_>>(), vec![40, 41]);
    }

    #[test]
    fn bootstrap_lists_must_match_the_items() {
        let body = br#"{"text":["a","b"],"bootstrap_host":"h","bootstrap_room":[1,2,3]}"#;
        let err = parse(&tok(), Route::Generate, body, "x").unwrap_err();
        assert_eq!((err.status(), err.param()), (400, Some("bootstrap_room")));
    }
}
