//! Loading a model's tokenizer: a local Hugging Face directory (`tokenizer.json`,
//! `tokenizer_config.json`, optionally `chat_template.jinja`), a bare `tokenizer.json` file, or
//! the same files as bytes (a worker's `GetTokenizer` answer). Loaded once per model.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde_json::Value as Json;
use tokenizers::Tokenizer;

use crate::byte_level::ByteTable;
use crate::chat::{ChatTemplate, ChatTemplateInputs};
use crate::detok::IncrementalDecoder;
use crate::error::TokenizerError;
use crate::stop::{StopMatcher, StreamDecoder};

const TOKENIZER_FILE: &str = "tokenizer.json";
const CONFIG_FILE: &str = "tokenizer_config.json";
const TEMPLATE_FILE: &str = "chat_template.jinja";

/// One model's tokenizer and chat template.
#[derive(Debug)]
pub struct ModelTokenizer {
    tokenizer: Tokenizer,
    chat: Option<ChatTemplate>,
    eos_token_id: Option<u32>,
    /// Every id's bytes, for a byte-level tokenizer (byte_level.rs): its decoders skip the
    /// `tokenizers` pipeline.
    bytes: Option<ByteTable>,
}

impl ModelTokenizer {
    /// Loads from a model directory or a `tokenizer.json` path (its directory's
    /// `tokenizer_config.json`, when present, gives the chat template and special tokens).
    pub fn from_path(path: &Path) -> Result<Self, TokenizerError> {
        let (file, dir) = if path.is_dir() { (path.join(TOKENIZER_FILE), path.to_path_buf()) } else { (path.to_path_buf(), parent_dir(path)) };
        let load_err = |p: &Path, reason: String| TokenizerError::Load { path: p.display().to_string(), reason };
        let tokenizer_bytes = std::fs::read(&file).map_err(|e| load_err(&file, e.to_string()))?;
        let config_path = dir.join(CONFIG_FILE);
        let config = read_optional(&config_path).map_err(|e| load_err(&config_path, e))?;
        let template_path = dir.join(TEMPLATE_FILE);
        let template = read_optional(&template_path).map_err(|e| load_err(&template_path, e))?;
        Self::from_parts(&tokenizer_bytes, config.as_deref(), template.as_deref().map(String::from_utf8_lossy).as_deref()).map_err(|e| match e {
            TokenizerError::Load { reason, .. } => load_err(path, reason),
            other => other,
        })
    }

    /// Loads from the files' bytes: `tokenizer.json`, and optionally `tokenizer_config.json` and
    /// a separate chat template (used when the config has none).
    pub fn from_parts(tokenizer_json: &[u8], tokenizer_config: Option<&[u8]>, chat_template: Option<&str>) -> Result<Self, TokenizerError> {
        let bytes_err = |what: &str, reason: String| TokenizerError::Load { path: format!("<{what}>"), reason };
        let tokenizer = Tokenizer::from_bytes(tokenizer_json).map_err(|e| bytes_err(TOKENIZER_FILE, e.to_string()))?;
        let config: Json = match tokenizer_config {
            Some(bytes) => serde_json::from_slice(bytes).map_err(|e| bytes_err(CONFIG_FILE, e.to_string()))?,
            None => Json::Null,
        };
        let bos = special_token(&config, "bos_token");
        let eos = special_token(&config, "eos_token");
        let template_value = config.get("chat_template").cloned().or_else(|| chat_template.map(|t| Json::String(t.to_owned())));
        let chat = template_value.map(|t| ChatTemplate::from_config_value(&t, &bos, &eos)).transpose()?;
        let eos_token_id = (!eos.is_empty()).then(|| tokenizer.token_to_id(&eos)).flatten();
        let bytes = ByteTable::of(&tokenizer);
        Ok(Self { tokenizer, chat, eos_token_id, bytes })
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The EOS token's id, when the config names one the vocabulary has.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token_id
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat.is_some()
    }

    /// Token ids of `text`, with the tokenizer's special tokens (BOS) when `add_special_tokens`.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self.tokenizer.encode_fast(text, add_special_tokens).map_err(|e| TokenizerError::Codec(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The chat prompt text for these messages.
    pub fn apply_chat_template(&self, inputs: &ChatTemplateInputs<'_>) -> Result<String, TokenizerError> {
        self.chat.as_ref().ok_or(TokenizerError::NoChatTemplate)?.render(inputs)
    }

