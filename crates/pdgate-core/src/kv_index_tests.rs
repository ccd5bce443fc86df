#![allow(clippy::unwrap_used)] // test code: a panic is the failure report

use super::*;

const BS: u32 = 2;

fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> KvEvent {
    KvEvent::BlockStored { block_hashes: hashes.to_vec(), parent_block_hash: parent, token_ids: tokens.to_vec(), block_size: BS, medium: None }
}

fn removed(hashes: &[u64]) -> KvEvent {
    KvEvent::BlockRemoved { block_hashes: hashes.to_vec(), medium: None }
}

fn batch(events: Vec<KvEvent>) -> DecodedBatch {
    DecodedBatch { ts: 0.0, events, data_parallel_rank: Some(0), undecodable: 0 }
}

#[test]
fn a_stored_chain_matches_whole_blocks_from_the_start() {
    let mut ix = KvIndex::new(1, 100);
    let a = ix.add_worker();
    ix.apply_event(a, &stored(&[10, 11, 12], None, &[1, 2, 3, 4, 5, 6]));
    assert_eq!(ix.match_tokens(&[1, 2, 3, 4, 5]), vec![(a, 4)]); // the partial block never counts
    assert_eq!(ix.match_tokens(&[1, 2, 3, 4, 5, 6, 7, 8]), vec![(a, 6)]);
    assert_eq!(ix.match_tokens(&[1, 2, 9, 9]), vec![(a, 2)]);
    assert_eq!(ix.match_tokens(&[9, 2, 3, 4]), vec![]);
    // the same blocks stored in two events (parent named by its engine hash) match the same
    let b = ix.add_worker();
    ix.apply_event(b, &stored(&[20], None, &[1, 2]));
    ix.apply_event(b, &stored(&[21], Some(20), &[3, 4]));
    assert_eq!(ix.match_tokens(&[1, 2, 3, 4, 5, 6]), vec![(a, 6), (b, 4)]);
    assert_eq!(ix.stats().blocks, 5);
}

#[test]
fn a_removed_block_ends_the_match_there_and_clear_empties_one_worker() {
    let mut ix = KvIndex::new(1, 100);
    let (a, b) = (ix.add_worker(), ix.add_worker());
    for w in [a, b] {
        ix.apply_event(w, &stored(&[10, 11, 12], None, &[1, 2, 3, 4, 5, 6]));
    }
    ix.apply_event(a, &removed(&[11, 999]));
    assert_eq!(ix.match_tokens(&[1, 2, 3, 4, 5, 6]), vec![(a, 2), (b, 6)]);
    ix.apply_event(b, &KvEvent::AllBlocksCleared);
    assert_eq!(ix.match_tokens(&[1, 2, 3, 4, 5, 6]), vec![(a, 2)]);
    assert_eq!(ix.worker_blocks(b), 0);
    ix.remove_worker(a);
    assert_eq!(ix.match_tokens(&[1, 2]), vec![]);
    assert_eq!(ix.stats().blocks, 0);
    assert_eq!(ix.stats().removed, 1);
}

#[test]
fn a_block_whose_parent_is_unknown_is_an_orphan_not_a_guess() {
    let mut ix = KvIndex::new(1, 100);
    let a = ix.add_worker();
    ix.apply_event(a, &stored(&[11, 12], Some(10), &[3, 4, 5, 6]));
    assert_eq!(ix.stats().orphans, 2);
    assert_eq!(ix.worker_blocks(a), 0);
}

#[test]
fn sequence_numbers_detect_gaps_and_stale_replays() {
    let mut ix = KvIndex::new(1, 100);
    let a = ix.add_worker();
    let one = batch(vec![stored(&[10], None, &[1, 2])]);
    let two = batch(vec![stored(&[11], Some(10), &[3, 4])]);
    assert_eq!(ix.apply(a, 5, &one), SeqCheck::First);
    assert_eq!(ix.apply(a, 7, &two), SeqCheck::Gap { expected: 6, got: 7 });
    assert_eq!(ix.worker_blocks(a), 1); // not applied
    assert_eq!(ix.apply(a, 6, &two), SeqCheck::Next);
    assert_eq!(ix.apply(a, 6, &two), SeqCheck::Stale);
    assert_eq!(ix.match_tokens(&[1, 2, 3, 4]), vec![(a, 4)]);
    ix.reset(a);
    assert_eq!(ix.match_tokens(&[1, 2]), vec![]);
    assert_eq!(ix.apply(a, 100, &one), SeqCheck::First);
    let s = ix.stats();
    assert_eq!((s.gaps, s.resets), (1, 1));
}

