//! Unit tests of response.rs (token events in, the route's bytes out).

use super::*;
use crate::clients::grpc::logprobs::{LogprobAsk, LpPart, TokenLp};
use crate::clients::grpc::request::{Sampling, Shape};

pub(crate) fn tok() -> ModelTokenizer {
    let dir = format!("{}/../pdgate-tokenizer/tests/fixtures/bpe", env!("CARGO_MANIFEST_DIR"));
    ModelTokenizer::from_path(std::path::Path::new(&dir)).unwrap()
}

pub(crate) fn shape(route: Route, stream: bool, stop: &[&str], n: u32) -> Shape {
    Shape {
        route,
        stream,
        include_usage: true,
        return_token_ids: false,
        id: "cmpl-1".into(),
        model: Some("m".into()),
        prompts: vec![vec![]],
        batch: false,
        logprobs: None,
        resumed_ids: 0,
        sampling: Sampling { stop: stop.iter().map(|s| s.to_string()).collect(), skip_special_tokens: true, n, max_new_tokens: 64, ..Sampling::default() },
    }
}

pub(crate) fn data(b: &Bytes) -> Vec<Value> {
    String::from_utf8(b.to_vec()).unwrap().split("\n\n").filter_map(|e| e.strip_prefix("data: ")).filter(|d| *d != "[DONE]").map(|d| serde_json::from_str(d).unwrap()).collect()
}

pub(crate) fn counts(c: u32) -> Counts {
    Counts { prompt: 3, completion: c, cached: 2 }
}

/// Streams `ids` one token a chunk; returns every SSE event and the writer.
fn stream_one_by_one<'t>(tok: &'t ModelTokenizer, sh: Shape, ids: &[u32], reason: &str, matched: Option<Matched>) -> (Vec<Value>, Writer<'t>) {
    stream_through(Writer::new(sh, tok, "served"), ids, reason, matched)
}

/// Streams `ids` one token a chunk through `w`.
fn stream_through<'t>(mut w: Writer<'t>, ids: &[u32], reason: &str, matched: Option<Matched>) -> (Vec<Value>, Writer<'t>) {
    let mut out = vec![];
    let (last, body) = ids.split_last().unwrap();
    for (k, id) in body.iter().enumerate() {
        if let Some(b) = w.on_event(Gen::Chunk { index: 0, ids: vec![*id], counts: counts(k as u32 + 1), lp: LpPart::default() }).unwrap() {
            out.extend(data(&b));
        }
    }
    let done = Gen::Complete { index: 0, ids: vec![*last], finish_reason: reason.into(), matched, counts: counts(ids.len() as u32), lp: LpPart::default() };
    if let Some(b) = w.on_event(done).unwrap() {
        out.extend(data(&b));
    }
    assert!(w.all_done());
    out.extend(data(&w.end_stream()));
    (out, w)
}

fn text(events: &[Value]) -> String {
    events
        .iter()
        .flat_map(|e| e["choices"].as_array().cloned().unwrap_or_default())
        .map(|c| c["text"].as_str().or(c["delta"]["content"].as_str()).unwrap_or("").to_string())
        .collect()
}

#[test]
fn multibyte_text_streams_whole_characters_and_equals_one_decode() {
    let tok = tok();
    let want = "naïve café — 東京 ok";
    let ids = tok.encode(want, false).unwrap();
    let (events, _) = stream_one_by_one(&tok, shape(Route::Completions, true, &[], 1), &ids, "length", None);
    for e in &events {
        for c in e["choices"].as_array().unwrap() {
            assert!(!c["text"].as_str().unwrap().contains('\u{FFFD}'), "a broken character was sent: {e}");
        }
    }
    assert_eq!(text(&events), tok.decode(&ids, true).unwrap());
    let last = events.iter().rev().find(|e| !e["choices"].as_array().unwrap().is_empty()).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    let usage = &events.last().unwrap()["usage"];
    assert_eq!((usage["prompt_tokens"].as_u64(), usage["completion_tokens"].as_u64()), (Some(3), Some(ids.len() as u64)));
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 2);
}

