//! The events-based routing decision end to end: `cache_aware --cache-source events` choosing
//! among 1,000 workers whose KV index holds 1.1M worker-block entries (the `kv_index` bench's
//! fleet). One decision = the prompt's lookup in the index (`KvIndex::match_tokens`), the
//! slot -> snapshot index mapping the gateway does (a table indexed by slot), and the policy's
//! select over 1,000 candidates with random loads. Run:
//! `cargo bench -p pdgate-core --bench cache_events`.
//!
//! Criterion gives the mean per case; then single decisions are timed for p50/p99/max (`Instant`
//! around each, ~25 ns of timer overhead included); the target is p99 <= 10 us per decision.
//!
//! Last, a miss on an idle fleet (every load 0), the worst case of the miss tie-break: the
//! policy reads the block count of `SCAN_LIMIT` workers, as the gateway does (the worker's URL
//! in the subscriptions' map, then the index's mutex, per worker), against the same decision
//! without counts (a random least loaded worker, as before the tie-break), in the same run.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

use std::collections::HashMap;
use std::hint::black_box;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use criterion::Criterion;
use pdgate_core::kv_index::KvIndex;
use pdgate_core::policy::{CacheAwarePolicy, LoadView};
use pdgate_core::{CacheSource, CachedBlocks, KvMatch, NoBlocks, Policy, PolicyOptions, PoolSnapshot, RouteInput, WorkerRole, WorkerSpec, WorkerView};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

mod kv_fleet;
use kv_fleet::{cases, fleet, WORKERS};

struct Loads(Vec<u64>);

impl LoadView for Loads {
    fn load(&self, w: usize) -> u64 {
        self.0[w]
    }
}

/// What the gateway holds next to the index: the snapshot, and each index slot's snapshot index.
struct Router {
    snap: PoolSnapshot,
    candidates: Vec<usize>,
    index_of_slot: Vec<usize>,
    loads: Loads,
    policy: CacheAwarePolicy,
}

fn router(rng: &mut StdRng) -> Router {
    let views = (0..WORKERS)
        .map(|i| {
            let mut spec = WorkerSpec::new(&format!("http://10.0.{}.{}:30000", i / 256, i % 256), WorkerRole::Regular).unwrap();
            spec.kv_events = Some(format!("tcp://10.0.{}.{}:5557", i / 256, i % 256));
            WorkerView::new(Arc::new(spec), true)
        })
        .collect();
    let snap = PoolSnapshot::build(views, Default::default());
    let candidates = snap.eligible(WorkerRole::Regular).to_vec();
    // slots were added in worker order; a gateway's registration order may differ, hence the table
    let index_of_slot = (0..WORKERS).collect();
    let loads = Loads((0..WORKERS).map(|_| rng.random_range(0..32)).collect());
    let policy = CacheAwarePolicy::new(PolicyOptions { cache_source: CacheSource::Events, ..PolicyOptions::default() });
    Router { snap, candidates, index_of_slot, loads, policy }
}

fn decide(r: &Router, ix: &mut KvIndex, prompt: &[u32], rng: &mut StdRng) -> usize {
    let held: Vec<(usize, usize)> = ix.match_tokens(prompt).into_iter().map(|(slot, n)| (r.index_of_slot[slot as usize], n)).collect();
    let kv = KvMatch { prompt_tokens: prompt.len(), held: &held, key: prompt.len() as u64, subscribed: &[], blocks: &NoBlocks };
    let input = RouteInput { kv: Some(kv), loads: &r.loads, prompt_tokens: prompt.len() as u64, ..RouteInput::default() };
    r.policy.select(&r.snap, &r.candidates, &input, rng).map_or(usize::MAX, |s| s.worker)
}

/// The gateway's block counts (`kv_sub::SnapshotBlocks`): URL -> slot under the subscriptions'
/// mutex, then the count under the index's mutex.
struct GatewayBlocks<'a> {
    subs: &'a Mutex<HashMap<String, u32>>,
    ix: &'a Mutex<KvIndex>,
    snap: &'a PoolSnapshot,
}

