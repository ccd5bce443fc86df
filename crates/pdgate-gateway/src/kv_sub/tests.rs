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
    let slot = |url: &str| view.subs.lock().unwrap()[url].slot;
    // w1 holds two blocks of the prompt, w0 one, `gone` (not in the snapshot) two.
    view.shared.apply(slot("http://w1:8000"), 0, &stored(11, None, 0..4));
    view.shared.apply(slot("http://w1:8000"), 1, &stored(12, Some(11), 4..8));
    view.shared.apply(slot("http://w0:8000"), 0, &stored(21, None, 0..4));
    view.shared.apply(slot("http://gone:8000"), 0, &stored(31, None, 0..4));
    view.shared.apply(slot("http://gone:8000"), 1, &stored(32, Some(31), 4..8));
    let snap = snapshot(&["http://w0:8000", "http://other:8000", "http://w1:8000"]);
    let prompt: Vec<u32> = (0..10).collect();
    assert_eq!(view.held_in(&snap, &prompt), vec![(0, 4), (2, 8)]);
    assert!(view.any_watched());
    assert!(view.held_in(&snap, &[99, 98, 97, 96]).is_empty());
}
