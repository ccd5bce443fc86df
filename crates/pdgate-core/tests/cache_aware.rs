//! cache_aware decisions on small tables: hits, misses, rebalancing that keeps affinity.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

use std::sync::Arc;

use pdgate_core::policy::CacheAwarePolicy;
use pdgate_core::{Policy, PolicyOptions, PoolSnapshot, RadixTree, RouteInput, WorkerRole, WorkerSpec, WorkerView};
use rand::{rngs::StdRng, SeedableRng};

const SYSTEM: &str = "You are a helpful assistant. Answer briefly and cite sources. ";

fn url(i: usize) -> String {
    format!("http://w{i}:8000")
}

fn snapshot(n: usize) -> PoolSnapshot {
    let views = (0..n).map(|i| WorkerView::new(Arc::new(WorkerSpec::new(&url(i), WorkerRole::Regular).unwrap()), true)).collect();
    PoolSnapshot::build(views, Default::default())
}

fn policy() -> CacheAwarePolicy {
    CacheAwarePolicy::new(PolicyOptions { cache_threshold: 0.5, ..PolicyOptions::default() })
}

fn pick(snap: &PoolSnapshot, tree: &RadixTree, loads: &[u64], text: &str, seed: u64) -> (usize, String, &'static str) {
    let candidates = snap.eligible(WorkerRole::Regular).to_vec();
    pick_among(snap, &candidates, tree, loads, text, seed)
}

fn pick_among(snap: &PoolSnapshot, candidates: &[usize], tree: &RadixTree, loads: &[u64], text: &str, seed: u64) -> (usize, String, &'static str) {
    let loads = loads.to_vec();
    let input = RouteInput { text: Some(text), tree: Some(tree), loads: &loads, ..RouteInput::default() };
    let s = policy().select(snap, candidates, &input, &mut StdRng::seed_from_u64(seed)).unwrap();
    (s.worker, s.reason.into_owned(), s.branch)
}

#[test]
fn a_hit_goes_to_the_least_loaded_worker_with_the_prefix() {
    let snap = snapshot(4);
    let mut tree = RadixTree::new();
    tree.insert(&format!("{SYSTEM}What is Rust?"), &url(1), 1);
    tree.insert(&format!("{SYSTEM}What is Go?"), &url(2), 2);
    let q = format!("{SYSTEM}What is Zig?");
    let (w, reason, branch) = pick(&snap, &tree, &[0, 9, 3, 0], &q, 1);
    assert_eq!((w, branch), (2, "cache_hit"), "w1 and w2 share the prefix; w2 is less loaded");
    let ratio = (SYSTEM.len() + "What is ".len()) as f64 / q.len() as f64;
    assert_eq!(reason, format!("cache_hit={ratio:.2}"));
    // The deepest match wins over a less loaded shallower one.
    let (w, _, _) = pick(&snap, &tree, &[0, 9, 3, 0], &format!("{SYSTEM}What is Rust? And Go?"), 1);
    assert_eq!(w, 1);
}

#[test]
fn a_miss_goes_to_the_least_loaded_worker_and_ties_spread() {
    let snap = snapshot(4);
    let mut tree = RadixTree::new();
    tree.insert(&format!("{SYSTEM}What is Rust?"), &url(1), 1);
    let (w, reason, branch) = pick(&snap, &tree, &[5, 0, 7, 3], "Translate to French: cheese", 1);
    assert_eq!((w, branch), (1, "cache_miss"));
    assert_eq!(reason, "cache_miss=0.00");
    let chosen: std::collections::HashSet<usize> = (0..40).map(|seed| pick(&snap, &RadixTree::new(), &[0; 4], "hello", seed).0).collect();
    assert!(chosen.len() >= 3, "an idle fleet does not pile onto one worker: {chosen:?}");
}

#[test]
fn rebalancing_avoids_overloaded_workers_but_keeps_affinity() {
    let snap = snapshot(4);
    let mut tree = RadixTree::new();
    tree.insert(&format!("{SYSTEM}Summarise this long document, part one."), &url(0), 1);
    tree.insert(&format!("{SYSTEM}Summarise this long document, part two."), &url(1), 2);
    let q = format!("{SYSTEM}Summarise this long document, part one. Thanks");
    // Imbalanced: max 300 - min 0 > 64 and 300 > 1.5 * 0. Worker 0 (best match) is overloaded;
    // worker 1 (next best match) is within the threshold of the minimum.
    let (w, reason, branch) = pick(&snap, &tree, &[300, 50, 0, 0], &q, 1);
    assert_eq!((w, branch), (1, "rebalance_hit"), "{reason}");
    assert!(reason.starts_with("rebalance cache_hit="), "{reason}");
    // Both matching workers overloaded: plain load balancing.
    let (w, _, branch) = pick(&snap, &tree, &[300, 200, 0, 90], &q, 1);
    assert_eq!((w, branch), (2, "rebalance"));
    // Balanced again: the best match wins even if it is busier.
    let (w, _, branch) = pick(&snap, &tree, &[40, 10, 0, 0], &q, 1);
    assert_eq!((w, branch), (0, "cache_hit"));
}

#[test]
fn non_candidates_in_the_tree_are_skipped() {
    let snap = snapshot(3);
    let mut tree = RadixTree::new();
    tree.insert(&format!("{SYSTEM}Question A"), &url(0), 1);
    tree.insert(&format!("{SYSTEM}Question B"), &url(1), 2);
    tree.insert(&format!("{SYSTEM}Question A"), "http://gone:1", 3);
    let q = format!("{SYSTEM}Question A!");
    // Worker 0 excluded (it failed this request): the shared-prefix worker 1 is next best.
    let (w, _, branch) = pick_among(&snap, &[1, 2], &tree, &[0, 5, 0], &q, 1);
    assert_eq!((w, branch), (1, "cache_hit"));
}

#[test]
fn the_tree_is_keyed_by_url_so_it_survives_reordering() {
    let mut tree = RadixTree::new();
    tree.insert(&format!("{SYSTEM}Question A"), &url(2), 1);
    let views: Vec<WorkerView> = [2, 0, 1].iter().map(|&i| WorkerView::new(Arc::new(WorkerSpec::new(&url(i), WorkerRole::Regular).unwrap()), true)).collect();
    let snap = PoolSnapshot::build(views, Default::default());
    let (w, _, branch) = pick(&snap, &tree, &[0, 0, 0], &format!("{SYSTEM}Question A?"), 1);
    assert_eq!((snap.worker(w).spec.url.as_str(), branch), (url(2).as_str(), "cache_hit"));
}

#[test]
fn without_text_or_tree_it_balances_by_load() {
    let snap = snapshot(3);
    let loads = vec![4u64, 1, 9];
    let input = RouteInput { loads: &loads, ..RouteInput::default() };
    let s = policy().select(&snap, &[0, 1, 2], &input, &mut StdRng::seed_from_u64(0)).unwrap();
    assert_eq!((s.worker, s.branch), (1, "cache_miss"));
    assert!(policy().uses_tree());
}
