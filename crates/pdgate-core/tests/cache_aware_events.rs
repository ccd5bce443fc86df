//! cache_aware with `--cache-source events|auto`: workers scored by the prompt tokens their KV
//! event views hold, balanced against load; auto mixes in the text tree for workers without
//! events; a PD decode pick goes by free KV.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

use std::sync::Arc;

use pdgate_core::policy::CacheAwarePolicy;
use pdgate_core::{CacheSource, KvMatch, LoadView, NoBlocks, Policy, PolicyOptions, PoolSnapshot, RadixTree, RouteInput, WorkerRole, WorkerSpec, WorkerView};
use rand::{rngs::StdRng, SeedableRng};

fn url(i: usize) -> String {
    format!("http://w{i}:8000")
}

/// `n` workers of `role`; those in `publishers` registered a KV event endpoint.
fn snapshot(n: usize, role: WorkerRole, publishers: &[usize]) -> PoolSnapshot {
    let views = (0..n)
        .map(|i| {
            let mut spec = WorkerSpec::new(&url(i), role).unwrap();
            if publishers.contains(&i) {
                spec.kv_events = Some(format!("tcp://w{i}:5557"));
            }
            WorkerView::new(Arc::new(spec), true)
        })
        .collect();
    PoolSnapshot::build(views, Default::default())
}

fn policy(source: CacheSource) -> CacheAwarePolicy {
    CacheAwarePolicy::new(PolicyOptions { cache_threshold: 0.5, cache_source: source, ..PolicyOptions::default() })
}

struct Pick {
    worker: usize,
    reason: String,
    branch: &'static str,
}

fn pick(snap: &PoolSnapshot, source: CacheSource, loads: &dyn LoadView, kv: Option<KvMatch<'_>>, tree: Option<(&RadixTree, &str)>, seed: u64) -> Pick {
    let role = snap.worker(0).spec.role;
    let candidates = snap.eligible(role).to_vec();
    let input = RouteInput { kv, loads, tree: tree.map(|t| t.0), text: tree.map(|t| t.1), prompt_tokens: 100, output_tokens: 20, ..RouteInput::default() };
    let s = policy(source).select(snap, &candidates, &input, &mut StdRng::seed_from_u64(seed)).unwrap();
    Pick { worker: s.worker, reason: s.reason.into_owned(), branch: s.branch }
}

#[test]
fn the_worker_holding_the_longest_prefix_wins() {
    let snap = snapshot(4, WorkerRole::Regular, &[0, 1, 2, 3]);
    let held = [(0, 32), (2, 96), (3, 64)];
    let kv = KvMatch { prompt_tokens: 100, held: &held, key: 7, subscribed: &[], blocks: &NoBlocks };
    let p = pick(&snap, CacheSource::Events, &vec![0, 0, 5, 0], Some(kv), None, 1);
    assert_eq!((p.worker, p.branch), (2, "cache_hit"));
    assert_eq!(p.reason, "cache_hit=0.96 events matched=96/100");
}

#[test]
fn equal_matches_go_to_the_less_loaded_and_below_the_threshold_is_a_miss() {
    let snap = snapshot(4, WorkerRole::Regular, &[0, 1, 2, 3]);
    let held = [(1, 80), (2, 80)];
    let kv = KvMatch { prompt_tokens: 100, held: &held, key: 7, subscribed: &[], blocks: &NoBlocks };
    assert_eq!(pick(&snap, CacheSource::Events, &vec![0, 4, 2, 0], Some(kv), None, 1).worker, 2);
    let held = [(1, 16)];
    let p = pick(&snap, CacheSource::Events, &vec![3, 0, 2, 1], Some(KvMatch { prompt_tokens: 100, held: &held, key: 7, subscribed: &[], blocks: &NoBlocks }), None, 1);
    assert_eq!((p.worker, p.branch, p.reason.as_str()), (1, "cache_miss", "cache_miss=0.16 events held=16"));
    let p = pick(&snap, CacheSource::Events, &vec![3, 2, 0, 1], Some(KvMatch { prompt_tokens: 100, held: &[], key: 7, subscribed: &[], blocks: &NoBlocks }), None, 1);
    assert_eq!((p.worker, p.branch), (2, "cache_miss"), "nothing held: the least loaded");
}

