//! The gateway's side of an events decision that grows with the fleet: mapping the index's
//! holders back to snapshot indices (`KvView::held_in`, once per request that routes on
//! events) and a miss's block counts (`SnapshotBlocks`, per equally least loaded worker asked).
//! One holder among 10 and among 1,000 watched workers, in the same run: the ratio says whether
//! the cost grows with the fleet. Run: `cargo bench -p pdgate-gateway --bench kv_view`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // bench code: a panic is the failure report

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::Criterion;
use pdgate_core::kv_events::{DecodedBatch, KvEvent};
use pdgate_core::{CachedBlocks, PoolSnapshot, WorkerRole, WorkerSpec, WorkerView};
use pdgate_gateway::kv_sub::{KvView, SnapshotBlocks, SubTimings};

/// `n` watched workers (their publishers never answer: nothing resets the views) and worker 5
/// holding the prompt's first block.
fn fleet(n: usize) -> (KvView, PoolSnapshot) {
    let view = KvView::new(7, 1 << 20, SubTimings::default());
    let urls: Vec<String> = (0..n).map(|i| format!("http://10.0.{}.{}:30000", i / 256, i % 256)).collect();
    for u in &urls {
        view.watch(u, "tcp://127.0.0.1:9", None);
    }
    let stored = KvEvent::BlockStored { block_hashes: vec![11], parent_block_hash: None, token_ids: (0..16).collect(), block_size: 16, medium: None };
    view.apply_to(&urls[5], 0, &DecodedBatch { events: vec![stored], ..DecodedBatch::default() }).unwrap();
    let views = urls.iter().map(|u| WorkerView::new(Arc::new(WorkerSpec::new(u, WorkerRole::Regular).unwrap()), true)).collect();
    (view, PoolSnapshot::build(views, Default::default()))
}

/// Median of single calls, in ns (`Instant` around each, ~25 ns of timer overhead included).
fn p50(mut f: impl FnMut()) -> u64 {
    let mut samples: Vec<u64> = (0..20_000)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_nanos() as u64
        })
        .collect();
    samples.sort_unstable();
    samples[samples.len() / 2]
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let _guard = rt.enter();
    let prompt: Vec<u32> = (0..64).collect();
    let (small, small_snap) = fleet(10);
    let (large, large_snap) = fleet(1_000);
    assert_eq!(large.held_in(&large_snap, &prompt).0, vec![(5, 16)], "worker 5 holds the first block");
    let blocks = SnapshotBlocks { view: &large, snap: &large_snap };

    let mut c = Criterion::default().warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(1)).sample_size(20).configure_from_args();
    c.bench_function("held_in, one holder, 10 workers", |b| b.iter(|| black_box(small.held_in(&small_snap, &prompt))));
    c.bench_function("held_in, one holder, 1000 workers", |b| b.iter(|| black_box(large.held_in(&large_snap, &prompt))));
    let mut w = 0;
    c.bench_function("cached_blocks, 1000 workers (per worker asked)", |b| {
        b.iter(|| {
            w = (w + 1) % 1_000;
            black_box(blocks.cached_blocks(w))
        })
    });
    c.final_summary();
    let (s, l) = (p50(|| drop(black_box(small.held_in(&small_snap, &prompt)))), p50(|| drop(black_box(large.held_in(&large_snap, &prompt)))));
    println!("held_in p50: 10 workers {s} ns, 1000 workers {l} ns: {:.2}x", l as f64 / s as f64);
}
