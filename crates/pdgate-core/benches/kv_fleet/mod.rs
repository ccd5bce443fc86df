//! The KV index bench fleet, shared by the `kv_index` and `cache_events` benches: 1,000 workers
//! holding 1,106,400 worker-block entries of 16 tokens, and the request cases (see
//! `benches/kv_index.rs` for the layout).
#![allow(dead_code)] // each bench uses part of it

use pdgate_core::kv_events::KvEvent;
use pdgate_core::kv_index::KvIndex;
use rand::rngs::StdRng;
use rand::Rng;

pub const WORKERS: usize = 1_000;
pub const BS: usize = 16;
pub const SYSTEMS: usize = 50;
pub const CONVERSATIONS: usize = 123;
pub const BLOCKS: usize = 8;
pub const DOCS: usize = 20;
pub const DOC_BLOCKS: usize = 256;

pub fn tokens(rng: &mut StdRng, n_blocks: usize) -> Vec<u32> {
    (0..n_blocks * BS).map(|_| rng.random_range(0..32_000)).collect()
}

/// Store `new` after `prefix` on worker `w`; engine hashes are any function of the prefix.
pub fn store(ix: &mut KvIndex, w: u32, prefix: &[u32], new: &[u32]) {
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

pub fn hash_of(prefix: &[u32]) -> u64 {
    prefix.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, t| (h ^ u64::from(*t)).wrapping_mul(0x100_0000_01b3))
}

pub struct Fleet {
    pub ix: KvIndex,
    pub systems: Vec<Vec<u32>>,
    pub conversations: Vec<Vec<Vec<u32>>>,
    pub private: Vec<Vec<u32>>,
    pub preamble: Vec<u32>,
    pub docs: Vec<Vec<u32>>,
}

pub fn fleet(rng: &mut StdRng) -> Fleet {
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
pub fn some(f: &Fleet, rng: &mut StdRng) -> Vec<u32> {
    let w = rng.random_range(0..WORKERS);
    [f.systems[w % SYSTEMS].as_slice(), &f.conversations[w][rng.random_range(0..CONVERSATIONS)], &tokens(rng, 4)].concat()
}

pub fn cases(f: &Fleet, rng: &mut StdRng) -> Vec<(&'static str, Vec<Vec<u32>>)> {
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