#[test]
fn past_the_bound_the_oldest_entries_are_evicted_and_counted() {
    let mut ix = KvIndex::new(1, 2);
    let a = ix.add_worker();
    ix.apply_event(a, &stored(&[10, 11, 12], None, &[1, 2, 3, 4, 5, 6]));
    let s = ix.stats();
    assert_eq!((s.blocks, s.evicted, s.over_capacity), (2, 1, 0));
    // the oldest (the chain's first block) went, so nothing matches from the start any more
    assert_eq!(ix.match_tokens(&[1, 2, 3, 4, 5, 6]), vec![]);
    assert_eq!(ix.worker_blocks(a), 2);
    assert!(ix.memory_bytes() > 0);
    // a bound of 0 keeps nothing, and says so
    let mut none = KvIndex::new(1, 0);
    let b = none.add_worker();
    none.apply_event(b, &stored(&[10], None, &[1, 2]));
    assert_eq!((none.stats().blocks, none.stats().over_capacity), (0, 1));
}

#[test]
fn a_prefix_that_lookups_reach_gets_a_second_chance_at_eviction() {
    let mut ix = KvIndex::new(1, 3);
    let (a, b) = (ix.add_worker(), ix.add_worker());
    ix.apply_event(a, &stored(&[10, 11], None, &[1, 2, 3, 4])); // the hot system prompt, oldest
    ix.apply_event(b, &stored(&[20], None, &[7, 7])); // a one-off
    assert_eq!(ix.match_tokens(&[1, 2, 3, 4, 9, 9]), vec![(a, 4)]);
    ix.apply_event(b, &stored(&[21], None, &[8, 8]));
    // once more: a second chance lasts until the entry reaches the front again unreached
    assert_eq!(ix.match_tokens(&[1, 2, 3, 4]), vec![(a, 4)]);
    ix.apply_event(b, &stored(&[22], None, &[6, 6]));
    assert_eq!(ix.stats().evicted, 2);
    assert_eq!(ix.match_tokens(&[1, 2, 3, 4]), vec![(a, 4)]); // still whole
    assert_eq!(ix.match_tokens(&[7, 7]), vec![]); // the one-off went
    assert_eq!(ix.match_tokens(&[8, 8]), vec![]); // and the next oldest unreached one
    assert_eq!(ix.match_tokens(&[6, 6]), vec![(b, 2)]);
}

#[test]
fn a_re_stored_block_counts_as_new_for_eviction() {
    let mut ix = KvIndex::new(1, 2);
    let a = ix.add_worker();
    ix.apply_event(a, &stored(&[10], None, &[1, 2]));
    ix.apply_event(a, &stored(&[20], None, &[3, 4]));
    ix.apply_event(a, &stored(&[10], None, &[1, 2])); // the engine stored it again
    ix.apply_event(a, &stored(&[30], None, &[5, 6]));
    assert_eq!(ix.match_tokens(&[1, 2]), vec![(a, 2)]);
    assert_eq!(ix.match_tokens(&[3, 4]), vec![]);
    assert_eq!(ix.stats().stored, 3);
}

#[test]
fn equal_content_under_two_engine_hashes_is_held_until_both_go() {
    let mut ix = KvIndex::new(1, 100);
    let a = ix.add_worker();
    ix.apply_event(a, &stored(&[10, 11], None, &[1, 2, 3, 4]));
    ix.apply_event(a, &stored(&[90], None, &[1, 2])); // a salted engine: same tokens, other hash
    ix.apply_event(a, &removed(&[10]));
    ix.apply_event(a, &stored(&[12], Some(90), &[3, 4])); // the chain continues from the twin
    assert_eq!(ix.match_tokens(&[1, 2, 3, 4]), vec![(a, 4)]);
    ix.apply_event(a, &removed(&[90]));
    assert_eq!(ix.match_tokens(&[1, 2, 3, 4]), vec![]);
    ix.apply_event(a, &removed(&[11, 12]));
    assert_eq!((ix.stats().blocks, ix.stats().keys), (0, 0));
}

