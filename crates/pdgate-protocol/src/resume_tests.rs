#![allow(clippy::unwrap_used)] // test code: a panic is the failure report

use serde_json::{json, Value};

use super::*;
use crate::limits::Limits;
use crate::request::parse_request;

fn req(endpoint: Endpoint, body: Value) -> ParsedRequest {
    parse_request(endpoint, body.to_string().as_bytes(), &Limits::default()).unwrap()
}

fn completions(extra: Value) -> ParsedRequest {
    let mut b = json!({"prompt": "hi", "stream": true, "max_tokens": 10});
    b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    req(Endpoint::Completions, b)
}

fn chunk(text: &str, ids: &[u64], finish: Option<&str>) -> Value {
    json!({"id": "cmpl-a", "object": "text_completion", "created": 7, "model": "m",
           "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish, "token_ids": ids}]})
}

#[test]
fn exact_continuations_only() {
    assert_eq!(refusal(&completions(json!({}))), None);
    let cases = [
        (json!({"n": 2}), "n_greater_than_1"),
        (json!({"stream": false}), "not_streaming"),
        (json!({"response_format": {"type": "json_object"}}), "guided_decoding"),
        (json!({"guided_regex": "a+"}), "guided_decoding"),
        (json!({"stop": ["\n"]}), "stop_strings"),
        (json!({"presence_penalty": 0.5}), "penalties"),
        (json!({"echo": true}), "echo"),
        (json!({"prompt": ["a", "b"]}), "batch"),
    ];
    for (extra, reason) in cases {
        assert_eq!(refusal(&completions(extra.clone())), Some(reason), "{extra}");
    }
    assert_eq!(refusal(&completions(json!({"response_format": {"type": "text"}, "stop": [], "presence_penalty": 0}))), None);
    let gen = req(Endpoint::Generate, json!({"text": "hi", "stream": true}));
    assert_eq!(refusal(&gen), Some("generate_text"), "a text prompt's ids are not in SGLang's stream");
    let ids = req(Endpoint::Generate, json!({"input_ids": [1, 2], "stream": true, "sampling_params": {"regex": "a+"}}));
    assert_eq!(refusal(&ids), Some("guided_decoding"));
    // Every grammar field of vLLM's and SGLang's OpenAI routes and of SGLang's /generate.
    let guided = [
        json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}),
        json!({"guided_json": {"type": "object"}}),
        json!({"guided_choice": ["a", "b"]}),
        json!({"guided_grammar": "root ::= \"a\""}),
        json!({"structured_outputs": {"regex": "a+"}}),
        json!({"regex": "a+"}),
        json!({"json_schema": "{}"}),
        json!({"ebnf": "root ::= \"a\""}),
        json!({"grammar": "root ::= \"a\""}),
    ];
    for extra in guided {
        assert_eq!(refusal(&completions(extra.clone())), Some("guided_decoding"), "{extra}");
    }
    for sp in [json!({"json_schema": "{}"}), json!({"ebnf": "root ::= \"a\""}), json!({"structural_tag": "{}"})] {
        let g = req(Endpoint::Generate, json!({"input_ids": [1, 2], "stream": true, "sampling_params": sp}));
        assert_eq!(refusal(&g), Some("guided_decoding"), "{sp}");
    }
    let n2 = req(Endpoint::Generate, json!({"input_ids": [1, 2], "stream": true, "sampling_params": {"n": 2}}));
    assert_eq!(refusal(&n2), Some("n_greater_than_1"));
    let chat_n = req(Endpoint::ChatCompletions, json!({"messages": [{"role": "user", "content": "x"}], "stream": true, "n": 3}));
    assert_eq!(refusal(&chat_n), Some("n_greater_than_1"));
    let chat = req(Endpoint::ChatCompletions, json!({"messages": [{"role": "user", "content": "x"}], "stream": true, "logprobs": true}));
    assert_eq!(refusal(&chat), Some("chat_logprobs"));
}

