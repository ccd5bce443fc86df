//! The load-blind policies: random and round robin.

use rand::{Rng, RngCore};

use super::{Policy, RouteInput, Selection};
use crate::snapshot::PoolSnapshot;

#[derive(Debug, Default)]
pub struct RandomPolicy;

impl Policy for RandomPolicy {
    fn name(&self) -> &'static str {
        "random"
    }
    fn select(&self, _: &PoolSnapshot, candidates: &[usize], _: &RouteInput<'_>, rng: &mut dyn RngCore) -> Option<Selection> {
        if candidates.is_empty() {
            return None;
        }
        let i = rng.random_range(0..candidates.len());
        Some(Selection::new(candidates[i], "random"))
    }
}

/// Round robin over the candidates, driven by the gateway's decision counter.
#[derive(Debug, Default)]
pub struct RoundRobinPolicy;

impl Policy for RoundRobinPolicy {
    fn name(&self) -> &'static str {
        "round_robin"
    }
    fn select(&self, _: &PoolSnapshot, candidates: &[usize], input: &RouteInput<'_>, _: &mut dyn RngCore) -> Option<Selection> {
        if candidates.is_empty() {
            return None;
        }
        let i = (input.sequence % candidates.len() as u64) as usize;
        Some(Selection::new(candidates[i], "round_robin"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, SeedableRng};

    #[test]
    fn round_robin_is_exactly_fair() {
        let snap = PoolSnapshot::default();
        let cands = [3, 5, 9];
        let mut rng = StdRng::seed_from_u64(1);
        let mut counts = std::collections::BTreeMap::new();
        for seq in 0..300 {
            let input = RouteInput { sequence: seq, ..RouteInput::default() };
            let s = RoundRobinPolicy.select(&snap, &cands, &input, &mut rng).unwrap();
            *counts.entry(s.worker).or_insert(0) += 1;
        }
        assert_eq!(counts.values().copied().collect::<Vec<_>>(), vec![100, 100, 100]);
    }

    #[test]
    fn random_covers_all_candidates_and_is_seeded() {
        let snap = PoolSnapshot::default();
        let cands = [0, 1, 2, 3];
        let pick = |seed| {
            let mut rng = StdRng::seed_from_u64(seed);
            (0..400).map(|_| RandomPolicy.select(&snap, &cands, &RouteInput::default(), &mut rng).unwrap().worker).collect::<Vec<_>>()
        };
        let a = pick(42);
        assert_eq!(a, pick(42), "same seed, same choices");
        for c in cands {
            let n = a.iter().filter(|&&w| w == c).count();
            assert!((60..=140).contains(&n), "candidate {c} chosen {n} times of 400");
        }
    }

    #[test]
    fn empty_candidates_select_nothing() {
        let mut rng = StdRng::seed_from_u64(0);
        assert!(RandomPolicy.select(&PoolSnapshot::default(), &[], &RouteInput::default(), &mut rng).is_none());
        assert!(RoundRobinPolicy.select(&PoolSnapshot::default(), &[], &RouteInput::default(), &mut rng).is_none());
    }
}
