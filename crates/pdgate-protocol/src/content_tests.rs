#![allow(clippy::unwrap_used)] // test code: a panic is the failure report

use proptest::prelude::*;
use serde_json::{json, Value};

use super::*;

fn raw(v: &Value) -> Vec<u8> {
    format!("data: {v}").into_bytes()
}

#[test]
fn the_usual_events_are_read_from_their_bytes_as_parsing_reads_them() {
    let chat = |delta: Value| json!({"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": null}], "prompt_token_ids": [1, 2]});
    let cases = [
        (true, chat(json!({"role": "assistant", "content": ""})), false),
        (true, chat(json!({"content": "h"})), true),
        (true, chat(json!({"reasoning_content": "hm"})), true),
        (true, chat(json!({"tool_calls": [{"id": "t"}]})), true),
        (true, chat(json!({"tool_calls": []})), false),
        (true, chat(json!({})), false),
        (true, chat(json!(null)), false),
        (false, json!({"choices": [{"text": "", "token_ids": [1]}, {"text": "b"}]}), true),
        (false, json!({"choices": [{"text": "", "prompt_token_ids": [1, 2, 3]}]}), false),
        (false, json!({"choices": [], "usage": {"completion_tokens": 2}}), false),
        (false, json!({"choices": [{"text": "\"}], \"text\": \"x"}]}), true),
    ];
    for (is_chat, v, expected) in cases {
        let endpoint = if is_chat { Endpoint::ChatCompletions } else { Endpoint::Completions };
        assert_eq!(has_content(endpoint, &v), expected, "{v}");
        assert_eq!(carries_output(is_chat, &raw(&v)), Some(expected), "{v}");
    }
}

#[test]
fn anything_unusual_is_left_to_the_parser() {
    for bytes in [
        &b"data: [DONE]"[..],
        b": comment",
        b"data: {\"choices\": [{\"text\": \"a\"}]}\ndata: {}",
        br#"data: {"choices": [{"text": "", "text": "a"}]}"#,
        br#"data: {"choices": [], "choices": [{"text": "a"}]}"#,
        br#"data: {"choices": {"text": "a"}}"#,
        br#"data: {"choices": [{"text": "a"}]"#,
        br#"data: {"choices": [{"text": "a"}]} x"#,
    ] {
        assert_eq!(carries_output(false, bytes), None, "{}", String::from_utf8_lossy(bytes));
    }
}

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![Just(Value::Null), Just(json!("")), "[a-z\"\\\\{}\\[\\],: ]{1,6}".prop_map(Value::from), Just(json!([])), Just(json!([1, 2])), Just(json!({})), Just(json!(3)),]
}

fn delta() -> impl Strategy<Value = Value> {
    prop::collection::btree_map(prop::sample::select(vec!["content", "reasoning_content", "tool_calls", "role"]), leaf(), 0..4)
        .prop_map(|m| Value::Object(m.into_iter().map(|(k, v)| (k.to_string(), v)).collect()))
}

fn choice() -> impl Strategy<Value = Value> {
    let member = prop_oneof![leaf(), delta()];
    prop::collection::btree_map(prop::sample::select(vec!["text", "delta", "index", "finish_reason", "token_ids", "logprobs"]), member, 0..5)
        .prop_map(|m| Value::Object(m.into_iter().map(|(k, v)| (k.to_string(), v)).collect()))
}

fn event() -> impl Strategy<Value = Value> {
    (prop::collection::vec(prop_oneof![4 => choice(), 1 => leaf()], 0..3), leaf(), any::<bool>()).prop_map(|(choices, other, usage)| {
        let mut v = json!({"id": "x", "choices": choices, "other": other});
        if usage {
            v["usage"] = json!({"completion_tokens": 1});
        }
        v
    })
}

proptest! {
    /// Compact JSON of any mix of the usual keys is read, and read as parsing reads it; the
    /// same event pretty-printed (line breaks in it) is left to the parser, and so is a cut one.
    #[test]
    fn the_scan_agrees_with_parsing(v in event(), chat in any::<bool>(), cut in 0usize..400) {
        let endpoint = if chat { Endpoint::ChatCompletions } else { Endpoint::Completions };
        prop_assert_eq!(carries_output(chat, &raw(&v)), Some(has_content(endpoint, &v)));
        let spaced = format!("data: {}", serde_json::to_string_pretty(&v).unwrap());
        prop_assert_eq!(carries_output(chat, spaced.as_bytes()), None);
        let bytes = raw(&v);
        if cut < bytes.len() {
            let head = &bytes[..cut];
            if let Some(found) = carries_output(chat, head) {
                // A prefix that is itself a whole event (only possible at the very end).
                let parsed: Value = serde_json::from_slice(&head[6..]).unwrap();
                prop_assert_eq!(found, has_content(endpoint, &parsed));
            }
        }
    }
}
