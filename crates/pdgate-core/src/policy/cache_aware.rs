//! Cache-aware routing (SMG semantics), with cache affinity kept while rebalancing.
//!
//! - Balanced load: if the best prefix match ratio (matched text / text) reaches
//!   `cache_threshold`, take the least loaded worker that has that match (`cache_hit=0.82`);
//!   otherwise the least loaded worker (`cache_miss=0.12`). With events, ties among the equally
//!   least loaded go to the longest held prefix, then the fewest cached blocks
//!   (`events_miss`).
//! - Imbalanced load (SMG's rule: `max - min > abs` AND `max > rel * min`): SMG routes purely by
//!   load and its hit rate collapses. Here only *overloaded* workers are avoided — those whose
//!   load would itself count as imbalanced against the minimum — and among the rest the one with
//!   the longest match above the threshold still wins (`rebalance cache_hit=0.64`); with no
//!   such match, the least loaded worker (`rebalance`).
//!
//! Where the cache view comes from is `--cache-source` (`cache_events.rs`): the engines' KV
//! events, matched in prompt tokens (ratio = tokens held / prompt tokens), or this text tree.
//! With events, a PD decode pick goes by free KV as `most_free_kv` does (a decode's own prefix
//! cache does not matter: the prompt's KV arrives from the prefill).
//!
//! The policy only reads the tree. After the decision the gateway inserts the text for the
//! chosen worker (see [`Policy::uses_tree`]). Cost: O(text length) for the match, plus at most
//! [`TENANT_VISITS`] worker lookups and [`super::SCAN_LIMIT`] load and holder reads.

use rand::{Rng, RngCore};

use super::cache_events::{best_held, uses_events};
use super::{is_candidate, scan_loads, visit_bounded, LoadScan, MostFreeKvPolicy, Policy, PolicyOptions, RouteInput, Selection, SCAN_LIMIT};
use crate::config::CacheSource;
use crate::radix::{MatchLevel, RadixTree};
use crate::snapshot::PoolSnapshot;
use crate::worker::WorkerRole;

/// The most tenants (workers sharing a prefix) looked at per decision, over all tree levels.
pub const TENANT_VISITS: usize = 64;

#[derive(Debug, Clone)]
pub struct CacheAwarePolicy {
    options: PolicyOptions,
}

impl CacheAwarePolicy {
    pub fn new(options: PolicyOptions) -> Self {
        CacheAwarePolicy { options }
    }
}

/// One decision's view of the tree: where to look and how much looking is left.
struct Lookup<'a> {
    snap: &'a PoolSnapshot,
    tree: &'a RadixTree,
    candidates: &'a [usize],
    input: &'a RouteInput<'a>,
    /// Tenant visits left.
    visits: usize,
    /// Random start within each level's tenant list, so that ties spread out.
    offset: usize,
    /// Workers whose view comes from events: their tree entries are not read.
    skip_events: Option<CacheSource>,
}

impl Lookup<'_> {
    /// The least loaded candidate at `level` whose load passes `ok`.
    fn best_at(&mut self, level: &MatchLevel<'_>, ok: &dyn Fn(u64) -> bool) -> Option<usize> {
        let n = level.tenant_count();
        let mut best: Option<(u64, usize)> = None;
        for i in 0..n.min(self.visits) {
            let tenant = level.tenant((self.offset + i) % n)?;
            let Some(w) = self.snap.index_of(self.tree.key(tenant)) else { continue };
            if !is_candidate(self.candidates, w) || self.skip_events.is_some_and(|src| uses_events(src, self.snap, self.input.kv.as_ref(), w)) {
                continue;
            }
            let load = self.input.loads.load(w);
            if ok(load) && best.is_none_or(|(l, _)| load < l) {
                best = Some((load, w));
            }
        }
        self.visits -= n.min(self.visits);
        best.map(|(_, w)| w)
    }
}

