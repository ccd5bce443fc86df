//! The KV event index against a naive oracle: per worker, every held engine hash with the full
//! token prefix it stands for; a worker matches k tokens when it holds every block prefix of the
//! request up to k. A second index under a tight `max_blocks` must never claim more than the
//! oracle (eviction only under-reports) and must stay within its bound.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use pdgate_core::kv_events::KvEvent;
use pdgate_core::kv_index::KvIndex;
use proptest::prelude::*;

const BS: usize = 2;
/// Enough workers that a shared prefix outgrows a short holder list into a bitset (more than 8).
const WORKERS: usize = 12;

/// The engine's name for a block: any function of the whole prefix (here SipHash, unlike the
/// index's own keys).
fn engine_hash(prefix: &[u32]) -> u64 {
    let mut h = DefaultHasher::new();
    prefix.hash(&mut h);
    h.finish()
}

#[derive(Clone, Debug)]
enum Op {
    /// Worker stores blocks `from..from + count` of base sequence `seq`.
    Store {
        worker: usize,
        seq: usize,
        from: usize,
        count: usize,
    },
    Remove {
        worker: usize,
        seq: usize,
        block: usize,
    },
    Clear {
        worker: usize,
    },
    /// The worker is removed and a new one takes its slot (empty).
    Replace {
        worker: usize,
    },
    /// Every worker stores the sequence's first blocks (a fleet-wide prefix).
    StoreAll {
        seq: usize,
        count: usize,
    },
}

/// `blocks`: the base sequences' length in blocks.
fn op(n_seqs: usize, blocks: usize) -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..WORKERS, 0..n_seqs, 0..blocks - 1, 1..blocks * 2 / 3).prop_map(|(worker, seq, from, count)| Op::Store { worker, seq, from, count }),
        2 => (0..WORKERS, 0..n_seqs, 0..blocks).prop_map(|(worker, seq, block)| Op::Remove { worker, seq, block }),
        1 => (0..WORKERS).prop_map(|worker| Op::Clear { worker }),
        1 => (0..WORKERS).prop_map(|worker| Op::Replace { worker }),
        1 => (0..n_seqs, 1..blocks).prop_map(|(seq, count)| Op::StoreAll { seq, count }),
    ]
}

/// Base sequences of `blocks` blocks over a 2-token alphabet, so they share prefixes often.
fn seqs(blocks: usize) -> impl Strategy<Value = Vec<Vec<u32>>> {
    proptest::collection::vec(proptest::collection::vec(0..2u32, blocks * BS), 1..5)
}

fn event(op: &Op, seqs: &[Vec<u32>]) -> Option<(usize, KvEvent)> {
    match *op {
        Op::Replace { .. } | Op::StoreAll { .. } => None,
        Op::Store { worker, seq, from, count } => {
            let s = &seqs[seq];
            let to = (from + count).min(s.len() / BS);
            if from >= to {
                return None;
            }
            let hashes = (from..to).map(|b| engine_hash(&s[..(b + 1) * BS])).collect();
            let parent = (from > 0).then(|| engine_hash(&s[..from * BS]));
            let tokens = s[from * BS..to * BS].to_vec();
            Some((worker, KvEvent::BlockStored { block_hashes: hashes, parent_block_hash: parent, token_ids: tokens, block_size: BS as u32, medium: None }))
        }
        Op::Remove { worker, seq, block } => {
            let s = &seqs[seq];
            let end = ((block + 1) * BS).min(s.len());
            Some((worker, KvEvent::BlockRemoved { block_hashes: vec![engine_hash(&s[..end])], medium: None }))
        }
        Op::Clear { worker } => Some((worker, KvEvent::AllBlocksCleared)),
    }
}

/// The oracle: worker -> engine hash -> token prefix.
fn oracle_apply(held: &mut [HashMap<u64, Vec<u32>>], worker: usize, ev: &KvEvent) {
    let w = &mut held[worker];
    match ev {
        KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, .. } => {
            let mut prefix = match parent_block_hash {
                None => vec![],
                Some(p) => match w.get(p) {
                    Some(pre) => pre.clone(),
                    None => return, // unknown parent: nothing placed
                },
            };
            for (i, h) in block_hashes.iter().enumerate() {
                prefix.extend_from_slice(&token_ids[i * BS..(i + 1) * BS]);
                w.entry(*h).or_insert_with(|| prefix.clone());
            }
        }
        KvEvent::BlockRemoved { block_hashes, .. } => {
            for h in block_hashes {
                w.remove(h);
            }
        }
        KvEvent::AllBlocksCleared => w.clear(),
    }
}