#[test]
fn signed_and_unsigned_hashes_are_just_names() {
    // older vLLM published Python's signed hash(); the decoder hands them over as their u64 bits
    let (neg, big) = (-5i64 as u64, u64::MAX - 1);
    let mut ix = KvIndex::new(1, 100);
    let a = ix.add_worker();
    ix.apply_event(a, &stored(&[neg], None, &[1, 2]));
    ix.apply_event(a, &stored(&[big, 0], Some(neg), &[3, 4, 5, 6]));
    assert_eq!(ix.match_tokens(&[1, 2, 3, 4, 5, 6]), vec![(a, 6)]);
    ix.apply_event(a, &removed(&[big]));
    assert_eq!(ix.match_tokens(&[1, 2, 3, 4, 5, 6]), vec![(a, 2)]);
}

#[test]
fn a_prefix_on_the_whole_fleet_is_a_bitset_and_matches_the_same() {
    let n = 300;
    let mut ix = KvIndex::new(1, 1 << 20);
    let slots: Vec<u32> = (0..n).map(|_| ix.add_worker()).collect();
    for &s in &slots {
        ix.apply_event(s, &stored(&[10, 11], None, &[1, 2, 3, 4]));
        if s % 3 == 0 {
            ix.apply_event(s, &stored(&[12], Some(11), &[5, 6]));
        }
        if s % 7 == 0 {
            ix.apply_event(s, &removed(&[11])); // eviction in the middle of the chain
        }
    }
    assert!(ix.sets.is_bits(&ix.holders[&content_key(1, root(1), BS, &[1, 2])].holders));
    let got = ix.match_tokens(&[1, 2, 3, 4, 5, 6, 7, 8]);
    let want: Vec<(u32, usize)> = slots
        .iter()
        .map(|&s| {
            (
                s,
                if s % 7 == 0 {
                    2
                } else if s % 3 == 0 {
                    6
                } else {
                    4
                },
            )
        })
        .collect();
    assert_eq!(got, want);
    // workers leave: the set shrinks back to a list and still answers the same
    for &s in &slots[5..] {
        ix.remove_worker(s);
    }
    assert_eq!(ix.match_tokens(&[1, 2, 3, 4, 5, 6]), vec![(0, 2), (1, 4), (2, 4), (3, 6), (4, 4)]);
    assert!(!ix.sets.is_bits(&ix.holders[&content_key(1, root(1), BS, &[1, 2])].holders));
    assert_eq!(ix.stats().blocks, ix.order_len());
}

#[test]
fn a_long_prompt_walks_past_one_key_batch() {
    let mut ix = KvIndex::new(1, 1 << 20);
    let (a, b) = (ix.add_worker(), ix.add_worker());
    let tokens: Vec<u32> = (0..200).collect();
    let hashes: Vec<u64> = (1000..1100).collect();
    ix.apply_event(a, &stored(&hashes, None, &tokens));
    ix.apply_event(b, &stored(&hashes[..40], None, &tokens[..80]));
    assert_eq!(ix.match_tokens(&tokens), vec![(a, 200), (b, 80)]);
    let mut longer = tokens.clone();
    longer.extend(0..1000);
    assert_eq!(ix.match_tokens(&longer), vec![(a, 200), (b, 80)]);
}

#[test]
fn a_removed_worker_s_slot_is_reused_empty() {
    let mut ix = KvIndex::new(1, 100);
    let (a, b) = (ix.add_worker(), ix.add_worker());
    ix.apply_event(a, &stored(&[10], None, &[1, 2]));
    ix.apply_event(b, &stored(&[10], None, &[1, 2]));
    ix.remove_worker(a);
    assert_eq!(ix.add_worker(), a);
    assert_eq!(ix.match_tokens(&[1, 2]), vec![(b, 2)]);
    ix.apply_event(a, &stored(&[11], Some(10), &[3, 4])); // its old blocks are gone: an orphan
    assert_eq!(ix.stats().orphans, 1);
}

