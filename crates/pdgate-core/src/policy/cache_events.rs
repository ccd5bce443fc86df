//! cache_aware's exact source: the prefix each worker holds, from the engines' KV events
//! (`RouteInput::kv`, matched in prompt tokens by the gateway's KV index).
//!
//! The text tree guesses what a worker holds from the prompts this gateway sent it; the events
//! say what the engine stored and evicted, so they see evictions and what other gateway
//! replicas sent. With `--cache-source auto` a worker that publishes no events is matched on the
//! text tree instead, and the deeper of the two matches (as a share of the prompt) wins.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

use rand::{Rng, RngCore};

use super::{is_candidate, KvMatch, RouteInput, SCAN_LIMIT};
use crate::config::CacheSource;
use crate::snapshot::PoolSnapshot;

/// Whether worker `w`'s cache view comes from KV events under `source`: with auto, when it
/// registered a publisher or its gRPC stream feeds the index (`kv`'s `subscribed`).
pub fn uses_events(source: CacheSource, snap: &PoolSnapshot, kv: Option<&KvMatch<'_>>, w: usize) -> bool {
    match source {
        CacheSource::Events => true,
        CacheSource::Auto => snap.worker(w).spec.kv_events.is_some() || kv.is_some_and(|k| k.subscribed.binary_search(&w).is_ok()),
        CacheSource::Text => false,
    }
}

/// How a holder ranks, greater is better: matched tokens, then less load, then weight.
type Rank = (usize, std::cmp::Reverse<u64>, u64);

/// Rendezvous weight of worker `url` for the prompt `key`: the same in every replica.
fn weight(key: u64, url: &str) -> u64 {
    let mut h = DefaultHasher::new();
    (key, url).hash(&mut h);
    h.finish()
}

/// The best event match among the candidates whose load passes `ok`: the most prompt tokens
/// held, then the least load, then the highest rendezvous weight (ties spread by prompt, and
/// every replica breaks them alike). Returns `(worker, matched tokens)`. Looks at most
/// [`SCAN_LIMIT`] holders (from a random start when there are more).
pub(super) fn best_held(
    source: CacheSource,
    snap: &PoolSnapshot,
    candidates: &[usize],
    input: &RouteInput<'_>,
    ok: &dyn Fn(u64) -> bool,
    rng: &mut dyn RngCore,
) -> Option<(usize, usize)> {
    let kv = input.kv?;
    let held = kv.held;
    let n = held.len();
    if n == 0 {
        return None;
    }
    let start = if n > SCAN_LIMIT { rng.random_range(0..n) } else { 0 };
    let mut best: Option<(Rank, usize)> = None;
    for i in 0..n.min(SCAN_LIMIT) {
        let (w, matched) = held[(start + i) % n];
        if matched == 0 || !is_candidate(candidates, w) || !uses_events(source, snap, Some(&kv), w) {
            continue;
        }
        let load = input.loads.load(w);
        if !ok(load) {
            continue;
        }
        let rank = (matched, std::cmp::Reverse(load), weight(kv.key, &snap.worker(w).spec.url));
        if best.is_none_or(|(b, _)| rank > b) {
            best = Some((rank, w));
        }
    }
    best.map(|((m, _, _), w)| (w, m))
}
