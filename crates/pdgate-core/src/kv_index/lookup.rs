//! A lookup: key the prompt's blocks, find each key's holders, walk them (`walk.rs`).
//!
//! Keys are computed and probed in batches (8 doubling to 64): a prompt that misses early hashes
//! few blocks, and a long cached prefix waits for memory once per batch, not once per block.
//!
//! A long cached prefix is mostly runs of blocks with the same holders (a document on the same
//! 20 workers, block after block). The first lookup that walks such a run leaves a skip pointer
//! on the run's first key: the run's length and its last key. A later lookup reaching that key
//! hashes its way to the run's end (hashing is cheap next to a table probe that misses the CPU
//! cache), and if its key there is the run's last key (keys are chained, so the prompt then has
//! the run's content), it passes the whole run with no probe at all. The pointer holds only while
//! no key has stopped having the run's holders since it was left (the holders' stamp,
//! `Sets::stamp`), so the answer is always the walk's. Skipped keys do not see their lookup clock
//! move: a pointer is used at most `REFRESH_AFTER` times, then a full walk refreshes it and the
//! clocks that second chances at eviction read.

use std::sync::atomic::{AtomicU32, Ordering::Relaxed};

use super::holders::Holders;
use super::keys::{content_key, root};
use super::walk::Walk;
use super::{by_slot, Key, KvIndex, WorkerSlot};

/// `Key::skip` when the key heads no recorded run.
pub(super) const NO_SKIP: u32 = u32::MAX;
/// Runs shorter than this get no pointer (it would save fewer probes than this).
const MIN_SKIP: usize = 16;
/// Uses of a pointer before a full walk refreshes it.
pub(super) const REFRESH_AFTER: u32 = 256;
const FIRST_BATCH: usize = 8;
const KEY_BATCH: usize = 64;

/// A run of blocks after a key that all have the key's holders.
pub(super) struct Skip {
    /// The run's last key (`len` blocks after the head).
    end_key: u64,
    holders: Holders,
    /// `Sets::stamp(holders)` when the run was walked.
    stamp: u64,
    len: u32,
    uses: AtomicU32,
}

/// The skip pointers, in a slab indexed by `Key::skip`.
#[derive(Default)]
pub(super) struct Skips {
    slab: Vec<Skip>,
    free: Vec<u32>,
}

impl Skips {
    fn get(&self, at: u32) -> Option<&Skip> {
        self.slab.get(at as usize)
    }

    /// Store `s` at `at` (a key's current pointer) or a new place; returns where.
    fn put(&mut self, at: u32, s: Skip) -> u32 {
        if let Some(old) = self.slab.get_mut(at as usize) {
            *old = s;
            return at;
        }
        match self.free.pop() {
            Some(i) => {
                self.slab[i as usize] = s;
                i
            }
            None => {
                self.slab.push(s);
                (self.slab.len() - 1) as u32
            }
        }
    }

    /// The key holding pointer `at` left the table.
    pub(super) fn free(&mut self, at: u32) {
        if (at as usize) < self.slab.len() {
            self.free.push(at);
        }
    }

    pub(super) fn heap_bytes(&self) -> usize {
        self.slab.capacity() * std::mem::size_of::<Skip>() + self.free.capacity() * 4
    }
}

/// A run of equal holders a lookup is in: its first block and that block's table entry.
struct Run<'k> {
    first: usize,
    head: &'k Key,
    /// Whether the lookup passed part of it through the head's pointer.
    skipped: bool,
}

/// A lookup's prompt keys, computed on demand.
struct PromptKeys<'t> {
    tokens: &'t [u32],
    bs: u32,
    seed: u64,
    keys: Vec<u64>,
}

impl PromptKeys<'_> {
    /// Make sure the first `n` block keys are computed.
    fn upto(&mut self, n: usize) {
        let bs = self.bs as usize;
        let mut key = self.keys.last().copied().unwrap_or(root(self.seed));
        for b in self.keys.len()..n {
            key = content_key(self.seed, key, self.bs, &self.tokens[b * bs..(b + 1) * bs]);
            self.keys.push(key);
        }
    }
}

