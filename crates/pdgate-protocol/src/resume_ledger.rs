//! The token ids of a streamed answer, told by the worker client that wrote its bytes.
//!
//! A client that writes the answer itself from token ids (gRPC workers: the gateway
//! detokenizes) knows every id it wrote. Writing them into the stream as `token_ids` only for
//! the resume tracker to scan them back out and cut them again cost about a seventh of such a
//! stream's gateway CPU. Such a client keeps them in a [`TokenLedger`] instead, shared with the
//! relay, and leaves them out of the bytes; the tracker reads the ledger when it needs the ids
//! (a death, the end's token counts), not per chunk.

use std::sync::{Mutex, MutexGuard};

use serde_json::{Map, Value};

/// What a leg's answer carried so far: its prompt's ids, the ids generated (those of every
/// chunk written, held-back text included), whether the answer finished, and the stream's
/// envelope (`id`, `object`, `created`, `model`) a continuation's chunks are rewritten to.
#[derive(Debug, Default)]
pub struct TokenLedger {
    inner: Mutex<Entries>,
}

#[derive(Debug, Default, Clone)]
pub struct Entries {
    pub prompt: Vec<u32>,
    pub generated: Vec<u32>,
    pub finished: bool,
    pub head: Map<String, Value>,
}

impl TokenLedger {
    /// The answer is to `prompt`, its chunks carry `head`: said by the writer before its first
    /// chunk (the ledger is handed to the relay before the writer exists).
    pub fn open(&self, prompt: &[u32], head: Map<String, Value>) {
        let mut e = self.lock();
        e.prompt = prompt.to_vec();
        e.head = head;
    }

    fn lock(&self) -> MutexGuard<'_, Entries> {
        // Entries stay consistent whatever panicked while holding them (plain pushes).
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Ids of a chunk about to be written; `finished` when it ends the answer.
    pub fn wrote(&self, ids: &[u32], finished: bool) {
        let mut e = self.lock();
        e.generated.extend_from_slice(ids);
        e.finished |= finished;
    }

    /// A copy of what was written so far.
    pub fn entries(&self) -> Entries {
        self.lock().clone()
    }

    /// Reads what was written so far in place (no copy of the ids).
    pub fn read<R>(&self, f: impl FnOnce(&Entries) -> R) -> R {
        f(&self.lock())
    }
}
