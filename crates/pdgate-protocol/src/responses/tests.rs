use serde_json::{json, Value};

use super::*;

fn chat_of(body: Value, history: &[Value]) -> Value {
    let mut req = parse_responses(body.to_string().as_bytes()).unwrap_or_else(|e| panic!("{e:?}"));
    Value::Object(req.chat_body(history).unwrap_or_else(|e| panic!("{e:?}")))
}

fn meta() -> ResponseMeta {
    let req = parse_responses(br#"{"model":"m","input":"hi","max_output_tokens":8,"instructions":"be brief"}"#).unwrap_or_else(|e| panic!("{e:?}"));
    ResponseMeta { id: "resp_abc".into(), created_at: 7, echo: req.echo }
}

#[test]
fn string_input_and_instructions_become_messages() {
    let chat = chat_of(json!({"model": "m", "input": "hello", "instructions": "be brief", "max_output_tokens": 5, "temperature": 0, "top_p": 0.5, "user": "u"}), &[]);
    assert_eq!(chat["messages"], json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]));
    assert_eq!((chat["max_tokens"].clone(), chat["temperature"].clone(), chat["top_p"].clone(), chat["user"].clone()), (json!(5), json!(0), json!(0.5), json!("u")));
    assert_eq!(chat["stream"], json!(false));
    assert!(chat.get("stream_options").is_none());
}

#[test]
fn engine_extensions_pass_and_responses_fields_do_not() {
    let chat = chat_of(json!({"input": "x", "ignore_eos": true, "top_k": 3, "store": false, "metadata": {"a": "b"}, "include": [], "messages": [1]}), &[]);
    assert_eq!((chat["ignore_eos"].clone(), chat["top_k"].clone()), (json!(true), json!(3)));
    for gone in ["store", "metadata", "include", "input"] {
        assert!(chat.get(gone).is_none(), "{gone}");
    }
    assert_eq!(chat["messages"], json!([{"role": "user", "content": "x"}]));
}

#[test]
fn stream_asks_for_usage() {
    let chat = chat_of(json!({"input": "x", "stream": true}), &[]);
    assert_eq!(chat["stream_options"], json!({"include_usage": true}));
}

#[test]
fn items_map_to_roles_parts_and_tool_turns() {
    let input = json!([
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "sys"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "calling", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\":1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
    ]);
    let chat = chat_of(json!({"input": input}), &[]);
    assert_eq!(
        chat["messages"],
        json!([
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "ab"},
            {"role": "assistant", "content": "calling", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{\"x\":1}"}},
            ]},
            {"role": "tool", "tool_call_id": "c1", "content": "one"},
            {"role": "tool", "tool_call_id": "c2", "content": "two"},
        ])
    );
}

#[test]
fn history_comes_before_the_input_and_pairs_calls() {
    let history = [json!({"type": "message", "role": "user", "content": "q"}), json!({"type": "function_call", "call_id": "c9", "name": "f", "arguments": "{}"})];
    let chat = chat_of(json!({"input": [{"type": "function_call_output", "call_id": "c9", "output": "r"}], "instructions": "i"}), &history);
    let roles: Vec<_> = chat["messages"].as_array().unwrap_or_else(|| panic!()).iter().map(|m| m["role"].clone()).collect();
    assert_eq!(roles, vec![json!("system"), json!("user"), json!("assistant"), json!("tool")]);
}

#[test]
fn tools_and_tool_choice_map_to_chat() {
    let tool = json!({"type": "function", "name": "get", "description": "d", "parameters": {"type": "object"}, "strict": true});
    let chat = chat_of(json!({"input": "x", "tools": [tool], "tool_choice": {"type": "function", "name": "get"}, "parallel_tool_calls": false}), &[]);
    assert_eq!(chat["tools"], json!([{"type": "function", "function": {"name": "get", "description": "d", "parameters": {"type": "object"}, "strict": true}}]));
    assert_eq!(chat["tool_choice"], json!({"type": "function", "function": {"name": "get"}}));
    assert_eq!(chat["parallel_tool_calls"], json!(false));
    assert_eq!(chat_of(json!({"input": "x", "tool_choice": "required"}), &[])["tool_choice"], json!("required"));
}

