//! Incremental Server-Sent Events framing: bytes in, complete `data:` payloads out.
//!
//! Used where the gateway must read a stream (the prefill's SSE answer, logprob merging, usage
//! accounting); streams the gateway does not need to change are relayed as raw bytes, watched by
//! an [`SseScanner`] (event size bound, the terminating `[DONE]`) that copies nothing.

/// Splits a byte stream into events. Feed chunks as they arrive; take complete events.
#[derive(Debug, Default)]
pub struct SseDecoder {
    buf: Vec<u8>,
    /// Bytes of `buf` already searched for a boundary: each byte is looked at once, however
    /// small the chunks (rescanning from the start was quadratic in the event size).
    scanned: usize,
}

/// One event's `data` (multi-line data joined with `\n`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SseEvent {
    pub data: String,
}

impl SseEvent {
    pub fn is_done(&self) -> bool {
        self.data.trim() == "[DONE]"
    }
}

impl SseDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds bytes and returns the events they completed.
    pub fn feed(&mut self, chunk: &[u8]) -> Vec<SseEvent> {
        self.buf.extend_from_slice(chunk);
        let mut events = Vec::new();
        let mut start = 0;
        // A `\r\n\r\n` may straddle the previous chunk's end: back up three bytes.
        let mut from = self.scanned.saturating_sub(3);
        while let Some((end, sep)) = find_boundary(&self.buf[start..], from) {
            if let Some(ev) = parse_event(&self.buf[start..start + end]) {
                events.push(ev);
            }
            start += end + sep;
            from = 0;
        }
        self.buf.drain(..start);
        self.scanned = self.buf.len();
        events
    }

    /// Whatever is left when the stream ends (an event without its blank line).
    pub fn finish(&mut self) -> Option<SseEvent> {
        let raw = std::mem::take(&mut self.buf);
        self.scanned = 0;
        parse_event(&raw)
    }

    /// Bytes held back waiting for an event boundary.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }
}

/// An event (or a line) longer than the limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EventTooLong {
    pub limit: usize,
}

/// Watches a relayed stream without copying it: bounds the size of each event (and so of each
/// line) and notes whether the stream's last event was `data: [DONE]`. Constant memory.
#[derive(Clone, Debug)]
pub struct SseScanner {
    limit: usize,
    /// Bytes of the event in progress (since the last blank line).
    event_len: usize,
    /// The line in progress: its length and its first bytes (enough to recognise `[DONE]`).
    line_len: usize,
    line_head: [u8; LINE_HEAD],
    /// The last non-empty line ended was `data: [DONE]`.
    done: bool,
    /// Bytes since the start: the first `\r` of a `\r\n` pair is a line end of its own.
    prev_cr: bool,
}

const LINE_HEAD: usize = 16;

impl SseScanner {
    pub fn new(limit: usize) -> Self {
        SseScanner { limit, event_len: 0, line_len: 0, line_head: [0; LINE_HEAD], done: false, prev_cr: false }
    }

    /// Looks at the next bytes of the stream; fails once an event grows past the limit.
    pub fn scan(&mut self, chunk: &[u8]) -> Result<(), EventTooLong> {
        let mut i = 0;
        while i < chunk.len() {
            // The bytes up to the next line break extend the line in progress, as a run.
            let end = memchr::memchr2(b'\n', b'\r', &chunk[i..]).map_or(chunk.len(), |j| i + j);
            let run = &chunk[i..end];
            if !run.is_empty() {
                self.prev_cr = false;
                if self.line_len < LINE_HEAD {
                    let n = run.len().min(LINE_HEAD - self.line_len);
                    self.line_head[self.line_len..self.line_len + n].copy_from_slice(&run[..n]);
                }
                self.line_len += run.len();
                self.event_len += run.len();
                if self.event_len > self.limit {
                    return Err(EventTooLong { limit: self.limit });
                }
            }
            let Some(&b) = chunk.get(end) else { break };
            if b == b'\n' && self.prev_cr {
                self.prev_cr = false;
            } else {
                self.prev_cr = b == b'\r';
                self.end_line();
            }
            i = end + 1;
        }
        Ok(())
    }

    fn end_line(&mut self) {
        if self.line_len == 0 {
            self.event_len = 0;
            return;
        }
        let head = &self.line_head[..self.line_len.min(LINE_HEAD)];
        if let Some(data) = head.strip_prefix(b"data:") {
            self.done = self.line_len <= LINE_HEAD && data.trim_ascii() == b"[DONE]";
        }
        // Count the line break towards the event, so many short lines are bounded too.
        self.event_len += 1;
        self.line_len = 0;
    }

    /// Whether the stream, if it ended here, ended with `data: [DONE]` (a last line without
    /// its line break counts).
    pub fn saw_done(&self) -> bool {
        if self.line_len > 0 {
            let head = &self.line_head[..self.line_len.min(LINE_HEAD)];
            if let Some(data) = head.strip_prefix(b"data:") {
                return self.line_len <= LINE_HEAD && data.trim_ascii() == b"[DONE]";
            }
        }
        self.done
    }

