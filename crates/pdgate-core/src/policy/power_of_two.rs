//! Power of two choices: sample two distinct candidates, take the less loaded one. Nearly as
//! good as least-loaded and O(1) in the fleet size (Mitzenmacher; tower's and linkerd's p2c).

use rand::{Rng, RngCore};

use super::{Policy, RouteInput, Selection};
use crate::snapshot::PoolSnapshot;

#[derive(Debug, Default)]
pub struct PowerOfTwoPolicy;

/// Two distinct positions in `0..len` (`len >= 2`), uniformly (linkerd's `gen_pair`).
pub fn gen_pair(rng: &mut dyn RngCore, len: usize) -> (usize, usize) {
    let a = rng.random_range(0..len);
    let b = rng.random_range(0..len - 1);
    (a, if b >= a { b + 1 } else { b })
}

impl Policy for PowerOfTwoPolicy {
    fn name(&self) -> &'static str {
        "power_of_two"
    }

    fn select(&self, _: &PoolSnapshot, candidates: &[usize], input: &RouteInput<'_>, rng: &mut dyn RngCore) -> Option<Selection> {
        match candidates.len() {
            0 => None,
            1 => Some(Selection::new(candidates[0], "power_of_two")),
            n => {
                let (a, b) = gen_pair(rng, n);
                let (wa, wb) = (candidates[a], candidates[b]);
                let (la, lb) = (input.loads.load(wa), input.loads.load(wb));
                let (worker, won, lost) = if lb < la { (wb, lb, la) } else { (wa, la, lb) };
                Some(Selection::with_reason(worker, "power_of_two", format!("power_of_two load={won}<={lost}")))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, SeedableRng};

    #[test]
    fn prefers_the_idle_worker_and_spreads_over_equals() {
        let snap = PoolSnapshot::default();
        let loads: Vec<u64> = vec![100, 0, 100, 100];
        let mut rng = StdRng::seed_from_u64(5);
        let input = RouteInput { loads: &loads, ..RouteInput::default() };
        let picks: Vec<usize> = (0..1000).map(|_| PowerOfTwoPolicy.select(&snap, &[0, 1, 2, 3], &input, &mut rng).unwrap().worker).collect();
        let idle = picks.iter().filter(|&&w| w == 1).count();
        // Worker 1 wins whenever it is sampled: P = 1 - (3/4 * 2/3) = 1/2.
        assert!((420..=580).contains(&idle), "idle worker picked {idle} of 1000");
        assert!(picks.iter().any(|&w| w != 1));
    }

    #[test]
    fn one_candidate_is_taken() {
        let mut rng = StdRng::seed_from_u64(5);
        let s = PowerOfTwoPolicy.select(&PoolSnapshot::default(), &[7], &RouteInput::default(), &mut rng).unwrap();
        assert_eq!(s.worker, 7);
    }
}
