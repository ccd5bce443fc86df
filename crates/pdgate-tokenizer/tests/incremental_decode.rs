//! Incremental detokenization: never a broken UTF-8 character in a chunk, and the chunks add up
//! to the one-shot decode whatever the split. On both paths: the prefix window through the
//! `tokenizers` decoder, and the byte table of a byte-level tokenizer (the fixture is one).

mod common;

use pdgate_tokenizer::{IncrementalDecoder, ModelTokenizer, ReplacementTail, StopMatch};
use proptest::prelude::*;

const MULTIBYTE: &str = "Ça va 👍🏽 日本語のテキスト 🚀 Straße 中文!";

/// Feeds `ids` in the given batches; returns the chunks emitted (finish included), of the
/// window path and of the table path.
fn chunks(tok: &ModelTokenizer, ids: &[u32], cuts: &[usize], skip_special: bool) -> Vec<String> {
    let window = chunks_of(IncrementalDecoder::new(tok.tokenizer(), skip_special), ids, cuts);
    assert!(tok.byte_level(), "the fixture is byte-level: its decoders take the table path");
    let table = chunks_of(tok.incremental_decoder(skip_special, &[]), ids, cuts);
    assert_eq!(window.concat(), table.concat(), "both paths give the same text (cuts {cuts:?})");
    [window, table].concat()
}

fn chunks_of(mut decoder: IncrementalDecoder<'_>, ids: &[u32], cuts: &[usize]) -> Vec<String> {
    let mut out = Vec::new();
    let mut start = 0;
    for &cut in cuts.iter().chain(std::iter::once(&ids.len())) {
        out.push(decoder.push(&ids[start..cut]).unwrap_or_else(|e| panic!("decode: {e}")));
        start = cut;
    }
    out.push(decoder.finish().unwrap_or_else(|e| panic!("finish: {e}")));
    out
}

fn assert_clean_and_complete(tok: &ModelTokenizer, ids: &[u32], cuts: &[usize]) {
    let got = chunks(tok, ids, cuts, false);
    for chunk in &got {
        assert!(!chunk.contains('\u{FFFD}'), "broken character in chunk {chunk:?} (cuts {cuts:?})");
    }
    assert_eq!(got[..got.len() / 2].concat(), tok.decode(ids, false).unwrap_or_else(|e| panic!("decode: {e}")), "cuts {cuts:?}");
}

/// Byte-level ids of the text: one token per byte, so every token boundary is a byte boundary
/// and multi-byte characters are split across tokens.
fn byte_ids(tok: &ModelTokenizer, text: &str) -> Vec<u32> {
    text.bytes()
        .map(|b| {
            let symbol = byte_symbol(b);
            tok.tokenizer().token_to_id(&symbol).unwrap_or_else(|| panic!("byte {b} in vocab"))
        })
        .collect()
}

