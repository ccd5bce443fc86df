//! A body's prompts as token ids, batches included, as the engine's HTTP surfaces read them:
//! completions' `prompt` (a string, a list of strings, token ids, or a list of token-id lists),
//! chat's `messages` (through the chat template), `/generate`'s `text` (a string or a list) or
//! `input_ids` (ids or a list of id lists).

use std::sync::{Arc, OnceLock};

use pdgate_core::GatewayError;
use pdgate_tokenizer::ModelTokenizer;
use serde_json::{Map, Value};

use super::shape::Route;
use crate::prompt_ids::{prompt_token_ids, PromptKind};

/// The prompts of one request, and whether the body gave a list (a batch: `/generate` then
/// answers a list even for one item).
#[derive(Debug, Clone, PartialEq)]
pub struct Prompts {
    pub ids: Vec<Vec<u32>>,
    pub batch: bool,
}

/// The prompts of one request as the first of its legs tokenized them, for its other legs (a PD
/// pair's legs carry the same prompt; a retry too): a prompt is tokenized, and a chat template
/// rendered, once per request instead of once per leg. Kept with the tokenizer that made it,
/// by address: a leg to another model's workers tokenizes its own (tokenizers live as long as
/// the gateway, configured or fetched once per model, so an address is never reused while a
/// request runs).
#[derive(Debug, Clone, Default)]
pub struct PromptMemo(Arc<OnceLock<(usize, Prompts)>>);

impl PromptMemo {
    /// The memo's prompts if `tok` made them, else `make`'s (kept for the next leg when the
    /// memo is empty).
    pub fn get_or(&self, tok: &ModelTokenizer, make: impl FnOnce() -> Result<Prompts, GatewayError>) -> Result<Prompts, GatewayError> {
        let key = std::ptr::from_ref(tok) as usize;
        if let Some((k, p)) = self.0.get() {
            if *k == key {
                return Ok(p.clone());
            }
        }
        // Concurrent legs may both tokenize (no wait on each other); the first to finish is kept.
        let p = make()?;
        let _ = self.0.set((key, p.clone()));
        Ok(p)
    }
}

fn bad(param: &str, message: impl Into<String>) -> GatewayError {
    GatewayError::invalid(Some(param), message)
}

fn token_ids(v: &Value) -> Option<Vec<u32>> {
    v.as_array()?.iter().map(|t| t.as_u64().and_then(|n| u32::try_from(n).ok())).collect()
}

fn encode(tok: &ModelTokenizer, field: &str, text: &str) -> Result<Vec<u32>, GatewayError> {
    tok.encode(text, true).map_err(|e| bad(field, format!("cannot tokenize the prompt: {e}")))
}

/// A string, a non-empty list of strings, token ids, or a non-empty list of token-id lists.
fn text_or_ids(tok: &ModelTokenizer, field: &str, v: &Value, what: &str) -> Result<Prompts, GatewayError> {
    let one = |ids: Vec<u32>| Prompts { ids: vec![ids], batch: false };
    match v {
        Value::String(s) => Ok(one(encode(tok, field, s)?)),
        Value::Array(items) if !items.is_empty() => {
            if let Some(ids) = token_ids(v) {
                return Ok(one(ids));
            }
            if items.iter().all(Value::is_string) {
                let ids = items.iter().map(|s| encode(tok, field, s.as_str().unwrap_or_default())).collect::<Result<_, _>>()?;
                return Ok(Prompts { ids, batch: true });
            }
            let ids: Option<Vec<Vec<u32>>> = items.iter().map(token_ids).collect();
            ids.map(|ids| Prompts { ids, batch: true }).ok_or_else(|| bad(field, what))
        }
        _ => Err(bad(field, what)),
    }
}

