//! Retry decisions: pure functions of the error, the attempt count and the time left.

use std::time::Duration;

use rand::Rng;

use crate::error::GatewayError;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Extra attempts after the first.
    pub max_retries: u32,
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
}

impl RetryPolicy {
    /// Whether attempt number `attempt` (1-based) that failed with `err` may be followed by
    /// another. Never once a byte reached the client, and never when the backoff alone would
    /// outlast the deadline.
    pub fn should_retry(&self, err: &GatewayError, attempt: u32, bytes_sent: bool, time_left: Duration) -> bool {
        !bytes_sent && err.retryable() && attempt <= self.max_retries && time_left > self.max_backoff_for(attempt)
    }

    fn max_backoff_for(&self, attempt: u32) -> Duration {
        let exp = self.initial_backoff.saturating_mul(1u32 << attempt.saturating_sub(1).min(16));
        exp.min(self.max_backoff)
    }

    /// Full-jitter exponential backoff before attempt `attempt + 1`.
    pub fn backoff<R: Rng + ?Sized>(&self, attempt: u32, rng: &mut R) -> Duration {
        let cap = self.max_backoff_for(attempt);
        if cap.is_zero() {
            return cap;
        }
        let nanos = rng.random_range(0..=cap.as_nanos().min(u64::MAX as u128) as u64);
        Duration::from_nanos(nanos)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Leg;
    use rand::{rngs::StdRng, SeedableRng};

    fn policy() -> RetryPolicy {
        RetryPolicy { max_retries: 2, initial_backoff: Duration::from_millis(50), max_backoff: Duration::from_millis(300) }
    }

    #[test]
    fn retries_a_failed_worker_up_to_the_budget() {
        let err = GatewayError::worker_status(Leg::Prefill, 503, None);
        let left = Duration::from_secs(10);
        assert!(policy().should_retry(&err, 1, false, left));
        assert!(policy().should_retry(&err, 2, false, left));
        assert!(!policy().should_retry(&err, 3, false, left));
    }

    #[test]
    fn never_retries_after_bytes_or_client_errors_or_near_deadline() {
        let err = GatewayError::unreachable(Leg::Decode, "reset");
        assert!(!policy().should_retry(&err, 1, true, Duration::from_secs(10)));
        assert!(!policy().should_retry(&err, 1, false, Duration::from_millis(10)));
        let bad = GatewayError::worker_status(Leg::Decode, 422, None);
        assert!(!policy().should_retry(&bad, 1, false, Duration::from_secs(10)));
    }

    #[test]
    fn backoff_is_jittered_and_capped() {
        let mut rng = StdRng::seed_from_u64(7);
        let p = policy();
        let samples: Vec<_> = (0..200).map(|_| p.backoff(5, &mut rng)).collect();
        assert!(samples.iter().all(|d| *d <= p.max_backoff));
        let distinct: std::collections::HashSet<_> = samples.iter().collect();
        assert!(distinct.len() > 100, "backoff should be jittered");
        assert!(p.backoff(1, &mut rng) <= Duration::from_millis(50));
    }
}
