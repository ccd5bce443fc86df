//! The resume tracker's fast path: what [`Progress::observe`] learns from an OpenAI stream
//! event, read by a structural scan of its bytes instead of a `serde_json::Value` parse and
//! re-serialisation (which cost ~10 µs per relayed chunk). The ids the client did not ask for
//! are cut out of the bytes; everything else goes out as the engine wrote it.
//!
//! The scan only handles the common shape: one `data:` line holding an object whose keys are
//! plain (no escapes), `choices` an array of objects, each key once. The first event is read
//! this way too: its `prompt_token_ids` (at the top for chat, on the choice for completions)
//! and its envelope (`id`, `created`, `model`, `object`: small values, parsed once a stream).
//! It never guesses: `None` sends the event down the slow path, which reads anything else.

use serde_json::Value;

use super::{set, Progress};
use crate::json_scan::{event_object, Scan};

/// The envelope keys a continuation's chunks are rewritten to (`Progress::head` holds only
/// these): bit `i` of a mask is `HEAD_KEYS[i]`.
const HEAD_KEYS: [&str; 4] = ["id", "created", "model", "object"];

/// Byte ranges (of the payload) to cut: an event has at most a few (`token_ids` per choice,
/// `prompt_token_ids`); one with more takes the slow path.
#[derive(Default)]
struct Cuts {
    ranges: [(usize, usize); 4],
    n: usize,
}

impl Cuts {
    fn push(&mut self, r: (usize, usize)) -> Option<()> {
        *self.ranges.get_mut(self.n)? = r;
        self.n += 1;
        Some(())
    }

    fn as_slice(&self) -> &[(usize, usize)] {
        &self.ranges[..self.n]
    }
}

/// What one event taught (its generated ids went straight into the caller's list), and the
/// byte ranges (of its payload) to cut.
#[derive(Default)]
struct Learned {
    text_without_ids: bool,
    /// A choice carried text and exactly one id (`Progress::released`).
    released: bool,
    finished: bool,
    had_usage: bool,
    all_empty: bool,
    cuts: Cuts,
    /// `prompt_token_ids` (the first event's: at the top for chat, on the choice otherwise).
    prompt_ids: Option<Vec<u32>>,
    choice_prompt_ids: Option<Vec<u32>>,
    /// Envelope values the head does not have yet: their raw ranges, by `HEAD_KEYS` index.
    head: [Option<(usize, usize)>; 4],
}

fn raw_set(raw: &[u8]) -> bool {
    match raw {
        b"null" | b"false" | b"\"\"" | b"[]" => false,
        // A non-empty string (escapes and all), an object.
        b"true" | [b'"', ..] | [b'{', ..] => true,
        _ => serde_json::from_slice::<Value>(raw).ok().is_some_and(|v| set(Some(&v))),
    }
}

/// The range to cut for a member from `key_start` to `end`: with the comma before it, or the
/// comma after it when it is the object's first member.
fn member_cut(b: &[u8], key_start: usize, end: usize, before: Option<usize>) -> (usize, usize) {
    if let Some(comma) = before {
        return (comma, end);
    }
    let mut j = end;
    while j < b.len() && matches!(b[j], b' ' | b'\t' | b'\n' | b'\r') {
        j += 1;
    }
    if b.get(j) == Some(&b',') {
        (key_start, j + 1)
    } else {
        (key_start, end)
    }
}

/// A JSON array of token ids, appended to `to`; `false` (nothing appended) for anything else,
/// as `serde_json` would judge it (an id over `u32::MAX` included).
pub(super) fn parse_ids(raw: &[u8], to: &mut Vec<u32>) -> bool {
    let before = to.len();
    if plain_ids(raw, to).is_some() {
        return true;
    }
    to.truncate(before);
    // Not digits and commas only (an exponent, a leading zero, ...): serde_json decides.
    match serde_json::from_slice::<Vec<u32>>(raw) {
        Ok(ids) => {
            to.extend(ids);
            true
        }
        Err(_) => false,
    }
}

