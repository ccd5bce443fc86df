//! What each worker's KV cache holds, built from its KV events, and how much of a request's
//! prompt each worker already has.
//!
//! The engines name blocks with their own hash function (sha256 over pickled or CBOR'd tuples,
//! seeds that differ between versions); reproducing it would tie the gateway to one engine
//! version. Instead each stored block is named here by a key computed from its content: the
//! parent block's key (looked up through the engine's parent hash in that worker's view) and the
//! block's token ids. Equal prefixes get equal keys on every worker, so a request's token ids,
//! cut into blocks and keyed the same way, find every worker holding them.
//!
//! Per worker: engine hash -> (key, block size), and the next expected event sequence number.
//! Across workers: key -> sorted list of the workers holding it. A match walks the request's
//! blocks from the start and keeps the workers that hold every block so far, so its cost is the
//! sum of the holder lists it reads: a block held by every worker is read whole (the worst case
//! is a long prefix cached on the whole fleet; see the `kv_index` bench).
//!
//! A stored block whose parent the worker's view does not know (events missed, or the parent
//! was evicted and re-stored under another prefix) cannot be placed and is counted as an orphan,
//! never guessed. Memory is bounded by `max_blocks` (worker-block entries): stores past it are
//! counted and ignored, so the view under-reports, which costs routing quality, not correctness.
//! Pure: no IO, no clock; the keys are seeded (pass a random seed in a gateway, so a client
//! cannot aim prompts at colliding keys).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::kv_events::{DecodedBatch, KvEvent};

/// A worker's index in the view; stable while the worker is registered.
pub type WorkerSlot = u32;

/// Where a batch's sequence number stands against what was seen from that worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeqCheck {
    /// The first batch seen from this worker (since registration or a reset): applied. Batches
    /// before it were missed; a subscriber may replay them from 0 first.
    First,
    /// The expected next batch: applied.
    Next,
    /// Batches `expected..got` were missed: NOT applied. Replay them (then apply this one), or
    /// `reset` the worker.
    Gap { expected: u64, got: u64 },
    /// Already applied (a replay overlapping the live stream): ignored.
    Stale,
}

/// Counters for metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IndexStats {
    pub blocks: usize,
    pub stored: u64,
    pub removed: u64,
    pub orphans: u64,
    pub over_capacity: u64,
    pub gaps: u64,
    pub resets: u64,
    pub undecodable: u64,
}

#[derive(Clone, Copy)]
struct Held {
    key: u64,
    block_size: u32,
}

#[derive(Default)]
struct WorkerState {
    blocks: Map<Held>,
    /// How many of its engine hashes map to each key (equal content hashed twice by an engine
    /// that salts its hashes): the worker holds the key while any of them is held.
    key_refs: Map<u32>,
    next_seq: Option<u64>,
}

type Map<V> = HashMap<u64, V, BuildHasherDefault<MixHasher>>;

/// The per-worker block views and the key -> holders table.
pub struct KvIndex {
    seed: u64,
    max_blocks: usize,
    holders: Map<Holders>,
    workers: Vec<Option<WorkerState>>,
    block_sizes: HashMap<u32, usize>,
    stats: IndexStats,
}

impl KvIndex {
    pub fn new(seed: u64, max_blocks: usize) -> Self {
        KvIndex { seed, max_blocks, holders: Map::default(), workers: Vec::new(), block_sizes: HashMap::new(), stats: IndexStats::default() }
    }

    /// Register a worker (its view starts empty); returns its slot.
    pub fn add_worker(&mut self) -> WorkerSlot {
        let slot = match self.workers.iter().position(Option::is_none) {
            Some(free) => free,
            None => {
                self.workers.push(None);
                self.workers.len() - 1
            }
        };
        self.workers[slot] = Some(WorkerState::default());
        slot as WorkerSlot
    }

    /// Forget a worker and everything it held; its slot may be reused.
    pub fn remove_worker(&mut self, slot: WorkerSlot) {
        self.clear_blocks(slot);
        if let Some(w) = self.workers.get_mut(slot as usize) {
            *w = None;
        }
    }

    /// Empty a worker's view (a reconnect, a gap that replay could not fill); the next batch
    /// is taken as `First`.
    pub fn reset(&mut self, slot: WorkerSlot) {
        self.clear_blocks(slot);
        if let Some(Some(w)) = self.workers.get_mut(slot as usize) {
            w.next_seq = None;
        }
        self.stats.resets += 1;
    }

