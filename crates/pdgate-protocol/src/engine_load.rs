//! What engines report about their own load, read from the three shapes they publish:
//!
//! - SGLang `GET /v1/loads`: `{"loads": [{num_running_reqs, num_waiting_reqs, num_used_tokens,
//!   num_total_tokens, max_total_num_tokens, num_waiting_uncached_tokens?, ...}]}`, one entry per
//!   data-parallel rank (`num_total_tokens` = used + pending prefill tokens).
//! - SGLang `GET /get_load` (older): `[{dp_rank, num_reqs, num_waiting_reqs, num_tokens}]`.
//! - Prometheus `GET /metrics`, SGLang names (`sglang:num_queue_reqs`, `sglang:num_running_reqs`,
//!   `sglang:token_usage`, `sglang:cache_config_info{page_size,num_pages}`) or vLLM names
//!   (`vllm:num_requests_waiting`, `vllm:num_requests_running`, `vllm:kv_cache_usage_perc`,
//!   `vllm:cache_config_info{block_size,num_gpu_blocks,cache_dtype}`).
//!
//! Series of several ranks or engines add up; usage fractions are weighted by capacity. Numbers
//! the worker gets wrong (negative, NaN, infinite) are dropped, never trusted.

use serde_json::Value;

use crate::prometheus::{samples, Sample};

/// One load report. `None`: the source does not say.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EngineLoad {
    pub running: Option<u64>,
    pub waiting: Option<u64>,
    /// Prompt tokens queued for prefill (SGLang `/v1/loads` only).
    pub waiting_prompt_tokens: Option<u64>,
    pub used_kv_tokens: Option<u64>,
    pub total_kv_tokens: Option<u64>,
    /// Which engine the report came from, when the format says (`sglang`, `vllm`).
    pub runtime: Option<&'static str>,
    /// vLLM `cache_config_info`: tokens per KV block and the KV cache dtype (pairing keys).
    pub block_size: Option<u32>,
    pub cache_dtype: Option<String>,
    /// Cumulative KV transfers the engine measured (see [`TransferTotals`]).
    pub transfers: Option<TransferTotals>,
}

/// Cumulative KV transfers as an engine counts them, from its start: how many, their bytes and
/// their time. Two reports a poll apart give the mean transfer of that interval. Sources:
/// vLLM's NIXL histograms `vllm:nixl_xfer_time_seconds` and `vllm:nixl_bytes_transferred`
/// (`_sum`, `_count`; measured where the KV is pulled, the decode), SGLang's
/// `sglang:kv_transfer_latency_ms` and `sglang:kv_transfer_total_mb` (MiB; measured where the KV
/// is sent, the prefill), the reference engine's `/v1/loads` `disaggregation.kv_transfer_totals`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TransferTotals {
    pub count: u64,
    pub bytes: u64,
    pub micros: u64,
}

impl TransferTotals {
    /// The mean transfer between `earlier` and `self` as (bytes, ms); `None` when no transfer
    /// finished in between or the counters went back (an engine restart).
    pub fn mean_since(&self, earlier: &TransferTotals) -> Option<(f64, f64)> {
        let n = self.count.checked_sub(earlier.count).filter(|n| *n > 0)?;
        let bytes = self.bytes.checked_sub(earlier.bytes)?;
        let micros = self.micros.checked_sub(earlier.micros)?;
        Some((bytes as f64 / n as f64, micros as f64 / 1000.0 / n as f64))
    }
}

impl EngineLoad {
    /// Running + waiting requests (what count-based load adds), when either is known.
    pub fn requests(&self) -> Option<u64> {
        match (self.running, self.waiting) {
            (None, None) => None,
            (r, w) => Some(r.unwrap_or(0).saturating_add(w.unwrap_or(0))),
        }
    }

    /// KV tokens still free: total − used.
    pub fn free_kv_tokens(&self) -> Option<u64> {
        Some(self.total_kv_tokens?.saturating_sub(self.used_kv_tokens?))
    }
}

/// A count from JSON: a non-negative integer (or integral float).
fn count(v: Option<&Value>) -> Option<u64> {
    let v = v?;
    v.as_u64().or_else(|| v.as_f64().and_then(float_count))
}

/// A non-negative finite float as a count (rounded); anything else is not a count.
fn float_count(f: f64) -> Option<u64> {
    (f.is_finite() && f >= 0.0).then(|| f.round().min(u64::MAX as f64) as u64)
}

/// Sums `Some`s; `None` when no item had the field.
fn sum(items: impl Iterator<Item = Option<u64>>) -> Option<u64> {
    items.flatten().fold(None, |acc, v| Some(acc.unwrap_or(0u64).saturating_add(v)))
}