#[test]
fn text_format_maps_to_response_format() {
    let chat = chat_of(json!({"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}, "strict": true}}}), &[]);
    assert_eq!(chat["response_format"], json!({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}, "strict": true}}));
    assert!(chat_of(json!({"input": "x", "text": {"format": {"type": "text"}}}), &[]).get("response_format").is_none());
}

#[test]
fn bad_input_is_refused_with_the_field() {
    let param = |body: Value| -> Option<String> {
        let req = parse_responses(body.to_string().as_bytes());
        match req {
            Err(e) => e.param,
            Ok(mut r) => r.chat_body(&[]).err().and_then(|e| e.param),
        }
    };
    assert_eq!(param(json!({})), Some("input".into()));
    assert_eq!(param(json!({"input": 3})), Some("input".into()));
    assert_eq!(param(json!({"input": [{"type": "image_generation_call"}]})), Some("input[0].type".into()));
    assert_eq!(param(json!({"input": [{"type": "message", "role": "robot", "content": "x"}]})), Some("input[0].role".into()));
    assert_eq!(param(json!({"input": [{"type": "message", "role": "user", "content": [{"type": "input_audio"}]}]})), Some("input[0].content[0].type".into()));
    assert_eq!(param(json!({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]})), Some("input[0].call_id".into()));
    assert_eq!(param(json!({"input": "x", "stream": "yes"})), Some("stream".into()));
    assert_eq!(param(json!({"input": "x", "max_output_tokens": -1})), Some("max_output_tokens".into()));
    assert_eq!(param(json!({"input": "x", "tools": [{"type": "web_search"}]})), Some("tools[0].type".into()));
    assert_eq!(param(json!({"input": "x", "background": true})), Some("background".into()));
    assert_eq!(param(json!({"input": "x", "tool_choice": "sometimes"})), Some("tool_choice".into()));
    assert!(parse_responses(b"[1]").is_err());
    assert!(parse_responses(b"{").is_err());
}

#[test]
fn whole_answer_maps_to_a_response() {
    let chat = json!({"model": "w", "choices": [{"message": {"role": "assistant", "content": "hi there"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7, "prompt_tokens_details": {"cached_tokens": 4}}});
    let r = response_from_chat(&chat, &meta());
    assert_eq!((r["id"].clone(), r["object"].clone(), r["status"].clone(), r["model"].clone()), (json!("resp_abc"), json!("response"), json!("completed"), json!("w")));
    assert_eq!(
        r["output"],
        json!([{"type": "message", "id": "msg_abc", "role": "assistant", "status": "completed", "content": [{"type": "output_text", "text": "hi there", "annotations": [], "logprobs": []}]}])
    );
    assert_eq!(
        r["usage"],
        json!({"input_tokens": 5, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 2, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 7})
    );
    assert_eq!((r["instructions"].clone(), r["max_output_tokens"].clone()), (json!("be brief"), json!(8)));
}

#[test]
fn length_is_incomplete_and_tool_calls_are_items() {
    let chat = json!({"choices": [{"message": {"content": null, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}}]}, "finish_reason": "length"}]});
    let r = response_from_chat(&chat, &meta());
    assert_eq!(r["status"], json!("incomplete"));
    assert_eq!(r["incomplete_details"], json!({"reason": "max_output_tokens"}));
    assert_eq!(r["output"], json!([{"type": "function_call", "id": "fc_abc_0", "call_id": "call_1", "name": "f", "arguments": "{\"a\":1}", "status": "completed"}]));
}

fn chunk(delta: Value, finish: Option<&str>) -> String {
    format!("data: {}\n\n", json!({"object": "chat.completion.chunk", "model": "w", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}))
}

/// Events as (type, data), checking the framing and the sequence numbers.
fn events(wire: &str) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    for (i, block) in wire.split("\n\n").filter(|b| !b.is_empty()).enumerate() {
        let mut lines = block.lines();
        let kind = lines.next().and_then(|l| l.strip_prefix("event: ")).unwrap_or_else(|| panic!("{block}")).to_string();
        let data: Value = lines.next().and_then(|l| l.strip_prefix("data: ")).and_then(|d| serde_json::from_str(d).ok()).unwrap_or_else(|| panic!("{block}"));
        assert_eq!(data["type"], json!(kind));
        assert_eq!(data["sequence_number"], json!(i), "consecutive sequence numbers");
        out.push((kind, data));
    }
    out
}

fn translate(wire: &str, split: usize) -> (String, Option<Value>) {
    let mut t = StreamTranslator::new(meta());
    let mut out = t.start();
    for piece in wire.as_bytes().chunks(split.max(1)) {
        out.extend(t.feed(piece));
    }
    out.extend(t.end());
    (String::from_utf8(out).unwrap_or_else(|e| panic!("not UTF-8: {e}")), t.terminal().map(Terminal::value))
}