#[test]
fn a_streamed_complete_that_repeats_the_last_chunk_adds_nothing_twice() {
    let tok = tok();
    let ids = tok.encode("once only", false).unwrap();
    let mut w = Writer::new(shape(Route::Completions, true, &[], 1), &tok, "served");
    let mut out = vec![];
    out.extend(data(&w.on_event(Gen::Chunk { index: 0, ids: ids.clone(), counts: counts(ids.len() as u32), lp: LpPart::default() }).unwrap().unwrap_or_default()));
    let done = Gen::Complete { index: 0, ids: ids.clone(), finish_reason: "length".into(), matched: None, counts: counts(ids.len() as u32), lp: LpPart::default() };
    out.extend(data(&w.on_event(done).unwrap().unwrap_or_default()));
    assert_eq!(text(&out), "once only");
}

#[test]
fn a_stop_string_spanning_chunks_is_cut_and_never_sent() {
    let tok = tok();
    let ids = tok.encode("hello world, stop here please", false).unwrap();
    let (events, _) = stream_one_by_one(&tok, shape(Route::Chat, true, &["stop here"], 1), &ids, "stop", Some(Matched::Text("stop here".into())));
    assert_eq!(events[0]["choices"][0]["delta"], json!({"role": "assistant", "content": ""}));
    assert_eq!(text(&events), "hello world, ");
    assert!(events.iter().all(|e| !e.to_string().contains("stop h")));
}

#[test]
fn whole_answers_have_every_choice_and_usage_counts_the_prompt_once() {
    let tok = tok();
    let ids = tok.encode("two answers", false).unwrap();
    let mut w = Writer::new(shape(Route::Completions, false, &[], 2), &tok, "served");
    for index in [1, 0] {
        let done = Gen::Complete { index, ids: ids.clone(), finish_reason: "length".into(), matched: None, counts: counts(ids.len() as u32), lp: LpPart::default() };
        assert!(w.on_event(done).unwrap().is_none());
    }
    let v: Value = serde_json::from_slice(&w.whole()).unwrap();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["model"], "m");
    assert_eq!(v["choices"][0]["text"], "two answers");
    assert_eq!(v["choices"][1]["text"], "two answers");
    assert_eq!(v["usage"]["prompt_tokens"], 3);
    assert_eq!(v["usage"]["completion_tokens"], 2 * ids.len() as u64);
    let bad = Gen::Chunk { index: 5, ids: vec![1], counts: counts(1), lp: LpPart::default() };
    assert!(w.on_event(bad).is_err());
}

#[test]
fn generate_reports_cumulative_text_ids_and_the_matched_stop() {
    let tok = tok();
    let ids = tok.encode("abc def", false).unwrap();
    let mut sh = shape(Route::Generate, false, &[], 1);
    sh.id = "g1".into();
    let mut w = Writer::new(sh, &tok, "served");
    let stop_id = *ids.last().unwrap();
    w.on_event(Gen::Complete {
        index: 0,
        ids: ids.clone(),
        finish_reason: "stop".into(),
        matched: Some(Matched::TokenId(stop_id)),
        counts: counts(ids.len() as u32),
        lp: LpPart::default(),
    })
    .unwrap();
    let v: Value = serde_json::from_slice(&w.whole()).unwrap();
    assert_eq!(v["output_ids"], json!(ids));
    assert_eq!(v["text"], "abc def");
    assert_eq!(v["meta_info"]["finish_reason"], json!({"type": "stop", "matched": stop_id}));
    assert_eq!(v["meta_info"]["id"], "g1");
}

fn lp(id: u32, v: f32) -> TokenLp {
    TokenLp { id, logprob: Some(v), top: vec![(v, id)] }
}