/// GPT-2's byte-to-unicode table (the ByteLevel alphabet).
fn byte_symbol(b: u8) -> String {
    let printable = (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
    if printable {
        return char::from(b).to_string();
    }
    let offset = (0u8..b).filter(|&x| !((b'!'..=b'~').contains(&x) || (0xA1..=0xAC).contains(&x) || (0xAE..=0xFF).contains(&x))).count();
    char::from_u32(256 + offset as u32).map(String::from).unwrap_or_default()
}

#[test]
fn one_token_per_byte_split_at_every_byte_position() {
    let tok = common::bpe();
    let ids = byte_ids(&tok, MULTIBYTE);
    assert_eq!(tok.decode(&ids, false).expect("d"), MULTIBYTE);
    assert_eq!(ids.len(), MULTIBYTE.len());
    // Token by token: every byte boundary is a chunk boundary.
    let every: Vec<usize> = (1..ids.len()).collect();
    assert_clean_and_complete(&tok, &ids, &every);
    // One split at each position.
    for cut in 0..=ids.len() {
        assert_clean_and_complete(&tok, &ids, &[cut]);
    }
}

#[test]
fn merged_tokens_decode_incrementally_to_the_one_shot_text() {
    let tok = common::bpe();
    let ids = tok.encode(MULTIBYTE, true).expect("e");
    let every: Vec<usize> = (1..ids.len()).collect();
    assert_clean_and_complete(&tok, &ids, &every);
    let got = chunks(&tok, &ids, &every, true);
    let skipped = got[..got.len() / 2].concat();
    assert_eq!(skipped, tok.decode(&ids, true).expect("d"));
    assert!(!skipped.contains("<|begin_of_text|>"));
}

#[test]
fn truncated_character_at_end_comes_out_as_one_shot_decode_shows_it() {
    let tok = common::bpe();
    let mut ids = byte_ids(&tok, "ok 🚀");
    ids.pop();
    let got = chunks(&tok, &ids, &(1..ids.len()).collect::<Vec<_>>(), false);
    let (window, table) = got.split_at(got.len() / 2);
    for path in [window, table] {
        assert_eq!(path.concat(), tok.decode(&ids, false).expect("d"));
        assert!(path.last().expect("finish").contains('\u{FFFD}'), "only the final flush may hold U+FFFD");
        assert!(path[..path.len() - 1].iter().all(|c| !c.contains('\u{FFFD}')));
    }
}

#[test]
fn prompt_context_does_not_leak_into_output() {
    let tok = common::bpe();
    let prompt = tok.encode("Hello, world!", true).expect("e");
    let generated = tok.encode(" The lazy dog 🚀", false).expect("e");
    let mut decoder = IncrementalDecoder::with_prompt(tok.tokenizer(), false, &prompt);
    let mut out: String = generated.iter().map(|id| decoder.push(&[*id]).expect("d")).collect();
    out += &decoder.finish().expect("f");
    assert_eq!(out, tok.decode(&generated, false).expect("d"));
}

#[test]
fn stream_decoder_stops_on_string_spanning_tokens_and_on_eos() {
    let tok = common::bpe();
    let ids = byte_ids(&tok, "answer: 42 日本<END> tail");
    let mut stream = tok.stream_decoder(true, vec!["<END>".into()], vec![], false);
    let mut text = String::new();
    let mut stop = None;
    for id in &ids {
        let step = stream.push(*id).expect("push");
        text += &step.text;
        if step.stop.is_some() {
            stop = step.stop;
            break;
        }
    }
    assert_eq!(text, "answer: 42 日本");
    assert_eq!(stop, Some(StopMatch::Text("<END>".into())));

    let eos = tok.eos_token_id().expect("eos");
    let mut ids = byte_ids(&tok, "done <EN");
    ids.push(eos);
    let mut stream = tok.stream_decoder(true, vec!["<END>".into()], vec![], false);
    let steps: Vec<_> = ids.iter().map(|id| stream.push(*id).expect("push")).collect();
    let text: String = steps.iter().map(|s| s.text.as_str()).collect();
    assert_eq!(text, "done <EN", "held partial stop is released when EOS ends the stream");
    assert_eq!(steps.last().and_then(|s| s.stop.clone()), Some(StopMatch::TokenId(eos)));
    assert_eq!(stream.push(ids[0]).expect("after stop").text, "", "nothing after a stop");

    let mut stream = tok.stream_decoder(true, vec![], vec![], true);
    assert_eq!(stream.push(eos).expect("push").stop, None, "ignore_eos");
}

/// The text a stream decoder with `tail` writes for `ids`, one token at a time, then finished.
fn streamed(tok: &ModelTokenizer, ids: &[u32], tail: ReplacementTail) -> String {
    let mut stream = tok.stream_decoder(false, vec![], vec![], true).with_tail(tail);
    let mut text = String::new();
    for id in ids {
        text += &stream.push(*id).unwrap_or_else(|e| panic!("push: {e}")).text;
    }
    text + &stream.finish().unwrap_or_else(|e| panic!("finish: {e}"))
}

#[test]
fn vllm_drops_a_tail_that_decodes_to_a_replacement_and_keeps_one_inside() {
    let tok = common::bpe();
    // A truncated character at the end: SGLang's text shows U+FFFD, vLLM's never sends it.
    let mut ids = byte_ids(&tok, "ok 🚀");
    ids.pop();
    assert_eq!(streamed(&tok, &ids, ReplacementTail::Lossy), "ok \u{FFFD}");
    assert_eq!(streamed(&tok, &ids, ReplacementTail::Dropped), "ok ");
    // Invalid bytes followed by text: both engines send the replacements once later text comes.
    let mut ids = byte_ids(&tok, "a");
    ids.extend([0xFFu8, 0xFE].iter().map(|&b| tok.tokenizer().token_to_id(&byte_symbol(b)).expect("byte in vocab")));
    ids.extend(byte_ids(&tok, "b"));
    let lossy = streamed(&tok, &ids, ReplacementTail::Lossy);
    assert_eq!(lossy, tok.decode(&ids, false).expect("d"));
    assert_eq!(streamed(&tok, &ids, ReplacementTail::Dropped), lossy);
    // The same invalid bytes at the end: vLLM holds them and they are never sent.
    ids.pop();
    assert_eq!(streamed(&tok, &ids, ReplacementTail::Dropped), "a");
    // An EOS after a held tail ends the answer the same way.
    let eos = tok.eos_token_id().expect("eos");
    let mut ids = byte_ids(&tok, "x 🚀");
    ids.pop();
    ids.push(eos);
    let mut stream = tok.stream_decoder(false, vec![], vec![], false).with_tail(ReplacementTail::Dropped);
    let text: String = ids.iter().map(|id| stream.push(*id).expect("push").text).collect();
    assert_eq!(text, "x ");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, .. ProptestConfig::default() })]

    #[test]
    fn any_text_any_cuts_equals_one_shot(text in "[a-zé中😀 ,.!\n]{0,24}", raw_cuts in proptest::collection::vec(0usize..64, 0..8), merged in any::<bool>()) {
        let tok = common::bpe();
        let ids = if merged { tok.encode(&text, false).expect("e") } else { byte_ids(&tok, &text) };
        let mut cuts: Vec<usize> = raw_cuts.into_iter().map(|c| c.min(ids.len())).collect();
        cuts.sort_unstable();
        let got = chunks(&tok, &ids, &cuts, false);
        prop_assert!(got.iter().all(|c| !c.contains(char::REPLACEMENT_CHARACTER)), "broken character");
        prop_assert_eq!(got[..got.len() / 2].concat(), text);
    }

    /// Any ids at all (special tokens, bytes that are no UTF-8, ids past the vocabulary): the
    /// table path's text is the one-shot decode's, with and without special tokens.
    #[test]
    fn any_ids_on_the_table_path_equal_one_shot(ids in proptest::collection::vec(0u32..440, 0..40), raw_cuts in proptest::collection::vec(0usize..40, 0..6), skip in any::<bool>()) {
        let tok = common::bpe();
        let mut cuts: Vec<usize> = raw_cuts.into_iter().map(|c| c.min(ids.len())).collect();
        cuts.sort_unstable();
        let table = chunks_of(tok.incremental_decoder(skip, &[]), &ids, &cuts);
        prop_assert_eq!(table.concat(), tok.decode(&ids, skip).expect("d"));
    }
}

#[test]
fn a_tokenizer_whose_decoder_is_not_byte_level_keeps_the_window_path() {
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": true},
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "hello": 1, "world": 2}, "unk_token": "[UNK]"}
    });
    let tok = ModelTokenizer::from_parts(json.to_string().as_bytes(), None, None).expect("load");
    assert!(!tok.byte_level());
    let mut d = tok.incremental_decoder(false, &[]);
    let text = d.push(&[1, 2]).expect("push") + &d.finish().expect("finish");
    assert_eq!(text, tok.decode(&[1, 2], false).expect("d"));
}