impl CachedBlocks for GatewayBlocks<'_> {
    fn cached_blocks(&self, w: usize) -> Option<usize> {
        let slot = *self.subs.lock().unwrap().get(&self.snap.worker(w).spec.url)?;
        Some(self.ix.lock().unwrap().worker_blocks(slot))
    }
}

/// A miss (nothing held) on an idle fleet, with `blocks` for the tie-break.
fn decide_idle_miss(r: &Router, idle: &Loads, blocks: &dyn CachedBlocks, rng: &mut StdRng) -> usize {
    let kv = KvMatch { prompt_tokens: 512, held: &[], key: 1, subscribed: &[], blocks };
    let input = RouteInput { kv: Some(kv), loads: idle, prompt_tokens: 512, ..RouteInput::default() };
    r.policy.select(&r.snap, &r.candidates, &input, rng).map_or(usize::MAX, |s| s.worker)
}

fn main() {
    let mut rng = StdRng::seed_from_u64(3);
    let f = fleet(&mut rng);
    let cases = cases(&f, &mut rng);
    let mut ix = f.ix;
    let r = router(&mut rng);
    let mut pick = StdRng::seed_from_u64(5);
    // the decision is the one the index says: a prompt held by one worker goes there
    let one = &cases[0].1[0];
    let holder = ix.match_tokens(one)[0].0 as usize;
    assert_eq!(decide(&r, &mut ix, one, &mut pick), holder);

    let mut c = Criterion::default().warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(1)).sample_size(20).configure_from_args();
    for (name, reqs) in &cases {
        let mut i = 0;
        c.bench_function(&format!("cache_aware events decision, 1000 workers, 1M blocks: {name}"), |b| {
            b.iter(|| {
                i = (i + 1) % reqs.len();
                black_box(decide(&r, &mut ix, &reqs[i], &mut pick))
            })
        });
    }
    c.final_summary();
    for (name, reqs) in &cases {
        let mut samples: Vec<u64> = (0..20_000)
            .map(|i| {
                let t = Instant::now();
                black_box(decide(&r, &mut ix, &reqs[i % reqs.len()], &mut pick));
                t.elapsed().as_nanos() as u64
            })
            .collect();
        samples.sort_unstable();
        let at = |q: f64| samples[((samples.len() as f64 * q) as usize).min(samples.len() - 1)];
        println!("{name:<26} p50 {:>8} ns  p99 {:>8} ns  max {:>9} ns", at(0.5), at(0.99), at(1.0));
    }

    // The miss tie-break's worst case, with and without counts, interleaved.
    let subs: Mutex<HashMap<String, u32>> = Mutex::new((0..WORKERS).map(|w| (r.snap.worker(w).spec.url.to_string(), w as u32)).collect());
    let ix = Mutex::new(ix);
    let idle = Loads(vec![0; WORKERS]);
    let counted = GatewayBlocks { subs: &subs, ix: &ix, snap: &r.snap };
    c.bench_function("idle fleet miss, 1000 workers: block counts (gateway path)", |b| b.iter(|| black_box(decide_idle_miss(&r, &idle, &counted, &mut pick))));
    c.bench_function("idle fleet miss, 1000 workers: no counts (random least loaded)", |b| b.iter(|| black_box(decide_idle_miss(&r, &idle, &NoBlocks, &mut pick))));
    for (name, blocks) in [("idle miss, counts", &counted as &dyn CachedBlocks), ("idle miss, no counts", &NoBlocks)] {
        let mut samples: Vec<u64> = (0..20_000)
            .map(|_| {
                let t = Instant::now();
                black_box(decide_idle_miss(&r, &idle, blocks, &mut pick));
                t.elapsed().as_nanos() as u64
            })
            .collect();
        samples.sort_unstable();
        let at = |q: f64| samples[((samples.len() as f64 * q) as usize).min(samples.len() - 1)];
        println!("{name:<26} p50 {:>8} ns  p99 {:>8} ns  max {:>9} ns", at(0.5), at(0.99), at(1.0));
    }
}