#[test]
fn a_batch_answers_in_prompt_order_with_usage_summed_per_prompt() {
    let tok = tok();
    let a = tok.encode("first", false).unwrap();
    let b = tok.encode("second one", false).unwrap();
    let mut sh = shape(Route::Completions, false, &[], 2);
    sh.prompts = vec![vec![1, 2, 3], vec![4, 5]];
    sh.batch = true;
    let mut w = Writer::new(sh, &tok, "served");
    // Prompt 1's calls answer first; choices 2 and 3 are prompt 1's.
    for (index, ids, prompt) in [(2, &b, 2), (3, &b, 2), (0, &a, 3), (1, &a, 3)] {
        let c = Counts { prompt, completion: ids.len() as u32, cached: 1 };
        w.on_event(Gen::Complete { index, ids: ids.clone(), finish_reason: "length".into(), matched: None, counts: c, lp: LpPart::default() }).unwrap();
    }
    let v: Value = serde_json::from_slice(&w.whole()).unwrap();
    let texts: Vec<&str> = v["choices"].as_array().unwrap().iter().map(|c| c["text"].as_str().unwrap()).collect();
    assert_eq!(texts, vec!["first", "first", "second one", "second one"]);
    assert_eq!(v["choices"][3]["index"], 3);
    assert_eq!(v["usage"]["prompt_tokens"], 5);
    assert_eq!(v["usage"]["completion_tokens"], 2 * (a.len() + b.len()) as u64);
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 2);
}

#[test]
fn generate_batches_answer_a_list_even_for_one_prompt() {
    let tok = tok();
    let ids = tok.encode("x", false).unwrap();
    let mut sh = shape(Route::Generate, false, &[], 1);
    sh.batch = true;
    sh.id = "g".into();
    let mut w = Writer::new(sh, &tok, "served");
    w.on_event(Gen::Complete { index: 0, ids, finish_reason: "length".into(), matched: None, counts: counts(1), lp: LpPart::default() }).unwrap();
    let v: Value = serde_json::from_slice(&w.whole()).unwrap();
    assert_eq!(v.as_array().map(Vec::len), Some(1), "{v}");
    assert_eq!(v[0]["meta_info"]["id"], "g");
}

#[test]
fn streamed_logprobs_go_out_per_token_and_a_repeating_complete_adds_none_twice() {
    let tok = tok();
    let ids = tok.encode("ab cd", false).unwrap();
    let mut sh = shape(Route::Completions, true, &[], 1);
    sh.logprobs = Some(LogprobAsk::Completions { top: 1 });
    let mut w = Writer::new(sh, &tok, "served");
    let mut out = vec![];
    let lps: Vec<TokenLp> = ids.iter().enumerate().map(|(k, &id)| lp(id, -(k as f32) - 0.5)).collect();
    out.extend(data(&w.on_event(Gen::Chunk { index: 0, ids: ids.clone(), counts: counts(ids.len() as u32), lp: LpPart { output: lps.clone(), input: None } }).unwrap().unwrap()));
    // The Complete repeats the chunk's ids and their logprobs (as the servicers do).
    let done =
        Gen::Complete { index: 0, ids: ids.clone(), finish_reason: "length".into(), matched: None, counts: counts(ids.len() as u32), lp: LpPart { output: lps, input: None } };
    out.extend(data(&w.on_event(done).unwrap().unwrap()));
    let tokens: Vec<String> =
        out.iter().flat_map(|e| e["choices"][0]["logprobs"]["tokens"].as_array().cloned().unwrap_or_default()).map(|t| t.as_str().unwrap().to_string()).collect();
    assert_eq!(tokens.concat(), "ab cd");
    assert_eq!(tokens.len(), ids.len());
    let values: Vec<f64> = out.iter().flat_map(|e| e["choices"][0]["logprobs"]["token_logprobs"].as_array().cloned().unwrap_or_default()).map(|v| v.as_f64().unwrap()).collect();
    assert_eq!(values[0], -0.5);
}

