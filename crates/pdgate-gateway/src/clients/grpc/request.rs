//! A leg's JSON body (the route's OpenAI or SGLang shape) as an SMG `GenerateRequest`: the
//! prompt tokenized (chat template applied for chat), the sampling fields mapped, and the
//! [`Shape`] the answer is to be written back in.

use pdgate_core::GatewayError;
use pdgate_tokenizer::ModelTokenizer;
use serde_json::{Map, Value};

use super::logprobs::{self, LogprobAsk};
use super::prompts::PromptMemo;
pub use super::shape::{Call, Route, Sampling, Shape};
use super::{calls, prompts};

/// The reference engine's and SGLang's defaults when a body gives no `max_tokens`.
const COMPLETIONS_DEFAULT_MAX_TOKENS: u32 = 16;
const CHAT_DEFAULT_MAX_TOKENS: u32 = 256;
const GENERATE_DEFAULT_MAX_NEW_TOKENS: u32 = 128;
/// The most choices one request may ask for (the engines' bound).
const MAX_N: u32 = 64;

/// A parsed leg: the answer's shape and the calls that make it (one for a single prompt; one
/// per prompt of a batch; one per item — prompt × choice — on a bootstrap PD leg, each with its
/// own room).
#[derive(Debug, Clone)]
pub struct Parsed {
    pub shape: Shape,
    pub calls: Vec<Call>,
}

fn bad(param: &str, message: impl Into<String>) -> GatewayError {
    GatewayError::invalid(Some(param), message)
}

fn f32_field(body: &Map<String, Value>, key: &str, default: f32) -> Result<f32, GatewayError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v.as_f64().map(|f| f as f32).ok_or_else(|| bad(key, format!("'{key}' must be a number"))),
    }
}

fn u32_field(body: &Map<String, Value>, key: &str) -> Result<Option<u32>, GatewayError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_u64().and_then(|n| u32::try_from(n).ok()).map(Some).ok_or_else(|| bad(key, format!("'{key}' must be a non-negative integer"))),
    }
}

fn stops(body: &Map<String, Value>) -> Result<Vec<String>, GatewayError> {
    match body.get("stop") {
        None | Some(Value::Null) => Ok(vec![]),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(a)) => a.iter().map(|s| s.as_str().map(str::to_string).ok_or_else(|| bad("stop", "'stop' must be a string or a list of strings"))).collect(),
        Some(_) => Err(bad("stop", "'stop' must be a string or a list of strings")),
    }
}

fn stop_ids(body: &Map<String, Value>) -> Result<Vec<u32>, GatewayError> {
    match body.get("stop_token_ids") {
        None | Some(Value::Null) => Ok(vec![]),
        Some(Value::Array(a)) => {
            a.iter().map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| bad("stop_token_ids", "'stop_token_ids' must be token ids"))).collect()
        }
        Some(_) => Err(bad("stop_token_ids", "'stop_token_ids' must be a list of token ids")),
    }
}

/// The sampling fields of an OpenAI body or of SGLang's `sampling_params` (same names, but
/// `max_new_tokens` there).
fn sampling(obj: &Map<String, Value>, max_tokens: Option<u32>, default_max: u32, n: u32) -> Result<Sampling, GatewayError> {
    let top_k = match obj.get("top_k") {
        None | Some(Value::Null) => -1,
        Some(v) => v.as_i64().and_then(|k| i32::try_from(k).ok()).ok_or_else(|| bad("top_k", "'top_k' must be an integer"))?,
    };
    let seed = match obj.get("seed").or_else(|| obj.get("sampling_seed")) {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_i64().ok_or_else(|| bad("seed", "'seed' must be an integer"))?),
    };
    let flag = |k: &str, d: bool| obj.get(k).and_then(Value::as_bool).unwrap_or(d);
    Ok(Sampling {
        max_new_tokens: max_tokens.unwrap_or(default_max),
        temperature: f32_field(obj, "temperature", 1.0)?,
        top_p: f32_field(obj, "top_p", 1.0)?,
        top_k,
        min_p: f32_field(obj, "min_p", 0.0)?,
        frequency_penalty: f32_field(obj, "frequency_penalty", 0.0)?,
        presence_penalty: f32_field(obj, "presence_penalty", 0.0)?,
        repetition_penalty: f32_field(obj, "repetition_penalty", 1.0)?,
        stop: stops(obj)?,
        stop_token_ids: stop_ids(obj)?,
        ignore_eos: flag("ignore_eos", false),
        skip_special_tokens: flag("skip_special_tokens", true),
        seed,
        n,
        logprobs: None,
        prompt_logprobs: false,
        logprob_start_len: -1,
    })
}

