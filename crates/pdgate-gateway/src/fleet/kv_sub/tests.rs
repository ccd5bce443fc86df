//! `KvView::held_in`: the index's worker slots read back as snapshot indices.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

use std::sync::Arc;

use pdgate_core::kv_events::{DecodedBatch, KvEvent};
use pdgate_core::{PoolSnapshot, WorkerRole, WorkerSpec, WorkerView};

use super::{KvView, SubTimings};

fn snapshot(urls: &[&str]) -> PoolSnapshot {
    let views = urls.iter().map(|u| WorkerView::new(Arc::new(WorkerSpec::new(u, WorkerRole::Regular).unwrap()), true)).collect();
    PoolSnapshot::build(views, Default::default())
}

fn stored(hash: u64, parent: Option<u64>, tokens: std::ops::Range<u32>) -> DecodedBatch {
    let event = KvEvent::BlockStored { block_hashes: vec![hash], parent_block_hash: parent, token_ids: tokens.collect(), block_size: 4, medium: None };
    DecodedBatch { events: vec![event], ..DecodedBatch::default() }
}

#[tokio::test]
async fn held_in_names_snapshot_indices_and_skips_workers_outside_the_snapshot() {
    let view = KvView::new(7, 1_000, SubTimings::default());
    // Nothing listens on port 9: the subscriptions never connect, so nothing resets the views.
    for url in ["http://w0:8000", "http://w1:8000", "http://gone:8000"] {
        view.watch(url, "tcp://127.0.0.1:9", None);
    }
    let slot = |url: &str| view.subs.lock().unwrap().by_url[url].slot;
    // w1 holds two blocks of the prompt, w0 one, `gone` (not in the snapshot) two.
    view.shared.apply(slot("http://w1:8000"), 0, &stored(11, None, 0..4));
    view.shared.apply(slot("http://w1:8000"), 1, &stored(12, Some(11), 4..8));
    view.shared.apply(slot("http://w0:8000"), 0, &stored(21, None, 0..4));
    view.shared.apply(slot("http://gone:8000"), 0, &stored(31, None, 0..4));
    view.shared.apply(slot("http://gone:8000"), 1, &stored(32, Some(31), 4..8));
    let snap = snapshot(&["http://w0:8000", "http://other:8000", "http://w1:8000"]);
    let prompt: Vec<u32> = (0..10).collect();
    assert_eq!(view.held_in(&snap, &prompt), (vec![(0, 4), (2, 8)], vec![]));
    assert!(view.any_watched());
    assert!(view.held_in(&snap, &[99, 98, 97, 96]).0.is_empty());
}

#[tokio::test]
async fn a_grpc_worker_counts_as_publishing_only_while_its_stream_is_open() {
    let view = KvView::new(7, 1_000, SubTimings::default());
    // Nothing listens on port 9: the stream never opens.
    view.watch_grpc("grpc://127.0.0.1:9", Arc::new(crate::clients::grpc::GrpcClient::new()));
    assert!(!view.is_watched("grpc://127.0.0.1:9") && !view.any_watched());
    let snap = snapshot(&["http://w0:8000", "grpc://127.0.0.1:9"]);
    assert_eq!(view.held_in(&snap, &[0, 1, 2, 3]), (vec![], vec![]));
    let slot = view.subs.lock().unwrap().by_url["grpc://127.0.0.1:9"].slot;
    view.shared.set_grpc_live(slot, true); // what the task does when the stream opens
    view.shared.apply(slot, 0, &stored(11, None, 0..4));
    assert!(view.is_watched("grpc://127.0.0.1:9") && view.any_watched());
    assert_eq!(view.held_in(&snap, &[0, 1, 2, 3, 4]), (vec![(1, 4)], vec![1]));
    assert!(view.metrics_text().contains("pdgate_kv_events_subscriptions 1\n"));
    view.unwatch("grpc://127.0.0.1:9");
    assert!(!view.any_watched() && view.held_in(&snap, &[0, 1, 2, 3]).0.is_empty());
}

