//! cache_aware's exact source: the prefix each worker holds, from the engines' KV events
//! (`RouteInput::kv`, matched in prompt tokens by the gateway's KV index).
//!
//! The text tree guesses what a worker holds from the prompts this gateway sent it; the events
//! say what the engine stored and evicted, so they see evictions and what other gateway
//! replicas sent. With `--cache-source auto` a worker that publishes no events is matched on the
//! text tree instead, and the deeper of the two matches (as a share of the prompt) wins.

use rand::{Rng, RngCore};

use super::{is_candidate, RouteInput, SCAN_LIMIT};
use crate::config::CacheSource;
use crate::snapshot::PoolSnapshot;

/// Whether worker `w`'s cache view comes from KV events under `source`.
pub fn uses_events(source: CacheSource, snap: &PoolSnapshot, w: usize) -> bool {
    match source {
        CacheSource::Events => true,
        CacheSource::Auto => snap.worker(w).spec.kv_events.is_some(),
        CacheSource::Text => false,
    }
}

/// The best event match among the candidates whose load passes `ok`: the most prompt tokens
/// held, then the least load. Returns `(worker, matched tokens)`. Looks at most
/// [`SCAN_LIMIT`] holders, from a random start so that ties spread.
pub(super) fn best_held(
    source: CacheSource,
    snap: &PoolSnapshot,
    candidates: &[usize],
    input: &RouteInput<'_>,
    ok: &dyn Fn(u64) -> bool,
    rng: &mut dyn RngCore,
) -> Option<(usize, usize)> {
    let held = input.kv?.held;
    let n = held.len();
    if n == 0 {
        return None;
    }
    let start = rng.random_range(0..n);
    let mut best: Option<(usize, u64, usize)> = None;
    for i in 0..n.min(SCAN_LIMIT) {
        let (w, matched) = held[(start + i) % n];
        if matched == 0 || !is_candidate(candidates, w) || !uses_events(source, snap, w) {
            continue;
        }
        let load = input.loads.load(w);
        if !ok(load) {
            continue;
        }
        if best.is_none_or(|(m, l, _)| matched > m || (matched == m && load < l)) {
            best = Some((matched, load, w));
        }
    }
    best.map(|(m, _, w)| (w, m))
}
