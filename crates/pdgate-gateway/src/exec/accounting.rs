//! Latency and token accounting of one request, at the gateway: when the first content token
//! went to the client, how many tokens the engine reported, and the finished figures handed
//! to `goodput.rs` (metrics, goodput window, request log).
//!
//! Streams are read as little as possible: every event is parsed only until the first content
//! token; after it, a chunk is passed on as it came unless it mentions `"usage"` (the engine's
//! usage chunk, read and, when the gateway asked for it, stripped) or an event straddles two
//! chunks there. Output tokens come from the engine's usage (OpenAI `usage`, SGLang
//! `meta_info`); without it they are counted as the data events from the first content on.

use std::sync::LazyLock;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use memchr::memmem;
use pdgate_core::slo::{RequestFigures, SloResult, SloTargets};
use pdgate_protocol::content::{carries_output, has_content};
use pdgate_protocol::sse::{find_boundary, frame};
use pdgate_protocol::{Endpoint, ParsedRequest};
use serde_json::{Map, Value};

use pdgate_core::plan::{LegBody, Mode};

use super::Ctx;
use crate::exec::Exec;
use crate::observe::goodput::{Finished, ResumedOn};

/// The placement a plan's mode serves the request by (the `placement` label).
pub fn placement_of(mode: Mode) -> &'static str {
    match mode {
        Mode::Regular => "colocated",
        Mode::Pd(_) => "disaggregated",
    }
}

/// Token counts as the engine reported them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt: Option<u64>,
    pub output: Option<u64>,
    pub cached: Option<u64>,
}

fn add(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x + y),
        (x, None) | (None, x) => x,
    }
}

/// Usage from an OpenAI `usage` block or an SGLang `meta_info`; a `/generate` batch (an
/// array of items) sums its items.
pub fn usage_of(v: &Value) -> Option<Usage> {
    if let Value::Array(items) = v {
        return items.iter().filter_map(usage_of).reduce(|a, b| Usage { prompt: add(a.prompt, b.prompt), output: add(a.output, b.output), cached: add(a.cached, b.cached) });
    }
    let num = |o: &Value, k: &str| o.get(k).and_then(Value::as_u64);
    if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
        let cached = u.get("prompt_tokens_details").and_then(|d| num(d, "cached_tokens"));
        return Some(Usage { prompt: num(u, "prompt_tokens"), output: num(u, "completion_tokens"), cached });
    }
    let m = v.get("meta_info").filter(|m| m.is_object())?;
    Some(Usage { prompt: num(m, "prompt_tokens"), output: num(m, "completion_tokens"), cached: num(m, "cached_tokens") })
}

/// How the gateway learns a stream's token counts when its client did not ask for the usage
/// chunk (the engine's counts: the request log, the metrics, the PD cached-token report).
/// Asking costs the engine one more event per stream, so it is asked only where needed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum UsageAsk {
    /// Nothing to ask or strip: the client asked for usage itself, the answer is whole, or the
    /// route reports counts in every chunk (SGLang `/generate`'s `meta_info`).
    #[default]
    None,
    /// `stream_options.include_usage` is in the body for every worker: PD (the decode's
    /// cached-token report needs `prompt_tokens_details`) and streams whose token ids are not
    /// tracked. The relay strips the chunk.
    Always,
    /// A regular stream whose token ids the resume tracker reads: its counts are the prompt's
    /// and the generated ids, so usage is asked only of a worker not (yet) known to send ids
    /// (`Runtime::gives_token_ids`). The relay strips any usage chunk.
    UnlessIds,
}

impl UsageAsk {
    /// The client did not ask for usage: a usage chunk is the gateway's and must not reach it.
    pub fn strips(self) -> bool {
        self != UsageAsk::None
    }
}

/// Whether a streamed request's client left the usage chunk out (so any usage chunk is the
/// gateway's). `/generate` reports counts in every chunk and has none.
pub fn client_left_out_usage(req: &ParsedRequest) -> bool {
    req.stream && req.endpoint != Endpoint::Generate && req.body.get("stream_options").and_then(|o| o.get("include_usage")) != Some(&Value::Bool(true))
}

