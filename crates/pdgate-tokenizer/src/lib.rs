//! The gateway's tokenizer component: a model's `tokenizer.json` and chat template, and the
//! incremental detokenizer with stop strings and stop token ids.
//!
//! gRPC workers take token ids, so the gateway tokenizes, renders the chat template and
//! detokenizes itself; HTTP routes use the same component for exact prompt token ids (cache-aware
//! routing). No async runtime here: the only IO is reading a model directory.

mod byte_level;
mod chat;
mod detok;
mod error;
mod load;
mod pyjson;
mod stop;
mod token_text;

pub use byte_level::ByteTable;
pub use chat::{ChatTemplate, ChatTemplateInputs};
pub use detok::IncrementalDecoder;
pub use error::TokenizerError;
pub use load::{ModelTokenizer, TokenizerCache};
pub use stop::{ReplacementTail, StopMatch, StopMatcher, StreamDecoder, StreamStep};
pub use token_text::token_text;
