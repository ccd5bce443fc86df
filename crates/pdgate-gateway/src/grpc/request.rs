//! A leg's JSON body (the route's OpenAI or SGLang shape) as an SMG `GenerateRequest`: the
//! prompt tokenized (chat template applied for chat), the sampling fields mapped, and the
//! [`Shape`] the answer is to be written back in.

use pdgate_core::GatewayError;
use pdgate_tokenizer::ModelTokenizer;
use serde_json::{Map, Value};

use crate::prompt_ids::{prompt_token_ids, PromptKind};

/// The reference engine's and SGLang's defaults when a body gives no `max_tokens`.
const COMPLETIONS_DEFAULT_MAX_TOKENS: u32 = 16;
const CHAT_DEFAULT_MAX_TOKENS: u32 = 256;
const GENERATE_DEFAULT_MAX_NEW_TOKENS: u32 = 128;
/// The most choices one request may ask for (the engines' bound).
const MAX_N: u32 = 64;

/// The route a leg was sent to, which decides both request and answer shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    Completions,
    Chat,
    Generate,
}

impl Route {
    pub fn of_path(path: &str) -> Option<Route> {
        match path {
            "/v1/completions" => Some(Route::Completions),
            "/v1/chat/completions" => Some(Route::Chat),
            "/generate" => Some(Route::Generate),
            _ => None,
        }
    }
}

/// Sampling as the engines take it, before the wire's own message is built.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Sampling {
    pub max_new_tokens: u32,
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: i32,
    pub min_p: f32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    pub repetition_penalty: f32,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub skip_special_tokens: bool,
    pub seed: Option<i64>,
    pub n: u32,
}

/// What the gateway must know to write the engine's answer back as the route's JSON or SSE.
#[derive(Debug, Clone)]
pub struct Shape {
    pub route: Route,
    pub stream: bool,
    /// `stream_options.include_usage`: a last chunk with the usage (the relay may strip it).
    pub include_usage: bool,
    /// vLLM's `return_token_ids`: the ids on each choice (what resume reads).
    pub return_token_ids: bool,
    /// The response `id` (`rid` when the body gives one, as the engines do).
    pub id: String,
    /// The body's `model`, echoed (else the worker's served name).
    pub model: Option<String>,
    pub prompt_ids: Vec<u32>,
    pub sampling: Sampling,
}

/// A parsed leg: the request id the engine is asked under, the prompt and sampling, and the shape.
#[derive(Debug, Clone)]
pub struct Parsed {
    pub request_id: String,
    pub shape: Shape,
    /// SGLang bootstrap fields of a PD leg (`bootstrap_host`, `bootstrap_port`, `bootstrap_room`).
    pub bootstrap: Option<(String, i32, i32)>,
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
    })
}