#[test]
fn a_zero_block_size_from_a_direct_caller_is_refused() {
    let mut ix = KvIndex::new(1, 100);
    let a = ix.add_worker();
    ix.apply_event(a, &KvEvent::BlockStored { block_hashes: vec![1], parent_block_hash: None, token_ids: vec![], block_size: 0, medium: None });
    assert_eq!((ix.stats().blocks, ix.stats().undecodable), (0, 1));
    assert_eq!(ix.match_tokens(&[1, 2]), vec![]);
}

#[test]
fn undecodable_events_of_an_applied_batch_are_counted() {
    let mut ix = KvIndex::new(1, 10);
    let a = ix.add_worker();
    let mut b = batch(vec![]);
    b.undecodable = 3;
    ix.apply(a, 0, &b);
    assert_eq!(ix.stats().undecodable, 3);
}

#[test]
fn keys_depend_on_the_whole_prefix_and_the_block_size() {
    let k = |parent, bs, t: &[u32]| content_key(7, parent, bs, t);
    assert_ne!(k(1, 2, &[3, 4]), k(2, 2, &[3, 4]));
    assert_ne!(k(1, 2, &[3, 4]), k(1, 4, &[3, 4]));
    assert_ne!(k(1, 2, &[3, 4]), k(1, 2, &[4, 3]));
    assert_ne!(content_key(7, 1, 2, &[3, 4]), content_key(8, 1, 2, &[3, 4]));
    // every position counts, in full blocks and in the tail past the last 8 tokens
    let base: Vec<u32> = (0..21).collect();
    for i in 0..base.len() {
        let mut other = base.clone();
        other[i] += 1;
        assert_ne!(k(1, 21, &base), k(1, 21, &other), "position {i}");
    }
    assert_ne!(k(1, 2, &[0, 0]), k(1, 2, &[0]));
}

/// 40 blocks (80 tokens) stored on `workers`, engine hashes `base..`.
fn long_chain(ix: &mut KvIndex, workers: &[WorkerSlot], base: u64) -> (Vec<u32>, Vec<u64>) {
    let tokens: Vec<u32> = (0..80).map(|t| t * 7 % 101).collect();
    let hashes: Vec<u64> = (base..base + 40).collect();
    for &w in workers {
        ix.apply_event(w, &stored(&hashes, None, &tokens));
    }
    (tokens, hashes)
}

#[test]
fn a_long_run_of_equal_holders_is_passed_through_its_skip_pointer() {
    let mut ix = KvIndex::new(1, 1 << 20);
    let (a, b, c) = (ix.add_worker(), ix.add_worker(), ix.add_worker());
    let (tokens, _) = long_chain(&mut ix, &[a, b], 100);
    let mut q = tokens.clone();
    q.extend([500, 501, 502]);
    assert_eq!(ix.match_tokens(&q), vec![(a, 80), (b, 80)]); // walks, leaves the pointer
    assert_eq!(ix.stats().skipped_blocks, 0);
    assert_eq!(ix.match_tokens(&q), vec![(a, 80), (b, 80)]);
    assert_eq!(ix.stats().skipped_blocks, 39); // the head is probed, the 39 after it are not
                                               // a prompt that leaves the run before its end cannot use it, and answers the same as a walk
    let mut early = tokens[..40].to_vec();
    early.extend([9, 9]);
    assert_eq!(ix.match_tokens(&early), vec![(a, 40), (b, 40)]);
    // a prompt that diverges inside the run: its key at the run's end differs, so it walks
    let mut diverged = tokens.clone();
    diverged[50] = 1000;
    assert_eq!(ix.match_tokens(&diverged), vec![(a, 50), (b, 50)]);
    assert_eq!(ix.stats().skipped_blocks, 39);
    // another worker joins the whole run: the holders change, the pointer is left unused
    ix.apply_event(c, &stored(&(0..40).collect::<Vec<u64>>(), None, &tokens));
    assert_eq!(ix.match_tokens(&q), vec![(a, 80), (b, 80), (c, 80)]);
    assert_eq!(ix.match_tokens(&q), vec![(a, 80), (b, 80), (c, 80)]);
    assert_eq!(ix.stats().skipped_blocks, 78);
}

