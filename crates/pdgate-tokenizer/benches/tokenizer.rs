//! Hot-path cost of the tokenizer component: encoding a ~1k-token prompt, and incremental
//! detokenization per generated token (the prefix window and the byte table, byte_level.rs). Run: `cargo bench -p pdgate-tokenizer --bench tokenizer`.
//!
//! The tokenizer is the test fixture (a byte-level BPE with a 420-entry vocabulary, trained in
//! tests/fixtures/make_fixtures.py): the same pipeline as a real model's (ByteLevel pre-tokenizer
//! and decoder, BPE merges), but a real 128k vocabulary changes merge-lookup costs. Treat the
//! numbers as the component's overhead, not a model's.
#![allow(clippy::unwrap_used, clippy::expect_used)] // bench code: a panic is the failure report

use std::hint::black_box;
use std::path::PathBuf;

use criterion::Criterion;
use pdgate_tokenizer::{IncrementalDecoder, ModelTokenizer, StreamDecoder};

fn fixture() -> ModelTokenizer {
    ModelTokenizer::from_path(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/bpe")).unwrap()
}

/// Text of about `tokens` tokens under `tok`, mixed English, accents, CJK and emoji.
fn prompt_of(tok: &ModelTokenizer, tokens: usize) -> String {
    let piece = "The quick brown fox jumps over the lazy dog. Ça va très bien. 東京は大きな都市です。 🚀 ";
    let mut text = String::new();
    while tok.encode(&text, false).unwrap().len() < tokens {
        text.push_str(piece);
    }
    text
}

fn main() {
    let tok = fixture();
    let prompt = prompt_of(&tok, 1000);
    let ids = tok.encode(&prompt, false).unwrap();
    println!("prompt: {} bytes, {} tokens", prompt.len(), ids.len());
    let mut c = Criterion::default().configure_from_args();
    c.bench_function("encode_1k_token_prompt", |b| b.iter(|| tok.encode(black_box(&prompt), true).unwrap()));
    c.bench_function("incremental_decode_1k_tokens", |b| {
        b.iter(|| {
            let mut decoder = IncrementalDecoder::new(tok.tokenizer(), true);
            for id in &ids {
                black_box(decoder.push(std::slice::from_ref(id)).unwrap());
            }
        })
    });
    // The same tokens on the byte-level path (the fixture is a ByteLevel tokenizer).
    assert!(tok.byte_level());
    c.bench_function("incremental_decode_1k_tokens_byte_table", |b| {
        b.iter(|| {
            let mut decoder = tok.incremental_decoder(true, &[]);
            for id in &ids {
                black_box(decoder.push(std::slice::from_ref(id)).unwrap());
            }
        })
    });
    c.bench_function("stream_decode_with_stops_1k_tokens", |b| {
        b.iter(|| {
            let mut stream: StreamDecoder<'_> = tok.stream_decoder(true, vec!["<|never|>".into(), "\n\n\n".into()], vec![], true);
            for id in &ids {
                black_box(stream.push(*id).unwrap());
            }
        })
    });
    c.final_summary();
}