#[test]
fn a_miss_breaks_a_load_tie_by_the_held_prefix_then_by_the_emptiest_cache() {
    let snap = snapshot(4, WorkerRole::Regular, &[0, 1, 2, 3]);
    let blocks = vec![30, 12, 40, 25];
    for seed in 0..16 {
        // Below the threshold (0.5), the longest holder among the equally least loaded: worker 3
        // (20 tokens), not worker 2 (30 tokens, but busier) nor worker 1 (idle, holds nothing).
        let held = [(0, 10), (2, 30), (3, 20)];
        let kv = KvMatch { prompt_tokens: 100, held: &held, key: 7, subscribed: &[], blocks: &blocks };
        let p = pick(&snap, CacheSource::Events, &vec![0, 0, 1, 0], Some(kv), None, seed);
        assert_eq!((p.worker, p.reason.as_str()), (3, "cache_miss=0.30 events held=20 blocks=25"), "seed {seed}");
        // All hold the same prefix (a shared chat template): the fewest blocks among them.
        let held = [(0, 16), (1, 16), (2, 16), (3, 16)];
        let kv = KvMatch { prompt_tokens: 100, held: &held, key: 7, subscribed: &[], blocks: &blocks };
        let p = pick(&snap, CacheSource::Events, &vec![0, 0, 0, 1], Some(kv), None, seed);
        assert_eq!((p.worker, p.reason.as_str()), (1, "cache_miss=0.16 events held=16 blocks=12"), "seed {seed}");
        // Nothing held: the fewest blocks among the least loaded (worker 1 has fewer, but is busier).
        let kv = KvMatch { prompt_tokens: 100, held: &[], key: 7, subscribed: &[], blocks: &blocks };
        let p = pick(&snap, CacheSource::Events, &vec![0, 1, 0, 0], Some(kv), None, seed);
        assert_eq!((p.worker, p.reason.as_str()), (3, "cache_miss=0.00 events blocks=25"), "seed {seed}");
        // Imbalanced load (SMG's rule): the same tie-break among the least loaded.
        let p = pick(&snap, CacheSource::Events, &vec![500, 200, 200, 300], Some(kv), None, seed);
        assert_eq!((p.worker, p.branch, p.reason.as_str()), (1, "rebalance", "rebalance cache_miss=0.00 events blocks=12"), "seed {seed}");
    }
    // One tied worker's count unknown (no events for it under auto): counts are not compared,
    // a random least loaded worker as before; once that worker is busier, the emptiest again.
    let partial = vec![30, 0, 40];
    let kv = KvMatch { prompt_tokens: 100, held: &[], key: 7, subscribed: &[], blocks: &partial };
    let picks: Vec<Pick> = (0..32).map(|seed| pick(&snap, CacheSource::Events, &vec![0; 4], Some(kv), None, seed)).collect();
    assert!(picks.iter().all(|p| p.reason == "cache_miss=0.00 events"), "{}", picks[0].reason);
    assert!(picks.iter().map(|p| p.worker).collect::<std::collections::BTreeSet<_>>().len() > 1);
    let p = pick(&snap, CacheSource::Events, &vec![0, 0, 0, 1], Some(kv), None, 1);
    assert_eq!((p.worker, p.reason.as_str()), (1, "cache_miss=0.00 events blocks=0"));
    // Counts unknown: the best holder as ranked for hits (by prompt, alike in every replica);
    // with no holder, a random least loaded worker, as without events.
    let held = [(0, 16), (2, 16)];
    let kv = KvMatch { prompt_tokens: 100, held: &held, key: 7, subscribed: &[], blocks: &NoBlocks };
    let p = pick(&snap, CacheSource::Events, &vec![0; 4], Some(kv), None, 1);
    assert!((0..16).all(|seed| pick(&snap, CacheSource::Events, &vec![0; 4], Some(kv), None, seed).worker == p.worker));
    assert!([0, 2].contains(&p.worker) && p.reason == "cache_miss=0.16 events held=16", "{}", p.reason);
    let kv = KvMatch { prompt_tokens: 100, held: &[], key: 7, subscribed: &[], blocks: &NoBlocks };
    let chosen: std::collections::BTreeSet<usize> = (0..32).map(|seed| pick(&snap, CacheSource::Events, &vec![0; 4], Some(kv), None, seed).worker).collect();
    assert_eq!(chosen.len(), 4, "{chosen:?}");
}

#[test]
fn ties_between_holders_do_not_depend_on_the_rng_and_spread_by_prompt() {
    // Two replicas (different rngs) pick the same holder for the same prompt; other prompts
    // spread over both holders.
    let snap = snapshot(4, WorkerRole::Regular, &[0, 1, 2, 3]);
    let held = [(1, 64), (3, 64)];
    let pick_key = |key: u64, seed: u64| {
        pick(&snap, CacheSource::Events, &vec![0; 4], Some(KvMatch { prompt_tokens: 100, held: &held, key, subscribed: &[], blocks: &NoBlocks }), None, seed).worker
    };
    let mut chosen = std::collections::BTreeSet::new();
    for key in 0..32 {
        let w = pick_key(key, 1);
        assert!((1..=10).all(|seed| pick_key(key, seed) == w), "key {key}");
        chosen.insert(w);
    }
    assert_eq!(chosen, [1, 3].into_iter().collect());
}