/// `[1, 2, 3]`: plain decimal ids, no leading zeros, each within `u32`.
fn plain_ids(raw: &[u8], to: &mut Vec<u32>) -> Option<()> {
    let mut s = Scan { b: raw, i: 0 };
    s.array(|s| {
        s.ws();
        let start = s.i;
        let mut n: u64 = 0;
        while let Some(d @ b'0'..=b'9') = s.peek() {
            n = n * 10 + u64::from(d - b'0');
            s.i += 1;
            if s.i - start > 10 {
                return None;
            }
        }
        if s.i == start || (raw[start] == b'0' && s.i - start > 1) {
            return None;
        }
        to.push(u32::try_from(n).ok()?);
        Some(())
    })?;
    s.ws();
    (s.i == raw.len()).then_some(())
}

/// One choice object: its ids (appended to `generated`), its prompt's ids, whether it has text
/// without ids, and whether it is empty once the ids are gone.
fn choice(s: &mut Scan<'_>, keep: bool, out: &mut Learned, generated: &mut Vec<u32>) -> Option<bool> {
    let (mut ids, mut text, mut content, mut delta, mut finish, mut logprobs) = (None, None, None, None, false, false);
    let before = generated.len();
    let mut seen = 0u8;
    s.object(|s, key, key_start, before| {
        let bit = match key {
            b"token_ids" => 1,
            b"text" => 2,
            b"delta" => 4,
            b"finish_reason" => 8,
            b"logprobs" => 16,
            b"prompt_token_ids" => 32,
            _ => 0,
        };
        if seen & bit != 0 {
            return None; // a repeated key: the slow path decides which one counts
        }
        seen |= bit;
        let (a, z) = match key {
            b"delta" if s.peek_after_ws() == Some(b'{') => {
                let a = s.i_after_ws();
                let mut members = 0;
                s.object(|s, k, _, _| {
                    members += 1;
                    let r = s.value()?;
                    if k == b"content" {
                        content = Some(r);
                    }
                    Some(())
                })?;
                delta = Some(members == 0);
                (a, s.i)
            }
            _ => s.value()?,
        };
        let raw = &s.b[a..z];
        match key {
            b"token_ids" => {
                ids = Some(parse_ids(raw, generated));
                if !keep {
                    out.cuts.push(member_cut(s.b, key_start, z, before))?;
                }
            }
            b"prompt_token_ids" => {
                let mut prompt = Vec::new();
                if !parse_ids(raw, &mut prompt) {
                    return None; // not ids: the slow path decides
                }
                out.choice_prompt_ids.get_or_insert(prompt);
                if !keep {
                    out.cuts.push(member_cut(s.b, key_start, z, before))?;
                }
            }
            b"text" => text = Some((a, z)),
            b"delta" if delta.is_none() => delta = Some(false), // not an object
            b"finish_reason" => finish = raw_set(raw),
            b"logprobs" => logprobs = raw_set(raw),
            _ => {}
        }
        Some(())
    })?;
    let nonempty_str = |r: Option<(usize, usize)>| r.is_some_and(|(a, z)| s.b[a] == b'"' && z - a > 2);
    // As the slow path: `text`, else the delta's `content`.
    let has_text = if text.is_some() { nonempty_str(text) } else { nonempty_str(content) };
    out.text_without_ids |= ids != Some(true) && has_text;
    match (has_text, generated.len() - before) {
        (true, 1) => out.released = true,
        // Text of several ids: the slow path keeps it (where that text stops is unknown).
        (true, n) if n > 1 => return None,
        _ => {}
    }
    out.finished |= finish;
    let no_text = match delta {
        Some(empty) => empty,
        None => text.is_some_and(|(a, z)| &s.b[a..z] == b"\"\""),
    };
    Some(no_text && !finish && !logprobs)
}

