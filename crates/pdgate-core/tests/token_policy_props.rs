//! The token policies with a seeded rng: least_tokens takes a worker of least cost (queued
//! prompt tokens + this prompt's uncached part) among the candidates, with the radix tree's
//! prefix credit; most_free_kv never takes a worker without KV room while one has room, and
//! among those with room never one with a larger batch than another.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

use std::sync::Arc;

use pdgate_core::policy::{LeastTokensPolicy, LoadView, MostFreeKvPolicy, NO_ROOM};
use pdgate_core::{Policy, PoolSnapshot, RadixTree, RouteInput, WorkerRole, WorkerSpec, WorkerView};
use proptest::prelude::*;
use rand::{rngs::StdRng, SeedableRng};

/// Per worker: queued prompt tokens, running requests, free KV tokens.
struct Table(Vec<(u64, u64, Option<u64>)>);

impl LoadView for Table {
    fn load(&self, w: usize) -> u64 {
        self.0[w].1
    }
    fn prompt_tokens(&self, w: usize) -> u64 {
        self.0[w].0
    }
    fn free_kv_tokens(&self, w: usize) -> Option<u64> {
        self.0[w].2
    }
}

fn url(i: usize) -> String {
    format!("http://w{i}:8000")
}

fn snapshot(n: usize) -> PoolSnapshot {
    let views = (0..n).map(|i| WorkerView::new(Arc::new(WorkerSpec::new(&url(i), WorkerRole::Prefill).unwrap()), true)).collect();
    PoolSnapshot::build(views, Default::default())
}

fn row() -> impl Strategy<Value = (u64, u64, Option<u64>)> {
    (0u64..50_000, 0u64..64, prop::option::of(0u64..20_000))
}

proptest! {
    #[test]
    fn least_tokens_takes_a_least_queued_worker(rows in prop::collection::vec(row(), 1..40), tokens in 0u64..10_000, seed in any::<u64>()) {
        let table = Table(rows);
        let n = table.0.len();
        let snap = snapshot(n);
        let candidates: Vec<usize> = (0..n).collect();
        let input = RouteInput { loads: &table, prompt_tokens: tokens, ..RouteInput::default() };
        let s = LeastTokensPolicy.select(&snap, &candidates, &input, &mut StdRng::seed_from_u64(seed)).unwrap();
        let least = table.0.iter().map(|r| r.0).min().unwrap();
        prop_assert_eq!(table.0[s.worker].0, least);
        let batch = table.0.iter().filter(|r| r.0 == least).map(|r| r.1).min().unwrap();
        prop_assert_eq!(table.0[s.worker].1, batch, "ties go to the smaller batch");
    }

    #[test]
    fn most_free_kv_prefers_room_then_the_smallest_batch(rows in prop::collection::vec(row(), 1..40), prompt in 0u64..8_000, output in 0u64..4_000, seed in any::<u64>()) {
        let table = Table(rows);
        let n = table.0.len();
        let candidates: Vec<usize> = (0..n).collect();
        let input = RouteInput { loads: &table, prompt_tokens: prompt, output_tokens: output, ..RouteInput::default() };
        let s = MostFreeKvPolicy.select(&snapshot(n), &candidates, &input, &mut StdRng::seed_from_u64(seed)).unwrap();
        let need = prompt + output;
        let fits = |r: &(u64, u64, Option<u64>)| r.2.is_none_or(|f| f >= need);
        let chosen = table.0[s.worker];
        if table.0.iter().any(fits) {
            prop_assert!(fits(&chosen), "chose a worker without room while one had room");
            prop_assert_ne!(s.branch, NO_ROOM);
            let smallest = table.0.iter().filter(|r| fits(r)).map(|r| r.1).min().unwrap();
            prop_assert_eq!(chosen.1, smallest);
        } else {
            prop_assert_eq!(s.branch, NO_ROOM);
            prop_assert_eq!(chosen.2, table.0.iter().filter_map(|r| r.2).max(), "the most free KV");
        }
    }
}

/// The prefix credit: a worker that cached most of the prompt wins over an idler one when the
/// uncached remainder plus its queue is still the smaller cost, and loses when its queue is long.
#[test]
fn least_tokens_credits_a_cached_prefix() {
    let snap = snapshot(2);
    let prompt = "a shared system prompt of some length that was cached on worker one ".repeat(4);
    let mut tree = RadixTree::new();
    tree.insert(&prompt, &url(1), 1);
    let text = format!("{prompt}and a short question");
    let tokens = text.len() as u64; // one byte per token
    let mut rng = StdRng::seed_from_u64(9);
    let pick = |table: &Table, rng: &mut StdRng| {
        let input = RouteInput { loads: table, prompt_tokens: tokens, text: Some(&text), tree: Some(&tree), ..RouteInput::default() };
        LeastTokensPolicy.select(&snap, &[0, 1], &input, rng).unwrap()
    };
    // Worker 1 has 100 tokens queued but ~93% of the prompt cached: cost ~100 + 20 < 0 + 296.
    let s = pick(&Table(vec![(0, 0, None), (100, 0, None)]), &mut rng);
    assert_eq!(s.worker, 1);
    assert!(s.reason.starts_with("least_tokens queued=100 cache_hit=0.9"), "{}", s.reason);
    // With 1,000 tokens queued the credit no longer pays.
    let s = pick(&Table(vec![(0, 0, None), (1_000, 0, None)]), &mut rng);
    assert_eq!((s.worker, s.reason.as_ref()), (0, "least_tokens queued=0"));
}
