//! A usual chat chunk, read from its bytes: the fast path of the stream translators (Messages,
//! Responses). A chat stream is mostly chunks of one choice whose delta is a piece of text, then
//! a finish reason and the usage; parsing each into a `serde_json::Value` cost more than the rest
//! of the translation. Strings are taken as the raw JSON string contents they are (escapes and
//! all) and written into the translated events as they are, neither decoded nor encoded. Anything else (tool calls,
//! reasoning, an error, several choices, a repeated key, an escaped finish reason) is `None`:
//! the caller parses.

use crate::json_scan::{event_object, Scan};
use crate::sse::{find_boundary, parse_event, SseDecoder};

/// Every event payload that `bytes` completes, to `f`, in order: whole events are read where
/// they lie (the relay hands over whole events, mostly); only a part event waits in `decoder`,
/// and what follows it goes through there too. The stream translators' shared reading.
pub(crate) fn each_payload(decoder: &mut SseDecoder, bytes: &[u8], mut f: impl FnMut(&[u8])) {
    let mut start = 0;
    if decoder.pending() == 0 {
        while let Some((end, sep)) = find_boundary(&bytes[start..], 0) {
            let raw = &bytes[start..start + end];
            match event_object(raw) {
                Some(payload) => f(payload),
                // The stream's end, as every engine writes it: not worth a parse.
                None if raw == b"data: [DONE]" => f(b"[DONE]"),
                None => {
                    if let Some(ev) = parse_event(raw) {
                        f(ev.data.as_bytes());
                    }
                }
            }
            start += end + sep;
        }
    }
    if start < bytes.len() {
        for ev in decoder.feed(&bytes[start..]) {
            f(ev.data.as_bytes());
        }
    }
}

/// What the translator needs of a usual chunk.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Chunk<'a> {
    /// The top-level `id` (raw string contents).
    pub id: Option<&'a [u8]>,
    /// The top-level `model` when a string (raw string contents).
    pub model: Option<&'a [u8]>,
    /// `choices[0].delta.content` (raw string contents).
    pub text: Option<&'a [u8]>,
    /// `choices[0].finish_reason` when not null (no escapes).
    pub finish: Option<&'a [u8]>,
    /// `choices[0].stop_reason` when not null: the raw JSON value (vLLM's matched stop).
    pub stop_reason: Option<&'a [u8]>,
    /// `usage` when not null: the raw JSON object.
    pub usage: Option<&'a [u8]>,
}

/// The chunk in one event's data; `None` when it is not of the usual shape. (The translators
/// read through a [`ChunkReader`]; the tests compare its shortcuts with this.)
#[cfg(test)]
pub(crate) fn usual_chunk(payload: &[u8]) -> Option<Chunk<'_>> {
    usual_chunk_at(payload).map(|(c, _)| c)
}

/// Where a chunk's parts lie, for [`ChunkReader`]'s template.
#[derive(Debug, Default, Clone, Copy)]
struct Places {
    /// The `choices` array: its `[` and the byte after its `]`.
    choices: (usize, usize),
    /// Whether the chunk has a `usage` key (`null` included).
    usage_key: bool,
    /// The `null` of `choices[0].finish_reason`.
    finish_null: Option<usize>,
}

/// [`usual_chunk`], and where its parts lie.
fn usual_chunk_at(payload: &[u8]) -> Option<(Chunk<'_>, Places)> {
    if payload.first() != Some(&b'{') {
        return None;
    }
    let mut s = Scan { b: payload, i: 0 };
    let (mut c, mut seen, mut at) = (Chunk::default(), 0u8, Places::default());
    s.object(|s, key, _, _| match key {
        b"choices" => {
            once(&mut seen, 1)?;
            let open = s.i_after_ws();
            let n = s.array(|s| choice(s, &mut c, &mut at.finish_null))?;
            at.choices = (open, s.i);
            (n <= 1).then_some(())
        }
        b"id" => {
            once(&mut seen, 2)?;
            c.id = Some(s.string()?);
            Some(())
        }
        b"usage" => {
            once(&mut seen, 4)?;
            c.usage = non_null(s)?;
            Some(())
        }
        b"model" => {
            once(&mut seen, 8)?;
            match s.peek_after_ws()? {
                b'"' => c.model = Some(s.string()?),
                _ => drop(s.value()?),
            }
            Some(())
        }
        b"error" => None,
        _ => s.value().map(drop),
    })?;
    s.ws();
    at.usage_key = seen & 4 != 0;
    (s.i == payload.len() && seen & 1 == 1).then_some((c, at))
}

