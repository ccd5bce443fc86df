//! The Messages translation: requests, answers, stream events, errors.

use serde_json::{json, Value};

use super::answer::from_chat;
use super::error::{error_type, from_openai};
use super::request::{to_chat, Kind, Translated};
use super::stream::MessagesStream;

fn chat_of(body: Value) -> Translated {
    to_chat(body.to_string().as_bytes(), Kind::Create).unwrap_or_else(|e| panic!("{e:?}"))
}

fn refused(body: Value) -> String {
    match to_chat(body.to_string().as_bytes(), Kind::Create) {
        Ok(t) => panic!("accepted: {:?}", t.chat),
        Err(e) => e.message,
    }
}

#[test]
fn request_maps_system_turns_and_sampling() {
    let t = chat_of(json!({
        "model": "tiny", "max_tokens": 20, "system": [{"type": "text", "text": "be brief"}],
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ],
        "stop_sequences": ["\n\n"], "temperature": 0, "top_p": 0.9, "top_k": 5,
        "metadata": {"user_id": "u1"}, "stream": true,
    }));
    assert_eq!(
        Value::Object(t.chat),
        json!({
            "model": "tiny", "max_tokens": 20, "stop": ["\n\n"], "temperature": 0, "top_p": 0.9, "top_k": 5, "user": "u1",
            "stream": true, "stream_options": {"include_usage": true},
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ],
        })
    );
    assert!(t.stream);
    assert_eq!(t.stop_sequences, vec!["\n\n".to_string()]);
}

#[test]
fn request_maps_tools_and_tool_turns() {
    let t = chat_of(json!({
        "model": "m", "max_tokens": 5,
        "tools": [{"name": "get_weather", "description": "weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
        "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": true},
        "messages": [
            {"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": [{"type": "text", "text": "checking"}, {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]}, {"type": "text", "text": "thanks"}]},
        ],
    }));
    let chat = Value::Object(t.chat);
    assert_eq!(
        chat["tools"],
        json!([{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])
    );
    assert_eq!(chat["tool_choice"], json!({"type": "function", "function": {"name": "get_weather"}}));
    assert_eq!(chat["parallel_tool_calls"], json!(false));
    assert_eq!(
        chat["messages"][1],
        json!({"role": "assistant", "content": "checking", "tool_calls": [{"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]})
    );
    assert_eq!(chat["messages"][2], json!({"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}));
    assert_eq!(chat["messages"][3], json!({"role": "user", "content": "thanks"}));
    for (choice, want) in [("auto", json!("auto")), ("any", json!("required")), ("none", json!("none"))] {
        let t = chat_of(json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": choice}}));
        assert_eq!(t.chat["tool_choice"], want);
    }
}

#[test]
fn a_final_assistant_turn_is_continued() {
    let t = chat_of(json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "The answer is"}]}));
    assert_eq!((t.chat["continue_final_message"].clone(), t.chat["add_generation_prompt"].clone()), (json!(true), json!(false)));
}

#[test]
fn bad_requests_are_refused_with_the_field() {
    let user = json!([{"role": "user", "content": "x"}]);
    assert!(refused(json!({"model": "m", "messages": user})).contains("max_tokens"));
    assert!(refused(json!({"max_tokens": 1, "messages": user})).contains("model"));
    assert!(refused(json!({"model": "m", "max_tokens": 0, "messages": user})).contains("max_tokens"));
    assert!(refused(json!({"model": "m", "max_tokens": 1, "messages": []})).contains("at least one"));
    assert!(refused(json!({"model": "m", "max_tokens": 1, "messages": [{"role": "assistant", "content": "x"}]})).contains("first message"));
    assert!(refused(json!({"model": "m", "max_tokens": 1, "messages": [{"role": "system", "content": "x"}]})).contains("role"));
    assert!(refused(json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "video"}]}]})).contains("unknown content block type 'video'"));
    let img = json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}});
    let remote = json!({"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}});
    let chat = to_chat(serde_json::to_vec(&json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [remote]}]})).unwrap().as_slice(), Kind::Create).unwrap();
    assert_eq!(
        chat.chat["messages"][0]["content"][0],
        json!({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}),
        "a url source is the chat part's remote URL"
    );
    let ftp = json!({"type": "image", "source": {"type": "url", "url": "ftp://example.com/cat.png"}});
    assert!(refused(json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [ftp]}]})).contains("source.url"));
    let pdf = json!({"type": "image", "source": {"type": "base64", "media_type": "application/pdf", "data": "AA=="}});
    assert!(refused(json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [pdf]}]})).contains("media_type"));
    let turns = json!([{"role": "user", "content": "x"}, {"role": "assistant", "content": [img]}]);
    assert!(refused(json!({"model": "m", "max_tokens": 1, "messages": turns})).contains("image blocks outside"));
    let orphan = json!({"model": "m", "max_tokens": 1, "messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": "no tools here"},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "r"}]}]});
    assert!(refused(orphan).contains("no matching tool_use"));
    assert!(refused(json!({"model": "m", "max_tokens": 1, "messages": user, "temperature": 3})).contains("temperature"));
    assert!(refused(json!({"model": "m", "max_tokens": 1, "messages": user, "stop_sequences": "x"})).contains("stop_sequences"));
    assert!(refused(json!({"model": "m", "max_tokens": 1, "messages": user, "tools": [{"type": "web_search_20250305", "name": "w"}]})).contains("not supported"));
    assert!(refused(json!({"model": "m", "max_tokens": 1, "messages": user, "tool_choice": {"type": "maybe"}})).contains("tool_choice"));
    assert!(to_chat(b"{not json", Kind::Create).is_err());
    // count_tokens needs no max_tokens, and never streams.
    let t = to_chat(json!({"model": "m", "messages": user, "stream": true}).to_string().as_bytes(), Kind::CountTokens).unwrap_or_else(|e| panic!("{e:?}"));
    assert!(!t.stream && !t.chat.contains_key("stream"));
}