/// SGLang `/v1/loads` (also what the reference engine answers).
pub fn from_sglang_loads(v: &Value) -> Option<EngineLoad> {
    let ranks = v.get("loads")?.as_array()?;
    let field = |k: &str| sum(ranks.iter().map(|r| count(r.get(k))));
    let used = field("num_used_tokens");
    // Pending prefill tokens: the explicit uncached count, else total (used + pending) − used.
    let pending =
        sum(ranks.iter().map(|r| count(r.get("num_waiting_uncached_tokens")).or_else(|| Some(count(r.get("num_total_tokens"))?.saturating_sub(count(r.get("num_used_tokens"))?)))));
    Some(EngineLoad {
        running: field("num_running_reqs"),
        waiting: field("num_waiting_reqs"),
        waiting_prompt_tokens: pending,
        used_kv_tokens: used,
        total_kv_tokens: field("max_total_num_tokens"),
        runtime: None,
        transfers: loads_transfers(ranks),
        ..EngineLoad::default()
    })
}

/// The reference engine's `disaggregation.kv_transfer_totals` `{count, bytes, seconds}`, summed
/// over ranks; `None` when no rank has it (SGLang's own `/v1/loads`).
fn loads_transfers(ranks: &[Value]) -> Option<TransferTotals> {
    let totals = ranks.iter().filter_map(|r| r.get("disaggregation")?.get("kv_transfer_totals"));
    totals.fold(None, |acc: Option<TransferTotals>, t| {
        let one = TransferTotals { count: count(t.get("count"))?, bytes: count(t.get("bytes"))?, micros: float_count(t.get("seconds")?.as_f64()? * 1e6)? };
        let acc = acc.unwrap_or_default();
        Some(TransferTotals { count: acc.count.saturating_add(one.count), bytes: acc.bytes.saturating_add(one.bytes), micros: acc.micros.saturating_add(one.micros) })
    })
}

/// SGLang's older `/get_load`: a list of `{num_reqs, num_waiting_reqs, num_tokens}` per rank,
/// `num_reqs` counting running and waiting requests.
pub fn from_sglang_get_load(v: &Value) -> Option<EngineLoad> {
    let ranks = v.as_array()?;
    if ranks.is_empty() || !ranks.iter().all(Value::is_object) {
        return None;
    }
    let field = |k: &str| sum(ranks.iter().map(|r| count(r.get(k))));
    let (reqs, waiting) = (field("num_reqs"), field("num_waiting_reqs"));
    reqs.or(waiting)?;
    let running = match (reqs, waiting) {
        (Some(r), Some(w)) => Some(r.saturating_sub(w)),
        (r, _) => r,
    };
    Some(EngineLoad { running, waiting, runtime: Some("sglang"), ..EngineLoad::default() })
}

const SGLANG: [&str; 9] = [
    "sglang:num_queue_reqs",
    "sglang:num_running_reqs",
    "sglang:token_usage",
    "sglang:cache_config_info",
    "sglang:max_total_num_tokens",
    "sglang:num_used_tokens",
    "sglang:kv_transfer_latency_ms_count",
    "sglang:kv_transfer_latency_ms_sum",
    "sglang:kv_transfer_total_mb_sum",
];
const VLLM: [&str; 8] = [
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:cache_config_info",
    "vllm:nixl_xfer_time_seconds_count",
    "vllm:nixl_xfer_time_seconds_sum",
    "vllm:nixl_bytes_transferred_sum",
];

