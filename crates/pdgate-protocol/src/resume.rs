//! Resuming a stream after its decode died: which requests can be continued exactly, what the
//! gateway learns from the stream while it relays it, the continuation request, and how the
//! continuation's chunks are made to read as the rest of the first stream.
//!
//! The continuation is built from token ids, never from re-tokenized text (a byte-level
//! model's output is mostly not valid UTF-8): the engine is asked for them with vLLM's
//! `return_token_ids` (the prompt's ids come back as `prompt_token_ids`: on the choice for
//! completions, at the top of the chunk for chat; each chunk's new ids as the choice's
//! `token_ids`). The continuation is always a `/v1/completions` request whose `prompt` is the
//! prompt's ids followed by every id generated so far, so a chat answer is continued inside the
//! already rendered template instead of restarting it (the choice: no template is applied
//! twice, and no engine-specific `continue_final_message` is needed). Ids the client did not ask
//! for are removed before it sees a chunk.

use serde_json::{json, Map, Value};

pub use self::ledger::TokenLedger;
use crate::request::{Endpoint, ParsedRequest};
use crate::sse::{find_boundary, frame, parse_event, SseDecoder};

/// OpenAI's default `max_tokens` for `/v1/completions` (vLLM's too).
pub const COMPLETIONS_DEFAULT_MAX_TOKENS: u64 = 16;

/// Fields that constrain the output to a grammar: a continuation would restart the grammar at
/// the prompt's end, not at the partial answer's state, so the answer could be invalid.
const GUIDED_FIELDS: &[&str] =
    &["response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs", "regex", "json_schema", "ebnf", "grammar"];

/// Chat fields that carry over to the completions-style continuation unchanged (sampling).
const CHAT_CARRIED: &[&str] =
    &["model", "temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos", "stop_token_ids", "skip_special_tokens", "user", "repetition_penalty", "logit_bias"];

fn set(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Number(n)) => n.as_f64() != Some(0.0),
        Some(Value::Object(_)) | Some(Value::Bool(true)) => true,
    }
}

/// Why a request cannot be resumed exactly, if it cannot (the `reason` of
/// `pdgate_resumes_total{result="refused"}`). Such a stream ends with the error event.
pub fn refusal(req: &ParsedRequest) -> Option<&'static str> {
    refusal_given(req, false)
}

/// [`refusal`], where `text_prompt_ids` says the gateway has a `/generate` text prompt's ids
/// (its tokenizer, `--model-path`): such a stream is continued from them.
pub fn refusal_given(req: &ParsedRequest, text_prompt_ids: bool) -> Option<&'static str> {
    let b = &req.body;
    if !req.stream {
        return Some("not_streaming");
    }
    if req.endpoint == Endpoint::Generate {
        return native_refusal(req, text_prompt_ids);
    }
    if b.get("n").and_then(Value::as_u64).is_some_and(|n| n > 1) {
        return Some("n_greater_than_1");
    }
    if req.batch_items.is_some() {
        return Some("batch");
    }
    let plain_text_format = b.get("response_format").and_then(|f| f.get("type")).and_then(Value::as_str) == Some("text");
    if GUIDED_FIELDS.iter().any(|f| set(b.get(*f)) && !(*f == "response_format" && plain_text_format)) {
        return Some("guided_decoding");
    }
    let checks: [(&[&str], &'static str); 5] = [
        // A stop string could straddle the break, and the text held back for one is unknown.
        (&["stop"], "stop_strings"),
        // Frequency and presence penalties count output tokens: the continuation's are fewer.
        (&["frequency_penalty", "presence_penalty"], "penalties"),
        (&["tools", "functions"], "tools"),
        (&["echo"], "echo"),
        (&["prompt_logprobs"], "prompt_logprobs"),
    ];
    for (fields, reason) in checks {
        if fields.iter().any(|f| set(b.get(*f))) {
            return Some(reason);
        }
    }
    if b.get("best_of").and_then(Value::as_u64).is_some_and(|n| n > 1) {
        return Some("best_of");
    }
    if req.endpoint == Endpoint::ChatCompletions && set(b.get("logprobs")) {
        return Some("chat_logprobs");
    }
    None
}

