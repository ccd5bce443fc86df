//! The routing rng (`--seed`): what random and power_of_two draw from, and what the other
//! policies break ties and sample with. Seeded, every decision takes one shared generator in
//! turn (a short lock per decision), so the same requests in the same order get the same
//! choices; unseeded, each thread's own generator (no lock on the routing path).
//!
//! Retry backoff jitter, bootstrap rooms and request ids do not come from here: rooms in
//! particular must differ between replicas started with the same seed.

use std::sync::Mutex;

use rand::rngs::StdRng;
use rand::{RngCore, SeedableRng};

pub struct PolicyRng(Option<Mutex<StdRng>>);

impl PolicyRng {
    pub fn new(seed: Option<u64>) -> Self {
        PolicyRng(seed.map(|s| Mutex::new(StdRng::seed_from_u64(s))))
    }

    /// Runs one decision with the routing rng.
    pub fn with<T>(&self, decide: impl FnOnce(&mut dyn RngCore) -> T) -> T {
        match &self.0 {
            Some(seeded) => decide(&mut *seeded.lock().unwrap_or_else(|p| p.into_inner())),
            None => decide(&mut rand::rng()),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use pdgate_core::route::select_regular;
    use pdgate_core::{make_policy, PolicyName, PoolSnapshot, RouteInput, WorkerRole, WorkerSpec, WorkerView};

    use super::PolicyRng;

    fn snapshot(n: usize) -> PoolSnapshot {
        let views = (0..n).map(|i| WorkerView::new(Arc::new(WorkerSpec::new(&format!("http://w{i}:8000"), WorkerRole::Regular).unwrap_or_else(|e| panic!("{e}"))), true)).collect();
        PoolSnapshot::build(views, Default::default())
    }

    /// 200 decisions of `policy` over 50 idle workers (every pick a random draw or tie-break).
    fn choices(rng: &PolicyRng, policy: PolicyName) -> Vec<usize> {
        let (snap, policy) = (snapshot(50), make_policy(policy));
        (0..200)
            .map(|i| {
                let input = RouteInput { sequence: i, ..RouteInput::default() };
                rng.with(|r| select_regular(&snap, policy.as_ref(), &input, &[], r)).map(|s| s.worker).unwrap_or(usize::MAX)
            })
            .collect()
    }

    #[test]
    fn the_same_seed_makes_the_same_choices_and_another_seed_others() {
        for policy in [PolicyName::Random, PolicyName::PowerOfTwo, PolicyName::CacheAware, PolicyName::LeastTokens] {
            let a = choices(&PolicyRng::new(Some(7)), policy);
            assert_eq!(a, choices(&PolicyRng::new(Some(7)), policy), "{policy:?}");
            assert_ne!(a, choices(&PolicyRng::new(Some(8)), policy), "{policy:?}");
            let spread = a.iter().collect::<std::collections::HashSet<_>>().len();
            assert!(spread > 10, "{policy:?}: the draws spread over the workers ({spread} of 50)");
        }
        // unseeded: thread rngs, two runs differ (200 picks of 50: equal by chance ~never)
        assert_ne!(choices(&PolicyRng::new(None), PolicyName::Random), choices(&PolicyRng::new(None), PolicyName::Random));
    }
}
