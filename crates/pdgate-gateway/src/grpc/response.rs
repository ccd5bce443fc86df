//! The engine's token answer written back as the route's JSON or SSE, as the engines' HTTP
//! surfaces write it: incremental UTF-8-safe detokenization, stop strings cut (and held back
//! while they may still match), the matched stop reported, usage with cached tokens.
//!
//! Both wires (SGLang's scheduler, vLLM's engine) are read into the same [`Gen`] events first.

use bytes::Bytes;
use pdgate_core::{GatewayError, Leg};
use pdgate_tokenizer::{IncrementalDecoder, ModelTokenizer, StopMatcher, StreamDecoder};
use serde_json::{json, Map, Value};

use super::request::{Route, Shape};

/// The stop an engine reports in its `GenerateComplete`.
#[derive(Debug, Clone, PartialEq)]
pub enum Matched {
    TokenId(u32),
    Text(String),
}

/// Token counts as the engine reports them (cumulative).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Counts {
    pub prompt: u32,
    pub completion: u32,
    pub cached: u32,
}

/// One message of a `Generate` stream, whichever the wire.
#[derive(Debug, Clone, PartialEq)]
pub enum Gen {
    /// New tokens of choice `index`.
    Chunk { index: u32, ids: Vec<u32>, counts: Counts },
    /// Choice `index` is done: its last new tokens (stream) or all its tokens (whole answer).
    Complete { index: u32, ids: Vec<u32>, finish_reason: String, matched: Option<Matched>, counts: Counts },
}

/// One choice's progress.
struct Choice<'t> {
    decoder: StreamDecoder<'t>,
    /// Everything emitted so far (`/generate` streams cumulative text).
    text: String,
    ids: Vec<u32>,
    role_sent: bool,
    done: Option<(String, Option<Matched>)>,
    counts: Counts,
}

/// Writes one leg's answer. `'t` is the tokenizer's borrow (the writer lives in the task that
/// reads the engine's stream, next to the `Arc` that owns the tokenizer).
pub struct Writer<'t> {
    shape: Shape,
    choices: Vec<Choice<'t>>,
    created: u64,
    model: String,
}