#[test]
fn answer_maps_text_stop_reasons_and_usage() {
    let chat = json!({"id": "chatcmpl-abc", "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop", "stop_reason": "END"}],
                      "usage": {"prompt_tokens": 10, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}}});
    let m = from_chat(&chat, "tiny", &["END".to_string()]);
    assert_eq!(
        m,
        json!({"id": "msg_abc", "type": "message", "role": "assistant", "model": "tiny", "content": [{"type": "text", "text": "Hi"}],
               "stop_reason": "stop_sequence", "stop_sequence": "END", "usage": {"input_tokens": 6, "output_tokens": 3, "cache_read_input_tokens": 4}})
    );
    let long = json!({"choices": [{"message": {"content": "x"}, "finish_reason": "length"}], "usage": {"prompt_tokens": 2, "completion_tokens": 1}});
    let m = from_chat(&long, "tiny", &[]);
    assert_eq!((m["stop_reason"].clone(), m["usage"].clone()), (json!("max_tokens"), json!({"input_tokens": 2, "output_tokens": 1})));
    let eos = json!({"choices": [{"message": {"content": "x"}, "finish_reason": "stop", "stop_reason": null}]});
    assert_eq!(from_chat(&eos, "tiny", &["y".into()])["stop_reason"], json!("end_turn"));
}

#[test]
fn answer_maps_tool_calls_to_tool_use_blocks() {
    let chat = json!({"id": "x", "choices": [{"message": {"content": null, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}},
        {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]}, "finish_reason": "tool_calls"}]});
    let m = from_chat(&chat, "tiny", &[]);
    assert_eq!(
        m["content"],
        json!([{"type": "tool_use", "id": "call_1", "name": "f", "input": {"a": 1}}, {"type": "tool_use", "id": "call_2", "name": "g", "input": {"_raw": "not json"}}])
    );
    assert_eq!(m["stop_reason"], json!("tool_use"));
}

