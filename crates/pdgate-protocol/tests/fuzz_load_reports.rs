//! Property tests of the load-report readers (`prometheus`, `engine_load`): a worker's
//! `/metrics` page or `/v1/loads` answer is untrusted input. They never panic, and what they
//! read back from a well-formed page is what was written. `PROPTEST_CASES=100000 cargo test -p
//! pdgate-protocol --test fuzz_load_reports` searches longer.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

use pdgate_protocol::engine_load::{from_metrics, from_sglang_get_load, from_sglang_loads};
use pdgate_protocol::prometheus::samples;
use proptest::prelude::*;

/// Lines built from the pieces of the format, so that generated pages reach every branch.
fn line() -> impl Strategy<Value = String> {
    let piece = prop::sample::select(vec![
        "vllm:num_requests_running",
        "vllm:cache_config_info",
        "sglang:token_usage",
        "sglang:cache_config_info",
        "{",
        "}",
        "=",
        "\"",
        "\\",
        ",",
        " ",
        "block_size",
        "page_size",
        "num_pages",
        "num_gpu_blocks",
        "16",
        "-1",
        "NaN",
        "+Inf",
        "1e400",
        "0.5",
        "#",
        "é",
        "\n",
    ]);
    prop::collection::vec(piece, 0..24).prop_map(|p| p.concat())
}

proptest! {
    #[test]
    fn arbitrary_pages_never_panic(lines in prop::collection::vec(line(), 0..16), junk in ".{0,200}") {
        let page = lines.join("\n") + &junk;
        let _ = samples(&page, &["vllm:num_requests_running", "sglang:token_usage"]);
        if let Some(l) = from_metrics(&page) {
            // Whatever it read is a sane report: free never exceeds the capacity.
            if let (Some(free), Some(total)) = (l.free_kv_tokens(), l.total_kv_tokens) {
                prop_assert!(free <= total);
            }
        }
    }

    #[test]
    fn written_samples_read_back(running in 0u32..100_000, waiting in 0u32..100_000, blocks in 1u32..1_000_000, block in prop::sample::select(vec![1u32, 16, 32, 64]), usage in 0.0f64..=1.0, dtype in "[a-z0-9_]{1,12}") {
        let page = format!(
            "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{model_name=\"m\"}} {running}.0\nvllm:num_requests_waiting{{model_name=\"m\"}} {waiting}\nvllm:kv_cache_usage_perc{{model_name=\"m\"}} {usage}\nvllm:cache_config_info{{block_size=\"{block}\",cache_dtype=\"{dtype}\",num_gpu_blocks=\"{blocks}\"}} 1.0\n"
        );
        let l = from_metrics(&page).unwrap();
        prop_assert_eq!((l.running, l.waiting), (Some(u64::from(running)), Some(u64::from(waiting))));
        let total = u64::from(blocks) * u64::from(block);
        prop_assert_eq!(l.total_kv_tokens, Some(total));
        prop_assert_eq!(l.block_size, Some(block));
        prop_assert_eq!(l.cache_dtype.as_deref(), Some(dtype.as_str()));
        let used = l.used_kv_tokens.unwrap();
        prop_assert!((used as f64 - total as f64 * usage).abs() <= 1.0);
    }

    #[test]
    fn arbitrary_json_reports_never_panic(v in any_json()) {
        let _ = from_sglang_loads(&v);
        let _ = from_sglang_get_load(&v);
        let wrapped = serde_json::json!({"loads": [v]});
        let _ = from_sglang_loads(&wrapped);
    }
}

fn any_json() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::{json, Value};
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<i64>().prop_map(|n| json!(n)),
        any::<f64>().prop_map(|f| json!(f)),
        any::<u64>().prop_map(|n| json!(n)),
        "[a-z_]{0,8}".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 32, 6, |inner| {
        let keys = prop::sample::select(vec!["num_running_reqs", "num_waiting_reqs", "num_used_tokens", "num_total_tokens", "max_total_num_tokens", "num_reqs", "loads", "x"]);
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::vec((keys, inner), 0..6).prop_map(|kv| Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())),
        ]
    })
}
