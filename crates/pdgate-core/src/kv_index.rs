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
//! Per worker: engine hash -> its entry, and the next expected event sequence number. Across
//! workers: key -> the set of workers holding it (`holders.rs`: one slot inline, or an interned
//! set, a short list or a bitset, shared by every key with the same holders). A lookup walks the
//! prompt's blocks once, narrowing the workers that held every block so far (`walk.rs`); a block
//! whose holders are the previous block's costs one id comparison, a change costs the short list
//! or one word per 64 workers (a prefix cached on the whole fleet: 16 word operations at 1,000
//! workers, not 1,000 searches). A long run of blocks with equal holders is passed with no table
//! probe through a skip pointer (`lookup.rs`; see the `kv_index` bench).
//!
//! A stored block whose parent the worker's view does not know (events missed, or the parent
//! was evicted and re-stored under another prefix) cannot be placed and is counted as an orphan,
//! never guessed. Memory is bounded by `max_blocks` (worker-block entries): past it the oldest
//! entry is evicted (`order.rs`), unless a lookup hit its key since it was stored, in which case
//! it goes to the back once (second chance: a hot system prompt outlives a one-off prompt). An
//! eviction makes the view under-report, which costs routing quality, not correctness.
//! Pure: no IO, no clock (the lookup counter is the only time); the keys are seeded (pass a
//! random seed in a gateway, so a client cannot aim prompts at colliding keys).

mod holders;
mod keys;
mod lookup;
mod order;
mod walk;

use std::collections::hash_map::Entry as MapEntry;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};

use crate::kv_events::{DecodedBatch, KvEvent};
use holders::{Holders, Sets};
use keys::{content_key, mix, root, K1};
use lookup::{Skips, NO_SKIP};
use order::{Entry, Order};

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
    /// Worker-block entries held (the quantity `max_blocks` bounds).
    pub blocks: usize,
    /// Distinct content keys (prefixes) held by at least one worker.
    pub keys: usize,
    pub stored: u64,
    pub removed: u64,
    pub orphans: u64,
    /// Stores ignored because the index has no room at all (`max_blocks` 0).
    pub over_capacity: u64,
    /// Entries evicted to stay within `max_blocks`.
    pub evicted: u64,
    pub gaps: u64,
    pub resets: u64,
    pub undecodable: u64,
    /// Blocks that lookups passed through skip pointers without a table probe.
    pub skipped_blocks: u64,
}

#[derive(Default)]
struct WorkerState {
    /// Engine hash -> its entry in `Order`.
    blocks: Map<u32>,
    next_seq: Option<u64>,
}

/// One content key: who holds it, the lookup clock when a lookup last reached it, and the skip
/// pointer of the run of equal holders it starts (`lookup.rs`). 16 bytes.
struct Key {
    holders: Holders,
    last_hit: AtomicU32,
    skip: u32,
}

type Map<V> = HashMap<u64, V, BuildHasherDefault<MixHasher>>;

/// An eviction gives at most this many hot entries a second chance before evicting anyway.
const SECOND_CHANCES: usize = 16;

/// The per-worker block views and the key -> holders table.
pub struct KvIndex {
    seed: u64,
    max_blocks: usize,
    holders: Map<Key>,
    workers: Vec<Option<WorkerState>>,
    order: Order,
    /// (slot, key) -> how many more engine hashes of that worker map to the key beyond the
    /// first (equal content hashed twice by an engine that salts its hashes): the worker holds
    /// the key until the last one goes. Rare, so kept apart from the hot table.
    dups: HashMap<(WorkerSlot, u64), u32>,
    block_sizes: HashMap<u32, usize>,
    /// The interned holder sets the keys point at.
    sets: Sets,
    skips: Skips,
    /// The lookup clock: one tick per `match_tokens`, for second chances.
    lookups: AtomicU32,
    /// `IndexStats::skipped_blocks`, counted by lookups.
    skipped: AtomicU64,
    stats: IndexStats,
}

