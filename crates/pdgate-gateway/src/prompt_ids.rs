//! The optional tokenizer (`--model-path` / `--tokenizer-path`) and a request's prompt token ids
//! from it: what cache-aware routing and exact `prompt_tokens` counts use. gRPC workers (later
//! work) will take these ids as their input.

use std::path::Path;
use std::sync::Arc;

use pdgate_core::{CacheSource, GatewayConfig, PolicyName};
use pdgate_protocol::Endpoint;
use pdgate_tokenizer::{ChatTemplateInputs, ModelTokenizer, TokenizerError};
use serde_json::{Map, Value};

/// Loads the configured tokenizer at start-up: `--tokenizer-path` wins over `--model-path`.
/// `Ok(None)` when neither is given; an error names the path and what is wrong with it.
pub fn load(config: &GatewayConfig) -> Result<Option<Arc<ModelTokenizer>>, String> {
    let Some(path) = config.tokenizer_path.as_deref().or(config.model_path.as_deref()).filter(|p| !p.is_empty()) else {
        return Ok(None);
    };
    let flag = if config.tokenizer_path.is_some() { "--tokenizer-path" } else { "--model-path" };
    ModelTokenizer::from_path(Path::new(path)).map(|t| Some(Arc::new(t))).map_err(|e| format!("{flag} {path}: {e}"))
}

/// Which body shape the route takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptKind {
    /// `/v1/completions`: `prompt` (a string, or token ids as given).
    Completion,
    /// `/v1/chat/completions`: `messages` through the chat template.
    Chat,
    /// SGLang `/generate`: `text` or `input_ids`.
    Generate,
}

/// The prompt token ids of a request body. `Ok(None)` when the body has no single prompt this
/// can tokenize (batched prompts, a missing field): callers keep their estimate then. Errors are
/// the client's (a template that raises for these messages): answer 400.
pub fn prompt_token_ids(tokenizer: &ModelTokenizer, kind: PromptKind, body: &Value) -> Result<Option<Vec<u32>>, TokenizerError> {
    prompt_ids_from(tokenizer, kind, |k| body.get(k))
}

fn prompt_ids_from<'a>(tokenizer: &ModelTokenizer, kind: PromptKind, get: impl Fn(&str) -> Option<&'a Value>) -> Result<Option<Vec<u32>>, TokenizerError> {
    let body = get;
    match kind {
        PromptKind::Completion => text_or_ids(tokenizer, body("prompt")),
        PromptKind::Generate => match body("input_ids") {
            Some(ids) => Ok(ids_of(ids)),
            None => text_or_ids(tokenizer, body("text")),
        },
        PromptKind::Chat => {
            let Some(messages) = body("messages").and_then(Value::as_array) else { return Ok(None) };
            let inputs = ChatTemplateInputs {
                messages,
                add_generation_prompt: body("add_generation_prompt").and_then(Value::as_bool).unwrap_or(true),
                tools: body("tools").and_then(Value::as_array).map(Vec::as_slice),
                extra: body("chat_template_kwargs").and_then(Value::as_object),
            };
            tokenizer.encode_chat(&inputs).map(Some)
        }
    }
}

fn text_or_ids(tokenizer: &ModelTokenizer, prompt: Option<&Value>) -> Result<Option<Vec<u32>>, TokenizerError> {
    match prompt {
        Some(Value::String(text)) => tokenizer.encode(text, true).map(Some),
        Some(ids @ Value::Array(_)) => Ok(ids_of(ids)),
        _ => Ok(None),
    }
}

/// A flat array of token ids; `None` for anything else (a batch of prompts).
fn ids_of(value: &Value) -> Option<Vec<u32>> {
    value.as_array()?.iter().map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok())).collect()
}

/// Whether a `cache_aware` pool may route on the engines' KV events (`--cache-source` not
/// `text`): then the gateway needs the prompt's token ids.
pub fn routes_on_events(config: &GatewayConfig) -> bool {
    let cache_aware = [config.policy, config.effective_prefill_policy(), config.effective_decode_policy()].contains(&PolicyName::CacheAware);
    cache_aware && config.cache_source != CacheSource::Text
}

/// The start-up line that says KV-event routing has no tokenizer: only requests that carry
/// token ids can use the events; the others route on the text tree.
pub fn no_tokenizer_note(config: &GatewayConfig, has_tokenizer: bool) -> Option<String> {
    (routes_on_events(config) && !has_tokenizer).then(|| {
        let source = format!("{:?}", config.cache_source).to_ascii_lowercase();
        format!(
            "cache_aware --cache-source {source}: no tokenizer (--model-path / --tokenizer-path), so only requests that carry token ids \
             (input_ids, a token-array prompt) route on the engines' KV events; the others route on the text tree"
        )
    })
}

