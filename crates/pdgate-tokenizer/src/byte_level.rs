//! Detokenization without the decoder pipeline, for byte-level tokenizers (GPT-2, Llama 3,
//! Qwen: the `ByteLevel` decoder).
//!
//! Such a decoder is context-free: a sequence decodes to the lossy UTF-8 of its tokens' bytes,
//! concatenated, each token's bytes fixed by its id. So a table of every id's bytes, built once
//! when the tokenizer loads, turns each generated token into a copy plus a UTF-8 check, where
//! the prefix-window technique (detok.rs) costs two decodes through the `tokenizers` pipeline
//! per token. The table is checked against the real decoder for every id when it is built; a
//! tokenizer it does not match keeps the general path.

use std::borrow::Cow;

use tokenizers::{DecoderWrapper, Tokenizer};

/// Text whose characters span tokens in byte-level vocabularies.
const SAMPLE: &str = "naïve café, Ça va très bien — 東京は大きな都市です。 Привет мир 🚀👍🏽 ok";

/// Every id's bytes, and whether `skip_special_tokens` drops it.
pub struct ByteTable {
    /// `bytes[offsets[id]..offsets[id + 1]]`: one flat buffer (a 128k vocabulary in ~1 MiB).
    offsets: Vec<u32>,
    bytes: Vec<u8>,
    special: Vec<bool>,
}

impl std::fmt::Debug for ByteTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ByteTable({} ids, {} bytes)", self.special.len(), self.bytes.len())
    }
}

/// GPT-2's byte ↔ character map (the `ByteLevel` pre-tokenizer's alphabet), inverted: the byte
/// each alphabet character stands for.
fn char_to_byte() -> std::collections::HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 256u32;
    (0..=255u8)
        .map(|b| {
            let c = if printable(b) {
                char::from(b)
            } else {
                next += 1;
                char::from_u32(next - 1).unwrap_or('\0')
            };
            (c, b)
        })
        .collect()
}

impl ByteTable {
    /// The table of a `ByteLevel`-decoded tokenizer, or `None` (another decoder, or a token the
    /// table would decode differently from the tokenizer).
    pub fn of(tokenizer: &Tokenizer) -> Option<ByteTable> {
        if !matches!(tokenizer.get_decoder(), Some(DecoderWrapper::ByteLevel(_))) {
            return None;
        }
        let alphabet = char_to_byte();
        let size = tokenizer.get_vocab(true).values().max().map_or(0, |m| *m as usize + 1);
        let mut t = ByteTable { offsets: Vec::with_capacity(size + 1), bytes: Vec::new(), special: Vec::with_capacity(size) };
        t.offsets.push(0);
        for id in 0..u32::try_from(size).ok()? {
            let all = tokenizer.decode(&[id], false).ok()?;
            if let Some(token) = tokenizer.id_to_token(id) {
                // As the `ByteLevel` decoder reads a token: its characters' bytes, or, when one
                // is not in the alphabet (an added token's text), the token's own UTF-8.
                let mapped: Option<Vec<u8>> = token.chars().map(|c| alphabet.get(&c).copied()).collect();
                t.bytes.extend_from_slice(&mapped.unwrap_or_else(|| token.into_bytes()));
            }
            t.offsets.push(u32::try_from(t.bytes.len()).ok()?);
            if String::from_utf8_lossy(t.get(id)) != all {
                return None;
            }
            t.special.push(!all.is_empty() && tokenizer.decode(&[id], true).ok()?.is_empty());
        }
        // Multi-byte characters span tokens: a sample in several scripts decodes alike both ways.
        let ids = tokenizer.encode_fast(SAMPLE, false).ok()?.get_ids().to_vec();
        let mut pending = BytePending::default();
        let text = pending.push(&t, &ids, false) + &pending.finish();
        (text == tokenizer.decode(&ids, false).ok()?).then_some(t)
    }

    /// The bytes of `id`, empty for an id the vocabulary lacks (the decoder skips it too).
    fn get(&self, id: u32) -> &[u8] {
        let id = id as usize;
        match (self.offsets.get(id), self.offsets.get(id + 1)) {
            (Some(&a), Some(&b)) => &self.bytes[a as usize..b as usize],
            _ => &[],
        }
    }

    fn skipped(&self, id: u32, skip_special_tokens: bool) -> bool {
        skip_special_tokens && self.special.get(id as usize).copied().unwrap_or(false)
    }
}

/// One stream's bytes not yet emitted: at most an incomplete UTF-8 character.
#[derive(Debug, Default)]
pub struct BytePending {
    held: Vec<u8>,
}

impl BytePending {
    /// Adds `ids`' bytes; returns the text they complete. Invalid bytes come out as U+FFFD
    /// (one per invalid sequence, as `String::from_utf8_lossy` writes them); an incomplete
    /// character at the end is held until the next token completes it or the stream ends.
    pub fn push(&mut self, table: &ByteTable, ids: &[u32], skip_special_tokens: bool) -> String {
        for &id in ids {
            if !table.skipped(id, skip_special_tokens) {
                self.held.extend_from_slice(table.get(id));
            }
        }
        let mut out = String::new();
        let mut start = 0;
        while start < self.held.len() {
            let rest = &self.held[start..];
            let (valid, bad) = match std::str::from_utf8(rest) {
                Ok(_) => (rest.len(), Some(0)),
                Err(e) => (e.valid_up_to(), e.error_len()),
            };
            out.push_str(std::str::from_utf8(&rest[..valid]).unwrap_or_default());
            start += valid;
            match bad {
                Some(0) => {}
                Some(n) => {
                    out.push(char::REPLACEMENT_CHARACTER);
                    start += n;
                }
                // An incomplete character at the end: held.
                None => break,
            }
        }
        self.held.drain(..start);
        out
    }

    /// At the end: what is held, as a one-shot decode shows an incomplete character (U+FFFD).
    pub fn finish(&mut self) -> String {
        let out = match String::from_utf8_lossy(&self.held) {
            Cow::Borrowed(s) => s.to_owned(),
            Cow::Owned(s) => s,
        };
        self.held.clear();
        out
    }
}
