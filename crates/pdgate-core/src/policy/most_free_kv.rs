//! `most_free_kv`: a decode worker with KV room for this request, then the smallest batch.
//!
//! A decode worker's capacity is its free KV memory, not its request count: a request needs
//! room for prompt + output tokens (`RouteInput::kv_tokens`), and a worker that lacks it
//! pre-empts (or retracts) running sequences later. Among candidates whose free KV tokens
//! (engine report minus what the gateway placed since) cover the need, the one with the
//! smallest running batch wins (each decode step serves the whole batch, so a smaller batch
//! means a faster step); ties go to the most free KV, then spread at random. A worker whose free
//! KV is unknown (no report yet, polling off) counts as having room but ranks after workers
//! known to have it at the same batch size.
//!
//! When no candidate has room the policy still answers, with the most free KV and the branch
//! [`NO_ROOM`], so that admission can hold the request back instead of sending it (the gateway
//! decides; the policy only says so). Cost: at most [`super::SCAN_LIMIT`] load reads.

use rand::{Rng, RngCore};

use super::visit_bounded;
use super::{Policy, RouteInput, Selection};
use crate::snapshot::PoolSnapshot;

/// The branch of a selection made when no candidate has KV room for the request.
pub const NO_ROOM: &str = "no_room";

#[derive(Debug, Default, Clone)]
pub struct MostFreeKvPolicy;

/// How one candidate ranks: lower is better.
#[derive(Clone, Copy, PartialEq, PartialOrd)]
struct Rank {
    /// Known to lack room: last, whatever its batch.
    no_room: bool,
    running: u64,
    /// Room unknown: after known room at the same batch size.
    unknown: bool,
    /// Free KV tokens, negated so that more free ranks lower (unknown: 0).
    less_free: i128,
}

impl Policy for MostFreeKvPolicy {
    fn name(&self) -> &'static str {
        "most_free_kv"
    }

    fn select(&self, _: &PoolSnapshot, candidates: &[usize], input: &RouteInput<'_>, rng: &mut dyn RngCore) -> Option<Selection> {
        let n = candidates.len();
        if n == 0 {
            return None;
        }
        let need = input.kv_tokens();
        let mut best: Option<(Rank, usize)> = None;
        let visit = |w: usize| {
            let free = input.loads.free_kv_tokens(w);
            let no_room = free.is_some_and(|f| f < need);
            // Without room, the most free KV comes first (it pre-empts least); with room, the batch.
            let running = if no_room { 0 } else { input.loads.running(w) };
            let rank = Rank { no_room, running, unknown: free.is_none(), less_free: -i128::from(free.unwrap_or(0)) };
            if best.is_none_or(|(b, _)| rank < b) {
                best = Some((rank, w));
            }
        };
        let start = rng.random_range(0..n);
        visit_bounded(candidates, start, rng, visit);
        let (rank, w) = best?;
        let free = -rank.less_free;
        Some(if rank.no_room {
            Selection::with_reason(w, NO_ROOM, format!("most_free_kv no_room need={need} most_free={free}"))
        } else if rank.unknown {
            Selection::with_reason(w, "kv_unknown", format!("most_free_kv need={need} free=unknown running={}", rank.running))
        } else {
            Selection::with_reason(w, "most_free_kv", format!("most_free_kv need={need} free={free} running={}", rank.running))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::LoadView;
    use rand::{rngs::StdRng, SeedableRng};

    /// Free KV tokens (None: unknown) and running requests per worker.
    struct Kv(Vec<(Option<u64>, u64)>);

    impl LoadView for Kv {
        fn load(&self, w: usize) -> u64 {
            self.0[w].1
        }
        fn free_kv_tokens(&self, w: usize) -> Option<u64> {
            self.0[w].0
        }
    }

    fn pick(kv: &Kv, prompt: u64, output: u64) -> Selection {
        let input = RouteInput { loads: kv, prompt_tokens: prompt, output_tokens: output, ..RouteInput::default() };
        let candidates: Vec<usize> = (0..kv.0.len()).collect();
        MostFreeKvPolicy.select(&PoolSnapshot::default(), &candidates, &input, &mut StdRng::seed_from_u64(3)).unwrap()
    }

    #[test]
    fn room_first_then_the_smallest_batch() {
        // Worker 0 has the most free KV but a big batch; worker 2 lacks room for 1,000 tokens.
        let kv = Kv(vec![(Some(90_000), 40), (Some(5_000), 3), (Some(900), 1)]);
        let s = pick(&kv, 800, 200);
        assert_eq!((s.worker, s.branch), (1, "most_free_kv"));
        assert_eq!(s.reason, "most_free_kv need=1000 free=5000 running=3");
    }

    #[test]
    fn unknown_room_counts_as_room_after_known_room() {
        let kv = Kv(vec![(None, 2), (Some(5_000), 2)]);
        assert_eq!(pick(&kv, 10, 10).worker, 1);
        let kv = Kv(vec![(None, 1), (Some(5_000), 2)]);
        assert_eq!(pick(&kv, 10, 10).branch, "kv_unknown", "a smaller batch wins over known room");
    }

    #[test]
    fn no_room_anywhere_says_so_and_names_the_most_free() {
        let kv = Kv(vec![(Some(100), 0), (Some(700), 50), (Some(300), 1)]);
        let s = pick(&kv, 1_000, 24);
        assert_eq!((s.worker, s.branch), (1, NO_ROOM));
        assert_eq!(s.reason, "most_free_kv no_room need=1024 most_free=700");
    }
}
