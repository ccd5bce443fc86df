//! SSE framing on arbitrary bytes, as the relay sees a worker's stream: no panic, and neither
//! the decoder's events nor the scanner's verdict depend on where the chunks were cut. The
//! first two bytes choose the cut points and the scanner's limit.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pdgate_protocol::logprobs::{merge_into, PrefillLogprobs};
use pdgate_protocol::sse::{looks_like_sse, SseDecoder, SseScanner};

fuzz_target!(|data: &[u8]| {
    let [step, limit, rest @ ..] = data else { return };
    let step = usize::from(*step).max(1);
    let limit = usize::from(*limit) * 4 + 1;
    let _ = looks_like_sse(rest);

    let mut whole = SseDecoder::new();
    let mut want = whole.feed(rest);
    want.extend(whole.finish());
    let mut chunked = SseDecoder::new();
    let mut got = Vec::new();
    for c in rest.chunks(step) {
        got.extend(chunked.feed(c));
    }
    got.extend(chunked.finish());
    assert_eq!(got, want);

    let mut a = SseScanner::new(limit);
    let whole_verdict = a.scan(rest).map(|()| a.saw_done());
    let mut b = SseScanner::new(limit);
    let chunked_verdict = rest.chunks(step).try_for_each(|c| b.scan(c)).map(|()| b.saw_done());
    assert_eq!(whole_verdict, chunked_verdict);

    // The logprob merge the rewriter applies to each decoded event.
    let lp = PrefillLogprobs::from_prefill_body(br#"{"meta_info":{"input_token_logprobs":[[-1.0,1,null]]}}"#);
    for ev in &want {
        if let Ok(mut v) = serde_json::from_str::<serde_json::Value>(&ev.data) {
            merge_into(&mut v, &lp);
        }
    }
});