/// The prompts of a body for `route`. Bad or empty prompts are the client's (400 naming the field).
pub fn prompts(tok: &ModelTokenizer, route: Route, value: &Value, body: &Map<String, Value>) -> Result<Prompts, GatewayError> {
    let out = match route {
        Route::Chat => {
            if body.get("messages").and_then(Value::as_array).is_none_or(Vec::is_empty) {
                return Err(bad("messages", "'messages' must be a non-empty list of messages"));
            }
            let ids = prompt_token_ids(tok, PromptKind::Chat, value).map_err(|e| bad("messages", format!("cannot tokenize the prompt: {e}")))?;
            Prompts { ids: vec![ids.unwrap_or_default()], batch: false }
        }
        Route::Completions => {
            let what = "'prompt' must be a string, a list of strings, token ids, or a list of token-id lists";
            text_or_ids(tok, "prompt", body.get("prompt").unwrap_or(&Value::Null), what)?
        }
        Route::Generate => match (body.get("text").filter(|v| !v.is_null()), body.get("input_ids").filter(|v| !v.is_null())) {
            (Some(_), Some(_)) => return Err(bad("text", "give either 'text' or 'input_ids', not both")),
            (Some(Value::Array(a)), None) if !a.iter().all(Value::is_string) => return Err(bad("text", "'text' must be a string or a non-empty list of strings")),
            (Some(text), None) => text_or_ids(tok, "text", text, "'text' must be a string or a non-empty list of strings")?,
            (None, Some(ids)) if ids.is_array() => text_or_ids(tok, "input_ids", ids, "'input_ids' must be token ids or a list of token-id lists")?,
            (None, Some(_)) => return Err(bad("input_ids", "'input_ids' must be token ids or a list of token-id lists")),
            (None, None) => return Err(bad("text", "one of 'text' or 'input_ids' is required")),
        },
    };
    let field = match route {
        Route::Completions => "prompt",
        Route::Chat => "messages",
        Route::Generate if body.contains_key("input_ids") => "input_ids",
        Route::Generate => "text",
    };
    if out.ids.iter().any(Vec::is_empty) {
        return Err(bad(field, format!("'{field}' has an empty prompt")));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok() -> ModelTokenizer {
        let dir = format!("{}/../pdgate-tokenizer/tests/fixtures/bpe", env!("CARGO_MANIFEST_DIR"));
        ModelTokenizer::from_path(std::path::Path::new(&dir)).unwrap()
    }

    fn of(route: Route, body: &str) -> Result<Prompts, GatewayError> {
        let v: Value = serde_json::from_str(body).unwrap();
        prompts(&tok(), route, &v, v.as_object().unwrap())
    }

    #[test]
    fn single_prompts_and_batches() {
        let t = tok();
        let hi = t.encode("hi", true).unwrap();
        assert_eq!(of(Route::Completions, r#"{"prompt":"hi"}"#).unwrap(), Prompts { ids: vec![hi.clone()], batch: false });
        assert_eq!(of(Route::Completions, r#"{"prompt":[1,2]}"#).unwrap(), Prompts { ids: vec![vec![1, 2]], batch: false });
        assert_eq!(of(Route::Completions, r#"{"prompt":["hi","hi"]}"#).unwrap(), Prompts { ids: vec![hi.clone(), hi.clone()], batch: true });
        assert_eq!(of(Route::Completions, r#"{"prompt":[[1],[2,3]]}"#).unwrap(), Prompts { ids: vec![vec![1], vec![2, 3]], batch: true });
        assert_eq!(of(Route::Generate, r#"{"text":["hi"]}"#).unwrap(), Prompts { ids: vec![hi], batch: true });
        assert_eq!(of(Route::Generate, r#"{"input_ids":[[4],[5]]}"#).unwrap().ids, vec![vec![4], vec![5]]);
    }

    #[test]
    fn a_request_tokenizes_once_across_its_legs_and_only_with_the_same_tokenizer() {
        let (t, other) = (tok(), tok());
        let memo = PromptMemo::default();
        let made = std::cell::Cell::new(0);
        let make = |ids: Vec<u32>| {
            made.set(made.get() + 1);
            Ok(Prompts { ids: vec![ids], batch: false })
        };
        assert!(memo.get_or(&t, || Err(GatewayError::invalid(Some("prompt"), "bad"))).is_err());
        assert_eq!(memo.get_or(&t, || make(vec![1])).unwrap().ids, vec![vec![1]], "an error is not kept");
        assert_eq!(memo.get_or(&t, || make(vec![2])).unwrap().ids, vec![vec![1]], "the second leg reuses the first's");
        assert_eq!(made.get(), 1);
        assert_eq!(memo.get_or(&other, || make(vec![3])).unwrap().ids, vec![vec![3]], "another tokenizer tokenizes its own");
        assert_eq!(memo.clone().get_or(&t, || make(vec![4])).unwrap().ids, vec![vec![1]], "clones share the memo");
    }

    #[test]
    fn bad_prompts_name_their_field() {
        for (route, body, field) in [
            (Route::Completions, r#"{"prompt":[["a"]]}"#, "prompt"),
            (Route::Completions, r#"{"prompt":[]}"#, "prompt"),
            (Route::Completions, r#"{"prompt":[[1],[]]}"#, "prompt"),
            (Route::Completions, r#"{}"#, "prompt"),
            (Route::Generate, r#"{"text":["a",1]}"#, "text"),
            (Route::Generate, r#"{"input_ids":"a"}"#, "input_ids"),
            (Route::Generate, r#"{"text":"a","input_ids":[1]}"#, "text"),
            (Route::Chat, r#"{"messages":[]}"#, "messages"),
        ] {
            let err = of(route, body).unwrap_err();
            assert_eq!((err.status(), err.param()), (400, Some(field)), "{body}");
        }
    }
}