#[test]
fn an_overloaded_holder_is_passed_over_for_the_next_best_holder() {
    let snap = snapshot(4, WorkerRole::Regular, &[0, 1, 2, 3]);
    let held = [(0, 90), (1, 70)];
    let kv = KvMatch { prompt_tokens: 100, held: &held, key: 7, subscribed: &[], blocks: &NoBlocks };
    // Worker 0 is overloaded (200 vs a minimum of 10): worker 1's shorter match still wins.
    let p = pick(&snap, CacheSource::Events, &vec![200, 12, 10, 11], Some(kv), None, 1);
    assert_eq!((p.worker, p.branch), (1, "rebalance_hit"));
    assert_eq!(p.reason, "rebalance cache_hit=0.70 events matched=70/100");
}

#[test]
fn events_win_over_a_stale_text_tree() {
    // The tree says worker 1 has the prompt; the events say worker 1 evicted it and worker 3 has it.
    let snap = snapshot(4, WorkerRole::Regular, &[0, 1, 2, 3]);
    let mut tree = RadixTree::new();
    let text = "a long shared system prompt and a question";
    tree.insert(text, &url(1), 1);
    let held = [(3, 80)];
    let kv = KvMatch { prompt_tokens: 100, held: &held, key: 7, subscribed: &[], blocks: &NoBlocks };
    assert_eq!(pick(&snap, CacheSource::Events, &vec![0; 4], Some(kv), Some((&tree, text)), 1).worker, 3);
    assert_eq!(pick(&snap, CacheSource::Auto, &vec![0; 4], Some(kv), Some((&tree, text)), 1).worker, 3, "w1 publishes: its tree entry is not read");
    assert_eq!(pick(&snap, CacheSource::Text, &vec![0; 4], Some(kv), Some((&tree, text)), 1).worker, 1);
}

#[test]
fn auto_reads_the_tree_for_workers_without_events_and_takes_the_deeper_match() {
    // Workers 0 and 1 publish; 2 and 3 do not.
    let snap = snapshot(4, WorkerRole::Regular, &[0, 1]);
    let mut tree = RadixTree::new();
    let text = "0123456789";
    tree.insert(text, &url(2), 1);
    let shallow = [(0, 60)];
    let p = pick(&snap, CacheSource::Auto, &vec![0; 4], Some(KvMatch { prompt_tokens: 100, held: &shallow, key: 7, subscribed: &[], blocks: &NoBlocks }), Some((&tree, text)), 1);
    assert_eq!((p.worker, p.reason.as_str()), (2, "cache_hit=1.00"), "the tree's full match beats 60%");
    let deep = [(0, 100)];
    let p =
        pick(&snap, CacheSource::Auto, &vec![0; 4], Some(KvMatch { prompt_tokens: 100, held: &deep, key: 7, subscribed: &[], blocks: &NoBlocks }), Some((&tree, "01234567xx")), 1);
    assert_eq!(p.worker, 0, "the events' full match beats the tree's 80%");
}

#[test]
fn without_token_ids_every_source_falls_back_to_the_text_tree() {
    let snap = snapshot(3, WorkerRole::Regular, &[0, 1, 2]);
    let mut tree = RadixTree::new();
    tree.insert("hello world", &url(2), 1);
    for source in [CacheSource::Events, CacheSource::Auto, CacheSource::Text] {
        let p = pick(&snap, source, &vec![0; 3], None, Some((&tree, "hello world!")), 1);
        assert_eq!((p.worker, p.branch), (2, "cache_hit"), "{source:?}");
    }
}

/// Free KV and running requests per worker.
struct Kv(Vec<(u64, u64)>);

impl LoadView for Kv {
    fn load(&self, w: usize) -> u64 {
        self.0[w].1
    }
    fn free_kv_tokens(&self, w: usize) -> Option<u64> {
        Some(self.0[w].0)
    }
}

#[test]
fn a_decode_pick_with_events_goes_by_free_kv() {
    let snap = snapshot(3, WorkerRole::Decode, &[0, 1, 2]);
    let held = [(0, 100)];
    let kv = KvMatch { prompt_tokens: 100, held: &held, key: 7, subscribed: &[], blocks: &NoBlocks };
    // Worker 0 holds the prompt but lacks room for prompt + output (120 tokens).
    let loads = Kv(vec![(50, 0), (9_000, 4), (9_000, 2)]);
    let p = pick(&snap, CacheSource::Events, &loads, Some(kv), None, 1);
    assert_eq!((p.worker, p.branch), (2, "most_free_kv"));
    // With the text source, a decode pick is cache_aware's as before.
    let p = pick(&snap, CacheSource::Text, &loads, Some(kv), None, 1);
    assert_eq!(p.branch, "cache_miss");
}
