//! One token's text, as logprob answers name tokens (`tokens`, `top_logprobs` keys, chat's
//! `token` and `bytes`).
//!
//! A byte-level BPE vocabulary spells bytes with GPT-2's printable alphabet (`Ġ` for a space),
//! so the vocabulary string is mapped back to the token's bytes first. Those bytes are shown as
//! UTF-8 when they are valid UTF-8 on their own, else one character per byte (Latin-1): a token
//! that is part of a multi-byte character still gets a distinct, lossless name. This is what the
//! reference engine's byte tokenizer writes (`bytes([id]).decode("latin-1")`), and for whole
//! tokens what SGLang and vLLM write (the token decoded alone).

use std::collections::HashMap;
use std::sync::OnceLock;

use tokenizers::{DecoderWrapper, Tokenizer};

/// GPT-2's byte-level alphabet, reversed: the printable character each byte is spelled with,
/// back to the byte.
fn byte_of_char() -> &'static HashMap<char, u8> {
    static TABLE: OnceLock<HashMap<char, u8>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let printable = |b: u32| (u32::from(b'!')..=u32::from(b'~')).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
        let mut extra = 0u32;
        (0u32..256)
            .map(|b| {
                let c = if printable(b) {
                    b
                } else {
                    extra += 1;
                    255 + extra
                };
                // Every value here is below 0x200, a valid char; b fits a byte.
                (char::from_u32(c).unwrap_or('\0'), b as u8)
            })
            .collect()
    })
}

/// The bytes of a byte-level vocabulary string; `None` when a character is not in the alphabet
/// (an added token written as plain text).
fn byte_level_bytes(piece: &str) -> Option<Vec<u8>> {
    let table = byte_of_char();
    piece.chars().map(|c| table.get(&c).copied()).collect()
}

/// Bytes as text: UTF-8 when valid, else one Latin-1 character per byte.
fn show_bytes(bytes: Vec<u8>) -> String {
    String::from_utf8(bytes).unwrap_or_else(|e| e.into_bytes().into_iter().map(char::from).collect())
}

/// Token `id`'s text (empty for an id outside the vocabulary).
pub fn token_text(tokenizer: &Tokenizer, id: u32) -> String {
    let Some(piece) = tokenizer.id_to_token(id) else { return String::new() };
    if !matches!(tokenizer.get_decoder(), Some(DecoderWrapper::ByteLevel(_))) {
        return piece;
    }
    match byte_level_bytes(&piece) {
        Some(bytes) => show_bytes(bytes),
        None => piece,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_alphabet_is_a_bijection_over_bytes() {
        let t = byte_of_char();
        assert_eq!(t.len(), 256);
        assert_eq!(t[&'Ġ'], b' ');
        assert_eq!(t[&'Ċ'], b'\n');
        assert_eq!(t[&'a'], b'a');
        let mut bytes: Vec<u8> = t.values().copied().collect();
        bytes.sort_unstable();
        assert_eq!(bytes, (0..=255).collect::<Vec<u8>>());
    }

    #[test]
    fn bytes_show_as_utf8_else_latin1() {
        assert_eq!(show_bytes(b" the".to_vec()), " the");
        assert_eq!(show_bytes("é".as_bytes().to_vec()), "é");
        // Half of a two-byte character: one character per byte, nothing lost.
        assert_eq!(show_bytes(vec![0xC3]), "\u{C3}");
    }
}