fn once(seen: &mut u8, bit: u8) -> Option<()> {
    if *seen & bit != 0 {
        return None;
    }
    *seen |= bit;
    Some(())
}

/// A member's raw value, `None` inside for `null`.
fn non_null<'a>(s: &mut Scan<'a>) -> Option<Option<&'a [u8]>> {
    let (a, z) = s.value()?;
    let raw = &s.b[a..z];
    Some((raw != b"null").then_some(raw))
}

fn choice<'a>(s: &mut Scan<'a>, c: &mut Chunk<'a>, finish_null: &mut Option<usize>) -> Option<()> {
    let mut seen = 0u8;
    s.object(|s, key, _, _| match key {
        b"finish_reason" => {
            once(&mut seen, 1)?;
            match s.peek_after_ws()? {
                b'"' => {
                    let f = s.string()?;
                    c.finish = (!f.contains(&b'\\')).then_some(f);
                    c.finish.map(drop)
                }
                _ => {
                    *finish_null = Some(s.i);
                    non_null(s)?.is_none().then_some(())
                }
            }
        }
        b"stop_reason" => {
            once(&mut seen, 2)?;
            c.stop_reason = non_null(s)?;
            Some(())
        }
        b"delta" => {
            once(&mut seen, 4)?;
            s.object(|s, k, _, _| match k {
                b"content" => {
                    once(&mut seen, 8)?;
                    match s.peek_after_ws()? {
                        b'"' => {
                            c.text = Some(s.string()?);
                            Some(())
                        }
                        _ => non_null(s)?.is_none().then_some(()),
                    }
                }
                b"role" => {
                    once(&mut seen, 16)?;
                    s.value().map(drop)
                }
                _ => None,
            })
        }
        b"index" | b"logprobs" | b"token_ids" => s.value().map(drop),
        _ => None,
    })
}

/// Reads a stream's chunks: [`usual_chunk`], with shortcuts for the chunks after the first text
/// chunk. An engine writes every chunk of a stream alike (the same id, model, fields and order),
/// so once one text chunk was read in full (the template), a chunk whose bytes are the
/// template's but for the text and the finish reason (a JSON string's contents, and `null` or
/// a plain string) is that chunk with another text and finish reason, and one whose bytes are
/// the template's with an empty `choices` array, then `,"usage":` and one JSON object before
/// the closing brace, is the usage chunk: no walk over the rest. Anything else is read in full.
#[derive(Debug, Default)]
pub(crate) struct ChunkReader {
    template: Option<Template>,
}

#[derive(Debug)]
struct Template {
    /// A text chunk read in full (no finish reason, stop reason or usage).
    bytes: Vec<u8>,
    /// Where its text lies in it.
    text: (usize, usize),
    /// Where its finish reason's `null` lies, when after the text.
    finish_null: Option<usize>,
    /// Where its `choices` array lies: its `[` and the byte after its `]` (`None` when the
    /// template has a `usage` key: the usage chunk would have two).
    choices: Option<(usize, usize)>,
}

impl ChunkReader {
    pub(crate) fn read<'a>(&mut self, payload: &'a [u8]) -> Option<Chunk<'a>> {
        if let Some(c) = self.template.as_ref().and_then(|t| t.same_but_text(payload).or_else(|| t.usage_chunk(payload))) {
            return Some(c);
        }
        let (c, at) = usual_chunk_at(payload)?;
        // A text chunk (not the first, empty one with the role) is the next template.
        if c.finish.is_none() && c.stop_reason.is_none() && c.usage.is_none() {
            if let Some(text) = c.text.filter(|t| !t.is_empty()) {
                let start = text.as_ptr() as usize - payload.as_ptr() as usize;
                let end = start + text.len();
                let finish_null = at.finish_null.filter(|&f| f > end);
                let choices = (!at.usage_key).then_some(at.choices);
                self.template = Some(Template { bytes: payload.to_vec(), text: (start, end), finish_null, choices });
            }
        }
        Some(c)
    }
}

