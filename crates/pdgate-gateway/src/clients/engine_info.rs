//! What an engine says about itself (`/v1/models`, `/server_info`, gRPC `GetServerInfo`):
//! models, disaggregation mode, runtime, KV layout, context length. Read by health checks
//! (fleet/health.rs) and kept per worker for `GET /workers` and pairing checks.

use pdgate_core::{KvConnector, KvLayout};
use serde_json::Value;

/// Facts learned from the engine itself (`/server_info`, `/v1/models`), for `GET /workers`.
#[derive(Clone, Debug, Default)]
pub struct EngineInfo {
    pub models: Vec<String>,
    /// `disaggregation_mode` as the engine reports it.
    pub mode: Option<String>,
    pub runtime: Option<String>,
    pub kv_layout: KvLayout,
    /// The PD protocol the engine reports (gRPC `GetServerInfo`: vLLM's `kv_connector`, an
    /// SGLang PD worker's bootstrap); `None` where it says nothing (HTTP `/server_info`).
    pub kv_connector: Option<KvConnector>,
    /// The model's context length as the engine reports it (requests asking for more output
    /// tokens are refused with 400).
    pub context_length: Option<u64>,
}

/// Model ids and the smallest `max_model_len` of a `/v1/models` answer.
pub fn model_cards(v: &Value) -> (Vec<String>, Option<u64>) {
    let Some(data) = v.get("data").and_then(Value::as_array) else { return (vec![], None) };
    let models = data.iter().filter_map(|m| m.get("id")?.as_str().map(str::to_string)).collect();
    let context = data.iter().filter_map(|m| positive(m.get("max_model_len")?)).min();
    (models, context)
}

/// A context length as engines report it: a positive integer (SGLang may say `null`).
fn positive(v: &Value) -> Option<u64> {
    v.as_u64().filter(|n| *n > 0)
}

/// Mode, runtime and KV layout from an SGLang-style `/server_info` (the reference engine adds
/// `"engine": "pdgate-reference"`). vLLM serves `/server_info` only with
/// `VLLM_SERVER_DEV_MODE=1`, as `{"vllm_config": ..., "vllm_env": ...}`
/// (vllm/entrypoints/serve/dev/server_info/api_router.py, 0.32): that names the runtime `vllm`
/// and nothing else (its layout comes from the load scrape). Read as SGLang's, it made a dev-mode
/// vLLM prefill "sglang" and refused its pairs with vLLM decodes (seen on real vLLM here).
pub fn server_info_facts(s: &Value) -> EngineInfo {
    if s.get("vllm_config").is_some() {
        return EngineInfo { runtime: Some("vllm".into()), ..EngineInfo::default() };
    }
    let text = |k: &str| s.get(k).and_then(Value::as_str).map(str::to_string);
    let num = |k: &str| s.get(k).and_then(Value::as_u64).map(|v| v as u32);
    // "auto" means "the model's dtype", which the server does not spell out: unknown.
    let kv_dtype = text("kv_cache_dtype").filter(|d| d != "auto");
    EngineInfo {
        models: vec![],
        mode: text("disaggregation_mode"),
        runtime: Some(text("engine").unwrap_or_else(|| "sglang".into())),
        // The attention backend is not read: SGLang pairs a prefill and a decode that run
        // different ones (`--prefill-attention-backend` / `--decode-attention-backend`).
        kv_layout: KvLayout { page_size: num("page_size"), kv_dtype, tp_size: num("tp_size"), attention_backend: None },
        kv_connector: None,
        context_length: s.get("context_length").and_then(positive),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn server_info_gives_mode_runtime_and_layout() {
        let sglang = server_info_facts(&json!({"disaggregation_mode": "prefill", "page_size": 64, "kv_cache_dtype": "auto", "tp_size": 8}));
        assert_eq!(sglang.mode.as_deref(), Some("prefill"));
        assert_eq!(sglang.runtime.as_deref(), Some("sglang"));
        assert_eq!(sglang.kv_layout, KvLayout { page_size: Some(64), kv_dtype: None, tp_size: Some(8), attention_backend: None });
        let reference = server_info_facts(&json!({"engine": "pdgate-reference", "page_size": 16, "kv_cache_dtype": "fp8_e4m3"}));
        assert_eq!(reference.runtime.as_deref(), Some("pdgate-reference"));
        assert_eq!(reference.kv_layout.kv_dtype.as_deref(), Some("fp8_e4m3"));
        assert_eq!(reference.context_length, None);
        assert_eq!(server_info_facts(&json!({"context_length": 8192})).context_length, Some(8192));
        assert_eq!(server_info_facts(&json!({"context_length": null})).context_length, None);
        // vLLM's dev-mode answer: the runtime is vllm, whatever else the config says.
        let vllm = server_info_facts(&json!({"vllm_config": "model='m', page_size=16", "vllm_env": {"VLLM_SERVER_DEV_MODE": "1"}}));
        assert_eq!((vllm.runtime.as_deref(), vllm.mode, vllm.kv_layout), (Some("vllm"), None, KvLayout::default()));
    }

    #[test]
    fn model_cards_give_ids_and_the_smallest_context() {
        let v = json!({"data": [{"id": "a", "max_model_len": 4096}, {"id": "b", "max_model_len": 2048}, {"id": "c"}]});
        assert_eq!(model_cards(&v), (vec!["a".into(), "b".into(), "c".into()], Some(2048)));
        assert_eq!(model_cards(&json!({"data": [{"id": "a", "max_model_len": 0}]})).1, None);
        assert_eq!(model_cards(&json!({})), (vec![], None));
    }
}