    /// Whether the stream is between events: an event appended now is read as its own.
    pub fn at_boundary(&self) -> bool {
        self.event_len == 0 && self.line_len == 0
    }
}

/// Whether the first bytes of an answer can be the start of an SSE stream: a field line
/// (`data:`, `event:`, `id:`, `retry:`) or a comment (`:`), after optional blank lines or a
/// byte-order mark. A chunk too short to tell (`da`) is given the benefit of the doubt.
pub fn looks_like_sse(first: &[u8]) -> bool {
    let rest = first.strip_prefix("\u{feff}".as_bytes()).unwrap_or(first);
    let start = rest.iter().position(|b| !matches!(b, b'\r' | b'\n')).unwrap_or(rest.len());
    let rest = &rest[start..];
    if rest.is_empty() {
        return true;
    }
    [&b"data:"[..], b"event:", b"id:", b"retry:", b":"].iter().any(|field| rest.starts_with(field) || (rest.len() < field.len() && field.starts_with(rest)))
}

/// Position of the first blank line (`\n\n` or `\r\n\r\n`) at or after `from`, and its length.
pub fn find_boundary(buf: &[u8], from: usize) -> Option<(usize, usize)> {
    let mut i = from;
    while let Some(j) = memchr::memchr2(b'\n', b'\r', buf.get(i..)?) {
        let at = i + j;
        if buf[at] == b'\n' {
            if buf.get(at + 1) == Some(&b'\n') {
                return Some((at, 2));
            }
        } else if buf[at..].starts_with(b"\r\n\r\n") {
            return Some((at, 4));
        }
        i = at + 1;
    }
    None
}

pub(crate) fn parse_event(raw: &[u8]) -> Option<SseEvent> {
    let text = String::from_utf8_lossy(raw);
    let mut data: Vec<&str> = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("data:") {
            data.push(rest.strip_prefix(' ').unwrap_or(rest));
        }
    }
    if data.is_empty() {
        None
    } else {
        Some(SseEvent { data: data.join("\n") })
    }
}

/// Frames one payload as an SSE event.
pub fn frame(data: &str) -> String {
    format!("data: {data}\n\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_across_chunks_are_reassembled() {
        let mut d = SseDecoder::new();
        assert!(d.feed(b"data: {\"a\"").is_empty());
        let evs = d.feed(b":1}\n\ndata: [DONE]\n\n");
        assert_eq!(evs.len(), 2);
        assert_eq!(evs[0].data, "{\"a\":1}");
        assert!(evs[1].is_done());
        assert_eq!(d.pending(), 0);
    }

    #[test]
    fn crlf_comments_and_multiline_data() {
        let mut d = SseDecoder::new();
        let evs = d.feed(b": keepalive\r\n\r\ndata: one\r\ndata: two\r\n\r\n");
        assert_eq!(evs, vec![SseEvent { data: "one\ntwo".into() }]);
    }

    #[test]
    fn byte_at_a_time_matches_whole() {
        let input = b"data: x\n\ndata: y\n\ndata: [DONE]\n\n";
        let mut d = SseDecoder::new();
        let mut got = Vec::new();
        for b in input.iter() {
            got.extend(d.feed(std::slice::from_ref(b)));
        }
        assert_eq!(got.iter().map(|e| e.data.as_str()).collect::<Vec<_>>(), vec!["x", "y", "[DONE]"]);
        assert_eq!(d.finish(), None);
    }

    #[test]
    fn scanner_bounds_events_and_sees_done() {
        let mut s = SseScanner::new(64);
        s.scan(b"data: {\"a\":1}\n\n").unwrap();
        assert!(!s.saw_done() && s.at_boundary());
        s.scan(b"data: [DO").unwrap();
        assert!(!s.saw_done() && !s.at_boundary());
        s.scan(b"NE]\r\n\r\n").unwrap();
        assert!(s.saw_done() && s.at_boundary());
        let mut s = SseScanner::new(64);
        s.scan(b"data: [DONE]").unwrap();
        assert!(s.saw_done(), "a last line without its line break counts");
        let mut s = SseScanner::new(64);
        assert_eq!(s.scan(&[b'x'; 65]), Err(EventTooLong { limit: 64 }));
        let mut s = SseScanner::new(64);
        let many_lines = b"data: x\n".repeat(10);
        assert!(s.scan(&many_lines).is_err(), "many short lines without a blank line are one long event");
    }

    #[test]
    fn sse_starts() {
        assert!(looks_like_sse(b"data: x"));
        assert!(looks_like_sse(b"\n\n: comment"));
        assert!(looks_like_sse(b"d"));
        assert!(!looks_like_sse(b"<html>"));
        assert!(!looks_like_sse(b"{\"a\":1}"));
    }
}