/// The prompt token ids for routing: the ids the request carries, else the tokenizer's
/// (when there is one). `None` for batches, bodies without a prompt, and templates that fail
/// (the engine will answer those; routing then falls back to the text tree).
pub fn routing_ids(tokenizer: Option<&ModelTokenizer>, endpoint: Endpoint, body: &Map<String, Value>) -> Option<Vec<u32>> {
    let carried = match endpoint {
        Endpoint::Completions => body.get("prompt").filter(|p| p.is_array()),
        Endpoint::Generate => body.get("input_ids"),
        Endpoint::ChatCompletions => None,
    };
    if let Some(ids) = carried {
        return ids_of(ids);
    }
    let kind = match endpoint {
        Endpoint::Completions => PromptKind::Completion,
        Endpoint::ChatCompletions => PromptKind::Chat,
        Endpoint::Generate => PromptKind::Generate,
    };
    prompt_ids_from(tokenizer?, kind, |k| body.get(k)).ok().flatten()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fixture_dir() -> String {
        format!("{}/../pdgate-tokenizer/tests/fixtures/bpe", env!("CARGO_MANIFEST_DIR"))
    }

    fn tokenizer() -> Arc<ModelTokenizer> {
        let config = GatewayConfig { model_path: Some(fixture_dir()), ..GatewayConfig::default() };
        load(&config).unwrap().unwrap()
    }

    #[test]
    fn no_flag_means_no_tokenizer_and_bad_path_fails_naming_the_flag() {
        assert!(load(&GatewayConfig::default()).unwrap().is_none());
        let config = GatewayConfig { model_path: Some(fixture_dir()), tokenizer_path: Some("/no/such/dir".into()), ..GatewayConfig::default() };
        let err = load(&config).unwrap_err();
        assert!(err.starts_with("--tokenizer-path /no/such/dir:"), "{err}");
    }

    #[test]
    fn completion_generate_and_chat_prompts_tokenize() {
        let tok = tokenizer();
        let text_ids = tok.encode("Hello, world!", true).unwrap();
        assert_eq!(prompt_token_ids(&tok, PromptKind::Completion, &json!({"prompt": "Hello, world!"})).unwrap(), Some(text_ids.clone()));
        assert_eq!(prompt_token_ids(&tok, PromptKind::Generate, &json!({"text": "Hello, world!"})).unwrap(), Some(text_ids));
        assert_eq!(prompt_token_ids(&tok, PromptKind::Generate, &json!({"input_ids": [5, 6, 7]})).unwrap(), Some(vec![5, 6, 7]));
        assert_eq!(prompt_token_ids(&tok, PromptKind::Completion, &json!({"prompt": ["a", "b"]})).unwrap(), None, "batches keep the estimate");
        let chat = json!({"messages": [{"role": "user", "content": "Hello!"}]});
        let ids = prompt_token_ids(&tok, PromptKind::Chat, &chat).unwrap().unwrap();
        let rendered = tok.decode(&ids, false).unwrap();
        assert!(rendered.starts_with("<|begin_of_text|><|start_header_id|>system") && rendered.ends_with("assistant<|end_header_id|>\n\n"), "{rendered:?}");
    }

    #[test]
    fn routing_ids_take_carried_ids_without_a_tokenizer() {
        let body = |v: Value| v.as_object().unwrap().clone();
        assert_eq!(routing_ids(None, Endpoint::Generate, &body(json!({"input_ids": [1, 2, 3]}))), Some(vec![1, 2, 3]));
        assert_eq!(routing_ids(None, Endpoint::Completions, &body(json!({"prompt": [4, 5]}))), Some(vec![4, 5]));
        assert_eq!(routing_ids(None, Endpoint::Completions, &body(json!({"prompt": "text"}))), None, "text needs the tokenizer");
        assert_eq!(routing_ids(None, Endpoint::Completions, &body(json!({"prompt": [[1], [2]]}))), None, "a batch has no one prompt");
        let tok = tokenizer();
        let ids = tok.encode("Hello, world!", true).unwrap();
        assert_eq!(routing_ids(Some(&tok), Endpoint::Completions, &body(json!({"prompt": "Hello, world!"}))), Some(ids));
        let bad_chat = body(json!({"messages": [{"role": "narrator", "content": "x"}]}));
        assert_eq!(routing_ids(Some(&tok), Endpoint::ChatCompletions, &bad_chat), None, "a failing template routes on text");
    }

    #[test]
    fn the_start_up_note_names_the_missing_tokenizer_only_where_events_could_route() {
        let c = |policy, cache_source| GatewayConfig { policy, cache_source, ..GatewayConfig::default() };
        assert!(no_tokenizer_note(&c(PolicyName::CacheAware, CacheSource::Auto), false).unwrap().contains("--cache-source auto: no tokenizer"));
        assert!(no_tokenizer_note(&c(PolicyName::CacheAware, CacheSource::Events), true).is_none());
        assert!(no_tokenizer_note(&c(PolicyName::CacheAware, CacheSource::Text), false).is_none());
        assert!(no_tokenizer_note(&c(PolicyName::RoundRobin, CacheSource::Events), false).is_none());
    }

    #[test]
    fn template_that_raises_is_a_client_error() {
        let tok = tokenizer();
        let err = prompt_token_ids(&tok, PromptKind::Chat, &json!({"messages": [{"role": "narrator", "content": "x"}]})).unwrap_err();
        assert!(err.is_client_error());
        assert!(err.to_string().contains("Unsupported role: narrator"), "{err}");
    }
}