impl KvIndex {
    /// `max_blocks`: the bound on worker-block entries, beyond which the oldest are evicted.
    pub fn new(seed: u64, max_blocks: usize) -> Self {
        KvIndex {
            seed,
            max_blocks,
            holders: Map::default(),
            workers: Vec::new(),
            order: Order::default(),
            dups: HashMap::new(),
            block_sizes: HashMap::new(),
            sets: Sets::default(),
            skips: Skips::default(),
            lookups: AtomicU32::new(0),
            skipped: AtomicU64::new(0),
            stats: IndexStats::default(),
        }
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
        if let Some(w) = self.worker_mut(slot) {
            w.next_seq = None;
        }
        self.stats.resets += 1;
    }

    /// Apply one batch from a worker, unless its sequence number says it must not be (see
    /// [`SeqCheck`]). Unknown slots are ignored (`Stale`).
    pub fn apply(&mut self, slot: WorkerSlot, seq: u64, batch: &DecodedBatch) -> SeqCheck {
        let Some(w) = self.worker_mut(slot) else { return SeqCheck::Stale };
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

    fn worker_mut(&mut self, slot: WorkerSlot) -> Option<&mut WorkerState> {
        self.workers.get_mut(slot as usize).and_then(Option::as_mut)
    }

    fn store(&mut self, slot: WorkerSlot, hashes: &[u64], parent: Option<u64>, tokens: &[u32], block_size: u32) {
        let Some(w) = self.workers.get(slot as usize).and_then(Option::as_ref) else { return };
        if block_size == 0 {
            self.stats.undecodable += 1; // the decoder refuses these; a direct caller may not
            return;
        }
        let mut key = match parent {
            None => root(self.seed),
            Some(p) => match w.blocks.get(&p).map(|&i| self.order.get(i)) {
                Some(e) if e.block_size == block_size => e.key,
                _ => {
                    self.stats.orphans += hashes.len() as u64;
                    return;
                }
            },
        };
        let now = self.lookups.load(Relaxed);
        for (i, &h) in hashes.iter().enumerate() {
            let chunk = tokens.get(i * block_size as usize..(i + 1) * block_size as usize).unwrap_or(&[]);
            key = content_key(self.seed, key, block_size, chunk);
            let known = self.worker_mut(slot).and_then(|w| w.blocks.get(&h).copied());
            if let Some(idx) = known {
                self.order.move_to_back(idx, now); // re-stored: same hash, same content, fresh
                continue;
            }
            if self.max_blocks == 0 {
                self.stats.over_capacity += (hashes.len() - i) as u64;
                return;
            }
            while self.stats.blocks >= self.max_blocks && self.evict_one(now) {}
            let idx = self.order.push_back(h, key, slot, block_size, now);
            if let Some(w) = self.worker_mut(slot) {
                w.blocks.insert(h, idx);
            }
            self.hold(slot, key, now);
            *self.block_sizes.entry(block_size).or_default() += 1;
            self.stats.blocks += 1;
            self.stats.stored += 1;
        }
    }

    /// `slot` holds one more engine block keyed `key`.
    fn hold(&mut self, slot: WorkerSlot, key: u64, now: u32) {
        let n_slots = self.workers.len();
        match self.holders.entry(key) {
            MapEntry::Occupied(mut o) => {
                let set = &mut o.get_mut().holders;
                if self.sets.contains(set, slot) {
                    *self.dups.entry((slot, key)).or_default() += 1;
                } else {
                    self.sets.insert(set, slot, n_slots);
                }
            }
            MapEntry::Vacant(v) => {
                v.insert(Key { holders: Holders::One(slot), last_hit: AtomicU32::new(now), skip: NO_SKIP });
                self.stats.keys += 1;
            }
        }
    }

    fn remove(&mut self, slot: WorkerSlot, hash: u64) {
        let Some(idx) = self.worker_mut(slot).and_then(|w| w.blocks.remove(&hash)) else { return };
        let e = self.order.remove(idx);
        self.forget(e);
        self.stats.removed += 1;
    }

    /// Evict the oldest entry, or give it a second chance if a lookup reached its key since it
    /// was queued. False when the index is empty.
    fn evict_one(&mut self, now: u32) -> bool {
        for chance in 0..=SECOND_CHANCES {
            let Some(idx) = self.order.front() else { return false };
            let e = *self.order.get(idx);
            let hot = self.holders.get(&e.key).is_some_and(|k| (k.last_hit.load(Relaxed).wrapping_sub(e.queued_at) as i32) > 0);
            if hot && chance < SECOND_CHANCES {
                self.order.move_to_back(idx, now);
                continue;
            }
            let e = self.order.remove(idx);
            if let Some(w) = self.worker_mut(e.slot) {
                w.blocks.remove(&e.hash);
            }
            self.forget(e);
            self.stats.evicted += 1;
            return true;
        }
        false
    }

    fn clear_blocks(&mut self, slot: WorkerSlot) {
        let Some(w) = self.worker_mut(slot) else { return };
        let held: Vec<u32> = w.blocks.drain().map(|(_, idx)| idx).collect();
        for idx in held {
            let e = self.order.remove(idx);
            self.forget(e);
        }
    }

    /// A worker let go of one engine block (its entry already unlinked): drop it from the
    /// key's holders once no engine block of that worker maps to the key any more.
    fn forget(&mut self, e: Entry) {
        self.stats.blocks -= 1;
        if let Some(n) = self.block_sizes.get_mut(&e.block_size) {
            *n -= 1;
            if *n == 0 {
                self.block_sizes.remove(&e.block_size);
            }
        }
        if let Some(n) = self.dups.get_mut(&(e.slot, e.key)) {
            *n -= 1;
            if *n == 0 {
                self.dups.remove(&(e.slot, e.key));
            }
            return;
        }
        let n_slots = self.workers.len();
        let Some(k) = self.holders.get_mut(&e.key) else { return };
        if self.sets.remove(&mut k.holders, e.slot, n_slots) {
            if let Some(k) = self.holders.remove(&e.key) {
                self.skips.free(k.skip);
            }
            self.stats.keys -= 1;
        }
    }

    /// The sequence number this worker's next batch should have (None: any, the view is fresh).
    pub fn next_seq(&self, slot: WorkerSlot) -> Option<u64> {
        self.workers.get(slot as usize).and_then(Option::as_ref).and_then(|w| w.next_seq)
    }

    /// How many blocks a worker's view holds.
    pub fn worker_blocks(&self, slot: WorkerSlot) -> usize {
        self.workers.get(slot as usize).and_then(Option::as_ref).map_or(0, |w| w.blocks.len())
    }

    /// The bound on worker-block entries.
    pub fn max_blocks(&self) -> usize {
        self.max_blocks
    }

    #[cfg(test)]
    fn order_len(&self) -> usize {
        self.order.len()
    }

    pub fn stats(&self) -> IndexStats {
        IndexStats { skipped_blocks: self.skipped.load(Relaxed), ..self.stats.clone() }
    }

    /// An estimate of the heap the index uses (tables at capacity, one control byte per
    /// bucket), for a size metric. O(workers), no walk over the blocks.
    pub fn memory_bytes(&self) -> usize {
        let bucket = |entry: usize| entry + 1;
        let per_worker: usize = self.workers.iter().flatten().map(|w| w.blocks.capacity() * bucket(std::mem::size_of::<(u64, u32)>())).sum();
        let keys = self.holders.capacity() * bucket(std::mem::size_of::<(u64, Key)>()) + self.sets.heap_bytes();
        let dups = self.dups.capacity() * bucket(std::mem::size_of::<((WorkerSlot, u64), u32)>());
        per_worker + keys + dups + self.skips.heap_bytes() + self.order.heap_bytes() + self.workers.capacity() * std::mem::size_of::<Option<WorkerState>>()
    }
}

/// Sort a lookup's answer by slot, keeping each worker's longest match (several block sizes can
/// each report it). A large answer (a prefix the whole fleet holds) is bucketed by slot: O(n)
/// where a sort would be O(n log n) on the routing path.
fn by_slot(out: &mut Vec<(WorkerSlot, usize)>, n_slots: usize) {
    if out.windows(2).all(|w| w[0].0 < w[1].0) {
        return; // one walk's survivors, emitted in order: already sorted, no repeats
    }
    if out.len() <= 64 {
        out.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
        out.dedup_by_key(|e| e.0);
        return;
    }
    let mut depth = vec![0usize; n_slots]; // a match is never 0 tokens: 0 means absent
    for &(s, d) in out.iter() {
        if let Some(slot) = depth.get_mut(s as usize) {
            *slot = (*slot).max(d);
        }
    }
    out.clear();
    out.extend(depth.iter().enumerate().filter(|(_, d)| **d > 0).map(|(s, d)| (s as WorkerSlot, *d)));
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