/// `/generate`: continued from `input_ids`, or from a text prompt's ids when the gateway has
/// them (its stream does not give them).
fn native_refusal(req: &ParsedRequest, text_prompt_ids: bool) -> Option<&'static str> {
    let b = &req.body;
    let sp = b.get("sampling_params").and_then(Value::as_object);
    let sp_set = |k: &&str| sp.is_some_and(|m| set(m.get(*k)));
    if sp.and_then(|m| m.get("n")).and_then(Value::as_u64).is_some_and(|n| n > 1) {
        return Some("n_greater_than_1");
    }
    if req.batch_items.is_some() {
        return Some("batch");
    }
    let ids = b.get("input_ids").is_some_and(Value::is_array);
    let text_with_ids = text_prompt_ids && b.get("text").is_some_and(Value::is_string);
    if !(ids || text_with_ids) {
        return Some("generate_text");
    }
    if ["regex", "json_schema", "ebnf", "structural_tag"].iter().any(sp_set) {
        return Some("guided_decoding");
    }
    if ["stop"].iter().any(sp_set) {
        return Some("stop_strings");
    }
    if ["frequency_penalty", "presence_penalty"].iter().any(sp_set) {
        return Some("penalties");
    }
    if set(b.get("return_logprob")) {
        return Some("logprobs");
    }
    None
}

/// SGLang's default `max_new_tokens`.
pub const GENERATE_DEFAULT_MAX_TOKENS: u64 = 128;

/// What the gateway knows of the answer so far, learned from the relayed chunks.
#[derive(Debug, Default)]
pub struct Progress {
    chat: bool,
    /// SGLang `/generate`: cumulative `text` and `output_ids` in every chunk.
    native: bool,
    /// `/generate`: the text sent so far, and what it was when the running continuation began.
    text: String,
    text_base: String,
    client_wants_ids: bool,
    head: Map<String, Value>,
    /// Token ids as numbers, not `Value`s (4 bytes a token instead of 32: a long answer's ids
    /// are held for its whole stream).
    prompt_ids: Option<Vec<u32>>,
    generated: Vec<u32>,
    /// Text went out without its token ids (an engine without `return_token_ids`).
    ids_unknown: bool,
    /// `/generate` with a text prompt: the prompt's ids are the gateway tokenizer's, checked
    /// against the engine's `meta_info.prompt_tokens` on the first event.
    tokenized: bool,
    /// The engine counted the prompt differently: the tokenizers differ, no exact continuation.
    tokenizer_differs: bool,
    finished: bool,
    /// Ids generated before the running continuation began (0 on the first stream).
    resumed_at: Option<usize>,
    /// How many of `generated` the client's text covers whole: the end of the last event that
    /// carried text and exactly one id. An engine holds a token's text while the text so far
    /// ends inside a UTF-8 character (or in bytes that are no character), and an event of
    /// several ids says nothing of where its text stops. A continuation goes on from here (see
    /// [`Progress::continuation`]).
    released: usize,
    /// The text the client has beyond the text of `generated[..released]`.
    text_after: String,
    /// Ids the client has been sent (a continuation regenerates those past `released`).
    sent_ids: usize,
    /// What the running continuation regenerates that the client has already: not sent again.
    skip_text: String,
}

/// A JSON array of token ids; `None` for anything else (an id over `u32::MAX` included: no
/// vocabulary is that large).
fn ids_of(v: Option<&Value>) -> Option<Vec<u32>> {
    v?.as_array()?.iter().map(|t| t.as_u64().and_then(|n| u32::try_from(n).ok())).collect()
}

fn ids_value(ids: impl Iterator<Item = u32>) -> Value {
    Value::Array(ids.map(Value::from).collect())
}

fn take_ids(obj: &mut Map<String, Value>, key: &str, keep: bool) -> Option<Vec<u32>> {
    if keep {
        ids_of(obj.get(key))
    } else {
        ids_of(obj.remove(key).as_ref())
    }
}

/// A choice that says nothing to a client that did not ask for ids (only ids were new).
fn empty_choice(c: &Map<String, Value>) -> bool {
    let no_text = match c.get("delta") {
        Some(Value::Object(d)) => d.is_empty(),
        Some(_) => false,
        None => c.get("text").and_then(Value::as_str).is_some_and(str::is_empty),
    };
    no_text && !set(c.get("finish_reason")) && !set(c.get("logprobs"))
}

