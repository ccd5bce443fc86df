//! The resume tracker's fast path: what [`Progress::observe`] learns from an OpenAI stream
//! event, read by a structural scan of its bytes instead of a `serde_json::Value` parse and
//! re-serialisation (which cost ~10 µs per relayed chunk). The ids the client did not ask for
//! are cut out of the bytes; everything else goes out as the engine wrote it.
//!
//! The scan only handles the common shape: one `data:` line holding an object whose keys are
//! plain (no escapes), `choices` an array of objects, no `prompt_token_ids` (the first event
//! carries them: it takes the slow path, and so does anything this scan does not recognise).
//! It never guesses: `None` sends the event down the slow path.

use serde_json::Value;

use super::{set, Progress};

/// What one event taught, and the byte ranges (of its payload) to cut.
#[derive(Default)]
struct Learned {
    ids: Vec<u32>,
    text_without_ids: bool,
    finished: bool,
    had_usage: bool,
    all_empty: bool,
    cuts: Vec<(usize, usize)>,
}

struct Scan<'a> {
    b: &'a [u8],
    i: usize,
}

impl<'a> Scan<'a> {
    fn ws(&mut self) {
        while self.i < self.b.len() && matches!(self.b[self.i], b' ' | b'\t' | b'\n' | b'\r') {
            self.i += 1;
        }
    }

    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn eat(&mut self, c: u8) -> Option<()> {
        self.ws();
        (self.peek()? == c).then(|| self.i += 1)
    }