#[test]
fn text_stream_is_the_responses_event_sequence_at_any_split() {
    let usage = json!({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5});
    let wire = [
        chunk(json!({"role": "assistant", "content": ""}), None),
        chunk(json!({"content": "Hel"}), None),
        chunk(json!({"content": "\"\\\n\u{1}é"}), None),
        chunk(json!({"content": "lo"}), Some("stop")),
        format!("data: {}\n\n", json!({"choices": [], "usage": usage})),
        "data: [DONE]\n\n".to_string(),
    ]
    .concat();
    let (whole, terminal) = translate(&wire, wire.len());
    for split in [1, 2, 7, 33] {
        assert_eq!(translate(&wire, split).0, whole, "split {split}");
    }
    let evs = events(&whole);
    let kinds: Vec<&str> = evs.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        kinds,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed"
        ]
    );
    assert_eq!(evs[7].1["text"], json!("Hel\"\\\n\u{1}élo"));
    // The hand-written delta event is the JSON the generic path would write.
    assert_eq!(
        evs[4].1,
        json!({"type": "response.output_text.delta", "sequence_number": 4, "output_index": 0, "item_id": "msg_abc", "content_index": 0, "delta": "Hel", "logprobs": []})
    );
    // So are the hand-written opening and closing events of the message.
    let text = "Hel\"\\\n\u{1}élo";
    let item = |status: &str, text: &str| answer::message_item("msg_abc", text, status);
    assert_eq!(evs[2].1, json!({"type": "response.output_item.added", "sequence_number": 2, "output_index": 0, "item": item("in_progress", "")}));
    assert_eq!(
        evs[3].1,
        json!({"type": "response.content_part.added", "sequence_number": 3, "output_index": 0, "item_id": "msg_abc", "content_index": 0, "part": answer::text_part("")})
    );
    assert_eq!(
        evs[7].1,
        json!({"type": "response.output_text.done", "sequence_number": 7, "output_index": 0, "item_id": "msg_abc", "content_index": 0, "text": text, "logprobs": []})
    );
    assert_eq!(
        evs[8].1,
        json!({"type": "response.content_part.done", "sequence_number": 8, "output_index": 0, "item_id": "msg_abc", "content_index": 0, "part": answer::text_part(text)})
    );
    assert_eq!(evs[9].1, json!({"type": "response.output_item.done", "sequence_number": 9, "output_index": 0, "item": item("completed", text)}));
    let r = terminal.unwrap_or_else(|| panic!("no terminal"));
    // The terminal Response, written directly, is the generic builder's.
    assert_eq!(r, meta().response("completed", vec![item("completed", text)], answer::usage_of(&usage), Some("w")));
    assert_eq!(evs[10].1["response"], r);
    assert_eq!(evs[0].1["response"], meta().response("in_progress", vec![], None, None));
    assert_eq!(r["output"][0]["content"][0]["text"], json!("Hel\"\\\n\u{1}élo"));
    assert_eq!(r["usage"]["output_tokens"], json!(2));
    assert_eq!(r["model"], json!("w"));
}

/// Metas whose echo holds nothing, the usual fields, and every field the Response echoes.
fn metas() -> Vec<ResponseMeta> {
    let all = br#"{"model":"m","input":"hi","max_output_tokens":8,"instructions":"be \"brief\"","temperature":0.3,"top_p":0,
        "user":"u\u00e9","parallel_tool_calls":false,"metadata":{"k":"v"},"tools":[{"type":"function","name":"f","parameters":{}}],
        "tool_choice":"required","text":{"format":{"type":"json_object"}},"reasoning":{"effort":"low"},"truncation":"auto",
        "previous_response_id":"resp_prev","store":false}"#;
    let all = parse_responses(all).unwrap_or_else(|e| panic!("{e:?}"));
    vec![meta(), ResponseMeta { id: "resp_x".into(), created_at: 0, echo: serde_json::Map::new() }, ResponseMeta { id: "resp_y".into(), created_at: u64::MAX, echo: all.echo }]
}

/// The Response object written directly is byte for byte the generic builder's JSON, and says
/// where its output items lie.
#[test]
fn the_written_response_is_the_generic_builders_json() {
    let usage = answer::usage_of(&json!({"prompt_tokens": 3, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 1}}));
    let outputs = [vec![], vec![answer::message_item("msg_1", "a\"é", "completed"), answer::call_item("fc_1", "call_1", "f", "{}", "completed")]];
    for meta in metas() {
        for status in ["in_progress", "completed", "incomplete", "failed"] {
            for output in &outputs {
                for (usage, model) in [(None, None), (usage.clone(), Some("worker \"m\""))] {
                    let want = meta.response(status, output.clone(), usage.clone(), model);
                    let mut got = Vec::new();
                    let range = meta.write_response_of(&mut got, status, output, usage.as_ref(), model);
                    assert_eq!(String::from_utf8_lossy(&got), want.to_string(), "{status}");
                    let items: Vec<Value> = serde_json::from_slice(&[b"[", &got[range], b"]"].concat()).unwrap_or_default();
                    assert_eq!(&items, output);
                }
            }
        }
        // A failed response's error.
        let mut want = meta.response("failed", vec![], None, None);
        want["error"] = json!({"code": "c\"", "message": "went \n wrong"});
        let mut got = Vec::new();
        meta.write_response(&mut got, &Outcome { status: "failed", output: b"", usage: None, model: None, error: Some(("c\"", "went \n wrong")) });
        assert_eq!(String::from_utf8_lossy(&got), want.to_string());
    }
}