/// A cache hit found by one source: the worker, its match ratio, and how it was found.
struct Hit {
    worker: usize,
    ratio: f64,
    /// Appended to the reason (empty for the text tree, as before events existed).
    how: String,
}

impl CacheAwarePolicy {
    /// The text tree's deepest hit at or above the threshold (and the best ratio seen).
    fn text_hit(&self, lookup: &mut Lookup<'_>, text: &str, ok: &dyn Fn(u64) -> bool) -> (Option<Hit>, f64) {
        let m = lookup.tree.match_prefix(text);
        let ratio = |matched: usize| matched as f64 / text.len() as f64;
        // Deepest match first: shallower levels have lower ratios and more tenants.
        for level in m.levels.iter().rev() {
            let r = ratio(level.matched);
            if r < self.options.cache_threshold || lookup.visits == 0 {
                break;
            }
            if let Some(w) = lookup.best_at(level, ok) {
                return (Some(Hit { worker: w, ratio: r, how: String::new() }), r);
            }
        }
        (None, ratio(m.matched()))
    }

    /// The events' best hit at or above the threshold (and the best ratio seen).
    fn event_hit(&self, snap: &PoolSnapshot, candidates: &[usize], input: &RouteInput<'_>, ok: &dyn Fn(u64) -> bool, rng: &mut dyn RngCore) -> (Option<Hit>, f64) {
        let Some(kv) = input.kv else { return (None, 0.0) };
        let Some((w, matched)) = best_held(self.options.cache_source, snap, candidates, input, ok, rng) else { return (None, 0.0) };
        let r = matched as f64 / kv.prompt_tokens.max(1) as f64;
        let hit = (r >= self.options.cache_threshold).then(|| Hit { worker: w, ratio: r, how: format!(" events matched={matched}/{}", kv.prompt_tokens) });
        (hit, r)
    }
}

impl CacheAwarePolicy {
    /// Where a miss goes when events are in play: the least loaded worker, as without them, but
    /// ties among the equally least loaded are broken by the cache instead of the scan's random
    /// pick. First the longest (below-threshold) prefix held: it keeps a conversation whose
    /// tail was evicted where its system prompt still is. Among those (or among all of them
    /// when none holds any of the prompt, or all hold the same shared template prefix), the
    /// one holding the fewest blocks: a new prefix goes to the emptiest cache rather than
    /// evicting another prefix's blocks (on an idle fleet, random picks pile prefixes onto one
    /// worker while others stay empty). Neither costs balance: only equal loads are reordered.
    /// When a tied worker's count is unknown (a worker without events under `auto`), counts
    /// are not compared at all, so a mixed fleet is not tilted towards its publishers. Returns
    /// the worker and what the reason adds.
    fn events_miss(&self, snap: &PoolSnapshot, candidates: &[usize], input: &RouteInput<'_>, scan: LoadScan, rng: &mut dyn RngCore) -> (usize, String) {
        let least = scan.min;
        let Some(kv) = input.kv else { return (scan.least, " events".to_string()) };
        let source = self.options.cache_source;
        let holder = best_held(source, snap, candidates, input, &|load| load <= least, rng);
        let longest = holder.map_or(0, |(_, m)| m);
        // The fewest blocks among the tied workers; None once one's count is unknown.
        let mut best: Option<(usize, usize)> = None;
        let mut unknown = false;
        let mut consider = |w: usize| {
            if unknown || input.loads.load(w) > least {
                return;
            }
            match kv.blocks.cached_blocks(w) {
                Some(blocks) if best.is_none_or(|(b, _)| blocks < b) => best = Some((blocks, w)),
                Some(_) => {}
                None => unknown = true,
            }
        };
        if longest > 0 {
            let holders = kv.held.iter().take(SCAN_LIMIT);
            for &(w, _) in holders.filter(|&&(w, m)| m == longest && is_candidate(candidates, w) && uses_events(source, snap, Some(&kv), w)) {
                consider(w);
            }
        } else {
            visit_bounded(candidates, rng.random_range(0..candidates.len()), rng, consider);
        }
        // Without known counts: the holder best_held ranked (ties by prompt, alike in every
        // replica), else the scan's pick.
        match (best.filter(|_| !unknown), holder) {
            (Some((blocks, w)), _) if longest > 0 => (w, format!(" events held={longest} blocks={blocks}")),
            (Some((blocks, w)), _) => (w, format!(" events blocks={blocks}")),
            (_, Some((w, m))) => (w, format!(" events held={m}")),
            (_, None) => (scan.least, " events".to_string()),
        }
    }
}