/// A top-logprobs count in [0, 20] (the engines' bound), or absent.
fn top_count(body: &Map<String, Value>, key: &str) -> Result<u32, GatewayError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(0),
        Some(v) => v
            .as_u64()
            .filter(|k| *k <= logprobs::MAX_TOP_LOGPROBS)
            .map(|k| k as u32)
            .ok_or_else(|| bad(key, format!("'{key}' must be an integer in [0, {}]", logprobs::MAX_TOP_LOGPROBS))),
    }
}

/// The logprobs the body asks for, in the route's terms (the engine's HTTP surfaces' rules).
fn logprob_ask(route: Route, body: &Map<String, Value>) -> Result<Option<LogprobAsk>, GatewayError> {
    Ok(match route {
        Route::Completions => match body.get("logprobs") {
            None | Some(Value::Null) => None,
            Some(_) => Some(LogprobAsk::Completions { top: top_count(body, "logprobs")? }),
        },
        Route::Chat => {
            let top = top_count(body, "top_logprobs")?;
            body.get("logprobs").and_then(Value::as_bool).unwrap_or(false).then_some(LogprobAsk::Chat { top })
        }
        Route::Generate => {
            let top = top_count(body, "top_logprobs_num")?;
            let text = body.get("return_text_in_logprobs").and_then(Value::as_bool).unwrap_or(false);
            body.get("return_logprob").and_then(Value::as_bool).unwrap_or(false).then_some(LogprobAsk::Native { top, text })
        }
    })
}

/// Parses a leg body for `route` with the gateway's tokenizer. Bad input is the client's (400),
/// named by field, never sent on to the engine.
pub fn parse(tok: &ModelTokenizer, route: Route, raw: &[u8], request_id: &str) -> Result<Parsed, GatewayError> {
    parse_shared(tok, route, raw, request_id, &PromptMemo::default())
}