#[test]
fn the_first_stream_is_learned_and_its_ids_hidden_unless_asked() {
    let r = completions(json!({}));
    let mut p = Progress::new(&r);
    let mut first = chunk("ab", &[97, 98], None);
    first["choices"][0]["prompt_token_ids"] = json!([256, 104, 105]);
    assert!(p.observe(&mut first));
    assert!(first["choices"][0].get("token_ids").is_none() && first["choices"][0].get("prompt_token_ids").is_none(), "{first}");
    // A chunk with only ids (text held back by the engine) says nothing to this client.
    assert!(!p.observe(&mut chunk("", &[0xe2], None)));
    assert_eq!(p.generated(), 3);
    assert_eq!(p.refusal(), None);

    // "ab" came in one event of two ids: where its text stops is unknown, so the continuation
    // starts before it (and regenerates it: see `a_continuation_regenerates_what_may_be_held`).
    let body = p.continuation(&r, None).unwrap();
    assert_eq!(body["prompt"], json!([256, 104, 105]));
    assert_eq!(body["max_tokens"], json!(10));
    assert_eq!(body["return_token_ids"], json!(true));
    assert!(p.observe(&mut chunk("c", &[99], None)));
    let body = p.continuation(&r, None).unwrap();
    assert_eq!(body["prompt"], json!([256, 104, 105, 97, 98, 0xe2, 99]), "text of one id: everything before it is the client's");
    assert_eq!(body["max_tokens"], json!(6));

    let mut wants = Progress::new(&completions(json!({"return_token_ids": true})));
    let mut c = chunk("a", &[97], None);
    assert!(wants.observe(&mut c));
    assert_eq!(c["choices"][0]["token_ids"], json!([97]), "asked for: kept");
}

#[test]
fn a_stream_without_ids_or_already_finished_is_not_continued() {
    let r = completions(json!({}));
    let mut p = Progress::new(&r);
    let mut c = json!({"choices": [{"index": 0, "text": "ab", "finish_reason": null}]});
    p.observe(&mut c);
    assert_eq!(p.continuation(&r, None).unwrap_err(), "no_token_ids");
    let mut p = Progress::new(&r);
    let mut c = chunk("a", &[97], Some("length"));
    c["choices"][0]["prompt_token_ids"] = json!([1]);
    p.observe(&mut c);
    assert_eq!(p.refusal(), Some("already_finished"));
}

