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
use pdgate_core::kv_events::KvEvent;
use pdgate_core::kv_index::KvIndex;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const WORKERS: usize = 1_000;
const BS: usize = 16;
const SYSTEMS: usize = 50;
const CONVERSATIONS: usize = 123;
const BLOCKS: usize = 8;
const DOCS: usize = 20;
const DOC_BLOCKS: usize = 256;

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
    private: Vec<Vec<u32>>,
    preamble: Vec<u32>,
    docs: Vec<Vec<u32>>,
}

fn fleet(rng: &mut StdRng) -> Fleet {
    let mut ix = KvIndex::new(9, 2_000_000);
    let systems: Vec<Vec<u32>> = (0..SYSTEMS).map(|_| tokens(rng, BLOCKS)).collect();
    let (mut conversations, mut private) = (vec![], vec![]);
    for w in 0..WORKERS {
        let slot = ix.add_worker();
        let sys = &systems[w % SYSTEMS];
        store(&mut ix, slot, &[], sys);
        let mine: Vec<Vec<u32>> = (0..CONVERSATIONS).map(|_| tokens(rng, BLOCKS)).collect();
        for conv in &mine {
            store(&mut ix, slot, sys, conv);
        }
        conversations.push(mine);
        let doc = tokens(rng, BLOCKS);
        store(&mut ix, slot, &[], &doc);
        private.push(doc);
    }
    let preamble = tokens(rng, 4);
    for w in 0..WORKERS as u32 {
        store(&mut ix, w, &[], &preamble);
    }
    let docs: Vec<Vec<u32>> = (0..DOCS).map(|_| tokens(rng, DOC_BLOCKS)).collect();
    for w in 0..WORKERS {
        if w % (WORKERS / 20) < DOCS {
            store(&mut ix, w as u32, &[], &docs[w % (WORKERS / 20)]);
        }
    }
    Fleet { ix, systems, conversations, private, preamble, docs }
}

/// A system prompt, one of a worker's conversations, 4 new blocks.
fn some(f: &Fleet, rng: &mut StdRng) -> Vec<u32> {
    let w = rng.random_range(0..WORKERS);
    [f.systems[w % SYSTEMS].as_slice(), &f.conversations[w][rng.random_range(0..CONVERSATIONS)], &tokens(rng, 4)].concat()
}

fn cases(f: &Fleet, rng: &mut StdRng) -> Vec<(&'static str, Vec<Vec<u32>>)> {
    let n = 1_000;
    vec![
        ("one holder", (0..n).map(|_| [f.private[rng.random_range(0..WORKERS)].as_slice(), &tokens(rng, 4)].concat()).collect()),
        ("some holders (20)", (0..n).map(|_| some(f, rng)).collect()),
        ("all holders (1,000)", (0..n).map(|_| [f.preamble.as_slice(), &some(f, rng)].concat()).collect()),
        ("miss", (0..n).map(|_| tokens(rng, 20)).collect()),
        ("long prompt, early miss", (0..n).map(|_| [some(f, rng).as_slice(), &tokens(rng, 512)].concat()).collect()),
        ("long prompt, cached", (0..n).map(|_| [f.docs[rng.random_range(0..DOCS)].as_slice(), &tokens(rng, 4)].concat()).collect()),
    ]
}

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
    for (name, reqs) in &cases {
        let hits = f.ix.match_tokens(&reqs[0]);
        assert_eq!(hits.is_empty(), *name == "miss", "{name}: {hits:?}");
    }

    let mut c = Criterion::default().warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(1)).sample_size(20).configure_from_args();
    for (name, reqs) in &cases {
        let mut i = 0;
        c.bench_function(&format!("kv_index match 1000 workers 1M blocks: {name}"), |b| {
            b.iter(|| {
                i = (i + 1) % reqs.len();
                black_box(f.ix.match_tokens(&reqs[i]))
            })
        });
    }
    c.final_summary();
    let time = |q: &[u32]| {
        let t = Instant::now();
        black_box(f.ix.match_tokens(q));
        t.elapsed().as_nanos() as u64
    };
    for (name, reqs) in &cases {
        percentiles(name, (0..20_000).map(|i| time(&reqs[i % reqs.len()])).collect());
    }
}