/// The events of a translated stream, as (name, data).
fn events(bytes: &[u8]) -> Vec<(String, Value)> {
    let text = String::from_utf8_lossy(bytes);
    text.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let mut lines = e.lines();
            let name = lines.next().and_then(|l| l.strip_prefix("event: ")).unwrap_or_else(|| panic!("no event line in {e:?}"));
            let data = lines.next().and_then(|l| l.strip_prefix("data: ")).unwrap_or_else(|| panic!("no data line in {e:?}"));
            (name.to_string(), serde_json::from_str(data).unwrap_or_else(|err| panic!("{err}: {data}")))
        })
        .collect()
}

fn chunk(delta: Value, finish: Option<&str>) -> String {
    format!("data: {}\n\n", json!({"id": "chatcmpl-s1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}))
}

#[test]
fn stream_text_events_in_anthropic_order_at_every_split() {
    let wire = [
        chunk(json!({"role": "assistant", "content": ""}), None),
        chunk(json!({"content": "Hel"}), None),
        chunk(json!({"content": "lo"}), Some("stop")),
        format!("data: {}\n\n", json!({"id": "chatcmpl-s1", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 7}}})),
        "data: [DONE]\n\n".to_string(),
    ]
    .concat();
    let want = {
        let mut s = MessagesStream::new("tiny".into(), vec![]);
        let mut out = s.feed(wire.as_bytes());
        out.extend(s.finish());
        out
    };
    let evs = events(&want);
    let names: Vec<&str> = evs.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["message_start", "content_block_start", "ping", "content_block_delta", "content_block_delta", "content_block_stop", "message_delta", "message_stop"]);
    assert_eq!(evs[0].1["message"]["id"], json!("msg_s1"));
    assert_eq!(evs[3].1["delta"], json!({"type": "text_delta", "text": "Hel"}));
    assert_eq!(
        evs[6].1,
        json!({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": null}, "usage": {"input_tokens": 0, "output_tokens": 2, "cache_read_input_tokens": 7}})
    );
    // The same events whatever the chunking of the bytes.
    for split in 1..wire.len() {
        let mut s = MessagesStream::new("tiny".into(), vec![]);
        let mut out = s.feed(&wire.as_bytes()[..split]);
        out.extend(s.feed(&wire.as_bytes()[split..]));
        out.extend(s.finish());
        assert_eq!(out, want, "split at {split}");
    }
}

#[test]
fn stream_tool_calls_become_tool_use_blocks() {
    let wire = [
        chunk(json!({"content": "Let me check."}), None),
        chunk(json!({"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}]}), None),
        chunk(json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\":"}}]}), None),
        chunk(json!({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}), Some("tool_calls")),
        "data: [DONE]\n\n".to_string(),
    ]
    .concat();
    let mut s = MessagesStream::new("tiny".into(), vec![]);
    let evs = events(&s.feed(wire.as_bytes()));
    let names: Vec<&str> = evs.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "ping",
            "content_block_delta",
            "content_block_stop",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    assert_eq!(evs[5].1["content_block"], json!({"type": "tool_use", "id": "call_1", "name": "f", "input": {}}));
    assert_eq!((evs[5].1["index"].clone(), evs[6].1["delta"].clone()), (json!(1), json!({"type": "input_json_delta", "partial_json": "{\"a\":"})));
    assert_eq!(evs[9].1["delta"]["stop_reason"], json!("tool_use"));
    assert!(s.ended() && s.finish().is_empty());
}