/// Sets `stream_options.include_usage` in a body (keeping the client's other stream options).
pub fn insert_include_usage(body: &mut Map<String, Value>) {
    let opts = body.entry("stream_options").or_insert_with(|| Value::Object(Map::new()));
    if !opts.is_object() {
        // The parser allows only an object or null here.
        *opts = Value::Object(Map::new());
    }
    if let Some(opts) = opts.as_object_mut() {
        opts.insert("include_usage".into(), Value::Bool(true));
    }
}

/// A streamed OpenAI request whose client did not ask for usage gets
/// `stream_options.include_usage` (the engine's token counts), and the relay strips that chunk
/// again. Returns whether it must. SGLang's `/generate` reports counts in every chunk.
pub fn ask_for_usage(req: &mut ParsedRequest) -> bool {
    if !client_left_out_usage(req) {
        return false;
    }
    if req.body.contains_key("stream_options") {
        insert_include_usage(&mut req.body);
        req.rewritten = true;
    } else {
        req.add_field("stream_options", serde_json::json!({"include_usage": true}));
    }
    true
}

// Searchers built once: `memmem::find` builds one per call, which showed in per-chunk profiles.
static DATA: LazyLock<memmem::Finder<'static>> = LazyLock::new(|| memmem::Finder::new(b"data:"));
static DONE: LazyLock<memmem::Finder<'static>> = LazyLock::new(|| memmem::Finder::new(b"[DONE]"));
static USAGE: LazyLock<memmem::Finder<'static>> = LazyLock::new(|| memmem::Finder::new(b"\"usage\""));

/// One leg's body with `stream_options.include_usage` added (a forwarded body becomes the
/// request's, encoded).
pub fn ask_for_usage_in(body: &mut LegBody, req: &ParsedRequest) {
    match body {
        LegBody::Json(b) => insert_include_usage(b),
        LegBody::Forward => {
            let mut b = req.body.clone();
            insert_include_usage(&mut b);
            *body = LegBody::Json(b);
        }
        // Regular plans have no other body shape.
        _ => {}
    }
}

/// Decides, once per request, how its token counts are learned: `pd` (the decode's cached-token
/// report needs the engine's usage), `tracks_ids` (the resume tracker reads the stream's token
/// ids, which count the prompt and the answer exactly). Edits the body for [`UsageAsk::Always`].
pub fn usage_ask(req: &mut ParsedRequest, pd: bool, tracks_ids: bool) -> UsageAsk {
    if !client_left_out_usage(req) {
        UsageAsk::None
    } else if pd || !tracks_ids {
        ask_for_usage(req);
        UsageAsk::Always
    } else {
        UsageAsk::UnlessIds
    }
}

/// The end of the first event in `data` and the length of its separator.
fn boundary(data: &[u8]) -> Option<(usize, usize)> {
    find_boundary(data, 0)
}

/// Data events in whole events, `[DONE]` left out.
fn count_data_events(events: &[u8]) -> u64 {
    let data = DATA.find_iter(events).count();
    let done = DONE.find_iter(events).count();
    data.saturating_sub(done) as u64
}

/// The last data event in `chunk` that is not `[DONE]`, up to its end (or the chunk's).
fn last_data_event(chunk: &Bytes) -> Option<Bytes> {
    let mut end = chunk.len();
    while let Some(at) = memmem::rfind(&chunk[..end], b"data:") {
        let rest = &chunk[at + 5..end];
        let payload = rest.strip_prefix(b" ").unwrap_or(rest);
        if !payload.starts_with(b"[DONE]") {
            let stop = boundary(&chunk[at..end]).map_or(end, |(e, _)| at + e);
            return Some(chunk.slice(at..stop));
        }
        end = at;
    }
    None
}

/// The `data` of one raw event (its `data:` lines joined); `None` for a comment-only event.
fn event_data(raw: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(raw).ok()?;
    let lines: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data:")).map(|l| l.strip_prefix(' ').unwrap_or(l)).collect();
    (!lines.is_empty()).then(|| lines.join("\n"))
}

enum Verdict {
    Keep,
    Drop,
    Replace(Bytes),
}