impl Progress {
    pub fn new(req: &ParsedRequest) -> Self {
        let client_wants_ids = req.body.get("return_token_ids") == Some(&Value::Bool(true));
        let native = req.endpoint == Endpoint::Generate;
        let prompt_ids = if native { ids_of(req.body.get("input_ids")) } else { None };
        Progress { chat: req.endpoint == Endpoint::ChatCompletions, native, prompt_ids, client_wants_ids, ..Progress::default() }
    }

    /// Token ids generated so far (those whose text reached the client).
    pub fn generated(&self) -> usize {
        self.generated.len()
    }

    /// The prompt's and the answer's token counts from the ids seen (the whole answer, across
    /// continuations); `None` when the engine sent no prompt ids or text without its ids.
    pub fn counts(&self) -> Option<(u64, u64)> {
        match (&self.prompt_ids, self.ids_unknown) {
            (Some(p), false) => Some((p.len() as u64, self.generated.len() as u64)),
            _ => None,
        }
    }

    /// Why this stream cannot be continued, if it cannot.
    pub fn refusal(&self) -> Option<&'static str> {
        if self.finished {
            Some("already_finished")
        } else if self.ids_unknown {
            Some("no_token_ids")
        } else if self.tokenizer_differs {
            Some("tokenizer_mismatch")
        } else if self.prompt_ids.is_none() {
            Some("no_prompt_ids")
        } else {
            None
        }
    }

    /// Learns from one event of the first stream and removes the ids the client did not ask
    /// for; `false` when nothing is left worth sending.
    pub fn observe(&mut self, v: &mut Value) -> bool {
        let Some(obj) = v.as_object_mut() else { return true };
        if self.native {
            self.observe_native(obj);
            return true;
        }
        for key in ["id", "created", "model", "object"] {
            if let (false, Some(x)) = (self.head.contains_key(key), obj.get(key)) {
                self.head.insert(key.to_string(), x.clone());
            }
        }
        let keep = self.client_wants_ids;
        if let Some(ids) = take_ids(obj, "prompt_token_ids", keep) {
            self.prompt_ids.get_or_insert(ids);
        }
        let had_usage = set(obj.get("usage"));
        let Some(Value::Array(choices)) = obj.get_mut("choices") else { return true };
        let mut all_empty = !choices.is_empty();
        for c in choices.iter_mut().filter_map(Value::as_object_mut) {
            if let Some(ids) = take_ids(c, "prompt_token_ids", keep) {
                self.prompt_ids.get_or_insert(ids);
            }
            let ids = take_ids(c, "token_ids", keep);
            let text = c.get("text").or_else(|| c.get("delta").and_then(|d| d.get("content"))).and_then(Value::as_str).unwrap_or_default();
            if ids.is_none() && !text.is_empty() {
                self.ids_unknown = true;
            }
            let n = ids.as_ref().map_or(0, Vec::len);
            self.generated.extend(ids.unwrap_or_default());
            self.sent_ids = self.generated.len();
            self.note_text(text, n);
            self.finished |= set(c.get("finish_reason"));
            all_empty &= empty_choice(c);
        }
        keep || had_usage || !all_empty
    }

    /// Where the client's text stands after an event whose choice had `text` and `n` new ids
    /// (already in `generated`).
    fn note_text(&mut self, text: &str, n: usize) {
        match (text.is_empty(), n) {
            (true, _) | (false, 0) => {}
            (false, 1) => {
                self.released = self.generated.len();
                self.text_after.clear();
            }
            (false, _) => self.text_after.push_str(text),
        }
    }

    /// The continuation's body: the prompt's ids and the generated ids whose text the client
    /// has whole (`released`) as a completions `prompt`, `max_tokens` reduced by those.
    /// `context_limit` sets the budget of a chat request that gave none (vLLM's default: the
    /// rest of the context).
    ///
    /// Why not every id generated: vLLM primes its detokenizer with the prompt's ids
    /// (tokenizers' `DecodeStream(ids=prompt)`, vllm/v1/engine/detokenizer.py), and when those
    /// decode to text ending in U+FFFD its first delta is the text of the whole prompt, not
    /// of the new ids alone: the client would read the prompt and the answer again. Ids past
    /// `released` are regenerated instead, and what the client already has of them is not
    /// sent twice ([`Progress::rewrite`]). A greedy answer regenerates the same ids.
    pub fn continuation(&self, req: &ParsedRequest, context_limit: Option<u64>) -> Result<Map<String, Value>, &'static str> {
        if let Some(reason) = self.refusal() {
            return Err(reason);
        }
        let prompt = self.prompt_ids.as_ref().ok_or("no_prompt_ids")?;
        let kept = if self.native { &self.generated[..] } else { &self.generated[..self.released] };
        let done = kept.len() as u64;
        let asked = match (req.max_tokens, self.chat, context_limit) {
            (Some((n, _)), _, _) => n,
            (None, _, _) if self.native => GENERATE_DEFAULT_MAX_TOKENS,
            (None, false, _) => COMPLETIONS_DEFAULT_MAX_TOKENS,
            (None, true, Some(limit)) => limit.saturating_sub(prompt.len() as u64),
            (None, true, None) => return Err("unknown_max_tokens"),
        };
        let left = asked.saturating_sub(done);
        if left == 0 {
            return Err("no_tokens_left");
        }
        if self.native {
            return Ok(self.native_continuation(req, prompt, left));
        }
        let mut body = if self.chat { CHAT_CARRIED.iter().filter_map(|k| req.body.get(*k).map(|v| (k.to_string(), v.clone()))).collect() } else { req.body.clone() };
        for k in ["max_completion_tokens", "stream_options", "messages", "n", "rid", "return_token_ids"] {
            body.remove(k);
        }
        body.insert("prompt".into(), ids_value(prompt.iter().chain(kept).copied()));
        body.insert("max_tokens".into(), json!(left));
        body.insert("stream".into(), Value::Bool(true));
        body.insert("return_token_ids".into(), Value::Bool(true));
        if let Some(opts) = req.body.get("stream_options") {
            body.insert("stream_options".into(), opts.clone());
        }
        if let Some(min) = req.body.get("min_tokens").and_then(Value::as_u64) {
            body.insert("min_tokens".into(), json!(min.saturating_sub(done)));
        }
        Ok(body)
    }

    fn native_continuation(&self, req: &ParsedRequest, prompt: &[u32], left: u64) -> Map<String, Value> {
        let mut body = req.body.clone();
        // A text prompt goes on as ids (an engine takes one or the other).
        body.remove("rid");
        body.remove("text");
        body.insert("input_ids".into(), ids_value(prompt.iter().chain(&self.generated).copied()));
        body.insert("stream".into(), Value::Bool(true));
        let mut sp = body.get("sampling_params").and_then(Value::as_object).cloned().unwrap_or_default();
        sp.insert("max_new_tokens".into(), json!(left));
        if let Some(min) = sp.get("min_new_tokens").and_then(Value::as_u64) {
            sp.insert("min_new_tokens".into(), json!(min.saturating_sub(self.generated.len() as u64)));
        }
        body.insert("sampling_params".into(), Value::Object(sp));
        body
    }

    /// Learns the running stream's ids from its client's ledger (`resume_ledger.rs`) instead of
    /// its bytes: the first stream's prompt and envelope, and the running stream's generated ids
    /// after those generated before it began.
    pub fn absorb(&mut self, ledger: &TokenLedger) {
        ledger.read(|e| {
            self.prompt_ids.get_or_insert_with(|| e.prompt.clone());
            for (k, v) in &e.head {
                if !self.head.contains_key(k) {
                    self.head.insert(k.clone(), v.clone());
                }
            }
            self.generated.truncate(self.resumed_at.unwrap_or(0));
            self.generated.extend_from_slice(&e.generated);
            self.finished |= e.finished;
        });
        // A ledger's stream is one the gateway detokenized itself (gRPC workers): its own
        // detokenizer, primed with a continuation's prompt, sends the character a continuation
        // completes, so such a stream goes on from every id.
        self.released = self.generated.len();
        self.sent_ids = self.sent_ids.max(self.released);
        self.text_after.clear();
    }

    /// Whether this is a `/generate` stream (its continuation goes to `/generate`).
    pub fn native(&self) -> bool {
        self.native
    }

    /// A continuation starts: its chunks are rewritten from now on.
    pub fn begin_continuation(&mut self) {
        if !self.native {
            self.generated.truncate(self.released);
            self.skip_text = self.text_after.clone();
        }
        self.resumed_at = Some(self.generated.len());
        self.text_base = self.text.clone();
    }

    /// `/generate` chunks carry the whole answer so far: keep the new ids' tail and the text.
    fn observe_native(&mut self, obj: &Map<String, Value>) {
        let text = obj.get("text").and_then(Value::as_str).unwrap_or_default();
        match ids_of(obj.get("output_ids")) {
            // SGLang's cumulative chunks are continued from every id (see `continuation`).
            Some(ids) => self.generated.extend(ids.into_iter().skip(self.generated.len())),
            _ if !text.is_empty() => self.ids_unknown = true,
            _ => {}
        }
        self.text = text.to_string();
        let meta = obj.get("meta_info");
        if self.tokenized {
            // Checked once: the first event's count of the prompt is the engine's tokenization.
            self.tokenized = false;
            let engine = meta.and_then(|m| m.get("prompt_tokens")).and_then(Value::as_u64);
            self.tokenizer_differs = engine != self.prompt_ids.as_ref().map(|p| p.len() as u64);
        }
        if let (false, Some(id)) = (self.head.contains_key("id"), meta.and_then(|m| m.get("id"))) {
            self.head.insert("id".into(), id.clone());
        }
        self.finished |= set(meta.and_then(|m| m.get("finish_reason")));
    }

    /// A `/generate` continuation's chunk as the first stream's: the text and ids so far
    /// prefixed, the counts of the whole answer.
    fn rewrite_native(&mut self, mut obj: Map<String, Value>) -> Value {
        let before = self.resumed_at.unwrap_or(0);
        let text = format!("{}{}", self.text_base, obj.get("text").and_then(Value::as_str).unwrap_or_default());
        let mut ids: Vec<u32> = self.generated[..before].to_vec();
        ids.extend(ids_of(obj.get("output_ids")).unwrap_or_default());
        if let Some(Value::Object(meta)) = obj.get_mut("meta_info") {
            let completion = meta.get("completion_tokens").and_then(Value::as_u64).unwrap_or(0) + before as u64;
            meta.insert("completion_tokens".into(), json!(completion));
            if let Some(p) = &self.prompt_ids {
                meta.insert("prompt_tokens".into(), json!(p.len()));
            }
            if let Some(id) = self.head.get("id") {
                meta.insert("id".into(), id.clone());
            }
            self.finished |= set(meta.get("finish_reason"));
        }
        obj.insert("text".into(), json!(text));
        self.text = text;
        obj.insert("output_ids".into(), ids_value(ids.iter().copied()));
        self.generated = ids;
        Value::Object(obj)
    }

    /// One event of a continuation as the next event of the first stream: its id, object,
    /// created and model, choice index 0, chat deltas for a chat request, usage counting the
    /// whole answer; `None` when nothing is left worth sending.
    pub fn rewrite(&mut self, v: Value) -> Option<Value> {
        let Value::Object(mut obj) = v else { return Some(v) };
        if obj.contains_key("error") {
            return Some(Value::Object(obj));
        }
        if self.native {
            return Some(self.rewrite_native(obj));
        }
        let before = self.resumed_at.unwrap_or(0) as u64;
        let mut out = self.head.clone();
        if self.chat {
            out.insert("object".into(), json!("chat.completion.chunk"));
        }
        let (mut choices, mut new_ids) = (Vec::new(), false);
        if let Some(Value::Array(cs)) = obj.remove("choices") {
            for mut c in cs.into_iter().filter_map(|c| if let Value::Object(m) = c { Some(m) } else { None }) {
                let ids = take_ids(&mut c, "token_ids", true).unwrap_or_default();
                let raw = c.remove("text").and_then(|t| if let Value::String(t) = t { Some(t) } else { None }).unwrap_or_default();
                // Ids and text the client has already (regenerated past `released`) are not sent.
                let seen = self.sent_ids.saturating_sub(self.generated.len()).min(ids.len());
                self.generated.extend_from_slice(&ids);
                self.sent_ids = self.sent_ids.max(self.generated.len());
                let text = unsent(&raw, &mut self.skip_text).to_string();
                if ids.len() == 1 && !raw.is_empty() {
                    self.released = self.generated.len();
                    self.text_after = self.skip_text.clone();
                } else if !raw.is_empty() {
                    self.text_after.push_str(&text);
                }
                let finish = c.remove("finish_reason").unwrap_or(Value::Null);
                self.finished |= set(Some(&finish));
                let mut choice = Map::new();
                choice.insert("index".into(), json!(0));
                if self.chat {
                    let delta = if text.is_empty() { json!({}) } else { json!({"content": text}) };
                    choice.insert("delta".into(), delta);
                    choice.insert("logprobs".into(), Value::Null);
                } else {
                    choice.insert("text".into(), json!(text));
                    let mut logprobs = c.remove("logprobs").unwrap_or(Value::Null);
                    drop_first_entries(&mut logprobs, seen);
                    choice.insert("logprobs".into(), logprobs);
                }
                choice.insert("finish_reason".into(), finish);
                if self.client_wants_ids {
                    new_ids |= seen < ids.len();
                    choice.insert("token_ids".into(), ids_value(ids[seen..].iter().copied()));
                }
                choices.push(Value::Object(choice));
            }
        }
        let all_empty = !choices.is_empty() && choices.iter().filter_map(Value::as_object).all(empty_choice);
        out.insert("choices".into(), Value::Array(choices));
        let usage = obj.remove("usage").filter(|u| u.is_object());
        if let (Some(mut u), Some(prompt)) = (usage.clone(), self.prompt_ids.as_ref()) {
            let completion = u.get("completion_tokens").and_then(Value::as_u64).unwrap_or(0) + before;
            let prompt = prompt.len() as u64;
            u["prompt_tokens"] = json!(prompt);
            u["completion_tokens"] = json!(completion);
            u["total_tokens"] = json!(prompt + completion);
            out.insert("usage".into(), u);
        }
        (new_ids || usage.is_some() || !all_empty).then_some(Value::Object(out))
    }
}