/// [`parse`], the prompts taken from `memo` when another leg of the request tokenized them.
pub fn parse_shared(tok: &ModelTokenizer, route: Route, raw: &[u8], request_id: &str, memo: &PromptMemo) -> Result<Parsed, GatewayError> {
    let value: Value = serde_json::from_slice(raw).map_err(|e| GatewayError::invalid(None, format!("request body is not JSON: {e}")))?;
    let Value::Object(body) = &value else { return Err(GatewayError::invalid(None, "request body must be a JSON object")) };
    if route == Route::Completions && body.get("echo").and_then(Value::as_bool).unwrap_or(false) {
        // The engine's HTTP completions refuse it too (the prompt's logprobs are not written).
        return Err(bad("echo", "'echo' is not supported"));
    }
    let given = memo.get_or(tok, || prompts::prompts(tok, route, &value, body))?;
    let ask = logprob_ask(route, body)?;
    let rid = body.get("rid").and_then(Value::as_str).filter(|r| !r.is_empty()).map(str::to_string);
    let flag = |k: &str| body.get(k).and_then(Value::as_bool).unwrap_or(false);
    let (mut sampling, id) = match route {
        Route::Completions | Route::Chat => {
            let n = u32_field(body, "n")?.unwrap_or(1);
            if !(1..=MAX_N).contains(&n) {
                return Err(bad("n", format!("'n' must be in [1, {MAX_N}]")));
            }
            let mt = if route == Route::Chat { u32_field(body, "max_completion_tokens")? } else { None };
            let mt = match mt {
                Some(v) => Some(v),
                None => u32_field(body, "max_tokens")?,
            };
            let default = if route == Route::Chat { CHAT_DEFAULT_MAX_TOKENS } else { COMPLETIONS_DEFAULT_MAX_TOKENS };
            let prefix = if route == Route::Chat { "chatcmpl" } else { "cmpl" };
            (sampling(body, mt, default, n)?, rid.clone().unwrap_or_else(|| format!("{prefix}-{request_id}")))
        }
        Route::Generate => {
            let sp = match body.get("sampling_params") {
                None | Some(Value::Null) => Map::new(),
                Some(Value::Object(m)) => m.clone(),
                // A list (one per prompt) is not mapped yet: the items would differ in sampling.
                Some(_) => return Err(bad("sampling_params", "'sampling_params' must be an object (a list per prompt is not served over gRPC)")),
            };
            let n = u32_field(&sp, "n")?.unwrap_or(1);
            if !(1..=MAX_N).contains(&n) {
                return Err(bad("n", format!("'n' must be in [1, {MAX_N}]")));
            }
            let mt = u32_field(&sp, "max_new_tokens")?;
            (sampling(&sp, mt, GENERATE_DEFAULT_MAX_NEW_TOKENS, n)?, rid.clone().unwrap_or_else(|| request_id.to_string()))
        }
    };
    if let Some(ask) = ask {
        sampling.logprobs = Some(ask.top());
        sampling.prompt_logprobs = matches!(ask, LogprobAsk::Native { .. });
        if sampling.prompt_logprobs {
            sampling.logprob_start_len = body.get("logprob_start_len").and_then(Value::as_i64).and_then(|v| i32::try_from(v).ok()).unwrap_or(-1);
        }
    }
    let include_usage = body.get("stream_options").and_then(|o| o.get("include_usage")).and_then(Value::as_bool).unwrap_or(false);
    let shape = Shape {
        route,
        stream: flag("stream"),
        include_usage,
        return_token_ids: flag("return_token_ids"),
        id,
        model: body.get("model").and_then(Value::as_str).map(str::to_string),
        prompts: given.ids,
        batch: given.batch,
        sampling,
        logprobs: ask,
        resumed_ids: 0,
    };
    let calls = calls::calls(&shape, body, rid.as_deref().unwrap_or(request_id))?;
    Ok(Parsed { shape, calls })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok() -> ModelTokenizer {
        let dir = format!("{}/../pdgate-tokenizer/tests/fixtures/bpe", env!("CARGO_MANIFEST_DIR"));
        ModelTokenizer::from_path(std::path::Path::new(&dir)).unwrap()
    }

    #[test]
    fn completions_map_sampling_and_defaults() {
        let p = parse(&tok(), Route::Completions, br#"{"prompt":[1,2,3],"max_tokens":5,"temperature":0,"stop":"x","n":2}"#, "abc").unwrap();
        assert_eq!(p.shape.prompts, vec![vec![1, 2, 3]]);
        assert_eq!(p.shape.sampling.max_new_tokens, 5);
        assert_eq!(p.shape.sampling.temperature, 0.0);
        assert_eq!(p.shape.sampling.stop, vec!["x".to_string()]);
        assert_eq!(p.shape.sampling.n, 2);
        assert_eq!(p.shape.id, "cmpl-abc");
        let d = parse(&tok(), Route::Completions, br#"{"prompt":[1]}"#, "r").unwrap();
        assert_eq!(d.shape.sampling.max_new_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS);
        assert_eq!((d.shape.sampling.top_k, d.shape.sampling.top_p), (-1, 1.0));
    }

    #[test]
    fn bad_fields_are_the_clients_with_their_name() {
        for (route, body, param) in [
            (Route::Completions, &br#"{"prompt":[1],"n":0}"#[..], "n"),
            (Route::Completions, br#"{"prompt":[["a"]]}"#, "prompt"),
            (Route::Chat, br#"{"messages":[]}"#, "messages"),
            (Route::Generate, br#"{"text":"a","input_ids":[1]}"#, "text"),
            (Route::Completions, br#"{"prompt":[1],"stop":5}"#, "stop"),
            (Route::Completions, br#"{"prompt":[1],"logprobs":21}"#, "logprobs"),
            (Route::Completions, br#"{"prompt":[1],"echo":true}"#, "echo"),
            (Route::Chat, br#"{"messages":[{"role":"user","content":"a"}],"logprobs":true,"top_logprobs":-1}"#, "top_logprobs"),
            (Route::Generate, br#"{"input_ids":[1],"return_logprob":true,"top_logprobs_num":"2"}"#, "top_logprobs_num"),
            (Route::Generate, br#"{"input_ids":[1],"bootstrap_host":"h","bootstrap_room":4294967296}"#, "bootstrap_room"),
            (Route::Completions, br#"{"prompt":[1],"kv_transfer_params":[1]}"#, "kv_transfer_params"),
            (Route::Completions, br#"{"prompt":[[1],[2]],"kv_transfer_params":{"do_remote_decode":true}}"#, "kv_transfer_params"),
        ] {
            let err = parse(&tok(), route, body, "r").unwrap_err();
            assert_eq!(err.status(), 400, "{body:?}");
            assert_eq!(err.param(), Some(param), "{body:?}");
        }
    }

    #[test]
    fn generate_takes_sampling_params_rid_and_bootstrap() {
        let body = br#"{"input_ids":[5,6],"sampling_params":{"max_new_tokens":3},"rid":"g1","bootstrap_host":"h","bootstrap_port":8998,"bootstrap_room":7}"#;
        let p = parse(&tok(), Route::Generate, body, "r").unwrap();
        assert_eq!(p.calls.len(), 1);
        assert_eq!(p.calls[0].request_id, "g1");
        assert_eq!(p.shape.sampling.max_new_tokens, 3);
        assert_eq!(p.calls[0].bootstrap, Some(("h".into(), 8998, 7)));
    }

    #[test]
    fn logprob_asks_follow_the_engines_http_rules() {
        let c = parse(&tok(), Route::Completions, br#"{"prompt":[1],"logprobs":0}"#, "r").unwrap();
        assert_eq!(c.shape.logprobs, Some(LogprobAsk::Completions { top: 0 }));
        assert_eq!((c.shape.sampling.logprobs, c.shape.sampling.prompt_logprobs), (Some(0), false));
        let chat = parse(&tok(), Route::Chat, br#"{"messages":[{"role":"user","content":"a"}],"logprobs":true,"top_logprobs":3}"#, "r").unwrap();
        assert_eq!(chat.shape.logprobs, Some(LogprobAsk::Chat { top: 3 }));
        // top_logprobs without logprobs asks for nothing (OpenAI's rule, the engine's too).
        let none = parse(&tok(), Route::Chat, br#"{"messages":[{"role":"user","content":"a"}],"top_logprobs":3}"#, "r").unwrap();
        assert_eq!((none.shape.logprobs, none.shape.sampling.logprobs), (None, None));
        let g =
            parse(&tok(), Route::Generate, br#"{"input_ids":[1,2],"return_logprob":true,"top_logprobs_num":2,"logprob_start_len":0,"return_text_in_logprobs":true}"#, "r").unwrap();
        assert_eq!(g.shape.logprobs, Some(LogprobAsk::Native { top: 2, text: true }));
        assert_eq!((g.shape.sampling.logprobs, g.shape.sampling.prompt_logprobs, g.shape.sampling.logprob_start_len), (Some(2), true, 0));
    }

    #[test]
    fn kv_transfer_params_are_carried_as_json_text_verbatim() {
        let body = br#"{"prompt":[1],"max_tokens":1,"kv_transfer_params":{"do_remote_decode":true,"remote_block_ids":null,"x":{"y":[1,2]}}}"#;
        let p = parse(&tok(), Route::Completions, body, "r").unwrap();
        let sent: Value = serde_json::from_str(p.calls[0].kv_transfer_params.as_deref().unwrap()).unwrap();
        assert_eq!(sent, serde_json::json!({"do_remote_decode": true, "remote_block_ids": null, "x": {"y": [1, 2]}}));
        assert_eq!(parse(&tok(), Route::Completions, br#"{"prompt":[1]}"#, "r").unwrap().calls[0].kv_transfer_params, None);
    }
}
