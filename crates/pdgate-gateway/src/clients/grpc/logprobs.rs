//! Logprobs from a gRPC answer (`OutputLogProbs` / `InputLogProbs`, the same on both wires)
//! written in the JSON shapes the engine's HTTP surfaces write: OpenAI completions
//! (`tokens`/`token_logprobs`/`top_logprobs`), OpenAI chat (`content[]` with `bytes`), and
//! SGLang's `meta_info` lists (`[logprob, id, text|null]`).
//!
//! Token names come from the gateway's tokenizer (`ModelTokenizer::token_text`).

use pdgate_tokenizer::ModelTokenizer;
use serde_json::{json, Map, Value};

/// The most top logprobs a request may ask for (the engines' bound).
pub const MAX_TOP_LOGPROBS: u64 = 20;

/// What the client asked for, and so how the answer's logprobs are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogprobAsk {
    /// Completions' `logprobs: k`: `top_logprobs` is null when k is 0.
    Completions { top: u32 },
    /// Chat's `logprobs: true` with `top_logprobs`.
    Chat { top: u32 },
    /// `/generate`'s `return_logprob` with `top_logprobs_num` and `return_text_in_logprobs`.
    Native { top: u32, text: bool },
}

impl LogprobAsk {
    pub fn top(self) -> u32 {
        match self {
            LogprobAsk::Completions { top } | LogprobAsk::Chat { top } | LogprobAsk::Native { top, .. } => top,
        }
    }
}

/// One position's logprob: the token, its logprob (none for a prompt's first token), and the
/// most likely tokens there as (logprob, id).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TokenLp {
    pub id: u32,
    pub logprob: Option<f32>,
    pub top: Vec<(f32, u32)>,
}

/// The logprobs one stream message carries: its new tokens', and the prompt's when sent.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LpPart {
    pub output: Vec<TokenLp>,
    pub input: Option<Vec<TokenLp>>,
}

/// Zips the wire's parallel lists (a missing top list is an empty one).
pub fn zip_positions(ids: Vec<u32>, values: impl Iterator<Item = Option<f32>>, tops: impl Iterator<Item = (Vec<f32>, Vec<u32>)>) -> Vec<TokenLp> {
    let mut tops = tops.map(|(v, t)| v.into_iter().zip(t).collect::<Vec<_>>());
    ids.into_iter().zip(values).map(|(id, logprob)| TokenLp { id, logprob, top: tops.next().unwrap_or_default() }).collect()
}

fn num(v: Option<f32>) -> Value {
    v.map_or(Value::Null, |f| json!(f64::from(f)))
}

/// OpenAI completions' `logprobs` object for these positions.
pub fn completions(tok: &ModelTokenizer, positions: &[TokenLp], top: u32) -> Value {
    let tops = (top > 0)
        .then(|| positions.iter().map(|p| Value::Object(p.top.iter().map(|(lp, id)| (tok.token_text(*id), json!(f64::from(*lp)))).collect::<Map<_, _>>())).collect::<Vec<_>>());
    json!({
        "tokens": positions.iter().map(|p| tok.token_text(p.id)).collect::<Vec<_>>(),
        "token_logprobs": positions.iter().map(|p| num(p.logprob)).collect::<Vec<_>>(),
        "top_logprobs": tops,
        "text_offset": [],
    })
}

fn chat_entry(tok: &ModelTokenizer, id: u32, logprob: Option<f32>) -> Map<String, Value> {
    let text = tok.token_text(id);
    let bytes: Vec<u8> = text.as_bytes().to_vec();
    let mut m = Map::new();
    m.insert("token".into(), json!(text));
    m.insert("logprob".into(), num(logprob));
    m.insert("bytes".into(), json!(bytes));
    m
}

/// OpenAI chat's `logprobs` object (`content`) for these positions.
pub fn chat(tok: &ModelTokenizer, positions: &[TokenLp]) -> Value {
    let content: Vec<Value> = positions
        .iter()
        .map(|p| {
            let mut e = chat_entry(tok, p.id, p.logprob);
            e.insert("top_logprobs".into(), Value::Array(p.top.iter().map(|(lp, id)| Value::Object(chat_entry(tok, *id, Some(*lp)))).collect()));
            Value::Object(e)
        })
        .collect();
    json!({ "content": content })
}

fn native_entry(tok: &ModelTokenizer, logprob: Option<f32>, id: u32, text: bool) -> Value {
    json!([num(logprob), id, if text { json!(tok.token_text(id)) } else { Value::Null }])
}