/// The part of a continuation's `text` the client does not have yet: `skip` is what it has
/// that the continuation regenerates (consumed as it is matched). A sampled continuation may
/// regenerate other text than the client has: past the common part, its text goes out.
fn unsent<'a>(text: &'a str, skip: &mut String) -> &'a str {
    if skip.is_empty() {
        return text;
    }
    if let Some(rest) = text.strip_prefix(skip.as_str()) {
        skip.clear();
        return rest;
    }
    if skip.starts_with(text) {
        skip.drain(..text.len());
        return "";
    }
    let common = text.char_indices().zip(skip.chars()).find(|((_, a), b)| a != b).map_or(0, |((i, _), _)| i);
    skip.clear();
    &text[common..]
}

/// Removes the first `n` tokens' entries of a completions `logprobs` object (those of ids the
/// client was sent already).
fn drop_first_entries(logprobs: &mut Value, n: usize) {
    let Some(obj) = logprobs.as_object_mut().filter(|_| n > 0) else { return };
    for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        if let Some(Value::Array(a)) = obj.get_mut(key) {
            a.drain(..n.min(a.len()));
        }
    }
    if obj.get("tokens").and_then(Value::as_array).is_some_and(Vec::is_empty) {
        *logprobs = Value::Null; // nothing of it is new
    }
}