#[test]
fn the_written_usage_is_the_generic_builders_json() {
    for u in [
        json!({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}),
        json!({"prompt_tokens": 3, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 1}, "completion_tokens_details": {"reasoning_tokens": 7}}),
        json!({"prompt_tokens": 3.5, "total_tokens": null}),
        json!({}),
    ] {
        let counts = crate::chat_usage::UsageCounts::of_value(&u).unwrap_or_else(|| panic!("{u}"));
        let mut got = Vec::new();
        answer::write_usage(&mut got, &counts);
        assert_eq!(String::from_utf8_lossy(&got), answer::usage_of(&u).map(|v| v.to_string()).unwrap_or_default(), "{u}");
    }
}

#[test]
fn the_json_of_a_whole_answer_is_its_value() {
    let chat = json!({"model": "w", "choices": [{"message": {"content": "hi", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]}, "finish_reason": "length"}], "usage": {"prompt_tokens": 1, "completion_tokens": 1}});
    let (json, output, status) = response_json_from_chat(&chat, &meta());
    let want = response_from_chat(&chat, &meta());
    assert_eq!(String::from_utf8_lossy(&json), want.to_string());
    assert_eq!(status, "incomplete");
    let items: Vec<Value> = serde_json::from_slice(&[b"[", &json[output], b"]"].concat()).unwrap_or_default();
    assert_eq!(Some(&Value::Array(items)), want.get("output"));
}

#[test]
fn length_ends_incomplete() {
    let wire = [chunk(json!({"content": "a"}), Some("length")), "data: [DONE]\n\n".into()].concat();
    let (out, r) = translate(&wire, 5);
    assert_eq!(events(&out).last().map(|e| e.0.clone()), Some("response.incomplete".into()));
    let r = r.unwrap_or_else(|| panic!("no terminal"));
    assert_eq!(r["incomplete_details"]["reason"], json!("max_output_tokens"));
    assert_eq!(r["output"][0]["status"], json!("incomplete"), "the cut message is incomplete");
}

#[test]
fn tool_calls_stream_as_function_call_items() {
    let wire = [
        chunk(json!({"tool_calls": [{"index": 0, "id": "call_x", "type": "function", "function": {"name": "f", "arguments": ""}}]}), None),
        chunk(json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\":"}}]}), None),
        chunk(json!({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}), Some("tool_calls")),
        "data: [DONE]\n\n".into(),
    ]
    .concat();
    let (out, r) = translate(&wire, 3);
    let evs = events(&out);
    let kinds: Vec<&str> = evs.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        kinds,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed"
        ]
    );
    assert_eq!(evs[5].1["arguments"], json!("{\"a\":1}"));
    let r = r.unwrap_or_else(|| panic!());
    assert_eq!(r["output"], json!([{"type": "function_call", "id": "fc_abc_0", "call_id": "call_x", "name": "f", "arguments": "{\"a\":1}", "status": "completed"}]));
}

#[test]
fn an_error_event_or_a_cut_stream_fails_the_response() {
    let err = format!("data: {}\n\n", json!({"error": {"message": "decode died", "type": "server_error", "code": "decode_unavailable"}}));
    let (out, r) = translate(&[chunk(json!({"content": "a"}), None), err, "data: [DONE]\n\n".into()].concat(), 4);
    let evs = events(&out);
    assert_eq!(evs.last().map(|e| e.0.as_str()), Some("response.failed"));
    assert_eq!(evs.iter().filter(|e| e.0.starts_with("response.failed") || e.0 == "response.completed").count(), 1);
    assert_eq!(r.map(|r| r["error"]["code"].clone()), Some(json!("decode_unavailable")));
    let (out, _) = translate(&chunk(json!({"content": "a"}), None), 4);
    assert_eq!(events(&out).last().map(|e| e.1["response"]["error"]["code"].clone()), Some(json!("stream_truncated")));
}

#[test]
fn an_empty_answer_is_one_empty_message() {
    let (out, r) = translate(&[chunk(json!({"content": ""}), Some("stop")), "data: [DONE]\n\n".into()].concat(), 100);
    assert_eq!(events(&out).len(), 2 + 5 + 1);
    assert_eq!(r.map(|r| r["output"][0]["content"][0]["text"].clone()), Some(json!("")));
}

#[test]
fn numbers_are_written_as_their_digits() {
    for n in [0u64, 7, 10, 99, 100, 12345, u64::MAX] {
        let mut out = Vec::new();
        super::stream::push_u64(&mut out, n);
        assert_eq!(out, n.to_string().into_bytes());
    }
}