impl Policy for CacheAwarePolicy {
    fn name(&self) -> &'static str {
        "cache_aware"
    }

    fn uses_tree(&self) -> bool {
        true
    }

    fn select(&self, snap: &PoolSnapshot, candidates: &[usize], input: &RouteInput<'_>, rng: &mut dyn RngCore) -> Option<Selection> {
        let source = self.options.cache_source;
        // Events apply when the source allows them and the gateway matched the prompt's token ids.
        let events = source != CacheSource::Text && input.kv.is_some_and(|k| k.prompt_tokens > 0);
        if events && candidates.first().is_some_and(|&w| snap.worker(w).spec.role == WorkerRole::Decode) {
            return MostFreeKvPolicy.select(snap, candidates, input, rng);
        }
        let scan: LoadScan = scan_loads(candidates, input.loads, rng)?;
        let imbalanced = self.options.imbalanced(scan.min, scan.max);
        let opts = self.options;
        let min = scan.min;
        let not_overloaded = move |load: u64| !opts.imbalanced(min, load);
        let any = |_: u64| true;
        let ok: &dyn Fn(u64) -> bool = if imbalanced { &not_overloaded } else { &any };
        let (event_hit, event_ratio) = if events { self.event_hit(snap, candidates, input, ok, rng) } else { (None, 0.0) };
        // The text tree serves every worker without events, and every request without token ids.
        let events_only = events && source == CacheSource::Events;
        let text = match (input.tree, input.text) {
            (Some(tree), Some(text)) if !text.is_empty() && !events_only => Some((tree, text)),
            _ => None,
        };
        let (text_hit, text_ratio) = match text {
            Some((tree, text)) => {
                let offset = rng.random_range(0..usize::MAX / 2);
                let skip_events = events.then_some(source);
                let mut lookup = Lookup { snap, tree, candidates, input, visits: TENANT_VISITS, offset, skip_events };
                self.text_hit(&mut lookup, text, ok)
            }
            None => (None, 0.0),
        };
        if !events && text.is_none() {
            let branch = if imbalanced { "rebalance" } else { "cache_miss" };
            return Some(Selection::with_reason(scan.least, branch, format!("{branch} no_text")));
        }
        let hit = match (event_hit, text_hit) {
            (Some(e), Some(t)) => Some(if t.ratio > e.ratio { t } else { e }),
            (e, t) => e.or(t),
        };
        if let Some(Hit { worker, ratio: r, how }) = hit {
            return Some(if imbalanced {
                Selection::with_reason(worker, "rebalance_hit", format!("rebalance cache_hit={r:.2}{how}"))
            } else {
                Selection::with_reason(worker, "cache_hit", format!("cache_hit={r:.2}{how}"))
            });
        }
        let r = event_ratio.max(text_ratio);
        let (worker, how) = if events { self.events_miss(snap, candidates, input, scan, rng) } else { (scan.least, String::new()) };
        Some(if imbalanced {
            Selection::with_reason(worker, "rebalance", format!("rebalance cache_miss={r:.2}{how}"))
        } else {
            Selection::with_reason(worker, "cache_miss", format!("cache_miss={r:.2}{how}"))
        })
    }
}
