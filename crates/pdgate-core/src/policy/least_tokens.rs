//! `least_tokens`: the prefill worker with the least prompt-token work ahead of this request.
//!
//! Prefill time grows with prompt tokens, not with requests: one 30,000-token prompt costs as
//! much as a hundred short ones. The cost of sending this request to worker `w` is
//!
//! ```text
//! cost(w) = queued prompt tokens on w + this prompt's tokens not already cached on w
//! ```
//!
//! The second term is the prefix credit of cache-aware routing: when the gateway's radix tree
//! says `w` recently saw a prefix covering ratio `r` of the text, this request adds only
//! `(1 - r) × tokens` there. Without a tree or text the credit is zero and the policy is plain
//! "fewest queued prompt tokens". Ties go to the smaller running batch, then spread at random.
//!
//! Cost: at most [`super::SCAN_LIMIT`] load reads (a random sample beyond that) plus at most
//! [`TENANT_VISITS`] tree tenants.

use rand::{Rng, RngCore};

use super::cache_aware::TENANT_VISITS;
use super::visit_bounded;
use super::{is_candidate, Policy, RouteInput, Selection};
use crate::snapshot::PoolSnapshot;

#[derive(Debug, Default, Clone)]
pub struct LeastTokensPolicy;

/// Candidates with a cached prefix and its ratio of the text, best (deepest) match first.
fn prefix_credits(snap: &PoolSnapshot, candidates: &[usize], input: &RouteInput<'_>) -> Vec<(usize, f64)> {
    let (Some(tree), Some(text)) = (input.tree, input.text) else { return Vec::new() };
    if text.is_empty() {
        return Vec::new();
    }
    let m = tree.match_prefix(text);
    let mut credits: Vec<(usize, f64)> = Vec::new();
    let mut visits = TENANT_VISITS;
    for level in m.levels.iter().rev() {
        let ratio = level.matched as f64 / text.len() as f64;
        for i in 0..level.tenant_count().min(visits) {
            let Some(tenant) = level.tenant(i) else { break };
            let Some(w) = snap.index_of(tree.key(tenant)) else { continue };
            if is_candidate(candidates, w) && !credits.iter().any(|(c, _)| *c == w) {
                credits.push((w, ratio));
            }
        }
        visits -= level.tenant_count().min(visits);
        if visits == 0 {
            break;
        }
    }
    credits
}

/// The best candidate so far: lowest cost, then smallest running batch.
#[derive(Clone, Copy)]
struct Best {
    worker: usize,
    cost: u64,
    running: u64,
    ratio: f64,
}

impl Policy for LeastTokensPolicy {
    fn name(&self) -> &'static str {
        "least_tokens"
    }

    fn uses_tree(&self) -> bool {
        true
    }

    fn select(&self, snap: &PoolSnapshot, candidates: &[usize], input: &RouteInput<'_>, rng: &mut dyn RngCore) -> Option<Selection> {
        let n = candidates.len();
        if n == 0 {
            return None;
        }
        let credits = prefix_credits(snap, candidates, input);
        let tokens = input.prompt_tokens;
        let mut best: Option<Best> = None;
        let mut visit = |w: usize| {
            let ratio = credits.iter().find(|(c, _)| *c == w).map_or(0.0, |(_, r)| *r);
            let uncached = (tokens as f64 * (1.0 - ratio)).round() as u64;
            let cost = input.loads.prompt_tokens(w).saturating_add(uncached);
            let running = input.loads.running(w);
            if best.is_none_or(|b| (cost, running) < (b.cost, b.running)) {
                best = Some(Best { worker: w, cost, running, ratio });
            }
        };
        // Workers holding a prefix first, then a scan from a random start (ties spread out).
        credits.iter().for_each(|(w, _)| visit(*w));
        let start = rng.random_range(0..n);
        visit_bounded(candidates, start, rng, &mut visit);
        let b = best?;
        let queued = b.cost.saturating_sub((tokens as f64 * (1.0 - b.ratio)).round() as u64);
        let reason = if b.ratio > 0.0 { format!("least_tokens queued={queued} cache_hit={:.2}", b.ratio) } else { format!("least_tokens queued={queued}") };
        Some(Selection::with_reason(b.worker, "least_tokens", reason))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::LoadView;
    use rand::{rngs::StdRng, SeedableRng};

    /// Queued prompt tokens and running requests per worker.
    struct Tokens(Vec<(u64, u64)>);

    impl LoadView for Tokens {
        fn load(&self, w: usize) -> u64 {
            self.0.get(w).map_or(0, |t| t.1)
        }
        fn prompt_tokens(&self, w: usize) -> u64 {
            self.0.get(w).map_or(0, |t| t.0)
        }
    }

    #[test]
    fn one_long_prompt_outweighs_many_short_ones() {
        // Worker 0 runs one 30,000-token prompt; worker 1 runs a hundred 100-token ones.
        let loads = Tokens(vec![(30_000, 1), (10_000, 100)]);
        let input = RouteInput { loads: &loads, prompt_tokens: 50, ..RouteInput::default() };
        let mut rng = StdRng::seed_from_u64(1);
        for _ in 0..20 {
            let s = LeastTokensPolicy.select(&PoolSnapshot::default(), &[0, 1], &input, &mut rng).unwrap();
            assert_eq!(s.worker, 1);
            assert_eq!(s.reason, "least_tokens queued=10000");
        }
    }

    #[test]
    fn equal_tokens_go_to_the_smaller_batch() {
        let loads = Tokens(vec![(0, 5), (0, 2), (0, 9)]);
        let input = RouteInput { loads: &loads, ..RouteInput::default() };
        let mut rng = StdRng::seed_from_u64(2);
        assert_eq!(LeastTokensPolicy.select(&PoolSnapshot::default(), &[0, 1, 2], &input, &mut rng).unwrap().worker, 1);
    }
}
