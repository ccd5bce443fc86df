//! Policies' distributions with a seeded rng: power of two never takes the worse of its two
//! samples, consistent hashing moves ~1/N of the keys when a worker joins and only the keys of a
//! worker that leaves.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

use std::collections::HashMap;
use std::sync::Arc;

use pdgate_core::policy::{gen_pair, ConsistentHashPolicy, PowerOfTwoPolicy};
use pdgate_core::{Policy, PoolSnapshot, RouteInput, WorkerRole, WorkerSpec, WorkerView};
use proptest::prelude::*;
use rand::{rngs::StdRng, SeedableRng};

fn pool(n: usize, role: WorkerRole) -> Vec<WorkerView> {
    (0..n).map(|i| WorkerView::new(Arc::new(WorkerSpec::new(&format!("http://w{i}:8000"), role).unwrap()), true)).collect()
}

fn snapshot(views: Vec<WorkerView>) -> PoolSnapshot {
    PoolSnapshot::build(views, Default::default())
}

proptest! {
    #[test]
    fn power_of_two_never_takes_the_worse_sample(loads in proptest::collection::vec(0u64..10, 2..20), seed in any::<u64>()) {
        let snap = snapshot(pool(loads.len(), WorkerRole::Regular));
        let candidates: Vec<usize> = (0..loads.len()).collect();
        let input = RouteInput { loads: &loads, ..RouteInput::default() };
        let mut rng = StdRng::seed_from_u64(seed);
        for _ in 0..20 {
            let mut replay = rng.clone();
            let (a, b) = gen_pair(&mut replay, candidates.len());
            let chosen = PowerOfTwoPolicy.select(&snap, &candidates, &input, &mut rng).unwrap().worker;
            prop_assert!(chosen == a || chosen == b, "chose {chosen}, sampled {a} and {b}");
            prop_assert_eq!(loads[chosen], loads[a].min(loads[b]));
        }
        // A unique most-loaded worker is never chosen.
        let max = *loads.iter().max().unwrap();
        if loads.iter().filter(|&&l| l == max).count() == 1 {
            let worst = loads.iter().position(|&l| l == max).unwrap();
            for _ in 0..50 {
                prop_assert_ne!(PowerOfTwoPolicy.select(&snap, &candidates, &input, &mut rng).unwrap().worker, worst);
            }
        }
    }
}

/// Key → worker URL for 2,000 keys.
fn assign(snap: &PoolSnapshot, keys: &[String]) -> HashMap<String, String> {
    let candidates = snap.eligible(WorkerRole::Decode).to_vec();
    let mut rng = StdRng::seed_from_u64(0);
    keys.iter()
        .map(|k| {
            let input = RouteInput { key: Some(k), ..RouteInput::default() };
            let w = ConsistentHashPolicy.select(snap, &candidates, &input, &mut rng).unwrap().worker;
            (k.clone(), snap.worker(w).spec.url.clone())
        })
        .collect()
}

#[test]
fn consistent_hash_moves_about_one_nth_when_a_worker_joins() {
    let keys: Vec<String> = (0..2000).map(|i| format!("user-{i}")).collect();
    for n in [4usize, 10, 25] {
        let before = assign(&snapshot(pool(n, WorkerRole::Decode)), &keys);
        let after = assign(&snapshot(pool(n + 1, WorkerRole::Decode)), &keys);
        let newcomer = format!("http://w{n}:8000");
        let moved: Vec<&String> = keys.iter().filter(|k| before[*k] != after[*k]).collect();
        assert!(moved.iter().all(|k| after[*k] == newcomer), "keys only move to the new worker");
        let share = moved.len() as f64 / keys.len() as f64;
        let ideal = 1.0 / (n + 1) as f64;
        assert!(share > ideal * 0.5 && share < ideal * 1.6, "n={n}: moved {share:.3}, ideal {ideal:.3}");
    }
}

#[test]
fn consistent_hash_moves_only_the_keys_of_an_unhealthy_worker_and_brings_them_back() {
    let keys: Vec<String> = (0..2000).map(|i| format!("session-{i}")).collect();
    let healthy = snapshot(pool(8, WorkerRole::Decode));
    let mut views = pool(8, WorkerRole::Decode);
    views[3].healthy = false;
    let sick = PoolSnapshot::build_with(views, Default::default(), Some(&healthy));
    let (a, b) = (assign(&healthy, &keys), assign(&sick, &keys));
    let lost = "http://w3:8000";
    for k in &keys {
        if a[k] == lost {
            assert_ne!(b[k], lost);
        } else {
            assert_eq!(a[k], b[k], "{k} moved although its worker stayed");
        }
    }
    let spread: std::collections::HashSet<&String> = keys.iter().filter(|k| a[*k] == lost).map(|k| &b[k]).collect();
    assert!(spread.len() >= 4, "an unhealthy worker's keys spread over the ring, not onto one neighbour");
    assert_eq!(assign(&snapshot(pool(8, WorkerRole::Decode)), &keys), a, "recovery restores the mapping");
}

#[test]
fn consistent_hash_is_even_and_random_without_a_key() {
    let snap = snapshot(pool(10, WorkerRole::Decode));
    let keys: Vec<String> = (0..5000).map(|i| format!("k{i}")).collect();
    let mut counts: HashMap<String, usize> = HashMap::new();
    for w in assign(&snap, &keys).into_values() {
        *counts.entry(w).or_default() += 1;
    }
    assert_eq!(counts.len(), 10);
    assert!(counts.values().all(|&c| (250..=800).contains(&c)), "{counts:?}");
    let candidates = snap.eligible(WorkerRole::Decode).to_vec();
    let mut rng = StdRng::seed_from_u64(1);
    let s = ConsistentHashPolicy.select(&snap, &candidates, &RouteInput::default(), &mut rng).unwrap();
    assert_eq!(s.branch, "hash_no_key");
}

#[test]
fn consistent_hash_falls_back_to_rendezvous_when_few_candidates_remain() {
    let snap = snapshot(pool(1000, WorkerRole::Decode));
    let mut rng = StdRng::seed_from_u64(1);
    let input = RouteInput { key: Some("user-7"), ..RouteInput::default() };
    let few = [17usize, 512];
    let s = ConsistentHashPolicy.select(&snap, &few, &input, &mut rng).unwrap();
    assert!(few.contains(&s.worker));
    let again = ConsistentHashPolicy.select(&snap, &few, &input, &mut rng).unwrap();
    assert_eq!(s.worker, again.worker, "deterministic");
}