#[test]
fn grpc_batches_decode_to_the_index_s_events_with_signed_hashes_as_the_same_bits() {
    use crate::clients::grpc::pb::smg::grpc::common::{kv_cache_event::Data, KvBlock, KvBlocksRemoved, KvBlocksStored, KvCacheCleared, KvCacheEvent, KvEventBatch};
    let block = |hash: i64, tokens: std::ops::Range<u32>| KvBlock { block_hash: hash, token_ids: tokens.collect(), block_size: 4, ..KvBlock::default() };
    let ev = |data: Data| KvCacheEvent { event_id: 0, data: Some(data) };
    let stored = KvBlocksStored { blocks: vec![block(-2, 0..4), block(5, 4..8)], parent_block_hash: Some(-1), ..KvBlocksStored::default() };
    let partial = KvBlocksStored { blocks: vec![block(6, 0..3)], ..KvBlocksStored::default() };
    let b = KvEventBatch {
        sequence_number: 3,
        timestamp: 1.5,
        events: vec![
            ev(Data::Stored(stored)),
            ev(Data::Removed(KvBlocksRemoved { block_hashes: vec![-2], ..KvBlocksRemoved::default() })),
            ev(Data::Cleared(KvCacheCleared::default())),
            ev(Data::Stored(partial)),
            KvCacheEvent { event_id: 9, data: None },
        ],
        dp_rank: Some(0),
        ..KvEventBatch::default()
    };
    let d = super::grpc_sub::decode(&b);
    assert_eq!(d.undecodable, 2); // the partial block, the empty event
    assert_eq!(
        d.events,
        vec![
            KvEvent::BlockStored { block_hashes: vec![u64::MAX - 1], parent_block_hash: Some(u64::MAX), token_ids: (0..4).collect(), block_size: 4, medium: None },
            KvEvent::BlockStored { block_hashes: vec![5], parent_block_hash: Some(u64::MAX - 1), token_ids: (4..8).collect(), block_size: 4, medium: None },
            KvEvent::BlockRemoved { block_hashes: vec![u64::MAX - 1], medium: None },
            KvEvent::AllBlocksCleared,
        ]
    );
    assert_eq!((d.ts, d.data_parallel_rank), (1.5, Some(0)));
}

#[tokio::test]
async fn a_reused_slot_maps_to_its_new_worker_and_a_removed_worker_to_none() {
    let view = KvView::new(7, 1_000, SubTimings::default());
    // Nothing listens on port 9: the subscriptions never connect, so nothing resets the views.
    for url in ["http://a:1", "http://b:1"] {
        view.watch(url, "tcp://127.0.0.1:9", None);
    }
    let slot = |url: &str| view.subs.lock().unwrap().by_url[url].slot;
    let a_slot = slot("http://a:1");
    view.unwatch("http://a:1");
    view.watch("http://c:1", "tcp://127.0.0.1:9", None);
    assert_eq!(slot("http://c:1"), a_slot, "the index reuses the freed slot");
    view.shared.apply(a_slot, 0, &stored(11, None, 0..4));
    view.shared.apply(slot("http://b:1"), 0, &stored(21, None, 0..4));
    let snap = snapshot(&["http://a:1", "http://b:1", "http://c:1"]);
    assert_eq!(view.held_in(&snap, &[0, 1, 2, 3]).0, vec![(1, 4), (2, 4)]);
    let matched = view.matches(&[0, 1, 2, 3]);
    assert_eq!((matched.get("http://a:1"), matched.get("http://c:1")), (None, Some(&4)));
    view.unwatch("http://b:1");
    assert_eq!(view.held_in(&snap, &[0, 1, 2, 3]).0, vec![(2, 4)]);
    assert!(view.any_watched());
    view.unwatch("http://c:1");
    assert!(!view.any_watched(), "no publisher left");
}
