//! Reading prompt and cached token counts from an engine's answer, to tell whether KV really
//! moved (a decode that recomputed the prompt reports fewer cached tokens than prompt tokens).

use serde_json::Value;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct CacheReport {
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
}

impl CacheReport {
    /// The decode did not receive (all of) the prompt's KV.
    pub fn recomputed(&self) -> bool {
        self.cached_tokens < self.prompt_tokens
    }
}

/// From an OpenAI `usage` block or an SGLang `meta_info`; `None` when the answer has neither.
pub fn cache_report(v: &Value) -> Option<CacheReport> {
    if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
        let prompt = u.get("prompt_tokens")?.as_u64()?;
        let cached = u.get("prompt_tokens_details").and_then(|d| d.get("cached_tokens")).and_then(Value::as_u64).unwrap_or(0);
        return Some(CacheReport { prompt_tokens: prompt, cached_tokens: cached });
    }
    let m = v.get("meta_info")?;
    let prompt = m.get("prompt_tokens")?.as_u64()?;
    let cached = m.get("cached_tokens").and_then(Value::as_u64).unwrap_or(0);
    Some(CacheReport { prompt_tokens: prompt, cached_tokens: cached })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn openai_and_sglang_shapes() {
        let full = cache_report(&json!({"usage":{"prompt_tokens":10,"prompt_tokens_details":{"cached_tokens":10}}})).unwrap();
        assert!(!full.recomputed());
        let none = cache_report(&json!({"usage":{"prompt_tokens":10}})).unwrap();
        assert!(none.recomputed());
        let sg = cache_report(&json!({"meta_info":{"prompt_tokens":7,"cached_tokens":3}})).unwrap();
        assert_eq!((sg.prompt_tokens, sg.cached_tokens, sg.recomputed()), (7, 3, true));
        assert_eq!(cache_report(&json!({"usage": null})), None);
    }
}