impl Template {
    /// A chunk that is the template but for its text and finish reason.
    fn same_but_text<'a>(&self, payload: &'a [u8]) -> Option<Chunk<'a>> {
        let t = &self.bytes;
        let (start, end) = self.text;
        let prefix = &t[..start];
        let (middle, suffix) = match self.finish_null {
            Some(f) => (&t[end..f], &t[f + 4..]),
            None => (&t[end..end], &t[end..]),
        };
        if payload.len() < prefix.len() + middle.len() + suffix.len() || !payload.starts_with(prefix) || !payload.ends_with(suffix) {
            return None;
        }
        // The string that opens at the prefix's closing quote must close where the suffix starts
        // or, when the template has a finish reason after the text, where the bytes up to it
        // start; then comes the finish reason (`null` or a plain string), then the suffix.
        let suffix_at = payload.len() - suffix.len();
        let mut s = Scan { b: payload, i: prefix.len().checked_sub(1)? };
        let text = s.string()?;
        let close = s.i - 1;
        let mut c = Chunk { text: Some(text), ..Chunk::default() };
        if self.finish_null.is_none() {
            return (close == suffix_at).then_some(c);
        }
        // `middle` starts with the text's closing quote.
        let finish = payload.get(close..suffix_at)?.strip_prefix(middle)?;
        match finish {
            b"null" => {}
            [b'"', inner @ .., b'"'] if !inner.iter().any(|&b| b == b'"' || b == b'\\') => c.finish = Some(inner),
            _ => return None,
        }
        Some(c)
    }

    /// The usage chunk: the template's bytes with no choice, and the usage as its last member.
    fn usage_chunk<'a>(&self, payload: &'a [u8]) -> Option<Chunk<'a>> {
        let (open, close) = self.choices?;
        let t = &self.bytes;
        // `t` ends with its object's `}`.
        let rest = payload.strip_prefix(&t[..=open])?.strip_prefix(b"]")?.strip_prefix(&t[close..t.len() - 1])?.strip_prefix(br#","usage":"#)?;
        let mut s = Scan { b: rest, i: 0 };
        if s.peek()? != b'{' {
            return None;
        }
        let (a, z) = s.value()?;
        (&rest[z..] == b"}").then(|| Chunk { usage: Some(&rest[a..z]), ..Chunk::default() })
    }
}

#[cfg(test)]
mod tests {
    use super::{usual_chunk, Chunk, ChunkReader};

