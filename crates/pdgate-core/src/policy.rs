//! Routing policies: pure functions that pick one of a set of candidate workers.
//!
//! A policy reads the snapshot and the request, takes randomness as an argument and keeps no
//! state: `select(snapshot, candidates, input, rng)`. The gateway supplies a monotonically
//! increasing `sequence` for round robin, so even that one is a function of its inputs.

use rand::{Rng, RngCore};

use crate::config::PolicyName;
use crate::snapshot::PoolSnapshot;

/// What a policy may look at besides the pool. Load-aware and cache-aware policies will add to
/// this (request text is already here for cache affinity).
#[derive(Clone, Copy, Debug, Default)]
pub struct RouteInput<'a> {
    /// The request's prompt text, when the policy needs it.
    pub text: Option<&'a str>,
    /// A per-gateway counter, one step per decision.
    pub sequence: u64,
}

/// A chosen worker and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selection {
    /// Index into the snapshot's workers.
    pub worker: usize,
    pub reason: &'static str,
}

pub trait Policy: Send + Sync + std::fmt::Debug {
    fn name(&self) -> &'static str;
    /// Picks among `candidates` (indices into `snapshot`); `None` only when it is empty.
    fn select(&self, snapshot: &PoolSnapshot, candidates: &[usize], input: &RouteInput<'_>, rng: &mut dyn RngCore) -> Option<Selection>;
}

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
        Some(Selection { worker: candidates[i], reason: "random" })
    }
}

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
        Some(Selection { worker: candidates[i], reason: "round_robin" })
    }
}

pub fn make_policy(name: PolicyName) -> Box<dyn Policy> {
    match name {
        PolicyName::Random => Box::new(RandomPolicy),
        PolicyName::RoundRobin => Box::new(RoundRobinPolicy),
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
        let mut counts = std::collections::HashMap::new();
        for seq in 0..300 {
            let s = RoundRobinPolicy.select(&snap, &cands, &RouteInput { text: None, sequence: seq }, &mut rng).unwrap();
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
    }
}