fn sse(v: &Value) -> Bytes {
    let mut out = Vec::with_capacity(128);
    out.extend_from_slice(b"data: ");
    // Serializing a Value cannot fail.
    let _ = serde_json::to_writer(&mut out, v);
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

fn codec(e: impl std::fmt::Display) -> GatewayError {
    GatewayError::bad_worker_response(Leg::Regular, format!("the worker's tokens cannot be detokenized: {e}"))
}

impl<'t> Writer<'t> {
    /// `served` is the worker's model name, for bodies that named none.
    pub fn new(shape: Shape, tok: &'t ModelTokenizer, served: &str) -> Self {
        let n = shape.sampling.n.max(1) as usize;
        let s = &shape.sampling;
        let mut stop_ids = s.stop_token_ids.clone();
        if let (Some(eos), false) = (tok.eos_token_id(), s.ignore_eos) {
            stop_ids.push(eos);
        }
        let choices = (0..n)
            .map(|_| Choice {
                decoder: StreamDecoder::new(
                    IncrementalDecoder::with_prompt(tok.tokenizer(), s.skip_special_tokens, &shape.prompt_ids),
                    StopMatcher::new(s.stop.clone()),
                    stop_ids.clone(),
                ),
                text: String::new(),
                ids: Vec::new(),
                role_sent: false,
                done: None,
                counts: Counts::default(),
            })
            .collect();
        let created = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let model = shape.model.clone().unwrap_or_else(|| served.to_string());
        Writer { shape, choices, created, model }
    }

    pub fn stream(&self) -> bool {
        self.shape.stream
    }

    pub fn content_type(&self) -> &'static str {
        if self.shape.stream {
            "text/event-stream"
        } else {
            "application/json"
        }
    }

    fn choice(&mut self, index: u32) -> Result<&mut Choice<'t>, GatewayError> {
        let n = self.choices.len();
        self.choices.get_mut(index as usize).ok_or_else(|| GatewayError::protocol(Leg::Regular, format!("the worker answered choice {index} of {n}")))
    }

    /// Feeds ids to a choice's decoder; returns the new visible text.
    fn decode(choice: &mut Choice<'t>, ids: &[u32], last: bool) -> Result<String, GatewayError> {
        let mut text = String::new();
        for &id in ids {
            text.push_str(&choice.decoder.push(id).map_err(codec)?.text);
        }
        if last {
            text.push_str(&choice.decoder.finish().map_err(codec)?);
        }
        choice.ids.extend_from_slice(ids);
        choice.text.push_str(&text);
        Ok(text)
    }

    /// One stream event: the SSE bytes to send now (possibly none).
    pub fn on_event(&mut self, event: Gen) -> Result<Option<Bytes>, GatewayError> {
        let (index, mut ids, counts, done) = match event {
            Gen::Chunk { index, ids, counts } => (index, ids, counts, None),
            Gen::Complete { index, ids, finish_reason, matched, counts } => (index, ids, counts, Some((finish_reason, matched))),
        };
        let route = self.shape.route;
        let (id, created, model, want_ids) = (self.shape.id.clone(), self.created, self.model.clone(), self.shape.return_token_ids);
        let stream = self.shape.stream;
        let choice = self.choice(index)?;
        if choice.done.is_some() {
            return Ok(None);
        }
        if done.is_some() && stream {
            // A streamed Complete may repeat the ids its last chunk carried (the SGLang and
            // vLLM servicers do): only those the chunks did not bring, by the engine's count.
            let missing = (counts.completion as usize).saturating_sub(choice.ids.len()).min(ids.len());
            ids.drain(..ids.len() - missing);
        }
        choice.counts = counts;
        let delta = Self::decode(choice, &ids, done.is_some())?;
        let reason = done.as_ref().map(|(r, _)| r.clone());
        choice.done = done;
        if !stream {
            // A whole answer is written once, at the end (`whole`).
            return Ok(None);
        }
        let mut out = Vec::new();
        match route {
            Route::Generate => {
                let mut v = self.native(index as usize);
                if self.choices.len() > 1 {
                    v["index"] = json!(index);
                }
                out.extend_from_slice(&sse(&v));
            }
            Route::Completions | Route::Chat => {
                let chat = route == Route::Chat;
                let object = if chat { "chat.completion.chunk" } else { "text_completion" };
                let chunk = |c: Value| json!({"id": id, "object": object, "created": created, "model": model, "choices": [c]});
                if chat && !choice.role_sent {
                    choice.role_sent = true;
                    out.extend_from_slice(&sse(&chunk(json!({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}))));
                }
                if !delta.is_empty() || reason.is_some() || (want_ids && !ids.is_empty()) {
                    let mut c = Map::new();
                    c.insert("index".into(), json!(index));
                    if chat {
                        c.insert("delta".into(), if delta.is_empty() { json!({}) } else { json!({"content": delta}) });
                    } else {
                        c.insert("text".into(), json!(delta));
                    }
                    c.insert("logprobs".into(), Value::Null);
                    c.insert("finish_reason".into(), json!(reason));
                    if want_ids {
                        c.insert("token_ids".into(), json!(ids));
                    }
                    out.extend_from_slice(&sse(&chunk(Value::Object(c))));
                }
            }
        }
        Ok((!out.is_empty()).then(|| Bytes::from(out)))
    }

    /// Whether every choice has its `Complete`.
    pub fn all_done(&self) -> bool {
        self.choices.iter().all(|c| c.done.is_some())
    }

    /// The stream's end: the usage chunk when asked for, then `[DONE]`.
    pub fn end_stream(&self) -> Bytes {
        let mut out = Vec::new();
        if self.shape.include_usage && self.shape.route != Route::Generate {
            let object = if self.shape.route == Route::Chat { "chat.completion.chunk" } else { "text_completion" };
            out.extend_from_slice(&sse(&json!({"id": self.shape.id, "object": object, "created": self.created, "model": self.model, "choices": [], "usage": self.usage()})));
        }
        out.extend_from_slice(b"data: [DONE]\n\n");
        Bytes::from(out)
    }

    /// OpenAI usage; with n choices the prompt counts once.
    fn usage(&self) -> Value {
        let first = self.choices.first().map(|c| c.counts).unwrap_or_default();
        let completion: u64 = self.choices.iter().map(|c| u64::from(c.counts.completion)).sum();
        json!({"prompt_tokens": first.prompt, "completion_tokens": completion, "total_tokens": u64::from(first.prompt) + completion,
               "prompt_tokens_details": {"cached_tokens": first.cached}})
    }

    /// SGLang's native result of one choice (cumulative text and ids).
    fn native(&self, i: usize) -> Value {
        let c = &self.choices[i];
        let reason = match &c.done {
            None => Value::Null,
            Some((r, matched)) if r == "stop" => match matched {
                Some(Matched::TokenId(t)) => json!({"type": "stop", "matched": t}),
                Some(Matched::Text(s)) => json!({"type": "stop", "matched": s}),
                None => json!({"type": "stop"}),
            },
            Some((r, _)) if r == "length" => json!({"type": "length", "length": c.counts.completion}),
            Some((r, _)) => json!({"type": r}),
        };
        json!({"text": c.text, "output_ids": c.ids, "meta_info": {"id": self.shape.id, "finish_reason": reason,
               "prompt_tokens": c.counts.prompt, "completion_tokens": c.counts.completion, "cached_tokens": c.counts.cached}})
    }

    /// A whole (non-stream) answer from the choices' `Complete`s, fed with `on_event` first.
    pub fn whole(&self) -> Bytes {
        let v = match self.shape.route {
            Route::Generate if self.choices.len() == 1 => self.native(0),
            Route::Generate => Value::Array((0..self.choices.len()).map(|i| self.native(i)).collect()),
            route @ (Route::Completions | Route::Chat) => {
                let chat = route == Route::Chat;
                let choices: Vec<Value> = self
                    .choices
                    .iter()
                    .enumerate()
                    .map(|(i, c)| {
                        let mut o = Map::new();
                        o.insert("index".into(), json!(i));
                        if chat {
                            o.insert("message".into(), json!({"role": "assistant", "content": c.text}));
                        } else {
                            o.insert("text".into(), json!(c.text));
                        }
                        o.insert("logprobs".into(), Value::Null);
                        o.insert("finish_reason".into(), json!(c.done.as_ref().map(|(r, _)| r)));
                        if self.shape.return_token_ids {
                            o.insert("token_ids".into(), json!(c.ids));
                            if !chat {
                                o.insert("prompt_token_ids".into(), json!(self.shape.prompt_ids));
                            }
                        }
                        Value::Object(o)
                    })
                    .collect();
                let object = if chat { "chat.completion" } else { "text_completion" };
                let mut v = json!({"id": self.shape.id, "object": object, "created": self.created, "model": self.model, "choices": choices, "usage": self.usage()});
                if chat && self.shape.return_token_ids {
                    v["prompt_token_ids"] = json!(self.shape.prompt_ids);
                }
                v
            }
        };
        Bytes::from(serde_json::to_vec(&v).unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grpc::request::{Sampling, Shape};

    fn tok() -> ModelTokenizer {
        let dir = format!("{}/../pdgate-tokenizer/tests/fixtures/bpe", env!("CARGO_MANIFEST_DIR"));
        ModelTokenizer::from_path(std::path::Path::new(&dir)).unwrap()
    }

    fn shape(route: Route, stream: bool, stop: &[&str], n: u32) -> Shape {
        Shape {
            route,
            stream,
            include_usage: true,
            return_token_ids: false,
            id: "cmpl-1".into(),
            model: Some("m".into()),
            prompt_ids: vec![],
            sampling: Sampling { stop: stop.iter().map(|s| s.to_string()).collect(), skip_special_tokens: true, n, max_new_tokens: 64, ..Sampling::default() },
        }
    }

    fn data(b: &Bytes) -> Vec<Value> {
        String::from_utf8(b.to_vec()).unwrap().split("\n\n").filter_map(|e| e.strip_prefix("data: ")).filter(|d| *d != "[DONE]").map(|d| serde_json::from_str(d).unwrap()).collect()
    }

    fn counts(c: u32) -> Counts {
        Counts { prompt: 3, completion: c, cached: 2 }
    }

    /// Streams `ids` one token a chunk; returns every SSE event and the writer.
    fn stream_one_by_one<'t>(tok: &'t ModelTokenizer, sh: Shape, ids: &[u32], reason: &str, matched: Option<Matched>) -> (Vec<Value>, Writer<'t>) {
        let mut w = Writer::new(sh, tok, "served");
        let mut out = vec![];
        let (last, body) = ids.split_last().unwrap();
        for (k, id) in body.iter().enumerate() {
            if let Some(b) = w.on_event(Gen::Chunk { index: 0, ids: vec![*id], counts: counts(k as u32 + 1) }).unwrap() {
                out.extend(data(&b));
            }
        }
        let done = Gen::Complete { index: 0, ids: vec![*last], finish_reason: reason.into(), matched, counts: counts(ids.len() as u32) };
        if let Some(b) = w.on_event(done).unwrap() {
            out.extend(data(&b));
        }
        assert!(w.all_done());
        out.extend(data(&w.end_stream()));
        (out, w)
    }

    fn text(events: &[Value]) -> String {
        events
            .iter()
            .flat_map(|e| e["choices"].as_array().cloned().unwrap_or_default())
            .map(|c| c["text"].as_str().or(c["delta"]["content"].as_str()).unwrap_or("").to_string())
            .collect()
    }

    #[test]
    fn multibyte_text_streams_whole_characters_and_equals_one_decode() {
        let tok = tok();
        let want = "naïve café — 東京 ok";
        let ids = tok.encode(want, false).unwrap();
        let (events, _) = stream_one_by_one(&tok, shape(Route::Completions, true, &[], 1), &ids, "length", None);
        for e in &events {
            for c in e["choices"].as_array().unwrap() {
                assert!(!c["text"].as_str().unwrap().contains('\u{FFFD}'), "a broken character was sent: {e}");
            }
        }
        assert_eq!(text(&events), tok.decode(&ids, true).unwrap());
        let last = events.iter().rev().find(|e| !e["choices"].as_array().unwrap().is_empty()).unwrap();
        assert_eq!(last["choices"][0]["finish_reason"], "length");
        let usage = &events.last().unwrap()["usage"];
        assert_eq!((usage["prompt_tokens"].as_u64(), usage["completion_tokens"].as_u64()), (Some(3), Some(ids.len() as u64)));
        assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 2);
    }

    #[test]
    fn a_streamed_complete_that_repeats_the_last_chunk_adds_nothing_twice() {
        let tok = tok();
        let ids = tok.encode("once only", false).unwrap();
        let mut w = Writer::new(shape(Route::Completions, true, &[], 1), &tok, "served");
        let mut out = vec![];
        out.extend(data(&w.on_event(Gen::Chunk { index: 0, ids: ids.clone(), counts: counts(ids.len() as u32) }).unwrap().unwrap_or_default()));
        let done = Gen::Complete { index: 0, ids: ids.clone(), finish_reason: "length".into(), matched: None, counts: counts(ids.len() as u32) };
        out.extend(data(&w.on_event(done).unwrap().unwrap_or_default()));
        assert_eq!(text(&out), "once only");
    }

    #[test]
    fn a_stop_string_spanning_chunks_is_cut_and_never_sent() {
        let tok = tok();
        let ids = tok.encode("hello world, stop here please", false).unwrap();
        let (events, _) = stream_one_by_one(&tok, shape(Route::Chat, true, &["stop here"], 1), &ids, "stop", Some(Matched::Text("stop here".into())));
        assert_eq!(events[0]["choices"][0]["delta"], json!({"role": "assistant", "content": ""}));
        assert_eq!(text(&events), "hello world, ");
        assert!(events.iter().all(|e| !e.to_string().contains("stop h")));
    }

    #[test]
    fn whole_answers_have_every_choice_and_usage_counts_the_prompt_once() {
        let tok = tok();
        let ids = tok.encode("two answers", false).unwrap();
        let mut w = Writer::new(shape(Route::Completions, false, &[], 2), &tok, "served");
        for index in [1, 0] {
            let done = Gen::Complete { index, ids: ids.clone(), finish_reason: "length".into(), matched: None, counts: counts(ids.len() as u32) };
            assert!(w.on_event(done).unwrap().is_none());
        }
        let v: Value = serde_json::from_slice(&w.whole()).unwrap();
        assert_eq!(v["object"], "text_completion");
        assert_eq!(v["model"], "m");
        assert_eq!(v["choices"][0]["text"], "two answers");
        assert_eq!(v["choices"][1]["text"], "two answers");
        assert_eq!(v["usage"]["prompt_tokens"], 3);
        assert_eq!(v["usage"]["completion_tokens"], 2 * ids.len() as u64);
        let bad = Gen::Chunk { index: 5, ids: vec![1], counts: counts(1) };
        assert!(w.on_event(bad).is_err());
    }

    #[test]
    fn generate_reports_cumulative_text_ids_and_the_matched_stop() {
        let tok = tok();
        let ids = tok.encode("abc def", false).unwrap();
        let mut sh = shape(Route::Generate, false, &[], 1);
        sh.id = "g1".into();
        let mut w = Writer::new(sh, &tok, "served");
        let stop_id = *ids.last().unwrap();
        w.on_event(Gen::Complete { index: 0, ids: ids.clone(), finish_reason: "stop".into(), matched: Some(Matched::TokenId(stop_id)), counts: counts(ids.len() as u32) }).unwrap();
        let v: Value = serde_json::from_slice(&w.whole()).unwrap();
        assert_eq!(v["output_ids"], json!(ids));
        assert_eq!(v["text"], "abc def");
        assert_eq!(v["meta_info"]["finish_reason"], json!({"type": "stop", "matched": stop_id}));
        assert_eq!(v["meta_info"]["id"], "g1");
    }
}