#[test]
fn chat_continues_as_completions_and_reads_as_chat() {
    let r = req(
        Endpoint::ChatCompletions,
        json!({"messages": [{"role": "user", "content": "x"}], "stream": true, "temperature": 0,
                                                  "stream_options": {"include_usage": true}}),
    );
    let mut p = Progress::new(&r);
    let mut role = json!({"id": "chatcmpl-a", "object": "chat.completion.chunk", "created": 3, "model": "m", "prompt_token_ids": [256, 1, 2],
                          "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]});
    assert!(p.observe(&mut role));
    assert!(role.get("prompt_token_ids").is_none());
    let mut c = json!({"id": "chatcmpl-a", "choices": [{"index": 0, "delta": {"content": "h"}, "token_ids": [104], "finish_reason": null}]});
    assert!(p.observe(&mut c));
    assert_eq!(p.continuation(&r, None).unwrap_err(), "unknown_max_tokens", "no budget given and no context limit known");
    let body = p.continuation(&r, Some(100)).unwrap();
    assert!(body.get("messages").is_none());
    assert_eq!(body["prompt"], json!([256, 1, 2, 104]));
    assert_eq!(body["max_tokens"], json!(96));
    assert_eq!(body["temperature"], json!(0));
    assert_eq!(body["stream_options"], json!({"include_usage": true}));

    p.begin_continuation();
    let out = p.rewrite(json!({"id": "cmpl-z", "object": "text_completion", "created": 9, "model": "m",
                               "choices": [{"index": 0, "text": "i", "token_ids": [105], "finish_reason": "length", "prompt_token_ids": [256, 1, 2, 104]}]}));
    let out = out.unwrap();
    assert_eq!(out["id"], "chatcmpl-a");
    assert_eq!(out["object"], "chat.completion.chunk");
    assert_eq!(out["created"], 3);
    assert_eq!(out["choices"], json!([{"index": 0, "delta": {"content": "i"}, "logprobs": null, "finish_reason": "length"}]));
    let usage = p.rewrite(json!({"id": "cmpl-z", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}})).unwrap();
    assert_eq!(usage["usage"], json!({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}), "the whole answer");
    assert_eq!(p.generated(), 2);
}

/// vLLM's detokenizer, primed with a prompt whose text ends inside a character, sends the
/// whole prompt's text as its first delta; so a continuation starts at the last id whose text
/// the client has whole, and what it regenerates that the client has already is not sent twice.
#[test]
fn a_continuation_regenerates_what_may_be_held_and_sends_only_what_is_new() {
    let r = completions(json!({"return_token_ids": true, "logprobs": 1}));
    let mut p = Progress::new(&r);
    let mut c = chunk("a", &[97], None);
    c["choices"][0]["prompt_token_ids"] = json!([256, 104]);
    assert!(p.observe(&mut c));
    assert!(p.observe(&mut chunk("bc", &[98, 99], None)), "two ids, their text in one event");
    assert!(p.observe(&mut chunk("", &[0xe2], None)), "held: the start of a character");
    let body = p.continuation(&r, None).unwrap();
    assert_eq!(body["prompt"], json!([256, 104, 97]));
    assert_eq!(body["max_tokens"], json!(9));

    p.begin_continuation();
    let ev = |text: &str, id: u32| {
        json!({"id": "cmpl-z", "choices": [{"index": 0, "text": text, "token_ids": [id], "finish_reason": null,
                                            "logprobs": {"tokens": ["t"], "token_logprobs": [-0.5], "top_logprobs": [{}], "text_offset": [0]}}]})
    };
    assert_eq!(p.rewrite(ev("b", 98)), None, "the client has \"b\" and its id");
    assert_eq!(p.rewrite(ev("c", 99)), None);
    assert_eq!(p.rewrite(ev("", 0xe2)), None);
    let out = p.rewrite(ev("", 0x82)).unwrap();
    assert_eq!((&out["choices"][0]["text"], &out["choices"][0]["token_ids"]), (&json!(""), &json!([0x82])), "new: its id goes out");
    assert_eq!(out["choices"][0]["logprobs"]["token_logprobs"], json!([-0.5]));
    let out = p.rewrite(ev("€", 0xac)).unwrap();
    assert_eq!(out["choices"][0]["text"], "€");
    assert_eq!(out["id"], "cmpl-a");
    let usage = p.rewrite(json!({"id": "cmpl-z", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}})).unwrap();
    assert_eq!(usage["usage"], json!({"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8}), "the whole answer, counted once");
    assert_eq!(p.generated(), 6);

    // Regenerated text arrives in other pieces than the client got it, or (sampled) differs.
    let mut skip = "bc".to_string();
    assert_eq!((unsent("b", &mut skip), skip.as_str()), ("", "c"));
    assert_eq!((unsent("cd", &mut skip), skip.as_str()), ("d", ""));
    let mut skip = "bc".to_string();
    assert_eq!((unsent("bx", &mut skip), skip.as_str()), ("x", ""), "past the common part, the new text goes out");
}

/// A second death during the regeneration: the client's text past `released` still counts.
#[test]
fn a_continuation_that_dies_while_regenerating_is_continued_from_the_same_point() {
    let r = completions(json!({}));
    let mut p = Progress::new(&r);
    let mut c = chunk("ab", &[97, 98], None);
    c["choices"][0]["prompt_token_ids"] = json!([256]);
    p.observe(&mut c);
    assert_eq!(p.continuation(&r, None).unwrap()["prompt"], json!([256]));
    p.begin_continuation();
    assert_eq!(p.rewrite(chunk("a", &[97], None)), None, "the client has it");
    // The second continuation starts after "a" and still owes nothing of "b" to the client.
    assert_eq!(p.continuation(&r, None).unwrap()["prompt"], json!([256, 97]));
    p.begin_continuation();
    assert_eq!(p.rewrite(chunk("b", &[98], None)), None);
    assert_eq!(p.rewrite(chunk("c", &[99], None)).unwrap()["choices"][0]["text"], "c");
}

#[test]
fn the_tracker_holds_partial_events_and_passes_done() {
    let r = completions(json!({}));
    let mut t = ResumeTracker::new(&r);
    let ev = format!("data: {}\n\n", chunk("a", &[97], None));
    let (head, tail) = ev.split_at(10);
    assert_eq!(t.process(head.as_bytes()), "");
    let out = t.process(tail.as_bytes());
    assert!(out.starts_with("data: {") && out.ends_with("\n\n") && !out.contains("token_ids"), "{out}");
    // The stream dies mid-event: the half is dropped, the continuation's events are rewritten.
    t.process(b"data: {\"choi");
    t.begin_continuation();
    let cont = format!("data: {}\n\ndata: [DONE]\n\n", json!({"id": "other", "choices": [{"index": 0, "text": "b", "token_ids": [98], "finish_reason": "length"}]}));
    let out = t.process(cont.as_bytes());
    assert!(out.contains("\"id\":\"cmpl-a\"") && out.contains("\"text\":\"b\"") && out.ends_with("data: [DONE]\n\n"), "{out}");
}

#[test]
fn generate_continues_from_input_ids_and_reads_as_one_cumulative_stream() {
    let r = req(Endpoint::Generate, json!({"input_ids": [256, 7], "stream": true, "rid": "x", "sampling_params": {"max_new_tokens": 5, "temperature": 0}}));
    assert_eq!(refusal(&r), None);
    let mut p = Progress::new(&r);
    let mut c = json!({"text": "a", "output_ids": [97], "meta_info": {"id": "g-1", "finish_reason": null, "prompt_tokens": 2, "completion_tokens": 1}});
    assert!(p.observe(&mut c));
    let mut c = json!({"text": "ab", "output_ids": [97, 98], "meta_info": {"id": "g-1", "finish_reason": null, "prompt_tokens": 2, "completion_tokens": 2}});
    p.observe(&mut c);
    let body = p.continuation(&r, None).unwrap();
    assert_eq!(body["input_ids"], json!([256, 7, 97, 98]));
    assert_eq!(body["sampling_params"], json!({"max_new_tokens": 3, "temperature": 0}));
    assert!(body.get("rid").is_none());
    p.begin_continuation();
    let out =
        p.rewrite(json!({"text": "c", "output_ids": [99], "meta_info": {"id": "g-2", "finish_reason": {"type": "length"}, "prompt_tokens": 4, "completion_tokens": 1}})).unwrap();
    assert_eq!(out["text"], "abc");
    assert_eq!(out["output_ids"], json!([97, 98, 99]));
    assert_eq!(out["meta_info"]["prompt_tokens"], 2);
    assert_eq!(out["meta_info"]["completion_tokens"], 3);
    assert_eq!(out["meta_info"]["id"], "g-1", "the first stream's id");
    assert_eq!(p.refusal(), Some("already_finished"));
}

/// Every event of `text` as JSON (or its raw data), for comparing two relays of one stream.
fn decoded(text: &[u8]) -> Vec<Value> {
    SseDecoder::new().feed(text).into_iter().map(|e| serde_json::from_str(&e.data).unwrap_or(Value::String(e.data))).collect()
}

/// The first stream read in place (`process_raw`, cut into `step`-byte chunks) and read by
/// parsing every event (`process`): the client sees the same events, the tracker learns the
/// same ids.
fn fast_equals_slow(r: &ParsedRequest, events: &[Value], step: usize) {
    let mut text: String = events.iter().map(|e| frame(&e.to_string())).collect();
    text.push_str("data: [DONE]\n\n");
    let (mut fast, mut slow) = (ResumeTracker::new(r), ResumeTracker::new(r));
    let mut out = Vec::new();
    for c in text.as_bytes().chunks(step) {
        out.extend(fast.process_raw(c).unwrap_or_else(|| c.to_vec()));
    }
    let expected = slow.process(text.as_bytes());
    assert_eq!(decoded(&out), decoded(expected.as_bytes()), "step {step}");
    let (f, s) = (&fast.progress, &slow.progress);
    assert_eq!((&f.generated, &f.prompt_ids, f.finished, f.ids_unknown, &f.head), (&s.generated, &s.prompt_ids, s.finished, s.ids_unknown, &s.head), "step {step}");
    assert_eq!((f.released, &f.text_after, f.sent_ids), (s.released, &s.text_after, s.sent_ids), "step {step}");
}

#[test]
fn reading_in_place_learns_and_hides_what_parsing_does() {
    let mut first = chunk("ab", &[97, 98], None);
    first["choices"][0]["prompt_token_ids"] = json!([256, 104, 105]);
    let mut ids_first = json!({"id": "cmpl-a", "choices": [{"token_ids": [7, 8], "index": 0, "text": "x", "finish_reason": null}]});
    ids_first["created"] = json!(7);
    let tricky = json!({"id": "cmpl-a", "choices": [{"index": 0, "text": "q\"token_ids\":[1]} \\", "logprobs": null, "finish_reason": null, "token_ids": [5]}]});
    let events = [
        first,
        chunk("c", &[99], None),
        chunk("", &[0xe2], None), // only ids: dropped for a client that did not ask
        ids_first,
        tricky,
        json!({"id": "cmpl-a", "choices": [{"index": 0, "text": "no ids", "finish_reason": null}]}),
        json!({"id": "cmpl-a", "choices": [{"index": 0, "text": "", "token_ids": [9], "logprobs": {"tokens": ["x"]}, "finish_reason": null}]}),
        chunk("d", &[100], Some("length")),
        json!({"id": "cmpl-a", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}),
        json!({"error": {"message": "boom"}}),
    ];
    for extra in [json!({}), json!({"return_token_ids": true})] {
        let r = completions(extra);
        for step in [1, 7, 64, 4096] {
            fast_equals_slow(&r, &events, step);
        }
    }
    let chat = req(Endpoint::ChatCompletions, json!({"messages": [{"role": "user", "content": "x"}], "stream": true}));
    let head = |choice: Value| json!({"id": "chatcmpl-a", "object": "chat.completion.chunk", "created": 3, "model": "m", "choices": [choice]});
    let mut role = head(json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}));
    role["prompt_token_ids"] = json!([256, 1, 2]);
    let events = [
        role,
        head(json!({"index": 0, "delta": {"content": "h"}, "token_ids": [104], "finish_reason": null})),
        head(json!({"index": 0, "delta": {}, "token_ids": [0xe2], "finish_reason": null})),
        head(json!({"index": 0, "delta": {"content": "i"}, "finish_reason": null})),
        head(json!({"index": 0, "delta": {}, "token_ids": [], "finish_reason": "stop"})),
    ];
    for step in [1, 5, 4096] {
        fast_equals_slow(&chat, &events, step);
    }
}

#[test]
fn an_event_of_the_usual_shape_goes_out_as_the_engine_wrote_it() {
    let wants = completions(json!({"return_token_ids": true}));
    let mut t = ResumeTracker::new(&wants);
    let mut first = chunk("a", &[97], None);
    first["choices"][0]["prompt_token_ids"] = json!([1]);
    t.process_raw(frame(&first.to_string()).as_bytes());
    let raw = br#"data: {"id":"cmpl-a","object":"text_completion","created":7,"model":"m","choices":[{"index":0,"text":"b","logprobs":null,"finish_reason":null,"token_ids":[98]}]}

"#;
    assert_eq!(t.process_raw(raw), None, "asked for ids: nothing to change, nothing copied");
    let mut t = ResumeTracker::new(&completions(json!({})));
    t.process_raw(frame(&first.to_string()).as_bytes());
    let out = String::from_utf8(t.process_raw(raw).unwrap()).unwrap();
    assert_eq!(out, "data: {\"id\":\"cmpl-a\",\"object\":\"text_completion\",\"created\":7,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\"b\",\"logprobs\":null,\"finish_reason\":null}]}\n\n");
    assert_eq!(t.progress.generated(), 2);
}

#[test]
fn the_first_event_with_the_prompts_ids_is_read_in_place_too() {
    // Keys not in serde_json's order: a parsed and re-framed event would read differently.
    let first = br#"data: {"id":"cmpl-a","object":"text_completion","created":7,"model":"m","choices":[{"index":0,"text":"a","logprobs":null,"finish_reason":null,"token_ids":[97],"prompt_token_ids":[1,2,3]}]}

"#;
    let mut t = ResumeTracker::new(&completions(json!({"return_token_ids": true})));
    assert_eq!(t.process_raw(first), None, "asked for ids: the event goes out as it came");
    assert_eq!((t.progress.prompt_ids.as_deref(), t.progress.generated()), (Some(&[1, 2, 3][..]), 1));
    assert_eq!(t.progress.head.get("created"), Some(&json!(7)));
    let mut t = ResumeTracker::new(&completions(json!({})));
    let out = String::from_utf8(t.process_raw(first).unwrap()).unwrap();
    assert_eq!(out, "data: {\"id\":\"cmpl-a\",\"object\":\"text_completion\",\"created\":7,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\"a\",\"logprobs\":null,\"finish_reason\":null}]}\n\n");
    assert_eq!(t.progress.counts(), Some((3, 1)));
    // Chat: the prompt's ids at the top of the chunk, cut with the comma before them.
    let chat = req(Endpoint::ChatCompletions, json!({"messages": [{"role": "user", "content": "x"}], "stream": true}));
    let mut t = ResumeTracker::new(&chat);
    let role = br#"data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}],"prompt_token_ids":[5,6]}

"#;
    let out = String::from_utf8(t.process_raw(role).unwrap()).unwrap();
    assert_eq!(out, "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}]}\n\n");
    assert_eq!(t.progress.prompt_ids.as_deref(), Some(&[5, 6][..]));
}

#[test]
fn the_ids_seen_count_the_prompt_and_the_answer_and_say_whether_the_engine_sends_them() {
    let r = completions(json!({}));
    let mut first = chunk("a", &[97], None);
    first["choices"][0]["prompt_token_ids"] = json!([1, 2, 3]);
    let mut t = ResumeTracker::new(&r);
    assert_eq!((t.gave_ids(), t.progress.counts()), (Some(false), None), "nothing read yet");
    t.process_raw(frame(&first.to_string()).as_bytes());
    t.process_raw(frame(&chunk("b", &[98], None).to_string()).as_bytes());
    assert_eq!((t.gave_ids(), t.progress.counts()), (Some(true), Some((3, 2))));
    t.begin_continuation();
    assert_eq!(t.gave_ids(), None, "a continuation's chunks say nothing of the first engine");
    t.process(frame(&chunk("c", &[99], Some("length")).to_string()).as_bytes());
    assert_eq!(t.progress.counts(), Some((3, 3)), "the whole answer, across the continuation");
    // An engine that ignores `return_token_ids` (text without ids): nothing to count from.
    let mut t = ResumeTracker::new(&r);
    let bare = json!({"id": "cmpl-a", "object": "text_completion", "created": 7, "model": "m", "choices": [{"index": 0, "text": "a", "finish_reason": null}]});
    t.process_raw(frame(&bare.to_string()).as_bytes());
    assert_eq!((t.gave_ids(), t.progress.counts()), (Some(false), None));
}

#[test]
fn a_generate_text_prompt_is_continued_from_the_gateways_ids_when_the_engine_counts_them_alike() {
    let r = req(Endpoint::Generate, json!({"text": "hi", "stream": true, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}));
    assert_eq!((refusal(&r), refusal_given(&r, true)), (Some("generate_text"), None));
    let guided = req(Endpoint::Generate, json!({"text": "hi", "stream": true, "sampling_params": {"regex": "a+"}}));
    assert_eq!(refusal_given(&guided, true), Some("guided_decoding"), "the other reasons still hold");
    let first =
        |prompt_tokens: u64| frame(&json!({"text": "a", "output_ids": [97], "meta_info": {"id": "g-1", "prompt_tokens": prompt_tokens, "completion_tokens": 1}}).to_string());
    let mut t = ResumeTracker::with_prompt_ids(&r, &[256, 104, 105]);
    t.process_raw(first(3).as_bytes());
    let body = t.progress.continuation(&r, None).unwrap();
    assert_eq!((body["input_ids"].clone(), body.get("text")), (json!([256, 104, 105, 97]), None), "ids, not text: an engine takes one");
    assert_eq!(body["sampling_params"]["max_new_tokens"], 3);
    // The engine made 2 tokens of the prompt: its tokenizer is not the gateway's.
    let mut t = ResumeTracker::with_prompt_ids(&r, &[256, 104, 105]);
    t.process_raw(first(2).as_bytes());
    assert_eq!(t.progress.continuation(&r, None).err(), Some("tokenizer_mismatch"));
}

#[test]
fn a_ledger_tells_what_the_bytes_would_have_across_a_continuation() {
    let r = completions(json!({}));
    let head = json!({"id": "cmpl-a", "object": "text_completion", "created": 7, "model": "m"});
    let Value::Object(head) = head else { unreachable!() };
    // The first stream, its ids in a ledger: the same continuation as from its bytes.
    let first = TokenLedger::default();
    first.open(&[256, 104, 105], head.clone());
    first.wrote(&[97, 98], false);
    first.wrote(&[0xe2], false);
    let mut p = Progress::new(&r);
    assert_eq!(p.refusal(), Some("no_prompt_ids"), "nothing learned before the ledger is read");
    p.absorb(&first);
    p.absorb(&first);
    assert_eq!(p.generated(), 3, "reading the ledger twice counts its ids once");
    assert_eq!(p.counts(), Some((3, 3)));
    // The gateway wrote that text itself (its detokenizer, primed with a continuation's
    // prompt, sends the character the continuation completes): every id is continued from.
    // An engine's bytes are continued from the last id whose text it sent.
    let mut from_bytes = Progress::new(&r);
    let mut c = chunk("a", &[97], None);
    c["choices"][0]["prompt_token_ids"] = json!([256, 104, 105]);
    from_bytes.observe(&mut c);
    from_bytes.observe(&mut chunk("b", &[98], None));
    from_bytes.observe(&mut chunk("", &[0xe2], None));
    assert_eq!(p.continuation(&r, None).unwrap()["prompt"], json!([256, 104, 105, 97, 98, 0xe2]));
    assert_eq!(from_bytes.continuation(&r, None).unwrap()["prompt"], json!([256, 104, 105, 97, 98]));

    // The continuation's own ledger: its prompt (the first prompt + what was generated) is not
    // the answer's, its ids follow the first stream's, and its chunks read as the first's.
    p.begin_continuation();
    let cont = TokenLedger::default();
    cont.open(&[256, 104, 105, 97, 98, 0xe2], Map::new());
    cont.wrote(&[0x82], false);
    p.absorb(&cont);
    cont.wrote(&[0xac], true);
    p.absorb(&cont);
    assert_eq!(p.generated(), 5);
    assert_eq!(p.counts(), Some((3, 5)));
    assert_eq!(p.refusal(), Some("already_finished"));
    let out = p.rewrite(json!({"id": "cmpl-z", "object": "text_completion", "created": 9, "model": "m",
                               "choices": [{"index": 0, "text": "€", "finish_reason": "length"}]}));
    let out = out.unwrap();
    assert_eq!((out["id"].as_str(), out["created"].as_u64()), (Some("cmpl-a"), Some(7)), "the envelope the ledger told");
    assert_eq!(p.generated(), 5, "a continuation's chunk without ids adds none");
}

#[test]
fn token_ids_are_read_by_hand_as_serde_json_would_read_them() {
    for raw in [
        "[]",
        "[ ]",
        "[0]",
        "[1,2,3]",
        " [ 4 , 5 ] ",
        "[4294967295]",
        "[4294967296]",
        "[01]",
        "[1e2]",
        "[1.0]",
        "[-1]",
        "[1,]",
        "[,1]",
        "[1 2]",
        "[\"1\"]",
        "[1]x",
        "",
        "[",
        "[99999999999999999999]",
    ] {
        let mut ids = vec![7];
        let by_hand = super::scan::parse_ids(raw.as_bytes(), &mut ids);
        let serde = serde_json::from_str::<Vec<u32>>(raw).ok();
        assert_eq!(by_hand, serde.is_some(), "{raw:?}");
        let expected: Vec<u32> = std::iter::once(7).chain(serde.unwrap_or_default()).collect();
        assert_eq!(ids, expected, "{raw:?}: appended, or nothing");
    }
}