#[test]
fn stream_errors_become_error_events() {
    let wire = [
        chunk(json!({"content": "par"}), None),
        "data: {\"error\":{\"message\":\"decode worker died\",\"type\":\"upstream_error\",\"code\":\"decode_unavailable\"}}\n\n".into(),
        "data: [DONE]\n\n".to_string(),
    ]
    .concat();
    let mut s = MessagesStream::new("tiny".into(), vec![]);
    let evs = events(&s.feed(wire.as_bytes()));
    let last = evs.last().unwrap_or_else(|| panic!("no events"));
    assert_eq!(last.0, "error");
    assert_eq!(last.1, json!({"type": "error", "error": {"type": "overloaded_error", "message": "decode_unavailable: decode worker died"}}));
    assert!(s.finish().is_empty(), "nothing after the error");
    // A cut stream (no [DONE]) ends with an error event.
    let mut s = MessagesStream::new("tiny".into(), vec![]);
    let _ = s.feed(chunk(json!({"content": "par"}), None).as_bytes());
    let evs = events(&s.finish());
    assert_eq!((evs.len(), evs[0].0.as_str(), evs[0].1["error"]["type"].clone()), (1, "error", json!("api_error")));
}

#[test]
fn errors_take_anthropic_types_by_status() {
    for (status, t) in [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (502, "api_error"),
        (503, "overloaded_error"),
        (504, "timeout_error"),
    ] {
        assert_eq!(error_type(status), t, "{status}");
    }
    let body = br#"{"error":{"message":"no healthy worker","type":"service_unavailable","code":"no_worker_available","param":null}}"#;
    assert_eq!(from_openai(503, body), json!({"type": "error", "error": {"type": "overloaded_error", "message": "no_worker_available: no healthy worker"}}));
    assert_eq!(from_openai(502, b"bad gateway")["error"]["message"], json!("bad gateway"));
    let invalid = br#"{"error":{"message":"max_tokens: Field required","type":"invalid_request_error","code":"invalid_request","param":"max_tokens"}}"#;
    assert_eq!(from_openai(400, invalid)["error"]["message"], json!("max_tokens: Field required"));
    assert_eq!(super::error::with_request_id(from_openai(400, invalid), Some("r1"))["request_id"], json!("r1"));
}

#[test]
fn stream_text_with_escapes_is_the_same_on_the_fast_path() {
    let texts = ["plain", "a \"quoted\" word", "line\nbreak\t\\", "é ☃ \u{1F600}", "\u{1}ctl"];
    let mut wire = chunk(json!({"role": "assistant", "content": ""}), None);
    for t in texts {
        wire.push_str(&chunk(json!({"content": t}), None));
    }
    wire.push_str("data: [DONE]\n\n");
    let mut s = MessagesStream::new("tiny".into(), vec![]);
    let evs = events(&s.feed(wire.as_bytes()));
    let got: Vec<Value> = evs.iter().filter(|(n, _)| n == "content_block_delta").map(|(_, d)| d["delta"]["text"].clone()).collect();
    assert_eq!(got, texts.iter().map(|t| json!(t)).collect::<Vec<_>>());
}

#[test]
fn image_blocks_become_data_url_parts_in_order() {
    let t = chat_of(json!({"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "look: "},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw=="}},
        {"type": "text", "text": " what is it?"},
    ]}]}));
    assert_eq!(
        t.chat["messages"],
        json!([{"role": "user", "content": [
            {"type": "text", "text": "look: "},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw=="}},
            {"type": "text", "text": " what is it?"},
        ]}])
    );
}

/// The stream's usage, written directly from the counts, is the whole answer's usage JSON.
#[test]
fn the_written_usage_is_the_generic_builders_json() {
    for u in [
        Some(json!({"prompt_tokens": 10, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}})),
        Some(json!({"prompt_tokens": 2, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 9}})),
        Some(json!({"prompt_tokens": 2, "completion_tokens": null, "prompt_tokens_details": null})),
        Some(json!(5)),
        None,
    ] {
        let counts = u.as_ref().and_then(crate::chat_usage::UsageCounts::of_value);
        let mut got = Vec::new();
        super::answer::write_usage(&mut got, counts.as_ref());
        assert_eq!(String::from_utf8_lossy(&got), Value::Object(super::answer::usage(u.as_ref())).to_string(), "{u:?}");
    }
}
