//! Cache-aware routing (SMG semantics), with cache affinity kept while rebalancing.
//!
//! - Balanced load: if the best prefix match ratio (matched text / text) reaches
//!   `cache_threshold`, take the least loaded worker that has that match (`cache_hit=0.82`);
//!   otherwise the least loaded worker (`cache_miss=0.12`).
//! - Imbalanced load (SMG's rule: `max - min > abs` AND `max > rel * min`): SMG routes purely by
//!   load and its hit rate collapses. Here only *overloaded* workers are avoided — those whose
//!   load would itself count as imbalanced against the minimum — and among the rest the one with
//!   the longest match above the threshold still wins (`rebalance cache_hit=0.64`); with no
//!   such match, the least loaded worker (`rebalance`).
//!
//! The policy only reads the tree. After the decision the gateway inserts the text for the
//! chosen worker (see [`Policy::uses_tree`]). Cost: O(text length) for the match, plus at most
//! [`TENANT_VISITS`] worker lookups and [`super::SCAN_LIMIT`] load reads.

use rand::{Rng, RngCore};

use super::{is_candidate, scan_loads, LoadScan, Policy, PolicyOptions, RouteInput, Selection};
use crate::radix::{MatchLevel, RadixTree};
use crate::snapshot::PoolSnapshot;

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
}

impl Lookup<'_> {
    /// The least loaded candidate at `level` whose load passes `ok`.
    fn best_at(&mut self, level: &MatchLevel<'_>, ok: &dyn Fn(u64) -> bool) -> Option<usize> {
        let n = level.tenant_count();
        let mut best: Option<(u64, usize)> = None;
        for i in 0..n.min(self.visits) {
            let tenant = level.tenant((self.offset + i) % n)?;
            let Some(w) = self.snap.index_of(self.tree.key(tenant)) else { continue };
            if !is_candidate(self.candidates, w) {
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

impl Policy for CacheAwarePolicy {
    fn name(&self) -> &'static str {
        "cache_aware"
    }

    fn uses_tree(&self) -> bool {
        true
    }

    fn select(&self, snap: &PoolSnapshot, candidates: &[usize], input: &RouteInput<'_>, rng: &mut dyn RngCore) -> Option<Selection> {
        let scan: LoadScan = scan_loads(candidates, input.loads, rng)?;
        let imbalanced = self.options.imbalanced(scan.min, scan.max);
        let (tree, text) = match (input.tree, input.text) {
            (Some(tree), Some(text)) if !text.is_empty() => (tree, text),
            _ => {
                let branch = if imbalanced { "rebalance" } else { "cache_miss" };
                return Some(Selection::with_reason(scan.least, branch, format!("{branch} no_text")));
            }
        };
        let m = tree.match_prefix(text);
        let ratio = |matched: usize| matched as f64 / text.len() as f64;
        let opts = self.options;
        let min = scan.min;
        let not_overloaded = move |load: u64| !opts.imbalanced(min, load);
        let any = |_: u64| true;
        let ok: &dyn Fn(u64) -> bool = if imbalanced { &not_overloaded } else { &any };
        let offset = rng.random_range(0..usize::MAX / 2);
        let mut lookup = Lookup { snap, tree, candidates, input, visits: TENANT_VISITS, offset };
        // Deepest match first: shallower levels have lower ratios and more tenants.
        for level in m.levels.iter().rev() {
            let r = ratio(level.matched);
            if r < self.options.cache_threshold || lookup.visits == 0 {
                break;
            }
            if let Some(w) = lookup.best_at(level, ok) {
                return Some(if imbalanced {
                    Selection::with_reason(w, "rebalance_hit", format!("rebalance cache_hit={r:.2}"))
                } else {
                    Selection::with_reason(w, "cache_hit", format!("cache_hit={r:.2}"))
                });
            }
        }
        let r = ratio(m.matched());
        Some(if imbalanced {
            Selection::with_reason(scan.least, "rebalance", format!("rebalance cache_miss={r:.2}"))
        } else {
            Selection::with_reason(scan.least, "cache_miss", format!("cache_miss={r:.2}"))
        })
    }
}