/// The accounting of one relayed stream (see the module doc).
pub struct StreamTally {
    endpoint: Endpoint,
    strip_usage: bool,
    /// A `/generate` batch reports per item: every event is read.
    every_event: bool,
    /// The last data event of a `/generate` stream passed through unread: its `meta_info` has
    /// the running counts, read once at the end.
    last: Option<Bytes>,
    /// The start of an event not yet complete, held while events are being read.
    held: BytesMut,
    pub first_content: Option<Instant>,
    /// Data events from the first content on (the count when the engine reports no usage).
    events: u64,
    usage: Option<Usage>,
    /// `/generate` per-item counts (the last seen per item index).
    items: Vec<(u64, Usage)>,
    /// Tokens generated before the running continuation began (0 until a resume): its engine
    /// counts them in its prompt and not in its output (see [`StreamTally::continued`]).
    resumed_after: u64,
}

impl StreamTally {
    /// `batch`: the request has several items (a prompt list, `n` > 1).
    pub fn new(endpoint: Endpoint, strip_usage: bool, batch: bool) -> Self {
        let every_event = endpoint == Endpoint::Generate && batch;
        StreamTally { endpoint, strip_usage, every_event, last: None, held: BytesMut::new(), first_content: None, events: 0, usage: None, items: Vec::new(), resumed_after: 0 }
    }

    /// One chunk from the worker, `now` being when it is relayed; returns what the client gets.
    pub fn process(&mut self, chunk: Bytes, now: Instant) -> Bytes {
        // A chunk of whole events without usage (the usual one) passes unread; one that ends
        // inside an event is read, so the rest of that event is held until it is complete.
        let whole = chunk.ends_with(b"\n\n");
        let read = self.first_content.is_none() || !self.held.is_empty() || self.every_event || !whole || USAGE.find(&chunk).is_some();
        if !read {
            self.events += count_data_events(&chunk);
            if self.endpoint == Endpoint::Generate {
                if let Some(last) = last_data_event(&chunk) {
                    self.last = Some(last);
                }
            }
            return chunk;
        }
        let data = if self.held.is_empty() {
            chunk
        } else {
            self.held.extend_from_slice(&chunk);
            self.held.split().freeze()
        };
        let (mut out, mut changed, mut pos) = (BytesMut::new(), false, 0);
        while let Some((end, sep)) = boundary(&data[pos..]) {
            let whole = data.slice(pos..pos + end + sep);
            match self.event(&data[pos..pos + end], now) {
                Verdict::Keep => out.extend_from_slice(&whole),
                Verdict::Drop => changed = true,
                Verdict::Replace(b) => {
                    out.extend_from_slice(&b);
                    changed = true;
                }
            }
            pos += end + sep;
        }
        if pos < data.len() {
            self.held.extend_from_slice(&data[pos..]);
            changed = true;
        }
        if changed {
            out.freeze()
        } else {
            data
        }
    }