#[test]
fn native_logprobs_keep_the_prompts_and_accumulate_the_outputs() {
    let tok = tok();
    let ids = tok.encode("ab", false).unwrap();
    let mut sh = shape(Route::Generate, true, &[], 1);
    sh.logprobs = Some(LogprobAsk::Native { top: 0, text: false });
    let mut w = Writer::new(sh, &tok, "served");
    let input = vec![TokenLp { id: 9, logprob: None, top: vec![] }, lp(10, -1.0)];
    let first = LpPart { output: vec![lp(ids[0], -0.25)], input: Some(input) };
    w.on_event(Gen::Chunk { index: 0, ids: vec![ids[0]], counts: counts(1), lp: first }).unwrap();
    let rest = ids[1..].to_vec();
    let part = LpPart { output: rest.iter().map(|&id| lp(id, -0.75)).collect(), input: None };
    let last =
        data(&w.on_event(Gen::Complete { index: 0, ids: rest, finish_reason: "length".into(), matched: None, counts: counts(ids.len() as u32), lp: part }).unwrap().unwrap());
    let meta = &last.last().unwrap()["meta_info"];
    assert_eq!(meta["input_token_logprobs"], json!([[null, 9, null], [-1.0, 10, null]]));
    assert_eq!(meta["output_token_logprobs"].as_array().unwrap().len(), ids.len());
    assert!(meta.get("output_top_logprobs").is_none());
}

#[test]
fn per_chunk_counts_as_vllm_sends_them_still_sum_to_every_token() {
    let tok = tok();
    let ids = tok.encode("four token text", false).unwrap();
    let mut w = Writer::new(shape(Route::Completions, true, &[], 1), &tok, "served");
    let (last, body) = ids.split_last().unwrap();
    for id in body {
        w.on_event(Gen::Chunk { index: 0, ids: vec![*id], counts: counts(1), lp: LpPart::default() }).unwrap();
    }
    w.on_event(Gen::Chunk { index: 0, ids: vec![*last], counts: counts(1), lp: LpPart::default() }).unwrap();
    // vLLM's Complete repeats the last chunk, counting only it.
    w.on_event(Gen::Complete { index: 0, ids: vec![*last], finish_reason: "length".into(), matched: None, counts: counts(1), lp: LpPart::default() }).unwrap();
    let usage = &data(&w.end_stream())[0]["usage"];
    assert_eq!(usage["completion_tokens"], ids.len() as u64);
}

/// A stream of one choice to the prompt [7, 8, 9] whose token ids were asked for.
fn ids_stream_shape(route: Route) -> Shape {
    let mut sh = shape(route, true, &[], 1);
    sh.return_token_ids = true;
    sh.prompts = vec![vec![7, 8, 9]];
    sh
}

#[test]
fn a_stream_with_return_token_ids_carries_the_prompt_ids_once_where_resume_reads_them() {
    let tok = tok();
    let ids = tok.encode("ids for resume", false).unwrap();
    for route in [Route::Completions, Route::Chat] {
        let sh = ids_stream_shape(route);
        let (events, _) = stream_one_by_one(&tok, sh, &ids, "length", None);
        // Chat: on the role chunk (top level); completions: on the first choice.
        let carriers: Vec<&Value> = events.iter().filter(|e| e.to_string().contains("prompt_token_ids")).collect();
        assert_eq!(carriers.len(), 1, "{route:?}: {events:?}");
        let at = if route == Route::Chat { &carriers[0]["prompt_token_ids"] } else { &carriers[0]["choices"][0]["prompt_token_ids"] };
        assert_eq!(at, &json!([7, 8, 9]), "{route:?}");
        if route == Route::Chat {
            assert_eq!(carriers[0]["choices"][0]["delta"]["role"], "assistant");
        }
        let streamed: Vec<u64> = events
            .iter()
            .flat_map(|e| e["choices"].as_array().cloned().unwrap_or_default())
            .flat_map(|c| c["token_ids"].as_array().cloned().unwrap_or_default())
            .filter_map(|v| v.as_u64())
            .collect();
        assert_eq!(streamed, ids.iter().map(|&i| u64::from(i)).collect::<Vec<_>>(), "{route:?}: every id once");
    }
    // Without return_token_ids, no ids at all.
    let (events, _) = stream_one_by_one(&tok, shape(Route::Completions, true, &[], 1), &ids, "length", None);
    assert!(events.iter().all(|e| !e.to_string().contains("token_ids")));
}

