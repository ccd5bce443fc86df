//! What tracking a stream for resume costs per relayed chunk (a measurement, not a test), both
//! ways in the same run: `process` parses each event, takes the token ids out and re-frames it
//! (the slow path, still used for the first event and for a continuation's); `process_raw`
//! (what the relay uses) scans each event's bytes and cuts the ids out. A stream that cannot be
//! resumed skips all of it. Run on a quiet machine:
//!
//!     cargo run --release -p pdgate-protocol --example resume_cost
#![allow(clippy::unwrap_used, clippy::print_stdout)]

use std::time::Instant;

use pdgate_protocol::resume::ResumeTracker;
use pdgate_protocol::{parse_request, Endpoint, Limits};
use serde_json::json;

fn main() {
    let req = parse_request(Endpoint::Completions, br#"{"prompt":"hi","stream":true,"max_tokens":100000}"#, &Limits::default()).unwrap();
    let chunk = |i: u64| {
        let c = json!({"id": "cmpl-0123456789abcdef", "object": "text_completion", "created": 1_700_000_000, "model": "meta-llama/Llama-3.1-8B-Instruct",
                       "choices": [{"index": 0, "text": " token", "logprobs": null, "finish_reason": null, "token_ids": [i]}]});
        format!("data: {c}\n\n").into_bytes()
    };
    let chunks: Vec<Vec<u8>> = (0..std::env::args().nth(1).map_or(100_000, |n| n.parse().unwrap())).map(chunk).collect();
    let run = |raw: bool| {
        let mut tracker = ResumeTracker::new(&req);
        let t = Instant::now();
        let mut out = 0usize;
        for c in &chunks {
            out += if raw { tracker.process_raw(c).map_or(c.len(), |v| v.len()) } else { tracker.process(c).len() };
        }
        let per = t.elapsed().as_nanos() as f64 / chunks.len() as f64;
        println!(
            "{}: {} chunks of {} bytes: {per:.0} ns per chunk tracked ({out} bytes out), {} ids kept",
            if raw { "process_raw (scan)" } else { "process (parse)" },
            chunks.len(),
            chunks[0].len(),
            tracker.progress.generated()
        );
    };
    run(false);
    run(true);
}
