//! The usual Responses body read from its bytes: the same request as the parse, and the parse
//! for every other shape.

use super::usual;
use crate::responses::request::parsed;

fn same(raw: &str) {
    let Some(mut fast) = usual(raw.as_bytes()) else { panic!("not read as usual: {raw}") };
    let mut slow = parsed(raw.as_bytes()).unwrap_or_else(|e| panic!("{raw}: {e:?}"));
    assert_eq!(fast, slow, "{raw}");
    // The chat bodies the two make for a turn, with and without history, byte for byte.
    let history = [serde_json::json!({"type": "message", "role": "assistant", "content": "before", "id": "msg_x"})];
    let (f, s) = (fast.clone().chat_body(&history), slow.clone().chat_body(&history));
    assert_eq!(format!("{f:?}"), format!("{s:?}"), "{raw}");
    let (f, s) = (fast.chat_body(&[]).map(|m| serde_json::to_string(&m).ok()), slow.chat_body(&[]).map(|m| serde_json::to_string(&m).ok()));
    assert_eq!(f, s, "{raw}");
}

#[test]
fn usual_bodies_read_as_parsed() {
    for raw in [
        r#"{"model":"mock-model","instructions":"You answer briefly.","input":"The capital of France is","max_output_tokens":8,"stream":true}"#,
        r#" { "input" : "hi" , "model" : "m" , "stream" : false , "store" : false } "#,
        r#"{"input":"é ✓","max_output_tokens":18446744073709551615,"previous_response_id":"resp_0123","store":true}"#,
        r#"{"model":"","input":""}"#,
        r#"{"model":"m","input":[{"role":"user","content":"a"},{"type":"message","role":"assistant","content":"b"},{"content":"c","role":"developer"},{"role":"system","content":"d"}],"stream":true}"#,
    ] {
        same(raw);
    }
}

#[test]
fn other_shapes_are_parsed() {
    for raw in [
        r#"{"model":"m","input":"a\nb"}"#,
        r#"{"model":"m","input":"a","temperature":0}"#,
        r#"{"model":"m","input":"a","model":"n"}"#,
        r#"{"model":"m"}"#,
        r#"{"model":"m","input":null}"#,
        r#"{"model":null,"input":"a"}"#,
        r#"{"model":"m","input":[]}"#,
        r#"{"model":"m","input":[{"role":"tool","content":"a"}]}"#,
        r#"{"model":"m","input":[{"role":"user","content":[{"type":"input_text","text":"a"}]}]}"#,
        r#"{"model":"m","input":[{"type":"function_call_output","call_id":"c","output":"a"}]}"#,
        r#"{"model":"m","input":[{"role":"user","content":"a","role":"user"}]}"#,
        r#"{"model":"m","input":[{"role":"user"}]}"#,
        r#"{"model":"m","input":"a","max_output_tokens":0}"#,
        r#"{"model":"m","input":"a","max_output_tokens":08}"#,
        r#"{"model":"m","input":"a","max_output_tokens":8.0}"#,
        r#"{"model":"m","input":"a","max_output_tokens":18446744073709551616}"#,
        r#"{"model":"m","input":"a","stream":"true"}"#,
        r#"{"model":"m","input":"a","store":1}"#,
        r#"{"model":"m","input":"a",}"#,
        r#"{"model":"m","input":"a"} x"#,
        r#"["model","m"]"#,
        "{\"model\":\"m\",\"input\":\"a\tb\"}",
    ] {
        assert!(usual(raw.as_bytes()).is_none(), "read as usual: {raw}");
    }
}