#[test]
fn ids_only_the_resume_tracker_wants_go_to_the_ledger_not_the_bytes() {
    let tok = tok();
    let ids = tok.encode("ids for resume", false).unwrap();
    for route in [Route::Completions, Route::Chat] {
        let sh = ids_stream_shape(route);
        let ledger = Arc::new(TokenLedger::default());
        let w = Writer::new(sh.clone(), &tok, "served").with_ledger(Some(ledger.clone()));
        let (events, _) = stream_through(w, &ids, "length", None);
        assert!(events.iter().all(|e| !e.to_string().contains("token_ids")), "{route:?}: {events:?}");
        let (with_ids, _) = stream_one_by_one(&tok, sh, &ids, "length", None);
        assert_eq!(text(&events), text(&with_ids), "{route:?}: the same text");
        let e = ledger.entries();
        assert_eq!((e.prompt, e.generated, e.finished), (vec![7, 8, 9], ids.clone(), true), "{route:?}");
        let object = if route == Route::Chat { "chat.completion.chunk" } else { "text_completion" };
        assert_eq!((e.head["id"].as_str(), e.head["object"].as_str(), e.head["model"].as_str()), (Some("cmpl-1"), Some(object), Some("m")));
        assert_eq!(e.head["created"], events[0]["created"], "the envelope the chunks carry");
    }
    // A whole answer, or `/generate` (its ids are in every event anyway), ignores the ledger.
    for (route, stream) in [(Route::Completions, false), (Route::Generate, true)] {
        let ledger = Arc::new(TokenLedger::default());
        let w = Writer::new(shape(route, stream, &[], 1), &tok, "served").with_ledger(Some(ledger.clone()));
        let _ = stream_through(w, &ids, "length", None);
        assert!(ledger.entries().generated.is_empty(), "{route:?}");
    }
}

#[test]
fn a_prefills_kv_transfer_params_are_the_whole_answers_top_level_field() {
    let tok = tok();
    let params = json!({"do_remote_prefill": true, "remote_block_ids": [3, 4], "remote_engine_id": "e1", "tp_size": 1});
    let done = || Gen::Complete { index: 0, ids: vec![65], finish_reason: "length".into(), matched: None, counts: counts(1), lp: LpPart::default() };
    for route in [Route::Completions, Route::Chat] {
        let mut w = Writer::new(shape(route, false, &[], 1), &tok, "served");
        assert!(w.on_event(Gen::KvTransferParams(params.clone())).unwrap().is_none());
        w.on_event(done()).unwrap();
        let v: Value = serde_json::from_slice(&w.whole()).unwrap();
        assert_eq!(v["kv_transfer_params"], params, "{route:?}");
    }
    let mut plain = Writer::new(shape(Route::Completions, false, &[], 1), &tok, "served");
    plain.on_event(done()).unwrap();
    let v: Value = serde_json::from_slice(&plain.whole()).unwrap();
    assert!(v.get("kv_transfer_params").is_none());
}

/// The text a stream writes for `ids` sent one chunk each, without its end (the stream broke).
fn stream_broken_after(w: &mut Writer<'_>, ids: &[u32]) -> String {
    let mut out = vec![];
    for (k, id) in ids.iter().enumerate() {
        if let Some(b) = w.on_event(Gen::Chunk { index: 0, ids: vec![*id], counts: counts(k as u32 + 1), lp: LpPart::default() }).unwrap() {
            out.extend(data(&b));
        }
    }
    text(&out)
}

/// A resume's continuation: the prompt is the original prompt plus what was generated, the
/// generated ids marked as the answer's own.
fn continuation(sh: &Shape, prompt: &[u32], generated: &[u32]) -> Shape {
    let mut sh = sh.clone();
    sh.prompts = vec![prompt.iter().chain(generated).copied().collect()];
    sh.resumed_ids = generated.len();
    sh
}