/// The SSE side of [`Progress`]: whole events in, whole events out (a partial event is held
/// until its end arrives, so a dead stream never leaves the client mid-event).
///
/// The first stream is read in place ([`ResumeTracker::process_raw`]): an event of the usual
/// shape is scanned, not parsed, and goes out as the engine wrote it less the ids the client
/// did not ask for (`resume_scan.rs`); the first event and anything unusual take the slow
/// path (`serde_json::Value`). A continuation's events are rewritten, so they are parsed.
#[derive(Debug)]
pub struct ResumeTracker {
    decoder: SseDecoder,
    pub progress: Progress,
    continuing: bool,
    /// The first stream's bytes of an event not yet complete.
    held: Vec<u8>,
}

impl ResumeTracker {
    pub fn new(req: &ParsedRequest) -> Self {
        ResumeTracker { decoder: SseDecoder::new(), progress: Progress::new(req), continuing: false, held: Vec::new() }
    }

    /// A `/generate` stream with a text prompt whose ids the gateway's tokenizer gave
    /// (`refusal_given(req, true)` allowed it). The engine's first event must count the same
    /// number of prompt tokens, else the stream is not resumed (`tokenizer_mismatch`).
    pub fn with_prompt_ids(req: &ParsedRequest, ids: &[u32]) -> Self {
        let mut t = ResumeTracker::new(req);
        if t.progress.native && t.progress.prompt_ids.is_none() {
            t.progress.prompt_ids = Some(ids.to_vec());
            t.progress.tokenized = true;
        }
        t
    }