/// SGLang's logprob fields, added to a `meta_info`: the prompt's and the output's lists, and
/// with `top > 0` their top lists (a position with none is null, as the prompt's first).
pub fn native(meta: &mut Map<String, Value>, tok: &ModelTokenizer, input: &[TokenLp], output: &[TokenLp], top: u32, text: bool) {
    let list = |ps: &[TokenLp]| Value::Array(ps.iter().map(|p| native_entry(tok, p.logprob, p.id, text)).collect());
    meta.insert("input_token_logprobs".into(), list(input));
    meta.insert("output_token_logprobs".into(), list(output));
    if top > 0 {
        let tops =
            |ps: &[TokenLp], empty_is_null: bool| {
                Value::Array(
                    ps.iter()
                        .map(|p| {
                            if p.top.is_empty() && empty_is_null {
                                Value::Null
                            } else {
                                Value::Array(p.top.iter().map(|(lp, id)| native_entry(tok, Some(*lp), *id, text)).collect())
                            }
                        })
                        .collect(),
                )
            };
        meta.insert("input_top_logprobs".into(), tops(input, true));
        meta.insert("output_top_logprobs".into(), tops(output, false));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok() -> ModelTokenizer {
        let dir = format!("{}/../pdgate-tokenizer/tests/fixtures/bpe", env!("CARGO_MANIFEST_DIR"));
        ModelTokenizer::from_path(std::path::Path::new(&dir)).unwrap()
    }

    fn positions(tok: &ModelTokenizer) -> (Vec<u32>, Vec<TokenLp>) {
        let ids = tok.encode("hi there", false).unwrap();
        // A runner-up token the text does not have, so no position names one token twice.
        let other = tok.encode("Q", false).unwrap()[0];
        assert!(!ids.contains(&other));
        let ps = ids.iter().enumerate().map(|(k, &id)| TokenLp { id, logprob: Some(-0.5 * (k as f32 + 1.0)), top: vec![(-0.25, id), (-1.5, other)] }).collect();
        (ids, ps)
    }

    #[test]
    fn zip_pads_missing_tops_and_keeps_a_missing_first_value() {
        let ps = zip_positions(vec![7, 8], [None, Some(-1.0)].into_iter(), std::iter::empty());
        assert_eq!(ps, vec![TokenLp { id: 7, logprob: None, top: vec![] }, TokenLp { id: 8, logprob: Some(-1.0), top: vec![] }]);
    }

    #[test]
    fn completions_shape_names_tokens_and_nulls_tops_when_k_is_zero() {
        let tok = tok();
        let (ids, ps) = positions(&tok);
        let v = completions(&tok, &ps, 2);
        let names: Vec<String> = ids.iter().map(|&i| tok.token_text(i)).collect();
        assert_eq!(v["tokens"], json!(names));
        assert_eq!(names.concat(), "hi there", "token names are the text the tokens spell");
        assert_eq!(v["token_logprobs"][1], json!(-1.0));
        assert_eq!(v["top_logprobs"][0][&names[0]], json!(-0.25));
        assert_eq!(v["text_offset"], json!([]));
        assert_eq!(completions(&tok, &ps, 0)["top_logprobs"], Value::Null);
    }

    #[test]
    fn chat_shape_has_bytes_and_top_entries() {
        let tok = tok();
        let (_, ps) = positions(&tok);
        let v = chat(&tok, &ps);
        let first = &v["content"][0];
        let token = first["token"].as_str().unwrap();
        assert_eq!(first["bytes"], json!(token.as_bytes()));
        assert_eq!(first["logprob"], json!(-0.5));
        assert_eq!(first["top_logprobs"][0]["logprob"], json!(-0.25));
        assert_eq!(first["top_logprobs"].as_array().unwrap().len(), 2);
    }

    #[test]
    fn native_shape_lists_triples_and_null_tops_for_the_first_prompt_token() {
        let tok = tok();
        let (ids, out) = positions(&tok);
        let input = vec![TokenLp { id: 5, logprob: None, top: vec![] }, TokenLp { id: 6, logprob: Some(-2.0), top: vec![(-2.0, 6)] }];
        let mut meta = Map::new();
        native(&mut meta, &tok, &input, &out, 2, false);
        assert_eq!(meta["input_token_logprobs"], json!([[null, 5, null], [-2.0, 6, null]]));
        assert_eq!(meta["output_token_logprobs"][0], json!([-0.5, ids[0], null]));
        assert_eq!(meta["input_top_logprobs"], json!([null, [[-2.0, 6, null]]]));
        assert_eq!(meta["output_top_logprobs"][0].as_array().unwrap().len(), 2);
        let mut plain = Map::new();
        native(&mut plain, &tok, &input, &out, 0, true);
        assert!(!plain.contains_key("output_top_logprobs"));
        assert_eq!(plain["output_token_logprobs"][0][2], json!(tok.token_text(ids[0])));
    }
}
