//! KV event index lookup cost at 1,000 workers holding 1M blocks (16 tokens each).
//! Run: `cargo bench -p pdgate-core --bench kv_index`.
//!
//! The fleet: 50 system prompts of 8 blocks, each cached on the 20 workers `w % 50 == s`; every
//! worker also holds 124 conversations of 8 blocks after its system prompt (1,000 blocks per
//! worker, 1,000,000 in all). A request is a system prompt, one worker's conversation and 4 new
//! blocks (320 tokens). The worst case is measured apart: a 4-block preamble that every worker
//! holds, so a lookup reads 1,000-entry holder lists. Criterion gives the mean; then single
//! lookups are timed (`Instant` around each call, ~25 ns of timer overhead included) for p50/p99,
//! the target being p99 <= 10 us.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::Criterion;
use pdgate_core::kv_events::KvEvent;
use pdgate_core::kv_index::KvIndex;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const WORKERS: usize = 1_000;
const BS: usize = 16;
const SYSTEMS: usize = 50;
const CONVERSATIONS: usize = 124;
const BLOCKS: usize = 8;

fn tokens(rng: &mut StdRng, n_blocks: usize) -> Vec<u32> {
    (0..n_blocks * BS).map(|_| rng.random_range(0..32_000)).collect()
}

/// Store `new` after `prefix` on worker `w`; engine hashes are any function of the prefix.
fn store(ix: &mut KvIndex, w: u32, prefix: &[u32], new: &[u32]) {
    let parent = (!prefix.is_empty()).then(|| hash_of(prefix));
    let mut all = prefix.to_vec();
    let hashes: Vec<u64> = new
        .chunks(BS)
        .map(|c| {
            all.extend_from_slice(c);
            hash_of(&all)
        })
        .collect();
    ix.apply_event(w, &KvEvent::BlockStored { block_hashes: hashes, parent_block_hash: parent, token_ids: new.to_vec(), block_size: BS as u32, medium: None });
}

fn hash_of(prefix: &[u32]) -> u64 {
    prefix.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, t| (h ^ u64::from(*t)).wrapping_mul(0x100_0000_01b3))
}

struct Fleet {
    ix: KvIndex,
    systems: Vec<Vec<u32>>,
    conversations: Vec<Vec<Vec<u32>>>,
    preamble: Vec<u32>,
}

fn fleet() -> Fleet {
    let mut rng = StdRng::seed_from_u64(3);
    let mut ix = KvIndex::new(9, 2_000_000);
    let systems: Vec<Vec<u32>> = (0..SYSTEMS).map(|_| tokens(&mut rng, BLOCKS)).collect();
    let preamble = tokens(&mut rng, 4);
    let mut conversations = vec![];
    for w in 0..WORKERS {
        let slot = ix.add_worker();
        let sys = &systems[w % SYSTEMS];
        store(&mut ix, slot, &[], sys);
        let mine: Vec<Vec<u32>> = (0..CONVERSATIONS).map(|_| tokens(&mut rng, BLOCKS)).collect();
        for conv in &mine {
            store(&mut ix, slot, sys, conv);
        }
        conversations.push(mine);
    }
    Fleet { ix, systems, conversations, preamble }
}

fn request(f: &Fleet, rng: &mut StdRng) -> Vec<u32> {
    let w = rng.random_range(0..WORKERS);
    let mut q = f.systems[w % SYSTEMS].clone();
    q.extend_from_slice(&f.conversations[w][rng.random_range(0..CONVERSATIONS)]);
    q.extend_from_slice(&tokens(rng, 4));
    q
}

fn percentiles(name: &str, mut samples: Vec<u64>) {
    samples.sort_unstable();
    let at = |q: f64| samples[((samples.len() as f64 * q) as usize).min(samples.len() - 1)];
    println!("{name:<28} p50 {:>8} ns  p99 {:>8} ns  max {:>9} ns", at(0.5), at(0.99), at(1.0));
}

fn main() {
    let t = Instant::now();
    let mut f = fleet();
    println!("built {} blocks on {WORKERS} workers in {:?}; index ~{} MiB", f.ix.stats().blocks, t.elapsed(), f.ix.memory_bytes() >> 20);
    let mut rng = StdRng::seed_from_u64(5);
    let reqs: Vec<Vec<u32>> = (0..1_000).map(|_| request(&f, &mut rng)).collect();
    let hits = f.ix.match_tokens(&reqs[0]);
    assert!(hits.iter().any(|(_, n)| *n == 2 * BLOCKS * BS), "a request must match its worker's conversation");

    let mut c = Criterion::default().warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(1)).sample_size(20).configure_from_args();
    let mut i = 0;
    c.bench_function("kv_index match 1000 workers 1M blocks", |b| {
        b.iter(|| {
            i = (i + 1) % reqs.len();
            black_box(f.ix.match_tokens(&reqs[i]))
        })
    });
    c.final_summary();
    let time = |ix: &KvIndex, q: &[u32]| {
        let t = Instant::now();
        black_box(ix.match_tokens(q));
        t.elapsed().as_nanos() as u64
    };
    percentiles("typical (20 holders/prefix)", (0..20_000).map(|i| time(&f.ix, &reqs[i % reqs.len()])).collect());

    // worst case: a preamble every worker holds, then the request
    for w in 0..WORKERS as u32 {
        let pre = f.preamble.clone();
        store(&mut f.ix, w, &[], &pre);
    }
    let worst: Vec<Vec<u32>> = reqs.iter().map(|r| [f.preamble.as_slice(), r].concat()).collect();
    percentiles("preamble held by all 1000", (0..5_000).map(|i| time(&f.ix, &worst[i % worst.len()])).collect());
}