    /// Whether the first stream's engine sent the prompt's token ids (known once its first
    /// event was read); `None` once a continuation runs (its chunks say nothing of that).
    pub fn gave_ids(&self) -> Option<bool> {
        (!self.continuing).then(|| self.progress.prompt_ids.is_some())
    }

    /// Whether a continuation is running (its chunks are rewritten, so they must pass
    /// [`ResumeTracker::process_raw`] even when a ledger tells their ids).
    pub fn continuing(&self) -> bool {
        self.continuing
    }

    /// The relayed stream broke: what it left half-sent is dropped, the next bytes are a
    /// continuation's.
    pub fn begin_continuation(&mut self) {
        self.decoder = SseDecoder::new();
        self.held.clear();
        self.progress.begin_continuation();
        self.continuing = true;
    }

    /// One chunk of the relayed stream, as the client is to see it: `None` when that is the
    /// chunk itself (the usual case when the client asked for the ids, or an event is dropped
    /// or cut nowhere).
    pub fn process_raw(&mut self, chunk: &[u8]) -> Option<Vec<u8>> {
        if self.continuing {
            return Some(self.process(chunk).into_bytes());
        }
        let held = !self.held.is_empty();
        let joined = held.then(|| {
            let mut j = std::mem::take(&mut self.held);
            j.extend_from_slice(chunk);
            j
        });
        let data: &[u8] = joined.as_deref().unwrap_or(chunk);
        let (mut out, mut changed, mut pos) = (Vec::with_capacity(data.len()), held, 0);
        while let Some((end, sep)) = find_boundary(&data[pos..], 0) {
            let (raw, whole) = (&data[pos..pos + end], &data[pos..pos + end + sep]);
            match self.progress.observe_raw(raw, &mut out) {
                Some(scan::Fast::Same) => out.extend_from_slice(whole),
                Some(scan::Fast::Cut) => {
                    out.extend_from_slice(&whole[end..]);
                    changed = true;
                }
                Some(scan::Fast::Drop) => changed = true,
                // The end goes out as it came (the slow path would re-frame it to the same).
                None if matches!(raw, b"data: [DONE]" | b"data:[DONE]") => out.extend_from_slice(whole),
                None => {
                    let slow = self.first_stream_event(raw);
                    changed |= slow.as_bytes() != whole;
                    out.extend_from_slice(slow.as_bytes());
                }
            }
            pos += end + sep;
        }
        if pos < data.len() {
            self.held.extend_from_slice(&data[pos..]);
            changed = true;
        }
        changed.then_some(out)
    }

