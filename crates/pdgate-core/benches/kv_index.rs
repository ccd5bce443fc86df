//! KV event index lookup cost at 1,000 workers holding 1M blocks (16 tokens each), per case,
//! and the index's memory per block. Run: `cargo bench -p pdgate-core --bench kv_index`.
//!
//! The fleet, 1,000 blocks per worker: a system prompt of 8 blocks (50 of them, each on the 20
//! workers `w % 50 == s`), 123 conversations of 8 blocks after it, and a private document of 8
//! blocks from the start. Then a 4-block preamble that every worker holds (+4,000 blocks) and
//! 20 long documents of 256 blocks, each on 20 workers (+102,400 blocks).
//!
//! Cases (each request ends in new blocks nobody holds):
//! - one holder: a worker's private document + 4 new blocks (12 blocks);
//! - some holders: a system prompt (20 holders) + one worker's conversation + 4 new (20 blocks);
//! - all holders: the preamble (1,000 holders) + the "some holders" request (24 blocks);
//! - miss: 20 random blocks;
//! - long prompt, early miss: the "some holders" request + 8,192 new tokens (532 blocks);
//! - long prompt, cached: a long document (20 holders) + 4 new blocks (260 blocks).
//!
//! Criterion gives each case's mean; then single lookups are timed (`Instant` around each
//! call, ~25 ns of timer overhead included) for p50/p99/max, the target being p99 <= 10 us.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::Criterion;
use rand::rngs::StdRng;
use rand::SeedableRng;

mod kv_fleet;
use kv_fleet::{cases, fleet, WORKERS};

fn percentiles(name: &str, mut samples: Vec<u64>) {
    samples.sort_unstable();
    let at = |q: f64| samples[((samples.len() as f64 * q) as usize).min(samples.len() - 1)];
    println!("{name:<26} p50 {:>8} ns  p99 {:>8} ns  max {:>9} ns", at(0.5), at(0.99), at(1.0));
}

fn main() {
    let mut rng = StdRng::seed_from_u64(3);
    let t = Instant::now();
    let f = fleet(&mut rng);
    let blocks = f.ix.stats().blocks;
    let bytes = f.ix.memory_bytes();
    println!("built {blocks} blocks on {WORKERS} workers in {:?}; index ~{} MiB, {} bytes per block", t.elapsed(), bytes >> 20, bytes / blocks);
    let cases = cases(&f, &mut rng);
    let mut ix = f.ix;
    for (name, reqs) in &cases {
        let hits = ix.match_tokens(&reqs[0]);
        assert_eq!(hits.is_empty(), *name == "miss", "{name}: {hits:?}");
    }

    let mut c = Criterion::default().warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(1)).sample_size(20).configure_from_args();
    for (name, reqs) in &cases {
        let mut i = 0;
        c.bench_function(&format!("kv_index match 1000 workers 1M blocks: {name}"), |b| {
            b.iter(|| {
                i = (i + 1) % reqs.len();
                black_box(ix.match_tokens(&reqs[i]))
            })
        });
    }
    c.final_summary();
    let mut time = |q: &[u32]| {
        let t = Instant::now();
        black_box(ix.match_tokens(q));
        t.elapsed().as_nanos() as u64
    };
    for (name, reqs) in &cases {
        percentiles(name, (0..20_000).map(|i| time(&reqs[i % reqs.len()])).collect());
    }
}
