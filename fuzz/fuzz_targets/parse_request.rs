//! Request parsing on arbitrary bytes: never a panic, bounds hold for whatever is accepted.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pdgate_protocol::{parse_request, Endpoint, Limits};

fuzz_target!(|data: &[u8]| {
    let limits = Limits { max_n: 3, max_batch_size: 4, ..Limits::default() };
    for ep in [Endpoint::Completions, Endpoint::ChatCompletions, Endpoint::Generate] {
        if let Ok(req) = parse_request(ep, data, &limits) {
            assert!(req.batch_items.unwrap_or(1) as u64 <= limits.max_batch_size);
        }
    }
});