#[test]
fn a_continuation_writes_what_the_dead_stream_held_back_at_every_break_point() {
    let tok = tok();
    let prompt = tok.encode("say:", false).unwrap();
    let want = "naïve café — 東京 ok";
    let ids = tok.encode(want, false).unwrap();
    let mut sh = shape(Route::Completions, true, &[], 1);
    sh.prompts = vec![prompt.clone()];
    let mut held_back_somewhere = false;
    for k in 1..ids.len() {
        let mut first = Writer::new(sh.clone(), &tok, "served");
        let before = stream_broken_after(&mut first, &ids[..k]);
        held_back_somewhere |= tok.decode(&ids[..k], true).unwrap() != before;
        let (after, _) = stream_one_by_one(&tok, continuation(&sh, &prompt, &ids[..k]), &ids[k..], "length", None);
        assert_eq!(before + &text(&after), tok.decode(&ids, true).unwrap(), "broken after {k} of {} tokens", ids.len());
    }
    assert!(held_back_somewhere, "the text has no break point inside a character: the test proves nothing");
}

#[test]
fn a_stop_string_that_spans_the_break_still_stops_the_continuation() {
    let tok = tok();
    let ids = tok.encode("hello world, stop here please", false).unwrap();
    let sh = shape(Route::Completions, true, &["stop here"], 1);
    // Break after the ids whose text is "hello world, stop" (a stop's prefix, held back).
    let k = (1..ids.len()).find(|&k| tok.decode(&ids[..k], true).unwrap().ends_with("stop")).unwrap();
    let mut first = Writer::new(sh.clone(), &tok, "served");
    let before = stream_broken_after(&mut first, &ids[..k]);
    assert_eq!(before, "hello world, ");
    let (after, _) = stream_one_by_one(&tok, continuation(&sh, &[], &ids[..k]), &ids[k..], "stop", Some(Matched::Text("stop here".into())));
    assert_eq!(text(&after), "", "the continuation completed the held stop: nothing more is said");
}

#[test]
fn a_vllm_answer_drops_a_truncated_character_at_its_end_as_vllm_does() {
    // Real vLLM's text for these ids (tokenizers' DecodeStream) never sends a tail that decodes
    // to U+FFFD; SGLang's (a one-shot decode) shows it. Streamed and whole answers alike.
    let tok = tok();
    // One token per byte, the rocket's last byte missing: the answer ends mid-character.
    let text_bytes = "ok 🚀".as_bytes();
    let ids: Vec<u32> = text_bytes[..text_bytes.len() - 1].iter().map(|&b| tok.tokenizer().token_to_id(&byte_symbol(b)).unwrap()).collect();
    let sgl = stream_through(Writer::new(shape(Route::Completions, true, &[], 1), &tok, "served"), &ids, "length", None).0;
    let vllm = stream_through(Writer::with_tail(shape(Route::Completions, true, &[], 1), &tok, "served", ReplacementTail::Dropped), &ids, "length", None).0;
    assert_eq!(text(&sgl), "ok \u{FFFD}");
    assert_eq!(text(&vllm), "ok ");

    let mut whole = Writer::with_tail(shape(Route::Completions, false, &[], 1), &tok, "served", ReplacementTail::Dropped);
    let done = Gen::Complete { index: 0, ids: ids.clone(), finish_reason: "length".into(), matched: None, counts: counts(ids.len() as u32), lp: LpPart::default() };
    assert!(whole.on_event(done).unwrap().is_none());
    let body: Value = serde_json::from_slice(&whole.whole()).unwrap();
    assert_eq!(body["choices"][0]["text"], "ok ");
}

/// GPT-2's byte-to-unicode table (the ByteLevel alphabet): the vocabulary symbol of one byte.
fn byte_symbol(b: u8) -> String {
    let printable = |x: u8| (b'!'..=b'~').contains(&x) || (0xA1..=0xAC).contains(&x) || (0xAE..=0xFF).contains(&x);
    if printable(b) {
        return char::from(b).to_string();
    }
    let offset = (0u8..b).filter(|&x| !printable(x)).count();
    char::from_u32(256 + offset as u32).map(String::from).unwrap_or_default()
}