/// A Prometheus `/metrics` page in SGLang's or vLLM's names; `None` when it has neither.
pub fn from_metrics(text: &str) -> Option<EngineLoad> {
    let all: Vec<&str> = SGLANG.iter().chain(VLLM.iter()).copied().collect();
    let found = samples(text, &all);
    let of = |name: &'static str| found.iter().filter(move |s| s.name == name);
    let total = |name: &'static str| sum(of(name).map(|s| float_count(s.value)));
    let real = |name: &'static str| of(name).map(|s| s.value).filter(|v| v.is_finite() && *v >= 0.0).fold(None, |acc: Option<f64>, v| Some(acc.unwrap_or(0.0) + v));
    // Histograms' count, and sums scaled to bytes and microseconds.
    let transfers = |n: &'static str, bytes: (&'static str, f64), time: (&'static str, f64)| {
        Some(TransferTotals { count: total(n)?, bytes: float_count(real(bytes.0)? * bytes.1)?, micros: float_count(real(time.0)? * time.1)? })
    };
    if let (Some(running), waiting) = (total("vllm:num_requests_running"), total("vllm:num_requests_waiting")) {
        let info: Vec<&Sample> = of("vllm:cache_config_info").collect();
        let block_size = info.iter().find_map(|s| s.label("block_size")?.parse::<u32>().ok());
        let capacity = sum(info.iter().map(|s| Some(s.label("num_gpu_blocks")?.parse::<u64>().ok()?.saturating_mul(u64::from(block_size?)))));
        let usage = mean_fraction(of("vllm:kv_cache_usage_perc").chain(of("vllm:gpu_cache_usage_perc")));
        return Some(EngineLoad {
            running: Some(running),
            waiting,
            used_kv_tokens: used_of(capacity, usage),
            total_kv_tokens: capacity,
            runtime: Some("vllm"),
            block_size,
            cache_dtype: info.iter().find_map(|s| s.label("cache_dtype")).filter(|d| !d.is_empty() && *d != "None").map(str::to_string),
            transfers: transfers("vllm:nixl_xfer_time_seconds_count", ("vllm:nixl_bytes_transferred_sum", 1.0), ("vllm:nixl_xfer_time_seconds_sum", 1e6)),
            ..EngineLoad::default()
        });
    }
    let (running, waiting) = (total("sglang:num_running_reqs"), total("sglang:num_queue_reqs"));
    running.or(waiting)?;
    let pages = sum(of("sglang:cache_config_info").map(|s| Some(s.label("page_size")?.parse::<u64>().ok()?.saturating_mul(s.label("num_pages")?.parse().ok()?))));
    let capacity = pages.or_else(|| total("sglang:max_total_num_tokens"));
    let used = total("sglang:num_used_tokens").or_else(|| used_of(capacity, mean_fraction(of("sglang:token_usage"))));
    let moved = transfers("sglang:kv_transfer_latency_ms_count", ("sglang:kv_transfer_total_mb_sum", 1024.0 * 1024.0), ("sglang:kv_transfer_latency_ms_sum", 1e3));
    Some(EngineLoad { running, waiting, used_kv_tokens: used, total_kv_tokens: capacity, runtime: Some("sglang"), transfers: moved, ..EngineLoad::default() })
}

/// The mean of usage fractions, clamped to 0..=1; `None` when there is none that is a number.
fn mean_fraction<'a>(series: impl Iterator<Item = &'a Sample>) -> Option<f64> {
    let (n, total) = series.filter(|s| s.value.is_finite()).fold((0u32, 0.0), |(n, t), s| (n + 1, t + s.value.clamp(0.0, 1.0)));
    (n > 0).then(|| total / f64::from(n))
}

