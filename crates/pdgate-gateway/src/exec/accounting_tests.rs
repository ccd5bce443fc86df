use std::time::{Duration, Instant};

use bytes::Bytes;
use pdgate_protocol::{parse_request, Endpoint, Limits};
use serde_json::json;

use super::*;

fn ev(v: serde_json::Value) -> String {
    format!("data: {v}\n\n")
}

fn chat(content: &str) -> String {
    ev(json!({"choices": [{"index": 0, "delta": {"content": content}, "finish_reason": null}]}))
}

fn usage_chunk() -> String {
    ev(json!({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 6}}}))
}

/// Feeds chunks at t0 + i ms; returns what the client got and the tally.
fn run(endpoint: Endpoint, strip: bool, chunks: &[&str]) -> (String, StreamTally, Instant) {
    let t0 = Instant::now();
    let mut t = StreamTally::new(endpoint, strip, false);
    let mut out = Vec::new();
    for (i, c) in chunks.iter().enumerate() {
        out.extend_from_slice(&t.process(Bytes::from(c.to_string()), t0 + Duration::from_millis(i as u64)));
    }
    if let Some(rest) = t.flush() {
        out.extend_from_slice(&rest);
    }
    (String::from_utf8(out).unwrap(), t, t0)
}

#[test]
fn the_role_chunk_is_not_the_first_token() {
    let role = ev(json!({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}));
    let (out, mut t, t0) = run(Endpoint::ChatCompletions, false, &[&role, &chat("Hi"), &chat(" there"), &usage_chunk(), "data: [DONE]\n\n"]);
    assert_eq!(t.first_content, Some(t0 + Duration::from_millis(1)));
    assert_eq!(t.usage(), Usage { prompt: Some(7), output: Some(4), cached: Some(6) });
    // Not asked to strip: every byte passes as it came.
    assert_eq!(out, [role, chat("Hi"), chat(" there"), usage_chunk(), "data: [DONE]\n\n".into()].concat());
}

#[test]
fn usage_the_gateway_asked_for_is_stripped() {
    let (out, mut t, _) = run(Endpoint::ChatCompletions, true, &[&chat("a"), &chat("b"), &usage_chunk(), "data: [DONE]\n\n"]);
    assert_eq!(out, [chat("a"), chat("b"), "data: [DONE]\n\n".into()].concat());
    assert_eq!(t.usage().output, Some(4));
}

#[test]
fn usage_inside_a_content_chunk_is_removed_from_it_only() {
    let both = ev(json!({"choices": [{"index": 0, "text": "z"}], "usage": {"prompt_tokens": 2, "completion_tokens": 1}}));
    let (out, mut t, _) = run(Endpoint::Completions, true, &[&both, "data: [DONE]\n\n"]);
    assert!(!out.contains("usage") && out.contains("\"text\":\"z\"") && out.ends_with("data: [DONE]\n\n"), "{out}");
    assert_eq!(t.usage(), Usage { prompt: Some(2), output: Some(1), cached: None });
}

#[test]
fn an_event_split_across_chunks_is_read_and_stripped_whole() {
    let u = usage_chunk();
    let (a, b) = u.split_at(20);
    let (out, mut t, _) = run(Endpoint::ChatCompletions, true, &[&chat("a"), a, b, "data: [DONE]\n\n"]);
    assert_eq!(out, [chat("a"), "data: [DONE]\n\n".into()].concat());
    assert_eq!(t.usage().prompt, Some(7));
    // Split before the first content: the first token is when its event completes.
    let c = chat("x");
    let (a, b) = c.split_at(10);
    let (out, t, t0) = run(Endpoint::ChatCompletions, false, &[a, b, "data: [DONE]\n\n"]);
    assert_eq!(out, [c, "data: [DONE]\n\n".into()].concat());
    assert_eq!(t.first_content, Some(t0 + Duration::from_millis(1)));
}

#[test]
fn without_usage_the_events_are_counted() {
    let text = |s: &str| ev(json!({"choices": [{"index": 0, "text": s}]}));
    let (_, mut t, t0) = run(Endpoint::Completions, false, &[&text(""), &text("a"), &text("b"), &text("c"), "data: [DONE]\n\n"]);
    assert_eq!(t.first_content, Some(t0 + Duration::from_millis(1)));
    assert_eq!(t.usage(), Usage { prompt: None, output: Some(3), cached: None });
}

