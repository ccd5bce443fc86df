//! Shared fixture paths for the integration tests.
#![allow(dead_code)]

use std::path::PathBuf;

use pdgate_tokenizer::ModelTokenizer;

/// Read when the test runs (cargo sets it for every test binary), not compiled in: a build cache
/// shared by two checkouts can hand this checkout a binary built in the other, whose compiled-in
/// path may be gone.
pub fn fixtures() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR").map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from).join("tests/fixtures")
}

pub fn bpe() -> ModelTokenizer {
    match ModelTokenizer::from_path(&fixtures().join("bpe")) {
        Ok(t) => t,
        Err(e) => panic!("fixture tokenizer loads: {e}"),
    }
}

pub fn read_json(name: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(fixtures().join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{name}: {e}"))
}
