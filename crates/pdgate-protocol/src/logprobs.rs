//! Input-token logprobs in SGLang bootstrap PD: only the prefill computed them, so the gateway
//! puts the prefill's `meta_info.input_token_logprobs` in front of the decode's (docs/protocols.md §1).

use serde_json::Value;

use crate::sse::SseDecoder;

/// Per-item input logprobs taken from a prefill answer, indexed by the item's position.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PrefillLogprobs {
    items: Vec<Option<Value>>,
}

impl PrefillLogprobs {
    fn set(&mut self, index: usize, list: Value) {
        if self.items.len() <= index {
            self.items.resize(index + 1, None);
        }
        self.items[index] = Some(list);
    }

    pub fn get(&self, index: usize) -> Option<&Value> {
        self.items.get(index).and_then(Option::as_ref)
    }

    pub fn is_empty(&self) -> bool {
        self.items.iter().all(Option::is_none)
    }

    /// Reads a prefill's full answer: one JSON object, a JSON array (batch), or an SSE stream
    /// (the prefill answers in SSE when the client asked to stream, since both legs get the
    /// same body).
    pub fn from_prefill_body(body: &[u8]) -> Self {
        let mut out = PrefillLogprobs::default();
        if let Ok(v) = serde_json::from_slice::<Value>(body) {
            out.absorb(&v, 0);
            return out;
        }
        let mut dec = SseDecoder::new();
        let mut events = dec.feed(body);
        events.extend(dec.finish());
        for ev in events.iter().filter(|e| !e.is_done()) {
            if let Ok(v) = serde_json::from_str::<Value>(&ev.data) {
                out.absorb(&v, 0);
            }
        }
        out
    }

    fn absorb(&mut self, v: &Value, position: usize) {
        match v {
            Value::Array(items) => items.iter().enumerate().for_each(|(i, item)| self.absorb(item, i)),
            Value::Object(o) => {
                let index = item_index(v).unwrap_or(position);
                if let Some(list) = o.get("meta_info").and_then(|m| m.get("input_token_logprobs")).filter(|l| l.is_array()) {
                    if !list.as_array().is_some_and(Vec::is_empty) {
                        self.set(index, list.clone());
                    }
                }
            }
            _ => {}
        }
    }
}

fn item_index(v: &Value) -> Option<usize> {
    v.get("index").and_then(Value::as_u64).map(|i| i as usize)
}

/// Prepends the prefill's input logprobs to one decode answer (object or batch array).
/// Returns whether anything changed.
pub fn merge_into(decode: &mut Value, prefill: &PrefillLogprobs) -> bool {
    match decode {
        Value::Array(items) => {
            let mut changed = false;
            for (i, item) in items.iter_mut().enumerate() {
                changed |= merge_item(item, prefill, i);
            }
            changed
        }
        other => merge_item(other, prefill, 0),
    }
}

fn merge_item(item: &mut Value, prefill: &PrefillLogprobs, position: usize) -> bool {
    let index = item_index(item).unwrap_or(position);
    let Some(Value::Array(pre)) = prefill.get(index) else { return false };
    let Some(meta) = item.get_mut("meta_info").and_then(Value::as_object_mut) else { return false };
    let mut merged = pre.clone();
    if let Some(Value::Array(dec)) = meta.get("input_token_logprobs") {
        merged.extend(dec.iter().cloned());
    }
    meta.insert("input_token_logprobs".into(), Value::Array(merged));
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn merges_json_answers_item_by_item() {
        let pre = PrefillLogprobs::from_prefill_body(br#"[{"meta_info":{"input_token_logprobs":[[-1.0,5,null]]}},{"meta_info":{"input_token_logprobs":[[-2.0,6,null]]}}]"#);
        let mut dec = json!([{"meta_info":{"input_token_logprobs":[]}}, {"meta_info":{"input_token_logprobs":[[-0.5,7,null]]}}]);
        assert!(merge_into(&mut dec, &pre));
        assert_eq!(dec[0]["meta_info"]["input_token_logprobs"], json!([[-1.0, 5, null]]));
        assert_eq!(dec[1]["meta_info"]["input_token_logprobs"], json!([[-2.0, 6, null], [-0.5, 7, null]]));
    }

    #[test]
    fn reads_a_streamed_prefill_answer() {
        let body = b"data: {\"index\":0,\"meta_info\":{\"input_token_logprobs\":[[-1.5,3,null]]}}\n\ndata: [DONE]\n\n";
        let pre = PrefillLogprobs::from_prefill_body(body);
        assert!(!pre.is_empty(), "an SSE prefill answer must not be ignored");
        let mut chunk = json!({"index":0,"meta_info":{"input_token_logprobs":[]}});
        assert!(merge_into(&mut chunk, &pre));
        assert_eq!(chunk["meta_info"]["input_token_logprobs"], json!([[-1.5, 3, null]]));
    }

    #[test]
    fn nothing_to_merge_changes_nothing() {
        let pre = PrefillLogprobs::from_prefill_body(br#"{"meta_info":{}}"#);
        let mut dec = json!({"meta_info":{"input_token_logprobs":[[1]]}});
        assert!(!merge_into(&mut dec, &pre));
        assert_eq!(dec["meta_info"]["input_token_logprobs"], json!([[1]]));
    }
}