    fn event(&mut self, raw: &[u8], now: Instant) -> Verdict {
        if self.first_content.is_some() && !self.every_event && USAGE.find(raw).is_none() {
            // Read only for its boundary: counted, not parsed.
            let n = count_data_events(raw);
            self.events += n;
            if n > 0 && self.endpoint == Endpoint::Generate {
                self.last = Some(Bytes::copy_from_slice(raw));
            }
            return Verdict::Keep;
        }
        if self.endpoint != Endpoint::Generate && USAGE.find(raw).is_none() {
            // Before the first content: whether this event is it, read from its bytes (no
            // usage in it, so nothing else to learn or change).
            if let Some(output) = carries_output(self.endpoint == Endpoint::ChatCompletions, raw) {
                if output {
                    self.first_content.get_or_insert(now);
                }
                self.events += u64::from(self.first_content.is_some());
                return Verdict::Keep;
            }
        }
        let Some(text) = event_data(raw) else { return Verdict::Keep };
        if text.trim() == "[DONE]" {
            return Verdict::Keep;
        }
        let Ok(mut v) = serde_json::from_str::<Value>(&text) else {
            self.events += u64::from(self.first_content.is_some());
            return Verdict::Keep;
        };
        if self.first_content.is_none() && has_content(self.endpoint, &v) {
            self.first_content = Some(now);
        }
        if self.endpoint == Endpoint::Generate {
            self.last = None;
            if let Some(u) = usage_of(&v) {
                let index = v.get("index").and_then(Value::as_u64).unwrap_or(0);
                match self.items.iter_mut().find(|(i, _)| *i == index) {
                    Some(slot) => slot.1 = u,
                    None => self.items.push((index, u)),
                }
            }
            self.events += u64::from(self.first_content.is_some());
            return Verdict::Keep;
        }
        let usage = v.get("usage").filter(|u| u.is_object()).and_then(|_| usage_of(&v));
        let Some(usage) = usage else {
            self.events += u64::from(self.first_content.is_some());
            return Verdict::Keep;
        };
        self.usage = Some(usage);
        if !self.strip_usage {
            return Verdict::Keep;
        }
        let only_usage = v.get("choices").and_then(Value::as_array).is_none_or(Vec::is_empty);
        if only_usage {
            return Verdict::Drop;
        }
        self.events += u64::from(self.first_content.is_some());
        if let Some(o) = v.as_object_mut() {
            o.remove("usage");
        }
        Verdict::Replace(Bytes::from(frame(&v.to_string())))
    }

    /// The stream goes on as a continuation (resume after decode death) that starts after
    /// `generated` tokens of the answer: its engine reports the original prompt plus those as
    /// its prompt, and only its own tokens as output. The client's usage counts the whole
    /// answer (`pdgate_protocol::resume`); so does the gateway's accounting.
    pub fn continued(&mut self, generated: u64) {
        self.resumed_after = generated;
    }

    /// Whether the start of an event is held back: the client then has whole events only.
    pub fn holds_back(&self) -> bool {
        !self.held.is_empty()
    }

    /// The stream ended: bytes still held (an event without its blank line) go out as they are.
    pub fn flush(&mut self) -> Option<Bytes> {
        (!self.held.is_empty()).then(|| self.held.split().freeze())
    }

    /// The engine's counts, or the counted events for the output when it reported none.
    #[cfg(test)]
    pub fn usage(&mut self) -> Usage {
        self.usage_with(None)
    }

    /// The engine's counts; where it reported none, `ids` (the prompt's and the answer's token
    /// ids the resume tracker counted, whole answer), else the counted events for the output.
    pub fn usage_with(&mut self, ids: Option<(u64, u64)>) -> Usage {
        if let Some(v) = self.last.take().and_then(|raw| serde_json::from_str::<Value>(&event_data(&raw)?).ok()) {
            if let Some(u) = usage_of(&v) {
                self.items = vec![(0, u)];
            }
        }
        let reported = if self.items.is_empty() {
            self.usage
        } else {
            self.items.iter().map(|(_, u)| *u).reduce(|a, b| Usage { prompt: add(a.prompt, b.prompt), output: add(a.output, b.output), cached: add(a.cached, b.cached) })
        };
        let mut u = reported.unwrap_or_default();
        if let (Some(_), k @ 1..) = (reported, self.resumed_after) {
            u.prompt = u.prompt.map(|p| p.saturating_sub(k));
            u.output = u.output.map(|o| o + k);
            // What the continuation found cached covered the generated tokens too.
            u.cached = match (u.cached, u.prompt) {
                (Some(c), Some(p)) => Some(c.min(p)),
                (c, _) => c,
            };
        }
        if let (None, Some((prompt, output))) = (reported, ids) {
            u = Usage { prompt: Some(prompt), output: Some(output), cached: None };
        }
        if u.output.is_none() && self.first_content.is_some() {
            u.output = Some(self.events.max(1));
        }
        u
    }
}

/// The request's accounting, from arrival to its end; one per attempt that may commit.
pub struct Account {
    pub arrival: Instant,
    pub arrival_unix_s: f64,
    pub slo: SloTargets,
    pub placement: &'static str,
    pub protocol: &'static str,
    pub route: &'static str,
    pub streamed: bool,
    /// Who served it, kept only when there is a request log.
    pub who: Option<Box<Who>>,
    /// Continuations after decode deaths (resume).
    pub resumes: u32,
}