    /// The chat prompt's token ids. The template writes BOS itself, so no special tokens are
    /// added (as `apply_chat_template(tokenize=True)` does).
    pub fn encode_chat(&self, inputs: &ChatTemplateInputs<'_>) -> Result<Vec<u32>, TokenizerError> {
        self.encode(&self.apply_chat_template(inputs)?, false)
    }

    /// Token `id`'s text as logprob answers name it (token_text.rs).
    pub fn token_text(&self, id: u32) -> String {
        crate::token_text(&self.tokenizer, id)
    }

    /// One-shot decode.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        self.tokenizer.decode(ids, skip_special_tokens).map_err(|e| TokenizerError::Codec(e.to_string()))
    }

    /// Whether decoders take the byte-level path (a `ByteLevel` tokenizer whose table matched).
    pub fn byte_level(&self) -> bool {
        self.bytes.is_some()
    }

    /// An incremental decoder for tokens that follow `prompt`: the byte-level path when this
    /// tokenizer has one, else the prefix window seeded with the prompt's last tokens.
    pub fn incremental_decoder(&self, skip_special_tokens: bool, prompt: &[u32]) -> IncrementalDecoder<'_> {
        match &self.bytes {
            Some(table) => IncrementalDecoder::with_table(&self.tokenizer, table, skip_special_tokens),
            None => IncrementalDecoder::with_prompt(&self.tokenizer, skip_special_tokens, prompt),
        }
    }

    /// A stream decoder with the request's stop strings and stop ids (the EOS id added unless
    /// `ignore_eos`).
    pub fn stream_decoder(&self, skip_special_tokens: bool, stops: Vec<String>, mut stop_ids: Vec<u32>, ignore_eos: bool) -> StreamDecoder<'_> {
        if let (Some(eos), false) = (self.eos_token_id, ignore_eos) {
            stop_ids.push(eos);
        }
        StreamDecoder::new(self.incremental_decoder(skip_special_tokens, &[]), StopMatcher::new(stops), stop_ids)
    }
}

/// `bos_token`/`eos_token` in a config: a string, or an AddedToken object with `content`.
fn special_token(config: &Json, key: &str) -> String {
    match config.get(key) {
        Some(Json::String(s)) => s.clone(),
        Some(obj @ Json::Object(_)) => obj.get("content").and_then(Json::as_str).unwrap_or_default().to_owned(),
        _ => String::new(),
    }
}

fn parent_dir(path: &Path) -> PathBuf {
    path.parent().map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

fn read_optional(path: &Path) -> Result<Option<Vec<u8>>, String> {
    match std::fs::read(path) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e.to_string()),
    }
}

/// Tokenizers by model, loaded once each and shared.
#[derive(Debug, Default)]
pub struct TokenizerCache {
    by_key: Mutex<HashMap<String, Arc<ModelTokenizer>>>,
}

impl TokenizerCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// The tokenizer cached under `key`, or `load()`'s result, cached. A failed load is not cached.
    pub fn get_or_load(&self, key: &str, load: impl FnOnce() -> Result<ModelTokenizer, TokenizerError>) -> Result<Arc<ModelTokenizer>, TokenizerError> {
        if let Some(found) = self.get(key) {
            return Ok(found);
        }
        // Loaded outside the lock: a slow file read must not block other models' lookups.
        let loaded = Arc::new(load()?);
        let mut map = self.by_key.lock().unwrap_or_else(|p| p.into_inner());
        Ok(map.entry(key.to_owned()).or_insert(loaded).clone())
    }

    pub fn get(&self, key: &str) -> Option<Arc<ModelTokenizer>> {
        self.by_key.lock().unwrap_or_else(|p| p.into_inner()).get(key).cloned()
    }

    /// Loads (once) from a model directory or `tokenizer.json` path.
    pub fn get_or_load_path(&self, path: &Path) -> Result<Arc<ModelTokenizer>, TokenizerError> {
        self.get_or_load(&path.display().to_string(), || ModelTokenizer::from_path(path))
    }
}