#[test]
fn a_change_inside_a_skipped_run_is_seen_by_the_next_lookup() {
    let mut ix = KvIndex::new(1, 1 << 20);
    let (a, b) = (ix.add_worker(), ix.add_worker());
    let (tokens, hashes) = long_chain(&mut ix, &[a, b], 100);
    ix.match_tokens(&tokens);
    assert_eq!(ix.match_tokens(&tokens), vec![(a, 80), (b, 80)]);
    assert!(ix.stats().skipped_blocks > 0);
    // b evicts block 25: the run's holders lose a key, the pointer's stamp no longer holds
    ix.apply_event(b, &removed(&[hashes[25]]));
    assert_eq!(ix.match_tokens(&tokens), vec![(a, 80), (b, 50)]);
    assert_eq!(ix.match_tokens(&tokens), vec![(a, 80), (b, 50)]);
    // a re-stores the same content under other engine hashes (a duplicate): no holder change
    ix.apply_event(a, &stored(&(900..940).collect::<Vec<u64>>(), None, &tokens));
    assert_eq!(ix.match_tokens(&tokens), vec![(a, 80), (b, 50)]);
    // a drops its first copy of block 30 but holds the duplicate: still 80
    ix.apply_event(a, &removed(&[hashes[30]]));
    assert_eq!(ix.match_tokens(&tokens), vec![(a, 80), (b, 50)]);
    ix.apply_event(a, &removed(&[930]));
    assert_eq!(ix.match_tokens(&tokens), vec![(a, 60), (b, 50)]);
    // a worker removed and its slot reused empty: nothing of it is skipped into
    ix.remove_worker(a);
    let a2 = ix.add_worker();
    assert_eq!(a2, a);
    assert_eq!(ix.match_tokens(&tokens), vec![(b, 50)]);
    assert_eq!(ix.stats().blocks, 39);
}

#[test]
fn a_skip_pointer_is_refreshed_by_a_full_walk_so_second_chances_see_its_blocks() {
    let mut ix = KvIndex::new(1, 1 << 20);
    let a = ix.add_worker();
    let (tokens, _) = long_chain(&mut ix, &[a], 100);
    let walked = |ix: &KvIndex| ix.stats().skipped_blocks;
    ix.match_tokens(&tokens);
    for _ in 0..lookup::REFRESH_AFTER {
        ix.match_tokens(&tokens);
    }
    let before = walked(&ix);
    assert_eq!(before, u64::from(lookup::REFRESH_AFTER) * 39);
    ix.match_tokens(&tokens); // the pointer is spent: this one walks every block
    assert_eq!(walked(&ix), before);
    let mid = content_key_at(&tokens, 30);
    assert_eq!(ix.holders[&mid].last_hit.load(Relaxed), ix.lookups.load(Relaxed));
    ix.match_tokens(&tokens); // and leaves a fresh pointer
    assert_eq!(walked(&ix), before + 39);
}

/// The key of block `i` (0-based) of `tokens`, with seed 1.
fn content_key_at(tokens: &[u32], i: usize) -> u64 {
    tokens.chunks(BS as usize).take(i + 1).fold(root(1), |k, c| content_key(1, k, BS, c))
}

#[test]
fn holder_sets_are_interned_and_freed_with_their_last_key() {
    let mut ix = KvIndex::new(1, 1 << 20);
    let (a, b) = (ix.add_worker(), ix.add_worker());
    long_chain(&mut ix, &[a, b], 100);
    assert_eq!(ix.sets.len(), 1); // 40 keys, one set {a, b}
    ix.remove_worker(b);
    assert_eq!(ix.sets.len(), 0); // back to one holder each
    assert_eq!(ix.stats().keys, 40);
}