/// The identity of a request, for its log line.
#[derive(Clone, Debug, Default)]
pub struct Who {
    pub request_id: String,
    pub client_request_id: Option<String>,
    pub model: Option<String>,
    pub worker: Option<String>,
    pub prefill: Option<String>,
    pub decode: Option<String>,
    pub attempts: u32,
    /// The pairs (or workers) that continued the answer after its decode died, in order.
    pub resumed_on: Vec<ResumedOn>,
}

/// How the response ended.
pub struct Ending {
    pub status: u16,
    pub error: Option<String>,
    pub first_content: Option<Instant>,
    pub usage: Usage,
}

impl Account {
    /// The request's accounting as placed: `who` names the workers (kept only with a log).
    pub fn new(ctx: &Ctx, placement: &'static str, protocol: &'static str, who: impl FnOnce() -> Who) -> Self {
        let who = ctx.state.goodput.logging().then(|| {
            let mut w = who();
            w.request_id.clone_from(&ctx.request_id);
            w.client_request_id.clone_from(&ctx.client_request_id);
            w.model.clone_from(&ctx.req.model);
            Box::new(w)
        });
        Account { arrival: ctx.started, arrival_unix_s: ctx.arrival_unix_s, slo: ctx.slo, placement, protocol, route: ctx.route, streamed: ctx.req.stream, who, resumes: 0 }
    }

    /// The answer went on after a resume on the workers `cont` was placed on: the request log
    /// names them (the first attempt's workers stay the request's own).
    pub fn resumed(&mut self, cont: Option<Account>) {
        self.resumes += 1;
        if let (Some(mine), Some(theirs)) = (self.who.as_mut(), cont.and_then(|c| c.who)) {
            mine.resumed_on.push(ResumedOn { worker: theirs.worker, prefill: theirs.prefill, decode: theirs.decode });
        }
    }

    /// Records the finished request (metrics, goodput, log) at `now`.
    pub fn finish(self, state: &Exec, end: Ending, now: Instant) -> SloResult {
        let failed = end.error.is_some() || !(200..300).contains(&end.status);
        let e2e = now.saturating_duration_since(self.arrival);
        // A whole (non-streamed) answer brings its first token with it.
        let ttft = if self.streamed { end.first_content.map(|t| t.saturating_duration_since(self.arrival)) } else { (!failed).then_some(e2e) };
        let f = RequestFigures { e2e, ttft, streamed: self.streamed, prompt_tokens: end.usage.prompt, output_tokens: end.usage.output, cached_tokens: end.usage.cached, failed };
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1000.0;
        let Account { arrival_unix_s, slo, placement, protocol, route, streamed, who, resumes, .. } = self;
        // The placement cost model's decode step: a disaggregated stream's measured TPOT.
        if placement == "disaggregated" && !f.failed && f.output_tokens.is_some_and(|n| n >= 2) {
            if let Some(tpot) = f.tpot() {
                state.placer.observe_decode_step(ms(tpot));
            }
        }
        state.goodput.record(&state.metrics.slo, placement, &f, &slo, |result| {
            let who = who.map(|w| *w).unwrap_or_default();
            Finished {
                arrival_unix_s,
                request_id: who.request_id,
                client_request_id: who.client_request_id,
                route,
                model: who.model,
                stream: streamed,
                placement,
                protocol,
                worker: who.worker,
                prefill: who.prefill,
                decode: who.decode,
                prompt_tokens: f.prompt_tokens,
                output_tokens: f.output_tokens,
                cached_tokens: f.cached_tokens,
                ttft_ms: f.ttft.map(ms),
                tpot_ms: f.tpot().map(ms),
                e2e_ms: ms(e2e),
                slo_ttft_ms: slo.ttft_ms,
                slo_tpot_ms: slo.tpot_ms,
                slo_result: result.as_str(),
                status: end.status,
                error: end.error,
                attempts: who.attempts,
                resumes,
                resumed_on: who.resumed_on,
            }
        })
    }
}

#[cfg(test)]
#[path = "accounting_tests.rs"]
mod tests;
