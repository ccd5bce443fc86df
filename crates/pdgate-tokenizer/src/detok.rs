//! Incremental detokenization with Hugging Face's prefix-offset technique: each step decodes a
//! short window of tokens twice (without and with the new ones) and emits the difference, so
//! decoders that depend on context (leading-space rules, byte fallback) give the same text as one
//! decode of the whole sequence. A window that ends in U+FFFD is an incomplete UTF-8 character:
//! it is held until the next token completes it, so no chunk ever carries a broken character.
//!
//! A byte-level tokenizer's decoder needs no window: its ids' bytes are looked up in a table
//! and only an incomplete character is held (byte_level.rs); `ModelTokenizer` hands out decoders
//! that take that path when the tokenizer has a table.

use tokenizers::Tokenizer;

use crate::byte_level::{BytePending, ByteTable};
use crate::error::TokenizerError;

/// How many prompt tokens seed the window, so the first generated token decodes in context.
const PROMPT_CONTEXT: usize = 5;
const REPLACEMENT: char = '\u{FFFD}';

/// The detokenizer of one generation stream.
pub struct IncrementalDecoder<'t> {
    tokenizer: &'t Tokenizer,
    skip_special_tokens: bool,
    ids: Vec<u32>,
    /// Start of the window decoded as context.
    prefix_offset: usize,
    /// End of the text already emitted.
    read_offset: usize,
    /// The byte-level path: the tokenizer's table and the bytes not yet emitted.
    bytes: Option<(&'t ByteTable, BytePending)>,
}

impl<'t> IncrementalDecoder<'t> {
    /// A decoder with no context.
    pub fn new(tokenizer: &'t Tokenizer, skip_special_tokens: bool) -> Self {
        Self { tokenizer, skip_special_tokens, ids: Vec::new(), prefix_offset: 0, read_offset: 0, bytes: None }
    }

    /// A decoder whose first tokens follow `prompt` (its last few tokens are the context).
    pub fn with_prompt(tokenizer: &'t Tokenizer, skip_special_tokens: bool, prompt: &[u32]) -> Self {
        let start = prompt.len().saturating_sub(PROMPT_CONTEXT);
        let ids = prompt[start..].to_vec();
        let read_offset = ids.len();
        Self { tokenizer, skip_special_tokens, ids, prefix_offset: 0, read_offset, bytes: None }
    }

    /// The same decoder on the byte-level path: `table` is `tokenizer`'s (`ByteTable::of`), so
    /// the text is the same, without the prompt context (a byte-level decode needs none).
    pub fn with_table(tokenizer: &'t Tokenizer, table: &'t ByteTable, skip_special_tokens: bool) -> Self {
        Self { bytes: Some((table, BytePending::default())), ..Self::new(tokenizer, skip_special_tokens) }
    }

    fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.tokenizer.decode(ids, self.skip_special_tokens).map_err(|e| TokenizerError::Codec(e.to_string()))
    }

    /// Adds generated tokens; returns the text they complete (possibly empty).
    pub fn push(&mut self, new_ids: &[u32]) -> Result<String, TokenizerError> {
        // The table path keeps bytes, not ids (it never decodes a window again).
        if let Some((table, pending)) = self.bytes.as_mut() {
            return Ok(pending.push(table, new_ids, self.skip_special_tokens));
        }
        self.ids.extend_from_slice(new_ids);
        let prefix = self.decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let full = self.decode(&self.ids[self.prefix_offset..])?;
        if full.len() <= prefix.len() || full.ends_with(REPLACEMENT) || !full.is_char_boundary(prefix.len()) {
            return Ok(String::new());
        }
        let delta = full[prefix.len()..].to_owned();
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Ok(delta)
    }

    /// At the end of the stream: whatever is still held (an incomplete character decodes as
    /// U+FFFD, exactly as a one-shot decode of the whole sequence shows it).
    pub fn finish(&mut self) -> Result<String, TokenizerError> {
        if let Some((_, pending)) = self.bytes.as_mut() {
            return Ok(pending.finish());
        }
        let prefix = self.decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let full = self.decode(&self.ids[self.prefix_offset..])?;
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Ok(full.get(prefix.len()..).unwrap_or_default().to_owned())
    }
}