#[test]
fn generate_reads_the_counts_of_its_last_event() {
    let g = |text: &str, n: u64| ev(json!({"text": text, "output_ids": [1], "meta_info": {"prompt_tokens": 9, "completion_tokens": n, "cached_tokens": 9}}));
    let (out, mut t, t0) = run(Endpoint::Generate, false, &[&g("a", 1), &g("ab", 2), &[g("abc", 3), "data: [DONE]\n\n".into()].concat()]);
    assert_eq!(t.first_content, Some(t0));
    assert_eq!(t.usage(), Usage { prompt: Some(9), output: Some(3), cached: Some(9) });
    assert!(out.ends_with("data: [DONE]\n\n"));
}

#[test]
fn a_generate_batch_sums_its_items() {
    let g = |i: u64, n: u64| ev(json!({"index": i, "text": "t", "meta_info": {"prompt_tokens": 4, "completion_tokens": n}}));
    let t0 = Instant::now();
    let mut t = StreamTally::new(Endpoint::Generate, false, true);
    for c in [g(0, 1), g(1, 1), g(0, 2), g(1, 5)] {
        t.process(Bytes::from(c), t0);
    }
    assert_eq!(t.usage(), Usage { prompt: Some(8), output: Some(7), cached: None });
}

#[test]
fn content_means_output_for_the_client() {
    assert!(has_content(Endpoint::ChatCompletions, &json!({"choices": [{"delta": {"tool_calls": [{"id": "c"}]}}]})));
    assert!(has_content(Endpoint::ChatCompletions, &json!({"choices": [{"delta": {"reasoning_content": "hm"}}]})));
    assert!(!has_content(Endpoint::ChatCompletions, &json!({"choices": [{"delta": {}, "finish_reason": "stop"}]})));
    assert!(has_content(Endpoint::Completions, &json!({"choices": [{"text": ""}, {"text": "b"}]})));
    assert!(!has_content(Endpoint::Generate, &json!({"text": "", "meta_info": {}})));
}