impl KvIndex {
    /// For each worker holding a prefix of `tokens`: how many leading tokens it holds (whole
    /// blocks, consecutive from the start). Sorted by slot; workers with nothing are left out.
    /// Mutable only to leave skip pointers; the answer is a function of the events applied.
    pub fn match_tokens(&mut self, tokens: &[u32]) -> Vec<(WorkerSlot, usize)> {
        let now = self.lookups.fetch_add(1, Relaxed).wrapping_add(1);
        let mut out: Vec<(WorkerSlot, usize)> = Vec::new();
        let mut runs: Vec<(u64, Skip)> = Vec::new();
        for &bs in self.block_sizes.keys() {
            self.match_block_size(tokens, bs, now, &mut out, &mut runs);
        }
        by_slot(&mut out, self.workers.len());
        for (head, skip) in runs {
            if let Some(k) = self.holders.get_mut(&head) {
                k.skip = self.skips.put(k.skip, skip);
            }
        }
        out
    }

    fn match_block_size(&self, tokens: &[u32], bs: u32, now: u32, out: &mut Vec<(WorkerSlot, usize)>, runs: &mut Vec<(u64, Skip)>) {
        let bsz = bs as usize;
        let n_blocks = tokens.len() / bsz;
        let mut keys = PromptKeys { tokens, bs, seed: self.seed, keys: Vec::with_capacity(n_blocks.min(4 * KEY_BATCH)) };
        let mut walk = Walk::new(out);
        // the current run of equal holders: its first block and the first key's table entry
        let mut run: Option<Run> = None;
        let (mut at, mut batch) = (0, FIRST_BATCH);
        let stop = 'blocks: loop {
            if at >= n_blocks {
                break n_blocks;
            }
            let end = (at + batch).min(n_blocks);
            keys.upto(end);
            batch = (batch * 2).min(KEY_BATCH);
            let found: [Option<&Key>; KEY_BATCH] = std::array::from_fn(|j| if at + j < end { self.holders.get(&keys.keys[at + j]) } else { None });
            let mut next = end; // where the next batch starts: the batch's end, or past a run
            for b in at..end {
                let Some(k) = found[b - at] else { break 'blocks b };
                k.last_hit.store(now, Relaxed);
                let head = !walk.same(k.holders);
                if head {
                    self.close_run(run, b, &keys.keys, runs);
                    run = Some(Run { first: b, head: k, skipped: false });
                }
                if !walk.step(k.holders, || self.sets.view(&k.holders), b * bsz) {
                    return; // nobody left: everyone was emitted with their depth
                }
                if head {
                    if let Some(len) = self.skip_from(k, b, &mut keys, n_blocks) {
                        if let Some(r) = run.as_mut() {
                            r.skipped = true;
                        }
                        next = b + 1 + len;
                        break;
                    }
                }
            }
            at = next;
        };
        self.close_run(run, stop, &keys.keys, runs);
        walk.finish(stop * bsz);
    }

    /// The run passed by `head`'s skip pointer, if it holds and the prompt follows it.
    fn skip_from(&self, head: &Key, at: usize, keys: &mut PromptKeys, n_blocks: usize) -> Option<usize> {
        let s = self.skips.get(head.skip)?;
        let last = at + s.len as usize;
        if s.holders != head.holders || s.stamp != self.sets.stamp(head.holders) || last >= n_blocks {
            return None;
        }
        keys.upto(last + 1);
        if keys.keys[last] != s.end_key || s.uses.fetch_add(1, Relaxed) >= REFRESH_AFTER {
            return None;
        }
        self.skipped.fetch_add(u64::from(s.len), Relaxed);
        Some(s.len as usize)
    }

    /// A run walked from `first` up to `end` (exclusive) ended: leave a pointer on its first key
    /// when it is long, and its key has none that is as long and still fresh.
    fn close_run(&self, run: Option<Run>, end: usize, keys: &[u64], runs: &mut Vec<(u64, Skip)>) {
        let Some(Run { first, head: k, skipped }) = run else { return };
        let len = end - 1 - first;
        if len < MIN_SKIP {
            return;
        }
        let stamp = self.sets.stamp(k.holders);
        let old = self.skips.get(k.skip).filter(|s| s.holders == k.holders && s.stamp == stamp);
        if old.is_some_and(|s| s.len as usize >= len && s.uses.load(Relaxed) < REFRESH_AFTER) {
            return; // still fresh
        }
        // a run longer than its pointer, passed partly through it: the passed part's clocks
        // were not refreshed, so the uses carry over
        let uses = if skipped { old.map_or(0, |s| s.uses.load(Relaxed)) } else { 0 };
        let skip = Skip { end_key: keys[end - 1], holders: k.holders, stamp, len: len as u32, uses: AtomicU32::new(uses) };
        runs.push((keys[first], skip));
    }
}
