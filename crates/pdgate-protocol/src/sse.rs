//! Incremental Server-Sent Events framing: bytes in, complete `data:` payloads out.
//!
//! Used where the gateway must read a stream (the prefill's SSE answer, logprob merging, usage
//! accounting); streams the gateway does not need to change are relayed as raw bytes.

/// Splits a byte stream into events. Feed chunks as they arrive; take complete events.
#[derive(Debug, Default)]
pub struct SseDecoder {
    buf: Vec<u8>,
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
        while let Some((end, sep)) = find_boundary(&self.buf) {
            let raw: Vec<u8> = self.buf.drain(..end + sep).collect();
            if let Some(ev) = parse_event(&raw[..end]) {
                events.push(ev);
            }
        }
        events
    }

    /// Whatever is left when the stream ends (an event without its blank line).
    pub fn finish(&mut self) -> Option<SseEvent> {
        let raw = std::mem::take(&mut self.buf);
        parse_event(&raw)
    }

    /// Bytes held back waiting for an event boundary.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }
}

/// Position of the first blank line (`\n\n` or `\r\n\r\n`) and its length.
fn find_boundary(buf: &[u8]) -> Option<(usize, usize)> {
    let mut i = 0;
    while i + 1 < buf.len() {
        if buf[i] == b'\n' && buf[i + 1] == b'\n' {
            return Some((i, 2));
        }
        if buf[i] == b'\r' && buf[i..].starts_with(b"\r\n\r\n") {
            return Some((i, 4));
        }
        i += 1;
    }
    None
}

fn parse_event(raw: &[u8]) -> Option<SseEvent> {
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
}