    /// Apply one batch from a worker, unless its sequence number says it must not be (see
    /// [`SeqCheck`]). Unknown slots are ignored (`Stale`).
    pub fn apply(&mut self, slot: WorkerSlot, seq: u64, batch: &DecodedBatch) -> SeqCheck {
        let Some(Some(w)) = self.workers.get_mut(slot as usize) else { return SeqCheck::Stale };
        let check = match w.next_seq {
            None => SeqCheck::First,
            Some(next) if seq == next => SeqCheck::Next,
            Some(next) if seq > next => SeqCheck::Gap { expected: next, got: seq },
            Some(_) => SeqCheck::Stale,
        };
        match check {
            SeqCheck::Gap { .. } => self.stats.gaps += 1,
            SeqCheck::Stale => {}
            SeqCheck::First | SeqCheck::Next => {
                w.next_seq = Some(seq.wrapping_add(1));
                self.stats.undecodable += batch.undecodable as u64;
                for ev in &batch.events {
                    self.apply_event(slot, ev);
                }
            }
        }
        check
    }

    /// Apply one event to a worker's view, without sequence checks.
    pub fn apply_event(&mut self, slot: WorkerSlot, ev: &KvEvent) {
        match ev {
            KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, block_size, .. } => self.store(slot, block_hashes, *parent_block_hash, token_ids, *block_size),
            KvEvent::BlockRemoved { block_hashes, .. } => {
                for h in block_hashes {
                    self.remove(slot, *h);
                }
            }
            KvEvent::AllBlocksCleared => self.clear_blocks(slot),
        }
    }

    fn store(&mut self, slot: WorkerSlot, hashes: &[u64], parent: Option<u64>, tokens: &[u32], block_size: u32) {
        let Some(Some(w)) = self.workers.get_mut(slot as usize) else { return };
        let mut key = match parent {
            None => root(self.seed),
            Some(p) => match w.blocks.get(&p) {
                Some(h) if h.block_size == block_size => h.key,
                _ => {
                    self.stats.orphans += hashes.len() as u64;
                    return;
                }
            },
        };
        for (i, h) in hashes.iter().enumerate() {
            let chunk = tokens.get(i * block_size as usize..(i + 1) * block_size as usize).unwrap_or(&[]);
            key = content_key(self.seed, key, block_size, chunk);
            if w.blocks.contains_key(h) {
                continue; // re-stored: same hash, same content
            }
            if self.stats.blocks >= self.max_blocks {
                self.stats.over_capacity += (hashes.len() - i) as u64;
                return;
            }
            w.blocks.insert(*h, Held { key, block_size });
            let refs = w.key_refs.entry(key).or_default();
            *refs += 1;
            if *refs == 1 {
                self.holders.entry(key).or_default().add(slot);
            }
            *self.block_sizes.entry(block_size).or_default() += 1;
            self.stats.blocks += 1;
            self.stats.stored += 1;
        }
    }

    fn remove(&mut self, slot: WorkerSlot, hash: u64) {
        let Some(Some(w)) = self.workers.get_mut(slot as usize) else { return };
        if let Some(held) = w.blocks.remove(&hash) {
            self.forget(slot, held);
            self.stats.removed += 1;
        }
    }

    fn clear_blocks(&mut self, slot: WorkerSlot) {
        let Some(Some(w)) = self.workers.get_mut(slot as usize) else { return };
        let held: Vec<Held> = w.blocks.drain().map(|(_, h)| h).collect();
        for h in held {
            self.forget(slot, h);
        }
    }

    /// A worker let go of one engine block: drop it from the key's holders once no engine
    /// block of that worker maps to the key any more.
    fn forget(&mut self, slot: WorkerSlot, held: Held) {
        self.stats.blocks -= 1;
        if let Some(n) = self.block_sizes.get_mut(&held.block_size) {
            *n -= 1;
            if *n == 0 {
                self.block_sizes.remove(&held.block_size);
            }
        }
        let Some(Some(w)) = self.workers.get_mut(slot as usize) else { return };
        let refs = w.key_refs.get_mut(&held.key).map(|r| {
            *r -= 1;
            *r
        });
        if refs != Some(0) {
            return;
        }
        w.key_refs.remove(&held.key);
        if let Some(list) = self.holders.get_mut(&held.key) {
            if list.remove(slot) {
                self.holders.remove(&held.key);
            }
        }
    }

    /// For each worker holding a prefix of `tokens`: how many leading tokens it holds (whole
    /// blocks, consecutive from the start). Sorted by slot; workers with nothing are left out.
    pub fn match_tokens(&self, tokens: &[u32]) -> Vec<(WorkerSlot, usize)> {
        let mut out: Vec<(WorkerSlot, usize)> = Vec::new();
        for &bs in self.block_sizes.keys() {
            self.match_block_size(tokens, bs, &mut out);
        }
        out.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
        out.dedup_by_key(|e| e.0); // several block sizes: keep each worker's longest match
        out
    }

    /// Walk the blocks keeping the workers that hold all of them so far; a worker leaving the
    /// walk (or still in it at the end) is pushed to `out` with its depth.
    fn match_block_size(&self, tokens: &[u32], bs: u32, out: &mut Vec<(WorkerSlot, usize)>) {
        // Keys first, then the lookups: they do not depend on each other, so their cache misses
        // (the table is large) overlap instead of queueing one per block.
        let mut key = root(self.seed);
        let keys: Vec<u64> = tokens
            .chunks_exact(bs as usize)
            .map(|chunk| {
                key = content_key(self.seed, key, bs, chunk);
                key
            })
            .collect();
        let found: Vec<&[WorkerSlot]> = keys.iter().map_while(|k| self.holders.get(k).map(Holders::as_slice)).collect();
        let (mut alive, mut next) = (Vec::<WorkerSlot>::new(), Vec::<WorkerSlot>::new());
        for (i, holders) in found.iter().enumerate() {
            let depth = i * bs as usize;
            if i == 0 {
                alive.extend_from_slice(holders);
            } else {
                next.clear();
                for &s in &alive {
                    if holders.binary_search(&s).is_ok() {
                        next.push(s);
                    } else {
                        out.push((s, depth));
                    }
                }
                std::mem::swap(&mut alive, &mut next);
            }
            if alive.is_empty() {
                return;
            }
        }
        let depth = found.len() * bs as usize;
        out.extend(alive.into_iter().map(|s| (s, depth)));
    }

    /// How many blocks a worker's view holds.
    pub fn worker_blocks(&self, slot: WorkerSlot) -> usize {
        self.workers.get(slot as usize).and_then(Option::as_ref).map_or(0, |w| w.blocks.len())
    }

    pub fn stats(&self) -> IndexStats {
        self.stats.clone()
    }

    /// An estimate of the heap the index uses (tables at capacity), for a size metric.
    pub fn memory_bytes(&self) -> usize {
        let per_worker: usize = self.workers.iter().flatten().map(|w| w.blocks.capacity() * (8 + 16 + 1) + w.key_refs.capacity() * (8 + 4 + 1)).sum();
        let lists: usize = self.holders.values().map(|l| if let Holders::Many(v) = l { v.capacity() * 4 } else { 0 }).sum();
        per_worker + self.holders.capacity() * (8 + 32 + 1) + lists
    }
}

