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
fn memory_is_bounded_and_what_does_not_fit_is_counted() {
    let mut ix = KvIndex::new(1, 2);
    let a = ix.add_worker();
    ix.apply_event(a, &stored(&[10, 11, 12], None, &[1, 2, 3, 4, 5, 6]));
    assert_eq!(ix.stats().blocks, 2);
    assert_eq!(ix.stats().over_capacity, 1);
    assert_eq!(ix.match_tokens(&[1, 2, 3, 4, 5, 6]), vec![(a, 4)]);
    assert!(ix.memory_bytes() > 0);
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
}
