//! Property tests of SSE framing, which every relayed stream crosses: any chunking of a stream
//! decodes to the same events, the decoder holds back at most one event, the scanner's verdict
//! (size limit, `[DONE]`) does not depend on chunking, and arbitrary bytes never panic. 256
//! cases by default; `PROPTEST_CASES=100000 cargo test -p pdgate-protocol --test fuzz_sse`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

use pdgate_protocol::sse::{looks_like_sse, SseDecoder, SseEvent, SseScanner};
use proptest::prelude::*;

/// One event: its data lines (no line breaks inside), a comment line or not, and its line end.
#[derive(Clone, Debug)]
struct Ev {
    lines: Vec<String>,
    comment: bool,
    crlf: bool,
}

impl Ev {
    fn encode(&self) -> String {
        let nl = if self.crlf { "\r\n" } else { "\n" };
        let mut s = String::new();
        if self.comment {
            s.push_str(": keep-alive");
            s.push_str(nl);
        }
        for l in &self.lines {
            s.push_str("data: ");
            s.push_str(l);
            s.push_str(nl);
        }
        s.push_str(nl);
        s
    }
    fn data(&self) -> String {
        self.lines.join("\n")
    }
}

fn event() -> impl Strategy<Value = Ev> {
    let line = prop_oneof!["[ -~\\u{e9}\\u{4e2d}]{0,40}", Just("[DONE]".to_string()), Just("{\"a\":1}".to_string())];
    (prop::collection::vec(line, 1..4), any::<bool>(), any::<bool>()).prop_map(|(lines, comment, crlf)| Ev { lines, comment, crlf })
}

/// Splits `bytes` at the given points (as fractions of its length).
fn chunks(bytes: &[u8], cuts: &[prop::sample::Index]) -> Vec<Vec<u8>> {
    let mut at: Vec<usize> = cuts.iter().map(|c| c.index(bytes.len() + 1)).collect();
    at.push(0);
    at.push(bytes.len());
    at.sort_unstable();
    at.windows(2).map(|w| bytes[w[0]..w[1]].to_vec()).collect()
}

fn decode_all(parts: &[Vec<u8>]) -> (Vec<SseEvent>, usize) {
    let mut d = SseDecoder::new();
    let mut out = Vec::new();
    let mut most = 0;
    for p in parts {
        out.extend(d.feed(p));
        most = most.max(d.pending());
    }
    out.extend(d.finish());
    (out, most)
}

fn scan_all(limit: usize, parts: &[Vec<u8>]) -> (Result<(), usize>, bool, bool) {
    let mut s = SseScanner::new(limit);
    for p in parts {
        if let Err(e) = s.scan(p) {
            return (Err(e.limit), s.saw_done(), s.at_boundary());
        }
    }
    (Ok(()), s.saw_done(), s.at_boundary())
}

proptest! {
    #[test]
    fn any_chunking_of_a_valid_stream_decodes_to_its_events(evs in prop::collection::vec(event(), 0..8), cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..12)) {
        let text: String = evs.iter().map(Ev::encode).collect();
        let (got, most) = decode_all(&chunks(text.as_bytes(), &cuts));
        let want: Vec<String> = evs.iter().map(Ev::data).collect();
        prop_assert_eq!(got.iter().map(|e| e.data.clone()).collect::<Vec<_>>(), want);
        // Bounded: never more than the longest event plus the chunk that completed it.
        let longest = evs.iter().map(|e| e.encode().len()).max().unwrap_or(0);
        prop_assert!(most <= longest + text.len().min(longest + 4), "held {most} bytes, longest event {longest}");
        // The scanner agrees: within a limit of the longest event, no error, and [DONE] seen
        // exactly when the last data line is [DONE].
        let (verdict, done, boundary) = scan_all(longest.max(1), &chunks(text.as_bytes(), &cuts));
        prop_assert_eq!(verdict, Ok(()));
        prop_assert!(boundary);
        let last_is_done = evs.last().and_then(|e| e.lines.last()).is_some_and(|l| l == "[DONE]");
        prop_assert_eq!(done, last_is_done);
    }

    #[test]
    fn a_line_over_the_limit_is_caught_however_it_arrives(prefix in prop::collection::vec(event(), 0..3), len in 1usize..400, limit in 1usize..300, cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..12)) {
        let head: String = prefix.iter().map(Ev::encode).collect();
        let text = format!("{head}data: {}", "x".repeat(len));
        let longest_prefix = prefix.iter().map(|e| e.encode().len()).max().unwrap_or(0);
        let (verdict, _, _) = scan_all(limit, &chunks(text.as_bytes(), &cuts));
        if len + 6 > limit {
            prop_assert_eq!(verdict, Err(limit));
        } else if longest_prefix <= limit {
            prop_assert_eq!(verdict, Ok(()));
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic_and_chunking_never_matters(bytes in prop::collection::vec(any::<u8>(), 0..512), cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..16), limit in 1usize..600) {
        let whole = decode_all(std::slice::from_ref(&bytes)).0;
        let parts = chunks(&bytes, &cuts);
        prop_assert_eq!(decode_all(&parts).0, whole);
        prop_assert_eq!(scan_all(limit, &parts), scan_all(limit, std::slice::from_ref(&bytes)));
        let _ = looks_like_sse(&bytes);
    }
}