fn oracle_match(held: &[HashMap<u64, Vec<u32>>], q: &[u32]) -> Vec<(u32, usize)> {
    let mut out = vec![];
    for (i, w) in held.iter().enumerate() {
        let prefixes: Vec<&Vec<u32>> = w.values().collect();
        let mut k = 0;
        while (k + 1) * BS <= q.len() && prefixes.iter().any(|p| p.as_slice() == &q[..(k + 1) * BS]) {
            k += 1;
        }
        if k > 0 {
            out.push((i as u32, k * BS));
        }
    }
    out
}

/// Apply `ops`, looking `probe_len` tokens of the first sequence up after each (the lookup clock
/// moves, second chances happen, skip pointers are left and used), then check `queries`.
fn check(bound: usize, seqs: &[Vec<u32>], ops: &[Op], queries: &[(usize, usize, Vec<u32>)], probe_len: usize) -> Result<(), TestCaseError> {
    let mut ix = KvIndex::new(42, usize::MAX);
    let mut small = KvIndex::new(42, bound);
    let slots: Vec<u32> = (0..WORKERS).map(|_| ix.add_worker()).collect();
    for _ in 0..WORKERS {
        small.add_worker();
    }
    prop_assert_eq!(&slots, &(0..WORKERS as u32).collect::<Vec<_>>());
    let mut held = vec![HashMap::new(); WORKERS];
    for o in ops {
        let evs: Vec<(usize, KvEvent)> = match *o {
            Op::Replace { worker } => {
                for index in [&mut ix, &mut small] {
                    index.remove_worker(slots[worker]);
                    prop_assert_eq!(index.add_worker(), slots[worker]);
                }
                held[worker].clear();
                vec![]
            }
            Op::StoreAll { seq, count } => (0..WORKERS).filter_map(|worker| event(&Op::Store { worker, seq, from: 0, count }, seqs)).collect(),
            _ => event(o, seqs).into_iter().collect(),
        };
        for (w, ev) in evs {
            ix.apply_event(slots[w], &ev);
            small.apply_event(slots[w], &ev);
            oracle_apply(&mut held, w, &ev);
        }
        let probe = &seqs[0][..probe_len];
        prop_assert_eq!(ix.match_tokens(probe), oracle_match(&held, probe));
        small.match_tokens(probe);
    }
    let total: usize = held.iter().map(HashMap::len).sum();
    prop_assert_eq!(ix.stats().blocks, total);
    prop_assert!(small.stats().blocks <= bound);
    for (s, cut, tail) in queries {
        let mut q = seqs[*s][..*cut.min(&seqs[*s].len())].to_vec();
        q.extend_from_slice(tail);
        let exact = oracle_match(&held, &q);
        prop_assert_eq!(ix.match_tokens(&q), exact.clone(), "query {:?}", q);
        for (slot, n) in small.match_tokens(&q) {
            let limit = exact.iter().find(|e| e.0 == slot).map_or(0, |e| e.1);
            prop_assert!(n <= limit, "bounded index claims {} tokens on {} for {:?}, oracle {}", n, slot, q, limit);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    #[test]
    fn the_index_matches_the_naive_oracle(
        bound in 1..30usize,
        (seqs, ops, queries) in seqs(6).prop_flat_map(|s| {
            let n = s.len();
            (Just(s), proptest::collection::vec(op(n, 6), 0..40), proptest::collection::vec((0..n, 0..13usize, proptest::collection::vec(0..2u32, 0..4)), 1..6))
        })
    ) {
        check(bound, &seqs, &ops, &queries, 6)?;
    }

    /// Sequences of 40 blocks: runs long enough for skip pointers (16 blocks or more), left by
    /// the probe after every event and used by the next ones, while events change the holders.
    #[test]
    fn long_runs_through_skip_pointers_match_the_naive_oracle(
        bound in 1..200usize,
        (seqs, ops, queries) in seqs(40).prop_flat_map(|s| {
            let n = s.len();
            (Just(s), proptest::collection::vec(op(n, 40), 0..40), proptest::collection::vec((0..n, 0..81usize, proptest::collection::vec(0..2u32, 0..4)), 1..6))
        })
    ) {
        check(bound, &seqs, &ops, &queries, 80)?;
    }
}
