//! The engine's token answer written back as the route's JSON or SSE, as the engines' HTTP
//! surfaces write it: incremental UTF-8-safe detokenization, stop strings cut (and held back
//! while they may still match), the matched stop reported, usage with cached tokens, logprobs
//! (logprobs.rs), and a batch's choices in the order of its prompts.
//!
//! Both wires (SGLang's scheduler, vLLM's engine) are read into the same [`Gen`] events first;
//! a leg of several calls (calls.rs) has its events' `index` already made answer-wide.

use std::sync::Arc;

use bytes::Bytes;
use pdgate_core::{GatewayError, Leg};
use pdgate_protocol::resume::TokenLedger;
use pdgate_tokenizer::{ModelTokenizer, ReplacementTail, StopMatcher, StreamDecoder};
use serde_json::{json, Map, Value};

use super::logprobs::{self, LogprobAsk, LpPart, TokenLp};
use super::request::{Route, Shape};
use super::sse_chunk::{ChoicePart, ChunkFrame};

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
    /// New tokens of choice `index` (and their logprobs, when asked for).
    Chunk { index: u32, ids: Vec<u32>, counts: Counts, lp: LpPart },
    /// Choice `index` is done: its last new tokens (stream) or all its tokens (whole answer).
    Complete { index: u32, ids: Vec<u32>, finish_reason: String, matched: Option<Matched>, counts: Counts, lp: LpPart },
    /// A vLLM prefill's returned `kv_transfer_params` (NIXL's pull handle, Mooncake's
    /// engine id): written into the whole answer as its top-level `kv_transfer_params`, the
    /// field the NIXL plan reads the decode's params from, as over HTTP.
    KvTransferParams(Value),
}

impl Gen {
    /// The same event with its choice number moved by `by` (a call's first choice in the answer).
    pub fn offset(mut self, by: u32) -> Gen {
        match &mut self {
            Gen::Chunk { index, .. } | Gen::Complete { index, .. } => *index += by,
            Gen::KvTransferParams(_) => {}
        }
        self
    }
}

/// One choice's progress.
struct Choice<'t> {
    decoder: StreamDecoder<'t>,
    /// Everything emitted so far (`/generate` streams cumulative text).
    text: String,
    ids: Vec<u32>,
    /// Output logprobs so far, one per id; the prompt's once the engine sent them.
    lps: Vec<TokenLp>,
    input_lps: Option<Vec<TokenLp>>,
    role_sent: bool,
    /// A stream's `prompt_token_ids` went out (with `return_token_ids`: what resume reads).
    prompt_ids_sent: bool,
    done: Option<(String, Option<Matched>)>,
    counts: Counts,
}