#[test]
fn usage_of_every_answer_shape() {
    assert_eq!(usage_of(&json!({"usage": {"prompt_tokens": 3, "completion_tokens": 2}})), Some(Usage { prompt: Some(3), output: Some(2), cached: None }));
    let batch = json!([{"meta_info": {"prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 1}}, {"meta_info": {"prompt_tokens": 4, "completion_tokens": 5}}]);
    assert_eq!(usage_of(&batch), Some(Usage { prompt: Some(7), output: Some(7), cached: Some(1) }));
    assert_eq!(usage_of(&json!({"usage": null, "choices": []})), None);
}

#[test]
fn usage_is_asked_for_only_where_the_client_did_not() {
    let limits = Limits::default();
    let parse = |e, v: serde_json::Value| parse_request(e, v.to_string().as_bytes(), &limits).unwrap();
    let mut r = parse(Endpoint::ChatCompletions, json!({"messages": [{"role": "user", "content": "hi"}], "stream": true}));
    // Absent: added (appended to the client's bytes when forwarded, not encoded).
    assert!(ask_for_usage(&mut r) && !r.rewritten && r.added == ["stream_options"]);
    assert_eq!(r.body["stream_options"], json!({"include_usage": true}));
    let mut r = parse(Endpoint::Completions, json!({"prompt": "a", "stream": true, "stream_options": {"include_usage": false, "x": 1}}));
    // The client's own options, changed: the body is encoded.
    assert!(ask_for_usage(&mut r) && r.rewritten);
    assert_eq!(r.body["stream_options"], json!({"include_usage": true, "x": 1}));
    let mut asked = parse(Endpoint::Completions, json!({"prompt": "a", "stream": true, "stream_options": {"include_usage": true}}));
    assert!(!ask_for_usage(&mut asked) && !asked.rewritten);
    let mut whole = parse(Endpoint::Completions, json!({"prompt": "a"}));
    assert!(!ask_for_usage(&mut whole) && !whole.body.contains_key("stream_options"));
    let mut generate = parse(Endpoint::Generate, json!({"text": "a", "stream": true}));
    assert!(!ask_for_usage(&mut generate));
}

#[test]
fn a_resumed_stream_counts_the_whole_answer_not_the_continuation() {
    // The first decode sent 3 tokens and died; the continuation's engine saw a prompt of
    // 4 + 3 tokens (7) and generated 4: the answer is a 4-token prompt and 7 tokens out.
    let t0 = Instant::now();
    let mut t = StreamTally::new(Endpoint::ChatCompletions, true, false);
    for (i, c) in [chat("a"), chat("b"), chat("c")].iter().enumerate() {
        t.process(Bytes::from(c.clone()), t0 + Duration::from_millis(i as u64));
    }
    t.continued(3);
    let out = t.process(Bytes::from(format!("{}{}", chat("d"), usage_chunk())), t0 + Duration::from_millis(5));
    assert!(!String::from_utf8_lossy(&out).contains("usage"), "the usage the gateway asked for is still stripped");
    assert_eq!(t.first_content, Some(t0), "the first token came on the first decode");
    assert_eq!(t.usage(), Usage { prompt: Some(4), output: Some(7), cached: Some(4) });
}

#[test]
fn a_resumed_generate_stream_counts_the_whole_answer() {
    let t0 = Instant::now();
    let mut t = StreamTally::new(Endpoint::Generate, false, false);
    let meta = |text: &str, prompt: u64, done: u64| ev(json!({"text": text, "output_ids": [1], "meta_info": {"prompt_tokens": prompt, "completion_tokens": done}}));
    t.process(Bytes::from(meta("a", 5, 1) + &meta("ab", 5, 2)), t0);
    t.continued(2);
    t.process(Bytes::from(meta("c", 7, 1) + &meta("cd", 7, 2)), t0 + Duration::from_millis(3));
    assert_eq!(t.usage(), Usage { prompt: Some(5), output: Some(4), cached: None });
}

#[test]
fn without_reported_usage_a_resumed_stream_counts_its_events_over_both_decodes() {
    let t0 = Instant::now();
    let mut t = StreamTally::new(Endpoint::Completions, false, false);
    let text = |s: &str| ev(json!({"choices": [{"index": 0, "text": s}]}));
    t.process(Bytes::from(text("a") + &text("b")), t0);
    t.continued(2);
    t.process(Bytes::from(text("c") + "data: [DONE]\n\n"), t0);
    assert_eq!(t.usage().output, Some(3));
}

#[test]
fn usage_is_asked_of_the_engine_only_where_the_counts_need_it() {
    let limits = Limits::default();
    let parse = |e, v: serde_json::Value| parse_request(e, v.to_string().as_bytes(), &limits).unwrap();
    let stream = || parse(Endpoint::Completions, json!({"prompt": "a", "stream": true}));
    // Regular, ids tracked: nothing in the body; per worker (`ask_for_usage_in`) until it is known to send ids.
    let mut r = stream();
    assert_eq!(usage_ask(&mut r, false, true), UsageAsk::UnlessIds);
    assert!(!r.body.contains_key("stream_options") && UsageAsk::UnlessIds.strips());
    // PD (the decode's cached-token report) and untracked streams: asked in the body.
    for (pd, ids) in [(true, true), (true, false), (false, false)] {
        let mut r = stream();
        assert_eq!(usage_ask(&mut r, pd, ids), UsageAsk::Always, "pd {pd} ids {ids}");
        assert_eq!(r.body["stream_options"], json!({"include_usage": true}));
    }
    // The client asked, or there is no usage chunk: nothing asked, nothing stripped.
    let mut asked = parse(Endpoint::Completions, json!({"prompt": "a", "stream": true, "stream_options": {"include_usage": true}}));
    let mut whole = parse(Endpoint::Completions, json!({"prompt": "a"}));
    let mut generate = parse(Endpoint::Generate, json!({"text": "a", "stream": true}));
    for r in [&mut asked, &mut whole, &mut generate] {
        assert_eq!(usage_ask(r, true, false), UsageAsk::None);
        assert!(!UsageAsk::None.strips());
    }
    assert_eq!(whole.body.get("stream_options"), None);
    // One leg's body: a forwarded body becomes the request's with the option added.
    let r = stream();
    let mut body = LegBody::Forward;
    ask_for_usage_in(&mut body, &r);
    let LegBody::Json(b) = body else { panic!("the forwarded body is encoded") };
    assert_eq!((b["stream_options"].clone(), b["prompt"].clone()), (json!({"include_usage": true}), json!("a")));
}

#[test]
fn without_usage_a_tracked_stream_counts_from_its_ids_then_from_its_events() {
    let text = |s: &str| ev(json!({"choices": [{"index": 0, "text": s}]}));
    let (_, mut t, _) = run(Endpoint::Completions, true, &[&text("a"), &text("b"), &text("c"), "data: [DONE]\n\n"]);
    assert_eq!(t.usage_with(Some((6, 3))), Usage { prompt: Some(6), output: Some(3), cached: None }, "the ids count exactly");
    assert_eq!(t.usage_with(None), Usage { prompt: None, output: Some(3), cached: None }, "else the events, and no prompt count");
    // Reported usage wins over the ids.
    let (_, mut t, _) = run(Endpoint::Completions, true, &[&text("a"), &usage_chunk(), "data: [DONE]\n\n"]);
    assert_eq!(t.usage_with(Some((1, 1))), Usage { prompt: Some(7), output: Some(4), cached: Some(6) });
}
