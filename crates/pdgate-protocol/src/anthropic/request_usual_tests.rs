//! The usual Messages body read from its bytes: the same translation as the parse, and the
//! parse for every other shape.

use serde_json::Value;

use super::usual;
use crate::anthropic::request::{parsed, Kind};

fn same(raw: &str, kind: Kind) {
    let Some(fast) = usual(raw.as_bytes(), kind) else { panic!("not read as usual: {raw}") };
    let slow = parsed(raw.as_bytes(), kind).unwrap_or_else(|e| panic!("{raw}: {e:?}"));
    assert_eq!(Value::Object(fast.chat.clone()).to_string(), Value::Object(slow.chat).to_string(), "{raw}");
    assert_eq!((fast.stream, fast.model, fast.stop_sequences), (slow.stream, slow.model, slow.stop_sequences), "{raw}");
}

#[test]
fn usual_bodies_translate_as_parsed() {
    let kinds = [Kind::Create, Kind::CountTokens];
    for raw in [
        r#"{"model":"mock-model","system":"You answer briefly.","messages":[{"role":"user","content":"The capital of France is"}],"max_tokens":8,"stream":true}"#,
        r#" { "model" : "m" , "messages" : [ { "content" : "hi" , "role" : "user" } ] , "max_tokens" : 1 , "stream" : false } "#,
        r#"{"model":"m","system":"","max_tokens":18446744073709551,"messages":[{"role":"user","content":"a"},{"role":"assistant","content":"b"}]}"#,
        r#"{"model":"m","max_tokens":3,"messages":[{"role":"user","content":"é ✓"},{"role":"assistant","content":""},{"role":"user","content":"c"}],"stream":true}"#,
    ] {
        for kind in kinds {
            same(raw, kind);
        }
    }
    same(r#"{"model":"m","messages":[{"role":"user","content":"a"}],"stream":true}"#, Kind::CountTokens);
}

#[test]
fn other_shapes_are_parsed() {
    for raw in [
        r#"{"model":"m","messages":[{"role":"user","content":"a\nb"}],"max_tokens":8}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"a"}],"max_tokens":8,"temperature":0}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"a"}],"max_tokens":8,"model":"n"}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"a","role":"user"}],"max_tokens":8}"#,
        r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"}]}],"max_tokens":8}"#,
        r#"{"model":"m","messages":[{"role":"assistant","content":"a"}],"max_tokens":8}"#,
        r#"{"model":"m","messages":[{"role":"system","content":"a"}],"max_tokens":8}"#,
        r#"{"model":"m","messages":[],"max_tokens":8}"#,
        r#"{"model":"","messages":[{"role":"user","content":"a"}],"max_tokens":8}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"a"}]}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"a"}],"max_tokens":0}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"a"}],"max_tokens":08}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"a"}],"max_tokens":8.0}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"a"}],"max_tokens":-8}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"a"}],"max_tokens":8,"stream":"true"}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"a"}],"max_tokens":8,"stream":tru}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"a"}],"max_tokens":8,}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"a"}],"max_tokens":8} x"#,
        r#"{"model":"m","messages":[{"role":"user","content":"a"} {"role":"user","content":"b"}],"max_tokens":8}"#,
        r#"{"model":"m","system":null,"messages":[{"role":"user","content":"a"}],"max_tokens":8}"#,
        "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"a\tb\"}],\"max_tokens\":8}",
    ] {
        assert!(usual(raw.as_bytes(), Kind::Create).is_none(), "read as usual: {raw}");
    }
}