/// The workers holding one key, sorted; most keys have one holder, kept inline (one cache miss
/// less per block on the routing path).
#[derive(Clone, Debug, Default)]
enum Holders {
    #[default]
    None,
    One(WorkerSlot),
    Many(Vec<WorkerSlot>),
}

impl Holders {
    fn as_slice(&self) -> &[WorkerSlot] {
        match self {
            Holders::None => &[],
            Holders::One(s) => std::slice::from_ref(s),
            Holders::Many(v) => v,
        }
    }

    fn add(&mut self, slot: WorkerSlot) {
        match self {
            Holders::None => *self = Holders::One(slot),
            Holders::One(s) if *s == slot => {}
            Holders::One(s) => *self = Holders::Many(if *s < slot { vec![*s, slot] } else { vec![slot, *s] }),
            Holders::Many(v) => {
                if let Err(at) = v.binary_search(&slot) {
                    v.insert(at, slot);
                }
            }
        }
    }

    /// Remove `slot`; true when nobody holds the key any more.
    fn remove(&mut self, slot: WorkerSlot) -> bool {
        match self {
            Holders::None => true,
            Holders::One(s) => *s == slot,
            Holders::Many(v) => {
                if let Ok(at) = v.binary_search(&slot) {
                    v.remove(at);
                }
                let (len, first) = (v.len(), v.first().copied());
                if let (1, Some(only)) = (len, first) {
                    *self = Holders::One(only);
                }
                len == 0
            }
        }
    }
}

const K1: u64 = 0x9e37_79b9_7f4a_7c15;
const K2: u64 = 0xff51_afd7_ed55_8ccd;

fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(K2);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

fn root(seed: u64) -> u64 {
    mix(seed ^ K1)
}

/// The key of a block: its parent's key, its size and its tokens, mixed under the seed.
pub(crate) fn content_key(seed: u64, parent: u64, block_size: u32, tokens: &[u32]) -> u64 {
    let mut h = parent ^ mix(seed.wrapping_add(u64::from(block_size)));
    for &t in tokens {
        h = (h.rotate_left(23) ^ u64::from(t)).wrapping_mul(K1);
    }
    mix(h ^ tokens.len() as u64)
}

/// Hasher for u64 keys that are already well mixed (content keys) or engine hashes: one final
/// mix instead of SipHash, since a lookup is on the routing path.
#[derive(Default)]
pub struct MixHasher(u64);

impl Hasher for MixHasher {
    fn finish(&self) -> u64 {
        mix(self.0)
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(*b)).wrapping_mul(K1);
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 ^= x;
    }
}

#[cfg(test)]
#[path = "kv_index_tests.rs"]
mod tests;