    /// The slow path for one raw event of the first stream: parsed, learned, re-framed.
    fn first_stream_event(&mut self, raw: &[u8]) -> String {
        let Some(ev) = parse_event(raw) else { return String::new() };
        if ev.is_done() {
            return frame(&ev.data);
        }
        let Ok(mut v) = serde_json::from_str::<Value>(&ev.data) else { return frame(&ev.data) };
        if self.progress.observe(&mut v) {
            frame(&v.to_string())
        } else {
            String::new()
        }
    }

    /// One chunk of the relayed stream, as the client is to see it (every event parsed).
    pub fn process(&mut self, chunk: &[u8]) -> String {
        let mut out = String::new();
        for ev in self.decoder.feed(chunk) {
            if ev.is_done() {
                out.push_str(&frame(&ev.data));
                continue;
            }
            let Ok(mut v) = serde_json::from_str::<Value>(&ev.data) else {
                out.push_str(&frame(&ev.data));
                continue;
            };
            let kept = if self.continuing {
                self.progress.rewrite(v)
            } else if self.progress.observe(&mut v) {
                Some(v)
            } else {
                None
            };
            if let Some(v) = kept {
                out.push_str(&frame(&v.to_string()));
            }
        }
        out
    }
}

#[path = "resume_scan.rs"]
mod scan;

#[path = "resume_ledger.rs"]
pub mod ledger;

#[cfg(test)]
#[path = "resume_tests.rs"]
mod tests;