fn used_of(capacity: Option<u64>, usage: Option<f64>) -> Option<u64> {
    Some((capacity? as f64 * usage?).round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn sglang_loads_sum_ranks_and_give_kv_and_pending_tokens() {
        let v = json!({"loads": [
            {"num_running_reqs": 3, "num_waiting_reqs": 2, "num_used_tokens": 1000, "num_total_tokens": 1500, "max_total_num_tokens": 8000},
            {"num_running_reqs": 1, "num_waiting_reqs": 0, "num_used_tokens": 200, "num_waiting_uncached_tokens": 70, "num_total_tokens": 999, "max_total_num_tokens": 8000},
        ]});
        let l = from_sglang_loads(&v).unwrap();
        assert_eq!(l.requests(), Some(6));
        assert_eq!(l.waiting_prompt_tokens, Some(500 + 70), "the explicit uncached count wins over total - used");
        assert_eq!(l.free_kv_tokens(), Some(16_000 - 1200));
        assert_eq!(from_sglang_loads(&json!({})), None);
        let bare = from_sglang_loads(&json!({"loads": [{"num_running_reqs": 1, "num_waiting_reqs": -3}]})).unwrap();
        assert_eq!((bare.running, bare.waiting, bare.free_kv_tokens()), (Some(1), None, None), "a negative count is dropped");
    }

    #[test]
    fn sglang_get_load_counts_running_as_reqs_minus_waiting() {
        let l = from_sglang_get_load(&json!([{"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 2, "num_tokens": 900}])).unwrap();
        assert_eq!((l.running, l.waiting), (Some(3), Some(2)));
        assert_eq!(from_sglang_get_load(&json!([])), None);
        assert_eq!(from_sglang_get_load(&json!({"loads": []})), None);
    }

    /// As vLLM's V1 engine exports them (labels from its logger), two engines of a DP group.
    const VLLM_PAGE: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.25
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="fp8_e4m3",calculate_kv_scales="False",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="1000",prefix_caching_hash_algo="sha256",sliding_window="None",swap_space="4"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="fp8_e4m3",calculate_kv_scales="False",enable_prefix_caching="True",engine="1",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="1000",prefix_caching_hash_algo="sha256",sliding_window="None",swap_space="4"} 1.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 12345.0
"#;

    #[test]
    fn vllm_metrics_give_requests_kv_and_pairing_keys() {
        let l = from_metrics(VLLM_PAGE).unwrap();
        assert_eq!((l.running, l.waiting), (Some(6), Some(3)));
        assert_eq!(l.total_kv_tokens, Some(32_000));
        assert_eq!(l.used_kv_tokens, Some(12_000), "mean usage 0.375 of 32000");
        assert_eq!(l.free_kv_tokens(), Some(20_000));
        assert_eq!((l.runtime, l.block_size, l.cache_dtype.as_deref()), (Some("vllm"), Some(16), Some("fp8_e4m3")));
        assert_eq!(l.waiting_prompt_tokens, None);
    }

    /// As SGLang's metrics collector exports them, one TP rank.
    const SGLANG_PAGE: &str = r#"# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="qwen/qwen2.5-0.5b-instruct",pp_rank="0",tp_rank="0"} 7.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="qwen/qwen2.5-0.5b-instruct",pp_rank="0",tp_rank="0"} 5.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{engine_type="unified",model_name="qwen/qwen2.5-0.5b-instruct",pp_rank="0",tp_rank="0"} 0.2
# HELP sglang:cache_config_info Information of the cache config.
# TYPE sglang:cache_config_info gauge
sglang:cache_config_info{num_pages="5000",page_size="1"} 1.0
# HELP sglang:max_total_num_tokens Maximum total number of tokens.
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{engine_type="unified",model_name="qwen/qwen2.5-0.5b-instruct",pp_rank="0",tp_rank="0"} 4999.0
"#;

    #[test]
    fn sglang_metrics_give_requests_and_kv() {
        let l = from_metrics(SGLANG_PAGE).unwrap();
        assert_eq!((l.running, l.waiting), (Some(7), Some(5)));
        assert_eq!(l.total_kv_tokens, Some(5000), "page_size x num_pages wins over max_total_num_tokens");
        assert_eq!(l.free_kv_tokens(), Some(4000));
        assert_eq!((l.runtime, l.block_size), (Some("sglang"), None));
        let without_info = SGLANG_PAGE.replace("sglang:cache_config_info", "other");
        assert_eq!(from_metrics(&without_info).unwrap().total_kv_tokens, Some(4999));
    }

    #[test]
    fn transfer_histograms_give_cumulative_totals() {
        let vllm = format!(
            "{VLLM_PAGE}vllm:nixl_xfer_time_seconds_count{{engine=\"0\"}} 4.0\nvllm:nixl_xfer_time_seconds_sum{{engine=\"0\"}} 0.2\nvllm:nixl_bytes_transferred_sum{{engine=\"0\"}} 4e9\nvllm:nixl_bytes_transferred_count{{engine=\"0\"}} 4.0\n"
        );
        let t = from_metrics(&vllm).unwrap().transfers.unwrap();
        assert_eq!(t, TransferTotals { count: 4, bytes: 4_000_000_000, micros: 200_000 });
        let sglang = format!("{SGLANG_PAGE}sglang:kv_transfer_latency_ms_count{{tp_rank=\"0\"}} 2\nsglang:kv_transfer_latency_ms_sum{{tp_rank=\"0\"}} 30.5\nsglang:kv_transfer_total_mb_sum{{tp_rank=\"0\"}} 3\n");
        assert_eq!(from_metrics(&sglang).unwrap().transfers, Some(TransferTotals { count: 2, bytes: 3 * 1024 * 1024, micros: 30_500 }));
        assert_eq!(from_metrics(VLLM_PAGE).unwrap().transfers, None, "no NIXL histograms, nothing known");
        let loads = json!({"loads": [{"num_running_reqs": 1, "disaggregation": {"kv_transfer_totals": {"count": 3, "bytes": 3000, "seconds": 0.006}}}]});
        let t = from_sglang_loads(&loads).unwrap().transfers.unwrap();
        assert_eq!(t, TransferTotals { count: 3, bytes: 3000, micros: 6000 });
        assert_eq!(TransferTotals { count: 5, bytes: 5000, micros: 10_000 }.mean_since(&t), Some((1000.0, 2.0)));
        assert_eq!(t.mean_since(&t), None, "no transfer in between");
        assert_eq!(TransferTotals::default().mean_since(&t), None, "an engine restart is no observation");
    }

    #[test]
    fn pages_without_engine_gauges_say_nothing() {
        assert_eq!(from_metrics("nothing 1\n# HELP vllm:x\n"), None);
        assert_eq!(from_metrics(""), None);
        let nan = "vllm:num_requests_running NaN\nvllm:kv_cache_usage_perc 7\n";
        assert_eq!(from_metrics(nan), None, "a NaN count is no count");
    }
}