/// Parses a leg body for `route` with the gateway's tokenizer. Bad input is the client's (400),
/// named by field, never sent on to the engine.
pub fn parse(tok: &ModelTokenizer, route: Route, raw: &[u8], request_id: &str) -> Result<Parsed, GatewayError> {
    let value: Value = serde_json::from_slice(raw).map_err(|e| GatewayError::invalid(None, format!("request body is not JSON: {e}")))?;
    let Value::Object(body) = &value else { return Err(GatewayError::invalid(None, "request body must be a JSON object")) };
    let kind = match route {
        Route::Completions => PromptKind::Completion,
        Route::Chat => PromptKind::Chat,
        Route::Generate => PromptKind::Generate,
    };
    let (field, what) = match route {
        Route::Completions => ("prompt", "'prompt' must be a string or a list of token ids (batched prompts are not served over gRPC yet)"),
        Route::Chat => ("messages", "'messages' must be a non-empty list of messages"),
        Route::Generate => ("text", "one of 'text' (a string) or 'input_ids' (a list of token ids) is required (batches are not served over gRPC yet)"),
    };
    if route == Route::Chat && body.get("messages").and_then(Value::as_array).is_none_or(Vec::is_empty) {
        return Err(bad(field, what));
    }
    if route == Route::Generate && body.contains_key("text") && body.contains_key("input_ids") {
        return Err(bad("text", "give either 'text' or 'input_ids', not both"));
    }
    let prompt_ids =
        prompt_token_ids(tok, kind, &value).map_err(|e| bad(field, format!("cannot tokenize the prompt: {e}")))?.filter(|ids| !ids.is_empty()).ok_or_else(|| bad(field, what))?;
    // Logprobs over gRPC are not written back yet: say so rather than answer null.
    let logprobs = match route {
        Route::Completions => body.get("logprobs").is_some_and(|v| !v.is_null()).then_some("logprobs"),
        Route::Chat => body.get("logprobs").and_then(Value::as_bool).unwrap_or(false).then_some("logprobs"),
        Route::Generate => body.get("return_logprob").and_then(Value::as_bool).unwrap_or(false).then_some("return_logprob"),
    };
    if let Some(param) = logprobs {
        return Err(bad(param, format!("'{param}' is not supported for gRPC workers yet")));
    }
    let rid = body.get("rid").and_then(Value::as_str).filter(|r| !r.is_empty()).map(str::to_string);
    let flag = |k: &str| body.get(k).and_then(Value::as_bool).unwrap_or(false);
    let (sampling, id) = match route {
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
                Some(_) => return Err(bad("sampling_params", "'sampling_params' must be an object (lists are not served over gRPC yet)")),
            };
            let n = u32_field(&sp, "n")?.unwrap_or(1);
            if !(1..=MAX_N).contains(&n) {
                return Err(bad("n", format!("'n' must be in [1, {MAX_N}]")));
            }
            let mt = u32_field(&sp, "max_new_tokens")?;
            (sampling(&sp, mt, GENERATE_DEFAULT_MAX_NEW_TOKENS, n)?, rid.clone().unwrap_or_else(|| request_id.to_string()))
        }
    };
    let include_usage = body.get("stream_options").and_then(|o| o.get("include_usage")).and_then(Value::as_bool).unwrap_or(false);
    let bootstrap = match (body.get("bootstrap_host").and_then(Value::as_str), body.get("bootstrap_room").and_then(Value::as_i64)) {
        (Some(host), Some(room)) => {
            let port = body.get("bootstrap_port").and_then(Value::as_i64).unwrap_or(0);
            let room = i32::try_from(room).map_err(|_| bad("bootstrap_room", "bootstrap_room does not fit the gRPC contract's int32"))?;
            Some((host.to_string(), i32::try_from(port).unwrap_or(0), room))
        }
        _ => None,
    };
    Ok(Parsed {
        request_id: rid.unwrap_or_else(|| request_id.to_string()),
        shape: Shape {
            route,
            stream: flag("stream"),
            include_usage,
            return_token_ids: flag("return_token_ids"),
            id,
            model: body.get("model").and_then(Value::as_str).map(str::to_string),
            prompt_ids,
            sampling,
        },
        bootstrap,
    })
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
        assert_eq!(p.shape.prompt_ids, vec![1, 2, 3]);
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
            (Route::Completions, br#"{"prompt":[1],"logprobs":2}"#, "logprobs"),
            (Route::Chat, br#"{"messages":[{"role":"user","content":"a"}],"logprobs":true}"#, "logprobs"),
            (Route::Generate, br#"{"input_ids":[1],"return_logprob":true}"#, "return_logprob"),
            (Route::Generate, br#"{"input_ids":[1],"bootstrap_host":"h","bootstrap_room":4294967296}"#, "bootstrap_room"),
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
        assert_eq!(p.request_id, "g1");
        assert_eq!(p.shape.sampling.max_new_tokens, 3);
        assert_eq!(p.bootstrap, Some(("h".into(), 8998, 7)));
    }
}