/// `known`: the `HEAD_KEYS` (bits) the head has already; the event's generated ids are
/// appended to `generated` (the caller takes them back when this returns `None`).
fn learn(payload: &[u8], known: u8, keep: bool, generated: &mut Vec<u32>) -> Option<Learned> {
    let mut s = Scan { b: payload, i: 0 };
    let mut out = Learned::default();
    let mut choices_seen = false;
    let mut top_prompt_ids = None;
    s.object(|s, key, key_start, before| {
        match key {
            b"prompt_token_ids" => {
                let (a, z) = s.value()?;
                let mut prompt = Vec::new();
                if top_prompt_ids.is_some() || !parse_ids(&s.b[a..z], &mut prompt) {
                    return None; // repeated, or not ids: the slow path decides
                }
                top_prompt_ids = Some(prompt);
                if !keep {
                    out.cuts.push(member_cut(s.b, key_start, z, before))?;
                }
            }
            b"id" | b"created" | b"model" | b"object" => {
                let k = HEAD_KEYS.iter().position(|h| h.as_bytes() == key)?;
                let r = s.value()?;
                if known & (1 << k) == 0 {
                    if out.head[k].is_some() {
                        return None; // repeated before the head knew it
                    }
                    out.head[k] = Some(r);
                }
            }
            b"usage" => {
                let (a, z) = s.value()?;
                out.had_usage = raw_set(&s.b[a..z]);
            }
            b"choices" if s.peek_after_ws() == Some(b'[') => {
                if choices_seen {
                    return None;
                }
                choices_seen = true;
                let mut empty = true;
                let n = s.array(|s| {
                    if s.peek_after_ws()? == b'{' {
                        empty &= choice(s, keep, &mut out, generated)?;
                    } else {
                        s.value()?;
                    }
                    Some(())
                })?;
                out.all_empty = n > 0 && empty;
            }
            b"choices" => return None,
            _ => {
                s.value()?;
            }
        }
        Some(())
    })?;
    s.ws();
    // As the slow path: the chunk's own ids (chat) before a choice's (completions).
    out.prompt_ids = top_prompt_ids.or(out.choice_prompt_ids.take());
    (s.i == payload.len()).then_some(out)
}

/// The fast path's verdict on one event.
pub(super) enum Fast {
    /// The event goes out as it came.
    Same,
    /// The event, its ids cut, was appended to the caller's buffer (its separator not).
    Cut,
    /// Nothing in it for the client.
    Drop,
}

impl Progress {
    /// The `HEAD_KEYS` the head has, as bits.
    fn head_mask(&self) -> u8 {
        HEAD_KEYS.iter().enumerate().filter(|(_, k)| self.head.contains_key(**k)).fold(0, |m, (i, _)| m | 1 << i)
    }

    /// Learns from one raw event (`data: {...}`, its separator excluded) of the first stream
    /// without parsing it into a `Value`; `None` when the slow path must read it. A cut event
    /// is written straight into `out` (no buffer of its own per chunk).
    pub(super) fn observe_raw(&mut self, raw: &[u8], out: &mut Vec<u8>) -> Option<Fast> {
        if self.native {
            return None;
        }
        let payload = event_object(raw)?;
        let keep = self.client_wants_ids;
        // Four map lookups per event only until the head is whole (it holds nothing else).
        let known = if self.head.len() == HEAD_KEYS.len() { 0b1111 } else { self.head_mask() };
        let before = self.generated.len();
        let learned = learn(payload, known, keep, &mut self.generated);
        // The envelope, once per stream: small values, parsed as the slow path keeps them.
        let head: Option<Vec<(usize, Value)>> =
            learned.as_ref().and_then(|l| l.head.iter().enumerate().filter_map(|(k, r)| r.map(|(a, z)| serde_json::from_slice(&payload[a..z]).ok().map(|v| (k, v)))).collect());
        let (Some(learned), Some(head)) = (learned, head) else {
            self.generated.truncate(before);
            return None;
        };
        for (k, v) in head {
            self.head.insert(HEAD_KEYS[k].to_string(), v);
        }
        if let Some(ids) = learned.prompt_ids {
            self.prompt_ids.get_or_insert(ids);
        }
        self.ids_unknown |= learned.text_without_ids;
        self.finished |= learned.finished;
        self.sent_ids = self.generated.len();
        if learned.released {
            self.released = self.generated.len();
            self.text_after.clear();
        }
        if !(keep || learned.had_usage || !learned.all_empty) {
            return Some(Fast::Drop);
        }
        if learned.cuts.n == 0 {
            return Some(Fast::Same);
        }
        let offset = raw.len() - payload.len();
        out.extend_from_slice(&raw[..offset]);
        let mut at = 0;
        for &(a, z) in learned.cuts.as_slice() {
            out.extend_from_slice(&payload[at..a]);
            at = z;
        }
        out.extend_from_slice(&payload[at..]);
        Some(Fast::Cut)
    }
}
