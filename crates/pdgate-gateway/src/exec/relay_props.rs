//! Property tests of the stream rewriter (a stand-in for a cargo-fuzz target): arbitrary bytes
//! never panic it, it passes bytes through unchanged when nothing is to be rewritten, and a
//! rewritten stream does not depend on how the worker's bytes were chunked. 256 cases by
//! default; `PROPTEST_CASES=100000 cargo test -p pdgate-gateway --lib props` searches longer.

use bytes::Bytes;
use pdgate_protocol::logprobs::PrefillLogprobs;
use pdgate_protocol::sse::SseDecoder;
use proptest::prelude::*;
use serde_json::{json, Value};

use super::Rewriter;

fn prefill_logprobs() -> PrefillLogprobs {
    PrefillLogprobs::from_prefill_body(br#"{"text":"x","meta_info":{"input_token_logprobs":[[-1.0,11,null],[-2.0,12,null]]}}"#)
}

fn split(bytes: &[u8], cuts: &[prop::sample::Index]) -> Vec<Bytes> {
    let mut at: Vec<usize> = cuts.iter().map(|c| c.index(bytes.len() + 1)).collect();
    at.extend([0, bytes.len()]);
    at.sort_unstable();
    at.windows(2).map(|w| Bytes::copy_from_slice(&bytes[w[0]..w[1]])).collect()
}

/// Runs a rewriter over chunks; returns everything it let out, the held-back tail included.
fn run(mut r: Rewriter, chunks: &[Bytes]) -> Vec<u8> {
    let mut out = Vec::new();
    for c in chunks {
        out.extend_from_slice(&r.process_sse(c.clone()));
    }
    if let Some(tail) = r.flush() {
        out.extend_from_slice(&tail);
    }
    out
}

/// An SGLang `/generate` stream chunk, sometimes with usage, sometimes not JSON at all.
fn event() -> impl Strategy<Value = String> {
    prop_oneof![
        ("[a-z ]{0,12}", 0u64..3)
            .prop_map(|(t, i)| json!({"index": i, "text": t, "meta_info": {"prompt_tokens": 5, "cached_tokens": 5, "input_token_logprobs": [[-0.5, 13, null]]}}).to_string()),
        "[a-z ]{0,12}".prop_map(|t| json!({"text": t, "usage": {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 0}}}).to_string()),
        "[ -~]{0,20}",
    ]
}

fn stream(events: &[String], done: bool) -> String {
    let mut s: String = events.iter().map(|e| format!("data: {e}\n\n")).collect();
    if done {
        s.push_str("data: [DONE]\n\n");
    }
    s
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(chunks in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..128), 0..8), merge in any::<bool>()) {
        let chunks: Vec<Bytes> = chunks.into_iter().map(Bytes::from).collect();
        let r = Rewriter::new(merge.then(prefill_logprobs), true).unwrap();
        let _ = run(r, &chunks);
    }

    #[test]
    fn without_a_rewrite_bytes_pass_unchanged(chunks in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..128), 0..8), events in prop::collection::vec(event(), 0..6), cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..8)) {
        // Usage scanning only (PD without logprobs): every chunk goes out as it came.
        let mut r = Rewriter::new(None, true).unwrap();
        for c in chunks.into_iter().map(Bytes::from) {
            prop_assert_eq!(r.process_sse(c.clone()), c);
        }
        let text = stream(&events, true);
        let mut r = Rewriter::new(None, true).unwrap();
        for c in split(text.as_bytes(), &cuts) {
            prop_assert_eq!(r.process_sse(c.clone()), c);
        }
    }

    #[test]
    fn a_rewritten_stream_does_not_depend_on_chunking(events in prop::collection::vec(event(), 0..6), done in any::<bool>(), cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..10)) {
        let text = stream(&events, done);
        let whole = run(Rewriter::new(Some(prefill_logprobs()), true).unwrap(), &[Bytes::from(text.clone())]);
        let chunked = run(Rewriter::new(Some(prefill_logprobs()), true).unwrap(), &split(text.as_bytes(), &cuts));
        prop_assert_eq!(&chunked, &whole);
        // One event out per event in, and every JSON chunk leads with the prefill's logprobs.
        let mut d = SseDecoder::new();
        let out = d.feed(&chunked);
        prop_assert_eq!(out.len(), events.len() + usize::from(done));
        for ev in out.iter().filter(|e| !e.is_done()) {
            if let Ok(v) = serde_json::from_str::<Value>(&ev.data) {
                // The prefill's logprobs are item 0's (the only item it answered here).
                if v.get("meta_info").is_some() && v["index"].as_u64().unwrap_or(0) == 0 {
                    prop_assert_eq!(&v["meta_info"]["input_token_logprobs"][0], &json!([-1.0, 11, null]), "{}", ev.data);
                }
            }
        }
    }
}