/// Writes one leg's answer. `'t` is the tokenizer's borrow (the writer lives in the task that
/// reads the engine's stream, next to the `Arc` that owns the tokenizer).
pub struct Writer<'t> {
    shape: Shape,
    tok: &'t ModelTokenizer,
    choices: Vec<Choice<'t>>,
    created: u64,
    model: String,
    /// A completions / chat stream's chunk envelope, written once (sse_chunk.rs).
    frame: Option<ChunkFrame>,
    kv_transfer_params: Option<Value>,
    /// Where a stream's ids go instead of its bytes when only the resume tracker wants them.
    ledger: Option<Arc<TokenLedger>>,
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
        Self::with_tail(shape, tok, served, ReplacementTail::Lossy)
    }

    /// The same, with the engine's rule for an answer whose text ends in U+FFFD.
    pub fn with_tail(shape: Shape, tok: &'t ModelTokenizer, served: &str, tail: ReplacementTail) -> Self {
        let s = &shape.sampling;
        let mut stop_ids = s.stop_token_ids.clone();
        if let (Some(eos), false) = (tok.eos_token_id(), s.ignore_eos) {
            stop_ids.push(eos);
        }
        let choices = (0..shape.choices())
            .map(|c| Choice {
                decoder: Self::decoder(tok, &shape, c, stop_ids.clone(), tail),
                text: String::new(),
                ids: Vec::new(),
                lps: Vec::new(),
                input_lps: None,
                role_sent: false,
                prompt_ids_sent: false,
                done: None,
                counts: Counts::default(),
            })
            .collect();
        let created = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let model = shape.model.clone().unwrap_or_else(|| served.to_string());
        let frame = (shape.stream && shape.route != Route::Generate).then(|| ChunkFrame::new(&shape.id, created, &model, shape.route == Route::Chat));
        Writer { shape, tok, choices, created, model, frame, kv_transfer_params: None, ledger: None }
    }

    /// Keeps the stream's token ids in `ledger` instead of writing them as `token_ids` /
    /// `prompt_token_ids` (the client did not ask for them; the resume tracker reads the
    /// ledger). Only for answers that `Shape::ledger_fits`; others are written as they were.
    pub fn with_ledger(mut self, ledger: Option<Arc<TokenLedger>>) -> Self {
        let Some(ledger) = ledger.filter(|_| self.shape.ledger_fits()) else { return self };
        let object = if self.shape.route == Route::Chat { "chat.completion.chunk" } else { "text_completion" };
        let head = json!({"id": self.shape.id, "object": object, "created": self.created, "model": self.model});
        let Value::Object(head) = head else { return self };
        ledger.open(self.shape.prompt_of(0), head);
        self.shape.return_token_ids = false;
        self.ledger = Some(ledger);
        self
    }

    /// Choice `c`'s decoder. A resume's continuation replays the answer's own ids (the
    /// prompt's tail) first, their text discarded (the client has it): the decoder is then as
    /// the dead stream's was, and what that one held back (an incomplete UTF-8 character, a
    /// possible stop string) comes out with the continuation's first tokens. A replay that
    /// cannot decode starts from the whole prompt, as a fresh request would.
    fn decoder(tok: &'t ModelTokenizer, shape: &Shape, c: usize, stop_ids: Vec<u32>, tail: ReplacementTail) -> StreamDecoder<'t> {
        let s = &shape.sampling;
        let prompt = shape.prompt_of(c);
        let fresh =
            |prompt: &[u32], stop_ids| StreamDecoder::new(tok.incremental_decoder(s.skip_special_tokens, prompt), StopMatcher::new(s.stop.clone()), stop_ids).with_tail(tail);
        // Only a single answer is ever resumed (the resumer refuses n > 1 and batches).
        let own = if shape.choices() == 1 { shape.resumed_ids.min(prompt.len()) } else { 0 };
        let (asked, answered) = prompt.split_at(prompt.len() - own);
        let mut decoder = fresh(asked, stop_ids.clone());
        for &id in answered {
            if decoder.push(id).is_err() {
                return fresh(prompt, stop_ids);
            }
        }
        decoder
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

    /// A chunk's `logprobs` for these new positions (null when none were asked for).
    fn chunk_logprobs(&self, new: &[TokenLp]) -> Value {
        match self.shape.logprobs {
            Some(LogprobAsk::Completions { top }) => logprobs::completions(self.tok, new, top),
            Some(LogprobAsk::Chat { .. }) => logprobs::chat(self.tok, new),
            _ => Value::Null,
        }
    }

    /// One stream event: the SSE bytes to send now (possibly none).
    pub fn on_event(&mut self, event: Gen) -> Result<Option<Bytes>, GatewayError> {
        let (index, mut ids, counts, mut lp, done) = match event {
            Gen::Chunk { index, ids, counts, lp } => (index, ids, counts, lp, None),
            Gen::Complete { index, ids, finish_reason, matched, counts, lp } => (index, ids, counts, lp, Some((finish_reason, matched))),
            Gen::KvTransferParams(params) => {
                self.kv_transfer_params = Some(params);
                return Ok(None);
            }
        };
        let route = self.shape.route;
        let want_ids = self.shape.return_token_ids;
        let (stream, want_lp) = (self.shape.stream, self.shape.logprobs.is_some());
        let choice = self.choice(index)?;
        if choice.done.is_some() {
            return Ok(None);
        }
        if done.is_some() && stream {
            // A streamed Complete may repeat the ids its last chunk carried (the SGLang and
            // vLLM servicers do): only those the chunks did not bring, by the engine's count.
            let missing = (counts.completion as usize).saturating_sub(choice.ids.len()).min(ids.len());
            ids.drain(..ids.len() - missing);
            let keep = lp.output.len().min(missing);
            lp.output.drain(..lp.output.len() - keep);
        }
        choice.counts = counts;
        if choice.input_lps.is_none() {
            choice.input_lps = lp.input;
        }
        let new_lps = lp.output;
        choice.lps.extend(new_lps.iter().cloned());
        let delta = Self::decode(choice, &ids, done.is_some())?;
        // vLLM's servicers count a chunk's own tokens, not the running total: never report
        // fewer than the choice has.
        choice.counts.completion = choice.counts.completion.max(u32::try_from(choice.ids.len()).unwrap_or(u32::MAX));
        let reason = done.as_ref().map(|(r, _)| r.clone());
        choice.done = done;
        if let Some(ledger) = &self.ledger {
            ledger.wrote(&ids, reason.is_some());
        }
        if !stream {
            // A whole answer is written once, at the end (`whole`).
            return Ok(None);
        }
        let mut out = Vec::new();
        match route {
            Route::Generate => {
                let mut v = self.native(index as usize);
                if self.shape.batch || self.choices.len() > 1 {
                    v["index"] = json!(index);
                }
                out.extend_from_slice(&sse(&v));
            }
            Route::Completions | Route::Chat => {
                let chat = route == Route::Chat;
                let logprobs = self.chunk_logprobs(&new_lps);
                let Some(frame) = &self.frame else { return Ok(None) };
                let n = self.choices.len();
                let choice = self.choices.get_mut(index as usize).ok_or_else(|| GatewayError::protocol(Leg::Regular, format!("the worker answered choice {index} of {n}")))?;
                // The prompt's ids go out once per choice, on its first chunk (vLLM's place for
                // them: the chat role chunk's top level, or a completion choice), as the engine's
                // HTTP stream does: resume reads them there.
                let prompt_ids = self.shape.prompt_of(index as usize);
                let mut send_prompt_ids = want_ids && !choice.prompt_ids_sent;
                if chat && !choice.role_sent {
                    choice.role_sent = true;
                    frame.chat_role(&mut out, index, send_prompt_ids.then_some(prompt_ids));
                    if send_prompt_ids {
                        choice.prompt_ids_sent = true;
                        send_prompt_ids = false;
                    }
                }
                // With logprobs every new token goes out at once, text or not (as the engine does).
                if !delta.is_empty() || reason.is_some() || ((want_ids || want_lp) && !ids.is_empty()) {
                    let text = if chat && delta.is_empty() { None } else { Some(delta.as_str()) };
                    let part_prompt_ids = (send_prompt_ids && !chat).then_some(prompt_ids);
                    if part_prompt_ids.is_some() {
                        choice.prompt_ids_sent = true;
                    }
                    let part = ChoicePart {
                        index,
                        text,
                        logprobs: &logprobs,
                        finish_reason: reason.as_deref(),
                        token_ids: want_ids.then_some(ids.as_slice()),
                        prompt_ids: part_prompt_ids,
                    };
                    if chat {
                        frame.chat(&mut out, &part);
                    } else {
                        frame.completion(&mut out, &part);
                    }
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

    /// OpenAI usage: each prompt (and its cached tokens) counted once, every choice's tokens.
    fn usage(&self) -> Value {
        let n = self.shape.sampling.n.max(1) as usize;
        let firsts = self.choices.iter().step_by(n);
        let (prompt, cached) = firsts.fold((0u64, 0u64), |(p, c), ch| (p + u64::from(ch.counts.prompt), c + u64::from(ch.counts.cached)));
        let completion: u64 = self.choices.iter().map(|c| u64::from(c.counts.completion)).sum();
        json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
               "prompt_tokens_details": {"cached_tokens": cached}})
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
        let mut meta = Map::new();
        meta.insert("id".into(), json!(self.shape.item_id(i)));
        meta.insert("finish_reason".into(), reason);
        meta.insert("prompt_tokens".into(), json!(c.counts.prompt));
        meta.insert("completion_tokens".into(), json!(c.counts.completion));
        meta.insert("cached_tokens".into(), json!(c.counts.cached));
        if let Some(LogprobAsk::Native { top, text }) = self.shape.logprobs {
            logprobs::native(&mut meta, self.tok, c.input_lps.as_deref().unwrap_or_default(), &c.lps, top, text);
        }
        json!({"text": c.text, "output_ids": c.ids, "meta_info": meta})
    }

    /// A whole (non-stream) answer from the choices' `Complete`s, fed with `on_event` first.
    pub fn whole(&self) -> Bytes {
        let v = match self.shape.route {
            Route::Generate if self.choices.len() == 1 && !self.shape.batch => self.native(0),
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
                        o.insert("logprobs".into(), self.chunk_logprobs(&c.lps));
                        o.insert("finish_reason".into(), json!(c.done.as_ref().map(|(r, _)| r)));
                        if self.shape.return_token_ids {
                            o.insert("token_ids".into(), json!(c.ids));
                            if !chat {
                                o.insert("prompt_token_ids".into(), json!(self.shape.prompt_of(i)));
                            }
                        }
                        Value::Object(o)
                    })
                    .collect();
                let object = if chat { "chat.completion" } else { "text_completion" };
                let mut v = json!({"id": self.shape.id, "object": object, "created": self.created, "model": self.model, "choices": choices, "usage": self.usage()});
                if chat && self.shape.return_token_ids {
                    v["prompt_token_ids"] = json!(self.shape.prompt_of(0));
                }
                if let Some(params) = &self.kv_transfer_params {
                    v["kv_transfer_params"] = params.clone();
                }
                v
            }
        };
        Bytes::from(serde_json::to_vec(&v).unwrap_or_default())
    }
}

#[cfg(test)]
#[path = "response_tests.rs"]
pub(super) mod tests;