    /// A string at the cursor: its raw content (escapes left as they are).
    fn string(&mut self) -> Option<&'a [u8]> {
        self.ws();
        if self.peek()? != b'"' {
            return None;
        }
        let start = self.i + 1;
        let mut j = start;
        while j < self.b.len() {
            match self.b[j] {
                b'\\' => j += 2,
                b'"' => {
                    self.i = j + 1;
                    return Some(&self.b[start..j]);
                }
                _ => j += 1,
            }
        }
        None
    }

    /// Skips one value; returns its range.
    fn value(&mut self) -> Option<(usize, usize)> {
        self.ws();
        let start = self.i;
        match self.peek()? {
            b'"' => {
                self.string()?;
            }
            b'{' | b'[' => {
                let mut depth = 0usize;
                while self.i < self.b.len() {
                    match self.b[self.i] {
                        b'"' => {
                            self.string()?;
                            continue;
                        }
                        b'{' | b'[' => depth += 1,
                        b'}' | b']' => {
                            depth -= 1;
                            if depth == 0 {
                                self.i += 1;
                                return Some((start, self.i));
                            }
                        }
                        _ => {}
                    }
                    self.i += 1;
                }
                return None;
            }
            _ => {
                while self.i < self.b.len() && !matches!(self.b[self.i], b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r') {
                    self.i += 1;
                }
                if self.i == start {
                    return None;
                }
            }
        }
        Some((start, self.i))
    }

    /// Walks the object at the cursor: `f(scan, key, key_start, before)` is called with the
    /// cursor at the member's value and must consume it; `before` is the comma that precedes
    /// the member, if any. Keys with escapes are refused.
    fn object(&mut self, mut f: impl FnMut(&mut Self, &'a [u8], usize, Option<usize>) -> Option<()>) -> Option<()> {
        self.eat(b'{')?;
        self.ws();
        if self.peek()? == b'}' {
            self.i += 1;
            return Some(());
        }
        let mut before = None;
        loop {
            self.ws();
            let key_start = self.i;
            let key = self.string()?;
            if key.contains(&b'\\') {
                return None;
            }
            self.eat(b':')?;
            f(self, key, key_start, before)?;
            self.ws();
            match self.peek()? {
                b',' => {
                    before = Some(self.i);
                    self.i += 1;
                }
                b'}' => {
                    self.i += 1;
                    return Some(());
                }
                _ => return None,
            }
        }
    }
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

/// One choice object: its ids, whether it has text without ids, and whether it is empty once
/// the ids are gone.
fn choice(s: &mut Scan<'_>, keep: bool, out: &mut Learned) -> Option<bool> {
    let (mut ids, mut text, mut content, mut delta, mut finish, mut logprobs) = (None, None, None, None, false, false);
    let mut seen = 0u8;
    s.object(|s, key, key_start, before| {
        let bit = match key {
            b"prompt_token_ids" => return None,
            b"token_ids" => 1,
            b"text" => 2,
            b"delta" => 4,
            b"finish_reason" => 8,
            b"logprobs" => 16,
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
                ids = Some(serde_json::from_slice::<Vec<u32>>(raw).ok());
                if !keep {
                    out.cuts.push(member_cut(s.b, key_start, z, before));
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
    let ids = ids.flatten();
    out.text_without_ids |= ids.is_none() && has_text;
    out.ids.extend(ids.unwrap_or_default());
    out.finished |= finish;
    let no_text = match delta {
        Some(empty) => empty,
        None => text.is_some_and(|(a, z)| &s.b[a..z] == b"\"\""),
    };
    Some(no_text && !finish && !logprobs)
}

impl Scan<'_> {
    fn peek_after_ws(&mut self) -> Option<u8> {
        self.ws();
        self.peek()
    }

    fn i_after_ws(&mut self) -> usize {
        self.ws();
        self.i
    }
}

fn learn(payload: &[u8], head_has: impl Fn(&str) -> bool, keep: bool) -> Option<Learned> {
    let mut s = Scan { b: payload, i: 0 };
    let mut out = Learned::default();
    let mut choices_seen = false;
    s.object(|s, key, _, _| {
        match key {
            b"prompt_token_ids" => return None,
            b"id" | b"created" | b"model" | b"object" if !head_has(std::str::from_utf8(key).ok()?) => return None,
            b"usage" => {
                let (a, z) = s.value()?;
                out.had_usage = raw_set(&s.b[a..z]);
            }
            b"choices" if s.peek_after_ws() == Some(b'[') => {
                if choices_seen {
                    return None;
                }
                choices_seen = true;
                s.i += 1;
                let (mut n, mut empty) = (0, true);
                loop {
                    match s.peek_after_ws()? {
                        b']' => {
                            s.i += 1;
                            break;
                        }
                        b',' if n > 0 => s.i += 1,
                        _ if n > 0 => return None,
                        _ => {}
                    }
                    n += 1;
                    if s.peek_after_ws()? == b'{' {
                        empty &= choice(s, keep, &mut out)?;
                    } else {
                        s.value()?;
                    }
                }
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
    /// Learns from one raw event (`data: {...}`, its separator excluded) of the first stream
    /// without parsing it into a `Value`; `None` when the slow path must read it. A cut event
    /// is written straight into `out` (no buffer of its own per chunk).
    pub(super) fn observe_raw(&mut self, raw: &[u8], out: &mut Vec<u8>) -> Option<Fast> {
        if self.native || self.head.is_empty() {
            return None;
        }
        let rest = raw.strip_prefix(b"data:")?;
        let payload = rest.strip_prefix(b" ").unwrap_or(rest);
        if payload.first() != Some(&b'{') || memchr_any(payload, b'\n', b'\r') {
            return None;
        }
        let keep = self.client_wants_ids;
        let learned = learn(payload, |k| self.head.contains_key(k), keep)?;
        self.generated.extend(learned.ids);
        self.ids_unknown |= learned.text_without_ids;
        self.finished |= learned.finished;
        if !(keep || learned.had_usage || !learned.all_empty) {
            return Some(Fast::Drop);
        }
        if learned.cuts.is_empty() {
            return Some(Fast::Same);
        }
        let offset = raw.len() - payload.len();
        out.extend_from_slice(&raw[..offset]);
        let mut at = 0;
        for (a, z) in learned.cuts {
            out.extend_from_slice(&payload[at..a]);
            at = z;
        }
        out.extend_from_slice(&payload[at..]);
        Some(Fast::Cut)
    }
}

fn memchr_any(b: &[u8], x: u8, y: u8) -> bool {
    b.iter().any(|&c| c == x || c == y)
}