    #[test]
    fn reads_the_usual_chunks_and_refuses_the_rest() {
        let usual =
            br#"{"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"a\"b\\n"},"logprobs":null,"finish_reason":null}]}"#;
        assert_eq!(usual_chunk(usual), Some(Chunk { id: Some(b"c1"), model: Some(b"m"), text: Some(br#"a\"b\\n"#), ..Chunk::default() }));
        let last = br#"{"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"stop","stop_reason":"END"}],"usage":null}"#;
        assert_eq!(usual_chunk(last), Some(Chunk { id: Some(b"c"), finish: Some(b"stop"), stop_reason: Some(br#""END""#), ..Chunk::default() }));
        let usage = br#"{"id":"c","choices":[],"usage":{"prompt_tokens":1}}"#;
        assert_eq!(usual_chunk(usage), Some(Chunk { id: Some(b"c"), usage: Some(br#"{"prompt_tokens":1}"#), ..Chunk::default() }));
        for other in [
            &br#"{"choices":[{"delta":{"tool_calls":[]}}]}"#[..],
            br#"{"choices":[{"delta":{"reasoning_content":"r"}}]}"#,
            br#"{"choices":[{"delta":{"content":"a","content":"b"}}]}"#,
            br#"{"choices":[{"delta":{"content":"a"}},{"delta":{"content":"b"}}]}"#,
            br#"{"choices":[{"delta":{"content":"a"},"finish_reason":"st\u006fp"}]}"#,
            br#"{"error":{"message":"x"}}"#,
            br#"{"id":"c"}"#,
            b"[DONE]",
        ] {
            assert_eq!(usual_chunk(other), None, "{}", String::from_utf8_lossy(other));
        }
    }

    #[test]
    fn a_reader_takes_the_text_of_chunks_like_the_first_and_reads_any_other_in_full() {
        let chunk = |text: &str, finish: &str| {
            format!(r#"{{"id":"c","model":"m","choices":[{{"index":0,"delta":{{"content":{}}},"finish_reason":{finish}}}]}}"#, serde_json::to_string(text).unwrap_or_default())
        };
        let mut r = ChunkReader::default();
        let role = r#"{"id":"c","model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}"#;
        assert_eq!(r.read(role.as_bytes()).map(|c| c.text), Some(Some(&b""[..])));
        for (i, text) in ["first", "", "a\"b", "tail\\", "\"", "é ü", "x"].into_iter().enumerate() {
            let raw = chunk(text, "null");
            let want = usual_chunk(raw.as_bytes()).map(|c| c.text);
            let got = r.read(raw.as_bytes());
            assert_eq!(got.as_ref().map(|c| c.text), want, "{raw}");
            if i > 0 {
                assert_eq!(got.map(|c| c.id), Some(None), "after the first: the shortcut");
            }
        }
        // Not the template's shape: read in full, with everything it says.
        let last = chunk("", r#""stop""#);
        assert_eq!(r.read(last.as_bytes()).and_then(|c| c.finish), Some(&b"stop"[..]));
        // The template's bytes around something that is not one string: read in full.
        let trick = chunk("PLACE", "null").replace("PLACE", r#"a","x":"b"#);
        assert_eq!(r.read(trick.as_bytes()), None);
        assert_eq!(usual_chunk(trick.as_bytes()), None);
        let other = r#"{"id":"d","choices":[{"index":0,"delta":{"content":"z"}}]}"#;
        assert_eq!(r.read(other.as_bytes()).and_then(|c| c.id), Some(&b"d"[..]));
    }

    /// The finish chunk and the usage chunk of a stream like the template's are read by their
    /// bytes, to what a full read says of them; any other shape is read in full.
    #[test]
    fn a_reader_takes_the_finish_and_usage_chunks_by_their_bytes() {
        let head = r#"{"id":"c","object":"chat.completion.chunk","created":0,"model":"m","#;
        let chunk = |text: &str, finish: &str| format!(r#"{head}"choices":[{{"index":0,"delta":{{"content":"{text}"}},"logprobs":null,"finish_reason":{finish}}}]}}"#);
        let mut r = ChunkReader::default();
        let first = chunk("a", "null");
        assert_eq!(r.read(first.as_bytes()), usual_chunk(first.as_bytes()), "the template, read in full");
        let fast = |r: &mut ChunkReader, raw: &str| {
            let got = r.read(raw.as_bytes());
            let full = usual_chunk(raw.as_bytes());
            // The shortcut leaves out what the template said already (id, model).
            assert_eq!(got.as_ref().map(|c| (c.text, c.finish, c.stop_reason, c.usage)), full.as_ref().map(|c| (c.text, c.finish, c.stop_reason, c.usage)), "{raw}");
            got.map(|c| c.id.is_some())
        };
        for (text, finish) in [("b", "null"), (r#"x\"y"#, r#""length""#), ("", r#""stop""#)] {
            assert_eq!(fast(&mut r, &chunk(text, finish)), Some(false), "by its bytes: {text} {finish}");
        }
        let usage = format!(r#"{head}"choices":[],"usage":{{"prompt_tokens":8,"prompt_tokens_details":{{"cached_tokens":8}}}}}}"#);
        assert_eq!(fast(&mut r, &usage), Some(false), "the usage chunk by its bytes");
        // Keys in another order (serde_json's sorted ones): the usage is still the last member.
        let mut sorted = ChunkReader::default();
        let first = r#"{"choices":[{"delta":{"content":"a"},"finish_reason":null,"index":0}],"id":"c","model":"m"}"#;
        assert!(sorted.read(first.as_bytes()).is_some());
        let usage = r#"{"choices":[],"id":"c","model":"m","usage":{"prompt_tokens":8}}"#;
        assert_eq!(fast(&mut sorted, usage), Some(false), "the usage chunk by its bytes");
        // Not the template's shape around the finish reason or the usage: read in full.
        for other in [
            chunk("b", r#""st\u006fp""#),
            chunk("b", r#""a","x":"b""#),
            chunk("b", "1"),
            chunk(r#"a","x":"b"#, "null"),
            format!(r#"{head}"choices":[],"usage":{{"prompt_tokens":8}},"x":1}}"#),
            format!(r#"{head}"choices":[],"usage":null}}"#),
            format!(r#"{head}"choices":[{{"index":0,"delta":{{}}}}],"usage":{{"prompt_tokens":8}}}}"#),
        ] {
            assert_eq!(fast(&mut r, &other), usual_chunk(other.as_bytes()).map(|c| c.id.is_some()), "{other}");
        }
        // A template with the usage before the choices takes no usage shortcut.
        let mut r = ChunkReader::default();
        let first = r#"{"id":"c","usage":null,"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}"#;
        assert!(r.read(first.as_bytes()).is_some());
        let twice = r#"{"id":"c","usage":null,"choices":[],"usage":{"prompt_tokens":1}}"#;
        assert_eq!(r.read(twice.as_bytes()), None, "a repeated key is not the usual shape");
    }
}
